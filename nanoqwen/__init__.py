"""nanoqwen: a small, hand-written Qwen2.5 inference runtime over a paged KV cache."""

from nanoqwen.errors import InvalidInputError
from nanoqwen.runtime.config import EngineConfig
from nanoqwen.runtime.engine import LLM
from nanoqwen.runtime.outputs import RequestOutput, StreamChunk
from nanoqwen.runtime.sampling_params import SamplingParams

__all__ = [
    "EngineConfig",
    "InvalidInputError",
    "LLM",
    "RequestOutput",
    "SamplingParams",
    "StreamChunk",
]
__version__ = "0.1.0"
