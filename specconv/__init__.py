"""specconv: MTP and draft heads from Hugging Face checkpoints to GGUF, proven by a reference runtime."""

__version__ = "0.1.0"
