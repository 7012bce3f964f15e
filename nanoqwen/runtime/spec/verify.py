"""Checks proposed tokens against the target model's own sampler.

Row j of a sequence's verify rows holds the target's logits for the token after its j-th
proposal (row 0: after its last real token). Each row is sampled exactly as a plain decode
step would sample it: the same processing, the same counter-based noise (keyed by the
request's seed and the output position), and penalties that count the rows before it. A
proposal is accepted while it equals the token sampled at its row; the first row whose
sample differs supplies the correction, and when all are accepted the last row adds one.

Proposals here are single tokens, not distributions (n-gram lookup), so this is the standard
rejection-sampling rule with a point-mass draft: a proposal d is accepted with probability
p(d), and a rejection leaves the target's sample, distributed as p without d. The output is
therefore distributed as plain sampling's, and for the same seed it is the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanoqwen.runtime.launched_step import logprob_entries
from nanoqwen.runtime.logprobs import TokenLogprobs
from nanoqwen.runtime.sampling.sampler import Sampler
from nanoqwen.runtime.sequence import Sequence

# sample(logits rows, their sequences) -> tokens, recorded in the sequences' sampler slots.
SampleRows = Callable[[torch.Tensor, list[Sequence]], torch.Tensor]
# to_device(host list, dtype) -> device tensor, sent without waiting.
ToDevice = Callable[[list, torch.dtype], torch.Tensor]


@dataclass
class Verified:
    tokens: list[list[int]]  # per sequence: its accepted proposals, then one sampled token
    logprobs: list[list[TokenLogprobs]] | None  # the target's entries for those tokens
    num_verified: int  # sequences that had proposals to check
    num_proposed: int
    num_accepted: int


def verify_rows(
    logits: torch.Tensor,
    seqs: list[Sequence],
    proposals: list[list[int]],
    sample: SampleRows,
    sampler: Sampler,
    to_device: ToDevice,
) -> Verified:
    """logits: [sum of (1 + len(proposal)), vocab], each sequence's rows in turn."""
    starts, row = [], 0
    for proposal in proposals:
        starts.append(row)
        row += 1 + len(proposal)
    depth = max(len(p) for p in proposals)
    order: list[tuple[int, int]] = []  # (sequence, row depth) of each sampled row, in order
    sampled = []
    # Depth by depth, so each row's penalties and noise position follow the rows before it.
    for j in range(depth + 1):
        members = [i for i, p in enumerate(proposals) if len(p) >= j]
        rows = to_device([starts[i] + j for i in members], torch.int64)
        sampled.append((rows, sample(logits[rows], [seqs[i] for i in members])))
        order += [(i, j) for i in members]
    flat_rows = torch.cat([r for r, _ in sampled])
    flat = torch.cat([t for _, t in sampled])
    return conclude(logits, flat_rows, flat, order, seqs, proposals, sampler, to_device)


def conclude(
    logits: torch.Tensor,
    rows: torch.Tensor | None,
    tokens: torch.Tensor,
    order: list[tuple[int, int]],
    seqs: list[Sequence],
    proposals: list[list[int]],
    sampler: Sampler,
    to_device: ToDevice,
    positions: list[int] | None = None,
    taken_back: bool = False,
) -> Verified:
    """What the sampled rows accept. tokens[n] (on the device) was sampled at depth j of
    sequence i for (i, j) = order[n], from logits[rows[n]] (rows: needed with logprobs
    only); depths run 0..len(proposal) for each. positions: tokens[positions[n]] instead,
    read on the host (no gather on the device). taken_back: the rows past each rejection are no
    longer counted in the sampler's slots (a verify graph does that itself)."""
    top = sampler.state.max_logprobs
    raw = sampler.logprobs(logits[rows], tokens, top) if top is not None else None
    host = tokens.tolist()  # the step's one wait for the device
    if positions is not None:
        host = [host[q] for q in positions]
    table: list[list[int]] = [[0] * (1 + len(p)) for p in proposals]
    where: list[list[int]] = [[0] * (1 + len(p)) for p in proposals]
    for n, (i, j) in enumerate(order):
        table[i][j] = host[n]
        where[i][j] = n
    accepted = []
    for proposal, row_tokens in zip(proposals, table):
        a = 0
        while a < len(proposal) and row_tokens[a] == proposal[a]:
            a += 1
        accepted.append(a)
    if not taken_back:
        _forget_rejected(sampler, seqs, table, accepted, to_device)
    entries = None
    if raw is not None:
        all_entries = logprob_entries(tuple(t.cpu() for t in raw), host)
        entries = [[all_entries[where[i][j]] for j in range(a + 1)] for i, a in enumerate(accepted)]
    return Verified(
        tokens=[row_tokens[: a + 1] for row_tokens, a in zip(table, accepted)],
        logprobs=entries,
        num_verified=sum(1 for p in proposals if p),
        num_proposed=sum(len(p) for p in proposals),
        num_accepted=sum(accepted),
    )


def _forget_rejected(sampler: Sampler, seqs, table, accepted, to_device: ToDevice) -> None:
    """The rows past each sequence's first rejection were sampled (and counted as outputs of
    its slot) only to be dropped: their counts and output positions are taken back."""
    slots, tokens = [], []
    for seq, row_tokens, a in zip(seqs, table, accepted):
        dropped = row_tokens[a + 1 :]
        if dropped:
            slot = sampler.state.slot(seq)
            slots += [slot] * len(dropped)
            tokens += dropped
    if slots:
        sampler.state.unrecord(to_device(slots, torch.int64), to_device(tokens, torch.int64))
