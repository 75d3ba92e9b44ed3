"""FP8 GEMMs on a GPU with FP8 tensor cores (compute capability >= 8.9): the ``torch._scaled_mm``
path against the CPU emulation of the same recipe (output and both gradients; the Triton and
compiled casts bit for bit against eager ones), no host sync in a linear's forward + backward or in
a training step, and the reduced 9B trained with each recipe next to bf16 (loss and grad norm within FP8's
error, every FP8 layer counted as run, full and selective recompute agreeing)."""

from __future__ import annotations

import pytest
import torch

from relax_gdn.bench.timing import count_host_syncs
from tests.helpers import train_reduced_9b_on_gpu

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
        reason="needs a CUDA GPU with FP8 tensor cores (compute capability >= 8.9)",
    ),
]

RECIPES = ("tensorwise", "rowwise", "rowwise_gw_hp")
# _scaled_mm (fp32 accumulation in the tensor cores, fast accumulation in forward) against the
# fp32 GEMM of the same FP8 operands: relative to the output's norm
SCALED_MM_TOL = 2e-3
# the reduced 9B, one step, FP8 against bf16: FP8's rounding (e4m3: 3 mantissa bits) of every GEMM operand
LOSS_TOL, GRAD_NORM_TOL = 2e-2, 1e-1


def _impl(recipe: str, bf16_rows: int = 0):
    from relax_gdn.model.fp8.linear import FP8LinearImpl

    return FP8LinearImpl.of_recipe(recipe, bf16_rows=bf16_rows)


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _fwd_bwd(impl, x, w, grad):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y = impl(x, w)
    y.backward(grad)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("recipe", RECIPES)
