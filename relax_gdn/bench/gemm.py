"""The 9B's linear layers in bf16 against each FP8 recipe, one GPU, per GEMM shape.

    python -m relax_gdn.bench.gemm [--tokens 8192] [--out gemm.json]
        [--recipes tensorwise,tensorwise@compiled,rowwise,rowwise_gw_hp]

Each row is one linear layer of the preset (``--preset``, default the 9B) at ``--tokens`` tokens,
run the way training runs it: bf16 is Megatron-Core's own linear function
(``linear_with_grad_accumulation_and_async_allreduce``), each recipe the FP8 implementation the
model installs (:class:`~relax_gdn.model.fp8.linear.FP8LinearImpl`, its casts included; ``@compiled``
after a recipe casts with ``torch.compile`` instead of the Triton kernel, for comparison), both
adding the weight gradient into an fp32 ``main_grad`` where the fused accumulation is available.
Per row: forward and backward (input + weight gradient) medians (CUDA events) with their TFLOP/s
(2·T·N·K forward, 4·T·N·K backward: MFU-style counts, the same for bf16 and FP8), the FP8/bf16
speed-up, the output's and input gradient's error relative to bf16, and the host syncs of one
forward + backward (expected 0). Last: the per-micro-batch sum over the model's layers (each
shape times how many the model has), the figure that bounds what FP8 can gain end to end.
The output layer (4,096 -> 248,320) is shown for reference: the recipe keeps it in bf16 (its chunked
loss never calls the layer; docs/fp8.md).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

import torch

from relax_gdn.bench.needs import require_gpus
from relax_gdn.bench.timing import count_host_syncs, cuda_median_ms


@dataclass(frozen=True)
class LinearShape:
    """One kind of linear layer: ``in_features -> out_features``, ``count`` of them in the model,
    ``bf16_rows`` output rows the recipe keeps in bf16 (the GDN gates), ``in_model``: whether the
    FP8 recipe runs it."""

    name: str
    in_features: int
    out_features: int
    count: int
    bf16_rows: int = 0
    in_model: bool = True


def model_linear_shapes(preset: str) -> list[LinearShape]:
    """The linear layers of ``preset`` at TP 1 (counts over the decoder; the MTP layer left out)."""
    from relax_gdn.model.presets import qwen3_5_preset

    p = qwen3_5_preset(preset)
    c = p.config
    h, layers = c["hidden_size"], c["num_layers"]
    attention = layers // c["linear_attention_freq"]
    gdn = layers - attention
    qk = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    v = c["linear_num_value_heads"] * c["linear_value_head_dim"]
    gates = 2 * c["linear_num_value_heads"]
    q = c["num_attention_heads"] * c["kv_channels"]
    kv = c["num_query_groups"] * c["kv_channels"]
    return [
        LinearShape("gdn in_proj", h, 2 * qk + 2 * v + gates, gdn, bf16_rows=gates),
        LinearShape("gdn out_proj", v, h, gdn),
        LinearShape("attn linear_qkv", h, 2 * q + 2 * kv, attention),  # the query with its output gate
        LinearShape("attn linear_proj", q, h, attention),
        LinearShape("mlp linear_fc1", h, 2 * c["ffn_hidden_size"], layers),
        LinearShape("mlp linear_fc2", c["ffn_hidden_size"], h, layers),
        LinearShape("output_layer", h, p.vocab_size, 1, in_model=False),
    ]


def _linear_fn(recipe: str | None, bf16_rows: int, fuse: bool):
    """``(x, w) -> y`` with the model's autograd: Megatron-Core's function for bf16, else the FP8
    implementation of ``recipe`` (``name`` or ``name@casts``, ``casts`` one of
    :class:`~relax_gdn.model.fp8.casts.CastKernels`' modes: the model's Triton kernel by default)."""
    from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce

    if recipe is None:
        return lambda x, w: linear_with_grad_accumulation_and_async_allreduce(
            x, w, None, gradient_accumulation_fusion=fuse, allreduce_dgrad=False, sequence_parallel=False
        )
    from relax_gdn.model.fp8.casts import CastKernels
    from relax_gdn.model.fp8.linear import FP8LinearImpl

    name, _, casts = recipe.partition("@")
    impl = FP8LinearImpl.of_recipe(name, kernels=CastKernels(casts or "triton"), bf16_rows=bf16_rows)
    return lambda x, w: impl(x, w, gradient_accumulation_fusion=fuse)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _measure_shape(shape: LinearShape, tokens: int, recipes: list[str | None], fuse: bool) -> list[dict]:
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(tokens, shape.in_features, device=dev, dtype=bf16, generator=gen).requires_grad_()
    w = (
        torch.randn(shape.out_features, shape.in_features, device=dev, dtype=bf16, generator=gen)
        * shape.in_features**-0.5
    ).requires_grad_()
    w.main_grad = torch.zeros(w.shape, device=dev, dtype=torch.float32)
    w.grad_added_to_main_grad = False
    grad = torch.randn(tokens, shape.out_features, device=dev, dtype=bf16, generator=gen)
    flops = 2 * tokens * shape.in_features * shape.out_features
    rows, reference = [], None
    for recipe in recipes:
        fn = _linear_fn(recipe, shape.bf16_rows, fuse)

        def forward():
            with torch.no_grad():
                return fn(x, w)

        def forward_backward():
            x.grad = None
            fn(x, w).backward(grad)

        forward_backward()  # compiles the casts (Triton's kernel, or Inductor's)
        x.grad = None
        y = fn(x, w)
        y.backward(grad)
        if reference is None:
            reference = (y.detach(), x.grad.detach().clone())
        fwd_ms = cuda_median_ms(forward, iters=10, warmup=2, align_ranks=False)
        total_ms = cuda_median_ms(forward_backward, iters=10, warmup=2, align_ranks=False)
        bwd_ms = max(total_ms - fwd_ms, 1e-9)
        rows.append(
            dict(
                shape=shape.name,
                recipe=recipe or "bf16",
                in_features=shape.in_features,
                out_features=shape.out_features,
                count=shape.count,
                in_model=shape.in_model,
                fwd_ms=fwd_ms,
                bwd_ms=bwd_ms,
                fwd_tflops=flops / fwd_ms / 1e9,
                bwd_tflops=2 * flops / bwd_ms / 1e9,
                out_rel_err=_rel(y, reference[0]),
                dgrad_rel_err=_rel(x.grad, reference[1]),
                host_syncs=count_host_syncs(forward_backward),
            )
        )
    base = rows[0]
    for row in rows:
        row["speedup"] = (base["fwd_ms"] + base["bwd_ms"]) / (row["fwd_ms"] + row["bwd_ms"])
    return rows


def _print_rows(rows: list[dict]) -> None:
    print(
        f"{'layer':<18}{'recipe':<22}{'fwd ms':>8}{'TFLOP/s':>9}{'bwd ms':>8}{'TFLOP/s':>9}{'x bf16':>8}"
        f"{'out err':>9}{'dx err':>8}{'syncs':>6}"
    )
    for r in rows:
        print(
            f"{r['shape']:<18}{r['recipe']:<22}{r['fwd_ms']:>8.3f}{r['fwd_tflops']:>9.0f}{r['bwd_ms']:>8.3f}"
            f"{r['bwd_tflops']:>9.0f}{r['speedup']:>8.2f}{r['out_rel_err']:>9.4f}{r['dgrad_rel_err']:>8.4f}"
            f"{r['host_syncs']:>6d}",
            flush=True,
        )


def model_totals(rows: list[dict]) -> dict[str, float]:
    """Per recipe: ms per micro-batch over the model's layers that the recipe runs in FP8 (each
    shape's fwd + bwd time x its count); the output layer left out (bf16 in every recipe)."""
    totals: dict[str, float] = {}
    for r in rows:
        if r["in_model"]:
            totals[r["recipe"]] = totals.get(r["recipe"], 0.0) + r["count"] * (r["fwd_ms"] + r["bwd_ms"])
    return totals


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--preset", default="qwen3_5_9b")
    parser.add_argument("--recipes", default="tensorwise,tensorwise@compiled,rowwise,rowwise_gw_hp")
    parser.add_argument("--no-output-layer", action="store_true", help="leave the output layer's row out")
    parser.add_argument("--out", default=None, help="write the rows and totals as JSON here")
    args = parser.parse_args(argv)
    require_gpus("relax_gdn.bench.gemm")

    from relax_gdn.compat.wgrad import enable_wgrad_accumulation_fusion
    from relax_gdn.runtime import Runtime

    with Runtime() as runtime:  # the fused wgrad GEMM is a process-wide change the Runtime undoes
        fuse, undo = enable_wgrad_accumulation_fusion()
        runtime.adopt(undo)
        recipes = [None, *filter(None, args.recipes.split(","))]
        shapes = [s for s in model_linear_shapes(args.preset) if s.in_model or not args.no_output_layer]
        rows = []
        for shape in shapes:
            rows += _measure_shape(shape, args.tokens, recipes, fuse)
            torch.cuda.empty_cache()
        _print_rows(rows)
        totals = model_totals(rows)
        base = totals["bf16"]
        print(
            f"\n{args.preset} linear layers per micro-batch of {args.tokens} tokens (fwd + bwd, the output layer "
            "left out):"
        )
        for recipe, ms in totals.items():
            print(f"  {recipe:<22}{ms:>9.1f} ms  {base / ms:.2f}x bf16")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(
                    {
                        "tokens": args.tokens,
                        "preset": args.preset,
                        "fused_wgrad": fuse,
                        "shapes": [asdict(s) for s in shapes],
                        "rows": rows,
                        "totals_ms": totals,
                    },
                    f,
                    indent=1,
                )


if __name__ == "__main__":
    main()
