"""The speculator's backoff (runtime/spec/speculator.py; on by default on a GPU): a sequence
whose proposals miss proposes after 1, 3, 7, 15 steps, one whose lookups find nothing after
1, 3, 3; an accepted proposal ends its backoff; while no sequence is due the engine runs
plain steps one step ahead, and the output stays plain decoding's."""

from __future__ import annotations

from spec_helpers import PROMPTS, OracleProposer, all_blocks_free, engine

from nanoqwen import SamplingParams
from nanoqwen.runtime.sampling_params import SamplingParams as Params
from nanoqwen.runtime.sequence import Sequence
from nanoqwen.runtime.spec.config import SpeculativeConfig
from nanoqwen.runtime.spec.speculator import Speculator
from nanoqwen.runtime.spec.verify import Verified


class Fixed:
    """Proposes `proposal` for every sequence (or nothing)."""

    def __init__(self, proposal: list[int]) -> None:
        self.proposal = proposal

    def propose(self, seqs, limits):
        return [self.proposal[:limit] for limit in limits]

    def release(self, seq) -> None:
        pass


def _speculator(proposal: list[int]) -> tuple[Speculator, Sequence]:
    config = SpeculativeConfig("ngram", 4)
    seq = Sequence([1, 2, 3], Params(max_tokens=1000))
    return Speculator(config, 4096, Fixed(proposal), backs_off=True), seq


def _verdict(seq: Sequence, proposal: list[int], accepted: int) -> Verified:
    return Verified([proposal[:accepted] + [0]], None, 1, len(proposal), accepted)


def _proposing_steps(spec: Speculator, seq: Sequence, steps: int, accepted: int = 0) -> list[int]:
    """The steps (1-based) at which seq proposed, each proposal verified with `accepted`."""
    proposed = []
    for _ in range(steps):
        (proposal,) = spec.propose([seq])
        if proposal:
            proposed.append(spec.step)
            spec.count(_verdict(seq, proposal, accepted), [seq], [proposal])
    return proposed


def test_rejected_proposals_back_off_exponentially_up_to_15_steps():
    spec, seq = _speculator([7, 7, 7, 7])
    # misses at 1, then skips of 1, 3, 7, 15, 15
    assert _proposing_steps(spec, seq, 60) == [1, 3, 7, 15, 31, 47]
    assert not spec.due([seq]) and spec.stats.num_proposed == 24


def test_lookups_that_find_nothing_back_off_up_to_3_steps():
    spec, seq = _speculator([])
    asked = []
    for _ in range(20):
        before = spec._resumes(seq)
        spec.propose([seq])
        if before <= spec.step:
            asked.append(spec.step)
    assert asked == [1, 3, 7, 11, 15, 19]


def test_an_accepted_proposal_ends_the_backoff():
    spec, seq = _speculator([7, 7, 7, 7])
    assert _proposing_steps(spec, seq, 14) == [1, 3, 7]  # the next at 15
    assert _proposing_steps(spec, seq, 4, accepted=2) == [15, 16, 17, 18]
    assert spec.due([seq])


def test_without_backoff_every_step_proposes():
    spec, seq = _speculator([7, 7, 7, 7])
    spec.backs_off = False
    assert _proposing_steps(spec, seq, 10) == list(range(1, 11))


def test_misses_run_plain_steps_ahead_and_keep_the_output(tiny_model):
    """A proposer that is always wrong: the engine verifies rarely, runs plain steps one
    ahead in between, and gives plain decoding's tokens; then one that is always right."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = engine(tiny_model[0], spec=None)
    expected = plain.generate(PROMPTS[:4], params)
    finished = [o.prompt_token_ids + o.token_ids for o in expected]
    for wrong, most_verifies in ((True, 6), (False, None)):
        llm = engine(tiny_model[0])
        llm.speculator.backs_off = True
        oracle = OracleProposer(finished)
        if wrong:  # every third proposal is perturbed by the oracle; make it every one
            oracle.calls = 0
            lookup = oracle.lookup

            def always_wrong(token_ids, limit, lookup=lookup):
                proposal = lookup(token_ids, limit)
                return [(t + 1) % 512 for t in proposal]

            oracle.lookup = always_wrong
        llm.speculator.proposer = oracle
        ahead = _count_calls(llm, "_step_ahead")
        got = llm.generate(PROMPTS[:4], params)
        assert [o.token_ids for o in got] == [o.token_ids for o in expected]
        stats = llm.stats()
        if wrong:
            assert stats["spec_accepted_tokens"] == 0
            assert stats["spec_verified"] <= 4 * most_verifies and ahead[0] >= 30
        else:
            # Only the prompts' step ran ahead (nothing was running to propose for).
            assert stats["spec_accepted_tokens"] > 0 and ahead[0] == 1
        assert all_blocks_free(llm)


def _count_calls(llm, name: str) -> list[int]:
    count = [0]
    method = getattr(llm, name)

    def counted():
        count[0] += 1
        return method()

    setattr(llm, name, counted)
    return count


def test_nothing_is_proposed_while_a_plain_step_runs_ahead():
    """The engine holds proposals while it runs a step ahead (a sequence due to propose,
    e.g. one swapped back in, would read a token still in flight); the steps still count."""
    spec, seq = _speculator([7, 7, 7, 7])
    spec.holding = True
    assert spec.propose([seq]) == [[]] and spec.step == 1
    spec.holding = False
    assert spec.propose([seq]) == [[7, 7, 7, 7]]
