"""Gated DeltaNet with three context-parallel modes on Megatron-Core 0.19.2.

``reference`` holds pure-torch kernels (CPU ground truth), ``kernels`` the backend switch
(FLA on CUDA, reference elsewhere), ``layer`` the CP-mode ``GatedDeltaNet``.
"""

CP_MODES = ("headwise", "chunkwise", "all_gather")
