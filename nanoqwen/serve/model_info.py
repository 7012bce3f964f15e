"""What the HTTP process knows of the model to check and tokenize requests: the tokenizer
(its own copy, chat template included) and the engine's limits. No weights, no device."""

from __future__ import annotations

from dataclasses import dataclass

from nanoqwen.errors import InvalidInputError
from nanoqwen.validation import check_prompt
from nanoqwen.weights.tokenizer import Tokenizer


@dataclass
class ModelInfo:
    tokenizer: Tokenizer | None  # None with random weights
    max_model_len: int
    vocab_size: int

    def encode(self, prompt: str | list[int]) -> list[int]:
        """A prompt's token ids, as LLM.encode gives them; InvalidInputError otherwise."""
        prompt = check_prompt(prompt, self.vocab_size)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidInputError(
                    "prompt is a string but this engine has no tokenizer: allowed token id lists",
                    param="prompt",
                )
            return self.tokenizer.encode(prompt)
        return prompt
