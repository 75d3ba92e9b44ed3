"""Options, not globals: two Qwen3.5 models built with different options live in one process. Run
interleaved under full recompute (forward of one, forward of the other, then the backwards, so
each model's recomputed forward runs inside its backward, after the other model ran), each gives
exactly what it gives alone, and the two differ (the options do change the computation).

CPU here (CP 2 over gloo, torch kernels: the fused norms and loss against the plain ones, the
recomputed prefix against the passed state, contiguous GDN runs against per-layer swaps); the FLA
options on 2 GPUs are ``test_interleaved_fla_options_keep_their_own_results`` in
tests/test_gdn_layer_gpu.py, through :func:`tests.model_harness.interleaved_options_case`.
"""

from __future__ import annotations

import torch

from tests.model_harness import interleaved_options_case

# 2 x CP = 4 divides every document; the one over [16, 56) crosses the CP-2 cut (32) with 16 tokens
# before it: model a recomputes that prefix on rank 1, model b passes the recurrent state
CPU_CU = [0, 12, 12, 16, 56, 64]


def _cpu_case():
    from relax_gdn.gdn.options import GDNOptions
    from relax_gdn.model.fusion import Fusion

    return interleaved_options_case(
        "qwen3_5_tiny",
        256,
        CPU_CU,
        torch.float32,
        {
            "defaults": dict(gdn=GDNOptions(kernel_backend="torch", max_cp_size=2)),
            "other options": dict(
                gdn=GDNOptions(kernel_backend="torch", max_cp_size=2, max_recomputed_prefix=0),
                fusion=Fusion(norms=False, cross_entropy=False),
                contiguous_between_layers=False,
            ),
        },
    )


def test_interleaved_models_keep_their_own_options(gloo):
    for rank, result in enumerate(gloo(_cpu_case, 2)):
        # bit for bit what each model gives alone: nothing of one model's options reached the other
        assert result["interleaved_vs_alone"] == {"defaults": 0.0, "other options": 0.0}, (rank, result)
        # full recompute ran each model's first layer again inside its backward
        assert result["recomputed_in_backward"] == {"defaults": 1, "other options": 1}, (rank, result)
        assert result["a_vs_b"] > 0, (rank, result)  # the options change the computation
