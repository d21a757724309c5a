"""`specconv imatrix`: llama.cpp's importance matrix computed from the runtime's own activations
(docs/imatrix.md)."""

from specconv.imatrix.run import ImatrixOptions, collect, run_imatrix, write

__all__ = ["ImatrixOptions", "collect", "run_imatrix", "write"]
