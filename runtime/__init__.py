"""The PyTorch reference runtime: loads GGUF files by graph type and decodes with rollback-able memory."""

from specconv.runtime.context import Context
from specconv.runtime.model import Model, load_model
from specconv.runtime.types import DecodeOutput, GraphType

__all__ = ["Context", "DecodeOutput", "GraphType", "Model", "load_model"]
