"""Which kernel moves a GDN layer's gradients: every conv/scan backend pairing vs an fp64 truth.

    python -m relax_gdn.bench.gdn_precision [--triton-dqkwg]

One process, CP 1 (precision is not a CP question: every CP mode matches all_gather to 1e-4 in
fp32, ``tests/test_gdn_layer_gpu.py``). The layer and batch are the GDN GPU test's (hidden 256,
Qwen3.5-9B head shapes 16 QK / 32 V x 128, packed [192, 0, 512, 64, 512] tokens, parameters
perturbed off their init). The truth is the pure-torch reference in fp64. Rows: the torch
reference in fp32; FLA conv + FLA scan (the layer on GPU); each FLA kernel alone with the other
from the reference; the layer in bf16. Columns: max |error| / max |truth| of the output, the
input gradient and the parameter gradients that matter.

On CPU only the fp32 torch row runs (FLA needs CUDA). ``TRITON_F32_DEFAULT=ieee`` makes FLA's
Triton kernels multiply fp32 exactly instead of in TF32; ``--triton-dqkwg`` runs FLA's Triton
``chunk_bwd_dqkwg`` instead of the TileLang one FLA 0.6 picks on Hopper (skipping FLA's guard
against Triton < 3.7.1 there, whose miscompile is at BK = 64; Hopper uses BK = 128).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist

PACKED = [0, 192, 192, 704, 768, 1280]
HIDDEN = 256
REPORTED = ("out", "dx", "A_log", "dt_bias", "in_proj.weight", "conv1d.weight")


class _Pairing:
    """The conv of one kernel backend with the scan of another."""

    def __init__(self, conv, scan):
        self._conv, self._scan, self.name = conv, scan, f"{conv.name} conv + {scan.name} scan"

    def conv(self, *args):
        return self._conv.conv(*args)

    def scan(self, *args):
        return self._scan.scan(*args)


@contextlib.contextmanager
def _kernels(kernels):
    from relax_gdn.gdn import layer as gdn_layer

    real = gdn_layer.select_kernels
    gdn_layer.select_kernels = lambda options, device: kernels
    try:
        yield
    finally:
        gdn_layer.select_kernels = real


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--triton-dqkwg", action="store_true", help="FLA's Triton chunk_bwd_dqkwg, not TileLang's"
    )
    args = parser.parse_args()
    if args.triton_dqkwg and "fla" in sys.modules:
        raise RuntimeError("--triton-dqkwg must take effect before FLA is imported")
    from relax_gdn.runtime import Runtime

    # FLA decides once per process, when it imports, which backends it may use: the Runtime sets
    # FLA_TILELANG before it imports FLA (on CUDA), and puts everything below back when it closes
    with Runtime(environ={"FLA_TILELANG": "0"} if args.triton_dqkwg else None) as runtime:
        if args.triton_dqkwg:
            import fla.ops.common.chunk_o as fla_chunk_o

            runtime.replace_attribute(
                fla_chunk_o, "TRITON_ABOVE_3_7_1", True
            )  # FLA's Hopper guard, see above
        if torch.cuda.is_available():
            # Megatron-Core's jit_fuser (torch.compile) cannot compile the gated norm in fp64
            runtime.replace_attribute(torch._dynamo.config, "disable", True)
        _measure(args)


def _measure(args) -> None:
    from relax_gdn.parallel import init_distributed

    cpu = not torch.cuda.is_available()
    device = torch.device("cpu") if cpu else torch.device("cuda", 0)
    created = init_distributed(device)  # one process: an in-process store, no port
    if not cpu:
        from megatron.core.tensor_parallel import random as mcore_random

        mcore_random.model_parallel_cuda_manual_seed(1234, tp_rank=0, ep_rank=0, etp_rank=0)

    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module

    from relax_gdn.bench.gdn_layer import packed_seq_params, qwen35_gdn_config
    from relax_gdn.gdn.kernels import FlaKernels, TorchKernels
    from relax_gdn.gdn.layer import gdn_cp_layer_spec
    from relax_gdn.gdn.options import GDNOptions

    world = dist.group.WORLD
    config = qwen35_gdn_config(hidden_size=HIDDEN, params_dtype=torch.float32, bf16=False)

    def layer(dtype, state=None):
        pgs = ProcessGroupCollection(tp=world, cp=world)
        built = build_module(
            gdn_cp_layer_spec(GDNOptions(max_cp_size=1)), config=config, layer_number=1, pg_collection=pgs
        ).to(device)
        if state is not None:
            built.load_state_dict(state)
        return built.to(dtype)

    base = layer(torch.float32)
    with torch.no_grad():
        for p in base.parameters():  # off the init: gate parameters and projections of some size
            p.add_(0.1 * torch.randn_like(p))
    state = base.state_dict()
    torch.manual_seed(0)
    x = torch.randn(PACKED[-1], 1, HIDDEN, device=device)
    weight = torch.randn_like(x)

    def run(kernels, dtype) -> dict[str, torch.Tensor]:
        module = layer(dtype, state)
        xx = x.to(dtype, copy=True).requires_grad_(True)  # a fresh leaf: x.to(x.dtype) would be x itself
        with _kernels(kernels):
            out, _ = module(xx, None, packed_seq_params=packed_seq_params(PACKED, device))
            (out * weight.to(dtype)).sum().backward()
        return {"out": out.detach(), "dx": xx.grad, **{n: p.grad for n, p in module.named_parameters()}}

    torch_kernels = TorchKernels()
    truth = run(torch_kernels, torch.float64)
    variants = [("torch, fp32", torch_kernels, torch.float32)]
    if not cpu:
        fla = FlaKernels(
            fused_gate=True, zigzag_cp=False, skip_unread_cp_summaries=False
        )  # CP 1: no summaries
        variants += [
            ("FLA conv + FLA scan, fp32", fla, torch.float32),
            ("torch conv + FLA scan, fp32", _Pairing(torch_kernels, fla), torch.float32),
            ("FLA conv + torch scan, fp32", _Pairing(fla, torch_kernels), torch.float32),
            ("FLA conv + FLA scan, bf16", fla, torch.bfloat16),
        ]
    print(
        f"GDN layer vs fp64 torch truth: max |error| / max |truth|; device {device}, "
        f"TRITON_F32_DEFAULT={os.environ.get('TRITON_F32_DEFAULT', 'tf32 (Triton default)')}, "
        f"chunk_bwd_dqkwg {'Triton' if args.triton_dqkwg else 'FLA default'}"
    )
    print(f"  {'variant':<30}" + "".join(f"{name:>16}" for name in REPORTED))
    for label, kernels, dtype in variants:
        got = run(kernels, dtype)
        errors = {
            k: ((got[k].double() - truth[k]).abs().max() / truth[k].abs().max()).item() for k in REPORTED
        }
        print(f"  {label:<30}" + "".join(f"{errors[k]:>16.2e}" for k in REPORTED), flush=True)
        print("json " + json.dumps({"variant": label, **errors}), flush=True)
    if created:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()  # installs the Runtime itself, with the FLA backend choice that must precede FLA's import
