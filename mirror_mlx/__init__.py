"""mirror-mlx: lossless speculative decoding (Mirror-SD) on Apple silicon."""

# First, before anything imports MLX: makes MLX use OpenBLAS on Linux (see platform.py).
from . import platform as _platform  # noqa: F401

__version__ = "0.1.0"
