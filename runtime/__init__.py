"""The PyTorch reference runtime: loads GGUF files by graph type and decodes with rollback-able memory."""
