"""The proposer a speculative_config names."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nanoqwen.runtime.spec.config import SpeculativeConfig
from nanoqwen.runtime.spec.draft import DraftProposer
from nanoqwen.runtime.spec.ngram import NgramProposer
from nanoqwen.runtime.spec.speculator import Proposer

if TYPE_CHECKING:
    from nanoqwen.runtime.builder import EngineParts
    from nanoqwen.runtime.config import EngineConfig


def make_proposer(spec: SpeculativeConfig, engine: EngineConfig, target: EngineParts) -> Proposer:
    if spec.method == "draft":
        return DraftProposer(spec, engine, target)
    return NgramProposer(
        spec.prompt_lookup_min, spec.prompt_lookup_max, spec.num_speculative_tokens
    )
