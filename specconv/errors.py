"""Re-export so every layer raises the same user-facing error type."""

from specconv.archs.errors import SpecconvError

__all__ = ["SpecconvError"]
