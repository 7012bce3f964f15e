"""Weight-only quantized formats: int8/int4 codes with scales, GGUF's block types, and the
linear layer that runs them."""
