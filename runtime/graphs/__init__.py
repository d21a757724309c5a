"""Per-architecture runtime graphs; each knows GGUF names only."""