def test_scaled_mm_matches_the_cpu_emulation(recipe):
    """1,000 tokens (not a multiple of 16: the weight gradient's GEMM pads them), 256 -> 208 with
    the last 16 rows in bf16, as the GDN input projection keeps its gates."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1000, 256, generator=gen).to(torch.bfloat16)
    w = (torch.randn(208, 256, generator=gen) / 16).to(torch.bfloat16)
    grad = torch.randn(1000, 208, generator=gen).to(torch.bfloat16)
    emulated = _fwd_bwd(_impl(recipe, bf16_rows=16), x, w, grad)
    gpu = _fwd_bwd(_impl(recipe, bf16_rows=16), x.cuda(), w.cuda(), grad.cuda())
    for name, got, want in zip(("output", "input grad", "weight grad"), gpu, emulated):
        assert got.dtype == want.dtype == torch.bfloat16
        assert _rel(got.cpu(), want) < SCALED_MM_TOL, (recipe, name, _rel(got.cpu(), want))


@pytest.mark.parametrize("mode", ["triton", "compiled"])
@pytest.mark.parametrize("axiswise_dim", [None, -1, 0])
def test_cast_kernels_equal_eager_ones(axiswise_dim, mode):
    """Every layout (as stored, transposed with the tokens padded) of the Triton and the compiled
    casts, and their scales, bit for bit against the eager torchao functions."""
    from relax_gdn.model.fp8.casts import CastKernels

    x = torch.randn(3000, 512, device="cuda").to(torch.bfloat16) * 7  # 3000: padded to 3008 when transposed
    x[5, 7] = 0.0  # a zero and values a rounding carries into the next binade (to 448 = the e4m3 max)
    rows, cols = axiswise_dim != 0, axiswise_dim != -1
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        for pow2 in (False, True):
            got_all = CastKernels(mode).amax_and_cast(x, axiswise_dim, dtype, pow2, rows, cols)
            eager = CastKernels("eager").amax_and_cast(x, axiswise_dim, dtype, pow2, rows, cols)
            for got, want in zip(got_all, eager):
                if want is None:
                    assert got is None
                    continue
                assert got.shape == want.shape and got.is_contiguous() == want.is_contiguous()
                bits = (lambda t: t.view(torch.uint8)) if want.dtype in (dtype,) else (lambda t: t.float())
                assert torch.equal(bits(got), bits(want)), (mode, dtype, pow2, axiswise_dim)


def test_a_frozen_weight_kept_in_fp8_computes_what_a_trained_one_does():
    """LoRA's base weight under tensorwise: the kept FP8 rows, and the input gradient's operand made
    from them on the GPU, give the output and input gradient of the same weight cast afresh, bit for
    bit; the second step casts nothing. With and without the GDN gates' last rows in bf16."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1000, 256, generator=gen).to(torch.bfloat16).cuda()
    w = (torch.randn(208, 256, generator=gen) / 16).to(torch.bfloat16).cuda()
    grad = torch.randn(1000, 208, generator=gen).to(torch.bfloat16).cuda()
    for bf16_rows in (0, 16):
        frozen = _impl("tensorwise", bf16_rows=bf16_rows)
        for _ in range(2):
            xf = x.clone().requires_grad_()
            y = frozen(xf, w)
            y.backward(grad)
        want_y, want_dx, _ = _fwd_bwd(_impl("tensorwise", bf16_rows=bf16_rows), x, w, grad)
        assert torch.equal(y.detach(), want_y) and torch.equal(xf.grad, want_dx), bf16_rows
        assert frozen.weight_casts == 1, bf16_rows


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_frozen_weight_in_host_memory_computes_what_one_on_the_gpu_does(recipe):
    """``model.fp8.frozen_weights_on_host``: the plan moves a frozen FP8 weight into pinned host memory
    (the GPU's allocated memory drops by its bytes); the layer's output and input gradient stay bit for
    bit those of the weight kept on the GPU, with the GDN gates' rows in bf16 too; later steps cast
    nothing again. ``frozen_weights_on_device`` (what a checkpoint save and the export run in) gives the
    values back on the GPU and keeps what was written into them once they are in host memory again."""
    from relax_gdn.model.fp8.options import FP8Options
    from relax_gdn.model.fp8.plan import FP8Plan, PlannedLayer

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1000, 256, generator=gen).to(torch.bfloat16).cuda()
    grad = torch.randn(1000, 208, generator=gen).to(torch.bfloat16).cuda()
    values = (torch.randn(208, 256, generator=gen) / 16).to(torch.bfloat16).cuda()
    for bf16_rows in (0, 16):
        on_gpu, in_host = _impl(recipe, bf16_rows=bf16_rows), _impl(recipe, bf16_rows=bf16_rows)
        weight = torch.nn.Parameter(values.clone(), requires_grad=False)
        plan = FP8Plan(
            FP8Options(recipe),
            [PlannedLayer("decoder.layers.0.mlp.linear_fc1", 208, 256, in_host, weight=weight)],
        )
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        assert plan.keep_frozen_weights_on_host() == values.numel() * 2
        assert weight.device.type == "cpu" and weight.is_pinned()
        assert before - torch.cuda.memory_allocated() == values.numel() * 2
        for _ in range(3):
            want_y, want_dx = _fwd_bwd_frozen(on_gpu, x, values, grad)
            got_y, got_dx = _fwd_bwd_frozen(in_host, x, weight, grad)
            assert torch.equal(got_y, want_y) and torch.equal(got_dx, want_dx), (recipe, bf16_rows)
        assert in_host.weight_casts == on_gpu.weight_casts, (recipe, bf16_rows)
        assert "1 frozen weights in host memory" in plan.startup_line()
        with plan.frozen_weights_on_device():
            assert weight.is_cuda and torch.equal(weight, values)
            weight.mul_(2)  # as the export's merge writes into it
        assert weight.device.type == "cpu" and torch.equal(weight.cuda(), values * 2)
        got_y, _ = _fwd_bwd_frozen(in_host, x, weight, grad)
        want_y, _ = _fwd_bwd_frozen(_impl(recipe, bf16_rows=bf16_rows), x, values * 2, grad)
        assert torch.equal(got_y, want_y), (recipe, bf16_rows)  # cast again from the new values


