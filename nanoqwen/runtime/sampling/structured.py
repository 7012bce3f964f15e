"""Structured output: a request's text constrained to a JSON schema, any JSON object, a
regular expression, an EBNF grammar or a structural tag (free text with constrained tagged
parts: how tool calls are constrained), with xgrammar (the grammar engine vLLM and SGLang use).

Each constrained request holds a GrammarState (xgrammar's matcher over its compiled
grammar). Before a step samples, the runner asks each of those for the tokens its grammar
allows next, as a bitmask over the vocabulary, and masks the rest of the request's logits to
-inf; once the step's token is read back, the state accepts it. A token the grammar ends on
(or EOS once it has ended) finishes the request."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import torch

from nanoqwen.errors import InvalidInputError
from nanoqwen.runtime.sampling.schema_check import check_json_schema
from nanoqwen.validation import a_type, invalid

KINDS = ("json", "json_object", "regex", "grammar", "structural_tag")


def load_xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise InvalidInputError(
            "structured_output needs xgrammar, which is not installed: "
            "pip install 'nanoqwen[structured]'",
            param="structured_output",
        ) from None
    return xgrammar


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one of: json (a JSON schema, as a dict or its text), json_object (any JSON
    object), regex, grammar (EBNF, in xgrammar's GBNF dialect), structural_tag (xgrammar's
    structural tag, as a dict or its JSON text). Checked when made: a spec that cannot
    compile is refused here, before any request runs."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    structural_tag: dict[str, Any] | str | None = None

    def __post_init__(self) -> None:
        given = [name for name in KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise InvalidInputError(
                f"structured_output sets {', '.join(given) or 'nothing'}: allowed exactly one "
                f"of {', '.join(KINDS)}",
                param="structured_output",
            )
        for name, what in (("json", "a JSON schema"), ("structural_tag", "a structural tag")):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (dict, str)):
                raise invalid(f"structured_output.{name}", value, f"is {a_type(value)}",
                              f"{what} (an object, or its JSON text)")  # fmt: skip
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise invalid(f"structured_output.{name}", value, "is not a non-empty string",
                              "a non-empty string")  # fmt: skip
        self._check()

    @classmethod
    def of(cls, value: Any) -> StructuredOutput | None:
        """From a StructuredOutput, a mapping of its fields (a request body), or None."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise invalid("structured_output", value, f"is {a_type(value)}",
                          "None, a StructuredOutput or a mapping of its fields")  # fmt: skip
        unknown = set(value) - set(KINDS)
        if unknown:
            raise InvalidInputError(
                f"unknown structured_output field {sorted(unknown)[0]!r}: allowed "
                f"{', '.join(KINDS)}",
                param="structured_output",
            )
        return cls(**value)

    def key(self) -> tuple[str, str]:
        """The kind and its text: what the compiled grammar is cached by."""
        for kind in ("json", "structural_tag"):
            value = getattr(self, kind)
            if value is not None:
                # Key order kept: a schema's property order is its documents'.
                return kind, value if isinstance(value, str) else json.dumps(value)
        if self.json_object:
            return "json_object", ""
        if self.regex is not None:
            return "regex", self.regex
        return "grammar", self.grammar

    def _check(self) -> None:
        """Parses the spec into a grammar without a tokenizer (cheap next to compiling it for
        one), so that bad input is refused where it is given."""
        xgr = load_xgrammar()
        kind, text = self.key()
        where = f"structured_output.{kind}"
        if kind == "json":
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise InvalidInputError(f"{where} cannot be compiled: the text is not "
                                            f"JSON ({e})", param=where) from None  # fmt: skip
            if not isinstance(schema, (dict, bool)):
                raise invalid(where, schema, f"is {a_type(schema)}", "a JSON schema")
            check_json_schema(schema, where)
        try:
            if kind == "json":
                xgr.Grammar.from_json_schema(text, any_whitespace=False)
            elif kind == "regex":
                xgr.Grammar.from_regex(text)
            elif kind == "grammar":
                xgr.Grammar.from_ebnf(text)
            elif kind == "structural_tag":
                xgr.Grammar.from_structural_tag(text)
        except Exception as e:  # xgrammar's parse errors
            raise InvalidInputError(
                f"{where} cannot be compiled: {xgrammar_message(e)}", param=where
            ) from None


