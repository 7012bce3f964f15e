"""check_prompt's fast path (plain ints, checked at C speed) takes exactly what the
element-by-element check takes, and returns plain ints."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from nanoqwen import InvalidInputError
from nanoqwen.validation import check_prompt

VOCAB = 100
token = st.one_of(
    st.integers(-3, VOCAB + 3),
    st.booleans(),
    st.floats(0, 10),
    st.integers(0, VOCAB - 1).map(np.int64),
)


@given(st.lists(token, max_size=12), st.booleans())
def test_a_prompt_is_taken_exactly_when_every_id_is_an_int_in_the_vocabulary(prompt, as_tuple):
    given_prompt = tuple(prompt) if as_tuple else prompt
    ok = all(
        isinstance(t, (int, np.integer)) and not isinstance(t, bool) and 0 <= t < VOCAB
        for t in prompt
    )
    if ok:
        ids = check_prompt(given_prompt, VOCAB)
        assert ids == [int(t) for t in prompt]
        assert all(type(t) is int for t in ids)
        assert ids is not given_prompt  # a copy: the caller's list is not kept
    else:
        with pytest.raises(InvalidInputError, match=r"^prompt=.* (holds|is) "):
            check_prompt(given_prompt, VOCAB)


def test_the_last_id_of_the_vocabulary_is_taken_and_the_next_refused():
    assert check_prompt([0, VOCAB - 1], VOCAB) == [0, VOCAB - 1]
    with pytest.raises(InvalidInputError, match=f"holds the token id {VOCAB}:"):
        check_prompt([0, VOCAB], VOCAB)
    assert check_prompt([0, 10**9], None) == [0, 10**9]  # no vocabulary: any id >= 0