def test_host_memory_too_short_for_the_frozen_weights_names_the_setting_and_leaves_them_on_the_gpu(
    monkeypatch,
):
    """A node short of pinned host memory: the second of two frozen weights cannot be moved. The error
    names the setting that keeps them on the GPU and the GiB asked for, and both weights are on the GPU
    again with their values (the run can be started again with the setting). Pinned memory cannot be
    exhausted safely on a shared test host, so the allocation fails the way torch reports it."""
    from relax_gdn.errors import RecipeError
    from relax_gdn.model.fp8.options import FP8Options
    from relax_gdn.model.fp8.plan import FP8Plan, PlannedLayer

    values = [torch.randn(208, 256, device="cuda").to(torch.bfloat16) for _ in range(2)]
    weights = [torch.nn.Parameter(v.clone(), requires_grad=False) for v in values]
    plan = FP8Plan(
        FP8Options("tensorwise"),
        [
            PlannedLayer(f"decoder.layers.{i}.mlp.linear_fc1", 208, 256, _impl("tensorwise"), weight=w)
            for i, w in enumerate(weights)
        ],
    )
    real_empty, pinned = torch.empty, []

    def empty(*args, pin_memory=False, **kwargs):
        if pin_memory and pinned:
            raise RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be reported later")
        pinned.append(pin_memory)
        return real_empty(*args, pin_memory=pin_memory, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    with pytest.raises(RecipeError) as raised:
        plan.keep_frozen_weights_on_host()
    monkeypatch.undo()
    message = str(raised.value)
    assert "model.fp8.frozen_weights_on_host=false" in message and "CUDA error: out of memory" in message
    assert message.startswith("model.fp8.frozen_weights_on_host: pinned host memory"), message
    assert plan.on_host == [] and "host memory" not in plan.startup_line()
    for weight, value in zip(weights, values):
        assert weight.is_cuda and torch.equal(weight, value)


def _fwd_bwd_frozen(impl, x, w, grad):
    """Output and input gradient of ``impl`` with ``w`` frozen (as LoRA's base weight is)."""
    x = x.detach().clone().requires_grad_()
    y = impl(x, w)
    y.backward(grad)
    return y.detach(), x.grad


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_linear_has_no_host_sync(recipe):
    x = torch.randn(8192, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16)
    impl = _impl(recipe)

    def step():
        impl(x, w).backward(grad)

    step()  # compiles the cast kernel
    assert count_host_syncs(step) == 0


def _train_reduced(runtime, **overrides) -> tuple[list[dict], str | None]:
    result = train_reduced_9b_on_gpu(runtime, **overrides)
    return result.records, result.fp8


@pytest.fixture(scope="module")
def bf16_reduced_9b():
    from relax_gdn.runtime import Runtime

    with Runtime() as runtime:
        return _train_reduced(runtime)[0]


@pytest.mark.parametrize("recipe,recompute", [*((r, "selective") for r in RECIPES), ("tensorwise", "full")])
def test_reduced_9b_trains_in_fp8_like_bf16(bf16_reduced_9b, runtime, recipe, recompute):
    """Selective recompute in every recipe, full recompute in tensorwise (its skipped fc2 GEMM and the
    recomputed forward's casts), against bf16."""
    records, ran = _train_reduced(runtime, **{"model.fp8.recipe": recipe, "recompute.granularity": recompute})
    assert "planned but never called" not in ran and ran.startswith(f"FP8 ({recipe}): 16 of 17"), ran
    for got, want in zip(records, bf16_reduced_9b):
        assert got["loss"] == pytest.approx(want["loss"], rel=LOSS_TOL), (recipe, recompute)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=GRAD_NORM_TOL), (recipe, recompute)
    assert records[-1]["host_syncs"] == 0, (recipe, recompute)


def test_reduced_9b_writes_a_steps_first_weight_gradient_as_it_would_add_it(runtime, monkeypatch):
    """The reduced 9B in tensorwise, several micro-batches per step: each step's first FP8 weight
    gradient written into the zeroed ``main_grad`` (in fp32) against every one added (in bf16, then
    into fp32). If ``main_grad`` held anything when it is written (DDP's protocol broken), the gradient
    norms would part by far more than the first micro-batch's bf16 rounding."""
    import relax_gdn.model.fp8.linear as linear

    fp8 = {"model.fp8.recipe": "tensorwise"}
    written = _train_reduced(runtime, **fp8)[0]
    monkeypatch.setattr(linear, "main_grad_is_empty", lambda weight: False)
    added = _train_reduced(runtime, **fp8)[0]
    for got, want in zip(written, added):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-3)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-2)
