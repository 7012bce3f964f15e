"""/tokenize and /detokenize, as vLLM serves them: a prompt (or messages through the chat
template) to token ids, and token ids back to text, with the tokenizer the server uses."""

from __future__ import annotations

from nanoqwen.errors import InvalidInputError
from nanoqwen.runtime.chat.request import chat_request
from nanoqwen.serve.errors import APIError
from nanoqwen.serve.model_info import ModelInfo
from nanoqwen.serve.params import dump_models
from nanoqwen.serve.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from nanoqwen.validation import token_ids
from nanoqwen.weights.tokenizer import Tokenizer


def _tokenizer(info: ModelInfo) -> Tokenizer:
    if info.tokenizer is None:
        raise APIError(400, "this server has no tokenizer (random weights)")
    return info.tokenizer


def tokenize(req: TokenizeRequest, info: ModelInfo) -> TokenizeResponse:
    tok = _tokenizer(info)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", "prompt")
    try:
        if req.prompt is not None:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            chat = chat_request(tok, dump_models(req.messages), tools=dump_models(req.tools),
                                add_generation_prompt=req.add_generation_prompt)  # fmt: skip
            ids = chat.prompt_ids
    except InvalidInputError as e:
        raise APIError(400, e.message, e.param) from None
    strs = (
        [tok.decode([t], skip_special_tokens=False) for t in ids] if req.return_token_strs else None
    )
    return TokenizeResponse(count=len(ids), max_model_len=info.max_model_len, tokens=ids,
                            token_strs=strs)  # fmt: skip


def detokenize(req: DetokenizeRequest, info: ModelInfo) -> DetokenizeResponse:
    tok = _tokenizer(info)
    try:
        ids = token_ids("tokens", req.tokens, info.vocab_size)
    except InvalidInputError as e:
        raise APIError(400, e.message, "tokens") from None
    return DetokenizeResponse(prompt=tok.decode(ids, skip_special_tokens=False))
