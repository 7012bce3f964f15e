"""`echo` on /v1/completions: each choice's text starts with its prompt, and with `logprobs`
its logprobs start with the prompt's (the first token's null, as OpenAI sends it): how
loglikelihood evaluations score text. `max_tokens: 0` with echo returns the prompt alone
(the engine still samples one token, which is dropped), as vLLM does."""

from __future__ import annotations

from dataclasses import dataclass

from nanoqwen.runtime.logprobs import TokenLogprobs
from nanoqwen.serve.engine_client import ChoiceOutput


@dataclass
class EchoPrompt:
    text: str
    token_ids: list[int]


class Echo:
    def __init__(self, prompts: list[EchoPrompt], choices_per_prompt: int, prompt_only: bool):
        self.prompts = prompts
        self.n = choices_per_prompt
        self.prompt_only = prompt_only
        self._started: set[int] = set()

    def apply(self, index: int, part: ChoiceOutput) -> None:
        """Puts the prompt in front of choice `index`'s first part (in place)."""
        if self.prompt_only:
            part.text, part.token_ids = "", []
            part.logprobs = [] if part.logprobs is not None else None
        if index in self._started:
            return
        self._started.add(index)
        prompt = self.prompts[index // self.n]
        part.text = prompt.text + part.text
        if part.prompt_logprobs is not None:
            first = TokenLogprobs(prompt.token_ids[0], None, None, None)  # type: ignore[arg-type]
            part.logprobs = [first, *part.prompt_logprobs[1:], *(part.logprobs or [])]
