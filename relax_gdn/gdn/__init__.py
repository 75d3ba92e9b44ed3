"""Gated DeltaNet with three context-parallel modes on Megatron-Core 0.19.2.

``reference`` holds pure-torch kernels (CPU ground truth), ``kernels`` the backend switch
(FLA on CUDA, reference elsewhere), ``layer`` the CP-mode ``GatedDeltaNet``.
"""

from relax_gdn.choices import CP_MODES  # noqa: F401 - the public name docs/design/ARCHITECTURE.md promises

# chunkwise: a sequence crossing a rank cut with at most this many tokens before the cut is
# recomputed by the next rank instead of passing the recurrent state between ranks
# (``gdn.cp_reference.RecomputedPrefix``; config key gdn.max_recomputed_prefix, 0 turns it off).
# 1024: about where recomputing a prefix costs as much as passing the state through FLA's CP
# kernels (the estimate and its numbers: docs/benchmarks.md, "Figures behind code comments").
DEFAULT_MAX_RECOMPUTED_PREFIX = 1024
