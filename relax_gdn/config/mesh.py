"""The parallel mesh of a run: world = dp × cp × tp (pipeline parallelism is not used).

Its rule (whole numbers of each) is :func:`relax_gdn.config.validate.validate`'s.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelDims:
    """The mesh arithmetic in one place: world = dp × cp × tp (pipeline parallelism is not used)."""

    world_size: int
    tp: int
    cp: int

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.cp)
