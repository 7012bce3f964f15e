"""IncrementalDetokenizer on byte-level tokens: multi-byte UTF-8 held back until complete,
stop strings (held-back prefixes, trimming, min_tokens), and the final flush."""

from __future__ import annotations

import pytest

from nanoqwen.runtime.detokenizer import IncrementalDetokenizer
from nanoqwen.weights.tokenizer import Tokenizer

TEXT = "你好，世界。今天天气很好。ok"


def byte_to_char() -> dict[int, str]:
    """GPT-2's byte -> printable character map that byte-level BPE vocabularies use."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    bs += range(ord("®"), ord("ÿ") + 1)
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


@pytest.fixture(scope="module")
def tok(tiny_model):
    return Tokenizer(tiny_model[0])


def byte_tokens(tok: Tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte: every multi-byte character is split over tokens."""
    table = byte_to_char()
    ids = [tok.token_to_id(table[b]) for b in text.encode()]
    assert None not in ids
    return ids


def run(tok, ids, stop=(), min_tokens=0, final_at=None):
    """Feeds ids one by one, as the engine does; returns (pieces, detokenizer)."""
    detok = IncrementalDetokenizer(tok, tuple(stop), min_tokens)
    pieces = []
    final_at = len(ids) if final_at is None else final_at
    for n, t in enumerate(ids, 1):
        final = n == final_at
        detok.add([t], final=final)
        pieces.append(detok.pending(final=final or detok.stopped))
        if detok.stopped or final:
            break
    return pieces, detok


def test_byte_split_characters_are_held_back_until_complete(tok):
    ids = byte_tokens(tok, TEXT)
    assert tok.decode(ids) == TEXT
    pieces, detok = run(tok, ids)
    assert "".join(pieces) == detok.text == TEXT
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[:3] == ["", "", "你"]  # three bytes, one character
    assert sum(1 for p in pieces if p) == len(TEXT)


def test_bpe_tokens_stream_to_the_decoded_text(tok):
    ids = tok.encode(TEXT + " The quick brown fox 今天天气")
    pieces, detok = run(tok, ids)
    assert "".join(pieces) == tok.decode(ids)


def test_stop_string_trims_and_its_prefix_is_never_emitted(tok):
    ids = byte_tokens(tok, TEXT)
    pieces, detok = run(tok, ids, stop=["。今天"])
    assert detok.stopped
    assert "".join(pieces) == detok.text == "你好，世界"
    assert all("。" not in p for p in pieces)
    # It stopped on the token that completed the stop string.
    assert len(pieces) == len("你好，世界。今天".encode())


def test_earliest_of_several_stop_strings_wins(tok):
    ids = byte_tokens(tok, TEXT)
    _, detok = run(tok, ids, stop=["很好", "世界", "ok"])
    assert detok.text == "你好，"


def test_unfinished_stop_prefix_is_released(tok):
    text = "ab abc abd"
    ids = byte_tokens(tok, text)
    pieces, detok = run(tok, ids, stop=["abX"])
    assert not detok.stopped
    assert "".join(pieces) == text
    # "ab" may start the stop string, so it waits for the next character.
    assert pieces[:3] == ["", "", "a"]


def test_stop_strings_inside_min_tokens_are_ignored(tok):
    text = "stop here, stop there"
    ids = byte_tokens(tok, text)
    # The first "stop" ends at token 4: with min_tokens=4 it does not count.
    _, detok = run(tok, ids, stop=["stop"], min_tokens=4)
    assert detok.stopped and detok.text == "stop here, "
    _, detok = run(tok, ids, stop=["stop"], min_tokens=3)
    assert detok.stopped and detok.text == ""
    # A stop string that starts inside min_tokens but ends after it counts.
    _, detok = run(tok, ids, stop=["here,"], min_tokens=6)
    assert detok.stopped and detok.text == "stop "
    _, detok = run(tok, ids, stop=["here,"], min_tokens=9)
    assert detok.stopped and detok.text == "stop "
    _, detok = run(tok, ids, stop=["here,"], min_tokens=10)  # "here," ends at token 10
    assert not detok.stopped and detok.text == text


def test_final_flush_releases_an_incomplete_character(tok):
    ids = byte_tokens(tok, "ok你")[:-1]  # the last byte of 你 never comes
    pieces, detok = run(tok, ids)
    assert "".join(pieces) == "ok\ufffd" == tok.decode(ids)