def xgrammar_message(error: Exception) -> str:
    """xgrammar's error as one line, without the C++ source location it starts with."""
    lines = [line for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", lines[0]).strip()


class GrammarCompiler:
    """Compiles StructuredOutputs for one tokenizer and vocabulary, each once (xgrammar's
    compiler caches too). Built at the first constrained request: xgrammar loads then."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        xgrammar = load_xgrammar()
        self.xgr = xgrammar
        vocab = tokenizer.vocab()
        encoded = [""] * len(vocab)
        for text, token_id in vocab.items():
            encoded[token_id] = text
        info = xgrammar.TokenizerInfo(
            encoded,
            xgrammar.VocabType.BYTE_LEVEL,
            vocab_size=vocab_size,
            stop_token_ids=sorted(eos_token_ids),
        )
        self.vocab_size = vocab_size
        self._compiler = xgrammar.GrammarCompiler(info)
        self._compiled: dict[tuple[str, str], Any] = {}

    def compile(self, spec: StructuredOutput):
        key = spec.key()
        if key not in self._compiled:
            kind, text = key
            try:
                if kind == "json":
                    # No free whitespace: a model could pad a JSON value with it for ever.
                    compiled = self._compiler.compile_json_schema(text, any_whitespace=False)
                elif kind == "json_object":
                    compiled = self._compiler.compile_builtin_json_grammar()
                elif kind == "regex":
                    compiled = self._compiler.compile_regex(text)
                elif kind == "structural_tag":
                    compiled = self._compiler.compile_structural_tag(text)
                else:
                    compiled = self._compiler.compile_grammar(text)
            except Exception as e:  # xgrammar's parse and compile errors, one line
                raise InvalidInputError(
                    f"structured_output.{kind} cannot be compiled: {xgrammar_message(e)}",
                    param=f"structured_output.{kind}",
                ) from None
            self._compiled[key] = compiled
        return GrammarState(self.xgr, self._compiled[key])


class GrammarState:
    """One request's place in its grammar."""

    def __init__(self, xgr, compiled) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)

    def accept(self, token: int) -> bool:
        """Advances past token; False when the grammar does not allow it."""
        return self.matcher.accept_token(token)

    @property
    def finished(self) -> bool:
        """The grammar has ended (and its stop token, if it takes one, been accepted)."""
        return self.matcher.is_terminated()


class TokenMasks:
    """A batch's allowed-token bitmasks: filled on the host by xgrammar (its matchers in
    parallel threads) into pinned memory, and sent to the device in one asynchronous copy.
    Rows without a grammar, or whose grammar has ended, allow every token."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.xgr = load_xgrammar()
        self.words = -(-vocab_size // 32)
        self.device = device
        self._pin = device.type == "cuda"
        self._host: list[torch.Tensor] = []
        self._dev: torch.Tensor | None = None
        self._mirror = 0
        self._fill = self.xgr.BatchGrammarMatcher()

    def _reserve(self, rows: int) -> None:
        if self._dev is not None and self._dev.shape[0] >= rows:
            return
        n = max(rows, 16, 2 * (0 if self._dev is None else self._dev.shape[0]))
        # Two host mirrors: one may still be read by the copy of the step before.
        self._host = [torch.empty((n, self.words), dtype=torch.int32, pin_memory=self._pin)
                      for _ in range(2)]  # fmt: skip
        self._dev = torch.empty((n, self.words), dtype=torch.int32, device=self.device)

    def send(self, states: list[GrammarState | None]) -> torch.Tensor:
        rows = len(states)
        self._reserve(rows)
        host = self._host[self._mirror]
        self._mirror ^= 1
        live = []
        for i, state in enumerate(states):
            if state is None or state.finished:
                host[i].fill_(-1)
            else:
                live.append(i)
        if len(live) == 1:  # the thread pool's hand-off costs more than one row's fill
            states[live[0]].matcher.fill_next_token_bitmask(host, live[0])
        elif live:
            matchers = [states[i].matcher for i in live]
            self._fill.batch_fill_next_token_bitmask(matchers, host, indices=live)
        if not self._pin:
            return host[:rows]
        device = self._dev[:rows]
        device.copy_(host[:rows], non_blocking=True)
        return device


def masked_logits(
    logits: torch.Tensor, states: list[GrammarState | None], masks: TokenMasks
) -> torch.Tensor:
    """logits [rows, vocab], or a copy in which each row with a grammar state has what its
    grammar forbids next at -inf (the raw logits stay as they are, for logprobs). No host
    sync: the masks go up in a copy queued behind the step's kernels."""
    if all(state is None for state in states):
        return logits
    bitmask = masks.send(states)
    masked = logits.clone()
    masks.xgr.apply_token_bitmask_inplace(masked, bitmask, vocab_size=logits.shape[-1])
    return masked
