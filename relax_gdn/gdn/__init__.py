"""Gated DeltaNet with three context-parallel modes on Megatron-Core 0.19.2.

``reference`` holds pure-torch kernels (CPU ground truth), ``kernels`` the backend switch
(FLA on CUDA, reference elsewhere), ``layer`` the CP-mode ``GatedDeltaNet``.
"""

CP_MODES = ("headwise", "chunkwise", "all_gather")

# chunkwise: a sequence crossing a rank cut with at most this many tokens before the cut is
# recomputed by the next rank instead of passing the recurrent state between ranks
# (``gdn.reference.RecomputedPrefix``; config key gdn.max_recomputed_prefix, 0 turns it off).
# Why 1024 (2 x H200, Qwen3.5-9B shapes, fwd+bwd, python -m relax_gdn.bench.gdn_layer): passing
# the state through FLA's CP kernels costs the layer 0.8-1.2 ms at 16k tokens and ~1.4 ms at 64k,
# while one GPU runs the layer at ~1 us per token, so a recomputed prefix costs as much as the
# state passing near a thousand tokens.
DEFAULT_MAX_RECOMPUTED_PREFIX = 1024
