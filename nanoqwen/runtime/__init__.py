"""The engine: EngineConfig, LLM and its builder, the scheduler, the paged KV cache, the
sampler, the model runner with its CUDA graphs, and tensor parallelism."""
