"""The conversion engine: lazy checkpoint reading, routing by MTP mode, quantization, atomic GGUF writing."""
