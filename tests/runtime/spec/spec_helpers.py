"""What the speculative-decoding tests share: prompts, engines and an oracle proposer."""

from __future__ import annotations

from nanoqwen import LLM

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}  # fmt: skip
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7] * 3,
    [40, 41, 42, 43] * 5,
    list(range(100, 130)),
    [7, 300, 7, 300, 7],
    [200 + (i * 7) % 50 for i in range(45)],
    [1, 2, 3],
    [60, 61, 62, 63, 64, 65] * 4,
    [400, 401, 402],
]


class OracleProposer:
    """Proposes what a plain run produced after the same tokens, with every third proposal's
    last token changed: long accepted runs, and rejections at known places."""

    def __init__(self, finished: list[list[int]], num_tokens: int = 4) -> None:
        self.finished = finished
        self.num_tokens = num_tokens
        self.calls = 0

    def propose(self, seqs, limits: list[int]) -> list[list[int]]:
        return [self.lookup(s.token_ids, limit) for s, limit in zip(seqs, limits)]

    def lookup(self, token_ids: list[int], limit: int) -> list[int]:
        k = min(self.num_tokens, limit)
        for full in self.finished:
            if full[: len(token_ids)] == token_ids:
                proposal = full[len(token_ids) : len(token_ids) + k]
                break
        else:
            return []
        self.calls += 1
        if proposal and self.calls % 3 == 0:
            proposal[-1] = (proposal[-1] + 1) % 512
        return proposal

    def release(self, seq) -> None:
        pass


def engine(model_dir, spec=NGRAM, **options) -> LLM:
    options.setdefault("num_kv_blocks", 128)
    return LLM(str(model_dir), block_size=8, speculative_config=spec, progress=False, **options)


def all_blocks_free(llm: LLM) -> bool:
    blocks = llm.scheduler.blocks
    return blocks.num_free_blocks == blocks.num_blocks and not llm.scheduler.has_unfinished()
