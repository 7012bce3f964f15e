"""FilterStage: which of the sampler's passes a step's filters need."""

from __future__ import annotations

from enum import IntEnum


class FilterStage(IntEnum):
    """Which passes a step's filters need; each decode graph is captured for one. NONE and
    FULL equal False and True, so a caller that only knows whether rows filter gets a stage
    that samples them right (FULL also serves NUCLEUS batches, slower)."""

    NONE = 0  # no row filters: the first pass draws every row
    FULL = 1  # a row has top-k or min-p: candidates, thresholds, then the draw
    NUCLEUS = 2  # the filtering rows use top-p alone: no candidates, no thresholds
