"""Qwen2's byte-level BPE tokenizer rebuilt from a GGUF file's tokenizer.ggml.* metadata."""

from __future__ import annotations

from typing import Any

from nanoqwen.errors import InvalidInputError

# Qwen2's pre-tokenizer split (as in Qwen2Tokenizer); the GGUF only names it: ggml.pre = "qwen2".
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def make_tokenizer(meta: dict[str, Any], source: str = "GGUF"):
    """A tokenizers.Tokenizer shaped like Qwen2's own tokenizer.json."""
    import tokenizers as tk

    if (meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")) != ("gpt2", "qwen2"):
        raise InvalidInputError(f"{source}: the tokenizer is not Qwen2's byte-level BPE")
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    # Types: 1 normal BPE token, 3 control (special), 4 user-defined (added, not special),
    # 5 the unused "[PADnnn]" rows llama.cpp invents to fill the embedding; Qwen2 has none.
    vocab = {tok: i for i, (tok, kind) in enumerate(zip(tokens, types)) if kind == 1}
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    tok = tk.Tokenizer(tk.models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    tok.normalizer = tk.normalizers.NFC()
    tok.pre_tokenizer = tk.pre_tokenizers.Sequence(
        [
            tk.pre_tokenizers.Split(tk.Regex(QWEN2_SPLIT), behavior="isolated"),
            tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.post_processor = tk.processors.ByteLevel(trim_offsets=False)
    tok.decoder = tk.decoders.ByteLevel()
    added = [
        (i, tk.AddedToken(t, special=k == 3, normalized=False))
        for i, (t, k) in enumerate(zip(tokens, types))
        if k in (3, 4)
    ]
    tok.add_tokens([a for _, a in added])  # in id order, so each lands on its trained id
    if any(tok.token_to_id(a.content) != i for i, a in added):
        raise InvalidInputError(f"{source}: added tokens did not land on their GGUF ids")
    return tok
