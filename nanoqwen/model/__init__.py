"""The Qwen2 forward (qwen2.py, layers.py), its config, tensor-parallel sharding, and how
weights are loaded into it (from safetensors, GGUF, or quantized after loading)."""
