"""Programs that embed the engine: the OpenAI-compatible server and the desktop chat."""
