"""An OpenAI-compatible HTTP server around one Engine (`mirror-mlx serve`)."""
