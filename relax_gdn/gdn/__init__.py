"""Gated DeltaNet with three context-parallel modes on Megatron-Core 0.19.2.

``reference`` holds pure-torch kernels (CPU ground truth), ``kernels`` the backend switch
(FLA on CUDA, reference elsewhere), ``layer`` the CP-mode ``GatedDeltaNet``.
"""

from relax_gdn.choices import CP_MODES  # noqa: F401 - the public name docs/design/ARCHITECTURE.md promises

# chunkwise: a sequence crossing a rank cut with at most this many tokens before the cut is
# recomputed by the next rank instead of passing the recurrent state between ranks
# (``gdn.reference.RecomputedPrefix``; config key gdn.max_recomputed_prefix, 0 turns it off).
# Why 1024 (2 x H200, Qwen3.5-9B shapes, fwd+bwd, python -m relax_gdn.bench.gdn_layer): passing
# the state through FLA's CP kernels cost the layer 0.4-2.8 ms more than recomputing a 192-token
# prefix at 16k tokens (three runs), and chunkwise at 64k sits ~1.4 ms above one GPU on half the
# batch plus the bare all-to-alls, while one GPU runs the layer at ~1 us per token: a recomputed
# prefix costs about as much as the state passing near a thousand tokens. Not swept.
DEFAULT_MAX_RECOMPUTED_PREFIX = 1024
