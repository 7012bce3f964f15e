"""What the HTTP process knows of the model to check and tokenize requests: the tokenizer
(its own copy, chat template included) and the engine's limits. No weights, no device."""

from __future__ import annotations

from dataclasses import dataclass, field

from nanoqwen.validation import encode_prompt
from nanoqwen.weights.tokenizer import Tokenizer


@dataclass
class ModelInfo:
    tokenizer: Tokenizer | None  # None with random weights
    max_model_len: int
    vocab_size: int
    # Sampling fields a request leaves out take these (the checkpoint's generation_config.json,
    # as `nanoqwen generate` uses it), then OpenAI's defaults.
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)

    def encode(self, prompt: str | list[int]) -> list[int]:
        """A prompt's token ids, as LLM.encode gives them; InvalidInputError otherwise."""
        return encode_prompt(prompt, self.tokenizer, self.vocab_size)
