"""What a GDN layer is told to do (:class:`GDNOptions`) and every rule those options must keep
(:func:`gdn_cp_problems`), written once: ``relax_gdn.config.validate`` reports the problems for a
run configuration before anything is built, and the layer checks the same rules when it is built.

Torch-free, so configuration checks import it without Megatron-Core.
"""

from __future__ import annotations

from dataclasses import dataclass

from relax_gdn.choices import (
    CP_MODES,
    KERNEL_BACKENDS,
    ROUTE_STRATEGIES,
    SWAP_TRANSPORTS,
    CPMode,
    KernelBackend,
    RouteStrategy,
    SwapTransport,
    choice_problem,
)
from relax_gdn.gdn import DEFAULT_MAX_RECOMPUTED_PREFIX


@dataclass(frozen=True)
class GDNOptions:
    """What a GDN layer is told, fixed when it is built (passed builder -> spec -> layer): the
    ``gdn.*`` keys, the largest CP size a micro-batch can run on, whether the layer trains, and
    the kernel variants benchmarks compare. Every field has a value of its own: two layers built
    with different options run side by side in one process, recompute included.

    Args:
        cp_mode: how the layer splits its work over CP (``gdn.cp_mode``; docs/design/LAYOUTS.md §4).
        route: zigzag <-> contiguous routes built on first use or by the data side (``gdn.route``).
        kernel_backend: FLA on CUDA, the pure-torch reference elsewhere, or one of them forced
            (``gdn.kernel_backend``).
        swap_transport: how chunkwise layout swaps of CUDA tensors move rows over NCCL
            (``gdn.swap_transport``; swaps on gloo always use the all-to-all).
        max_recomputed_prefix: chunkwise: a sequence crossing a rank cut with at most this many
            tokens before the cut is recomputed by the next rank instead of passing the state
            (``gdn.max_recomputed_prefix``; 0 always passes the state).
        max_cp_size: the largest CP group a micro-batch can run on (what head splits must divide);
            None: the CP group the layer is built with.
        training: the layer trains (some CP modes need recompute then).
        recompute_core: recompute the layer's conv -> gates -> scan -> gated norm in backward
            (``recompute.modules: gdn_core`` under selective recompute).
        fla_fused_gate: FLA computes the decay gate's activation inside its chunk cumsum (and its
            gradient in one backward kernel); False: torch computes ``g`` around FLA, as
            Megatron-Core does. FLA kernels only.
        fla_zigzag_cp: chunkwise scans a micro-batch of ONE document on its zigzag rows with FLA's
            native zigzag CP, without the layout swaps (only then is FLA's whole-stream zigzag the
            data's per-document zigzag). FLA kernels only.
        fla_skip_unread_cp_summaries: FLA's CP pre-pass skips the transition summaries no rank
            reads (:mod:`relax_gdn.gdn.fla_cp_summaries`; needs the patch that
            :class:`relax_gdn.runtime.Runtime` installs). FLA kernels only.
    """

    cp_mode: CPMode = "chunkwise"
    route: RouteStrategy = "lazy_cache"
    kernel_backend: KernelBackend = "auto"
    swap_transport: SwapTransport = "auto"
    max_recomputed_prefix: int = DEFAULT_MAX_RECOMPUTED_PREFIX
    max_cp_size: int | None = None
    training: bool = True
    recompute_core: bool = False
    fla_fused_gate: bool = True
    fla_zigzag_cp: bool = False
    fla_skip_unread_cp_summaries: bool = True


def _is_count(value: object, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def max_recomputed_prefix_problem(tokens: object) -> str | None:
    """The rule for ``gdn.max_recomputed_prefix`` (None when ``tokens`` keeps it)."""
    if _is_count(tokens, 0):
        return None
    return (
        f"gdn.max_recomputed_prefix={tokens!r} must be an integer >= 0 tokens (0: chunkwise always passes the "
        f"recurrent state between ranks; the default is {DEFAULT_MAX_RECOMPUTED_PREFIX})"
    )


def gdn_option_problems(options: GDNOptions) -> list[str]:
    """The options that are not one of their choices (or a negative prefix limit)."""
    return [
        p
        for p in (
            choice_problem("gdn.cp_mode", options.cp_mode, CP_MODES),
            choice_problem("gdn.route", options.route, ROUTE_STRATEGIES),
            choice_problem("gdn.kernel_backend", options.kernel_backend, KERNEL_BACKENDS),
            choice_problem("gdn.swap_transport", options.swap_transport, SWAP_TRANSPORTS),
            max_recomputed_prefix_problem(options.max_recomputed_prefix),
        )
        if p
    ]


def gdn_shape_problems(
    options: GDNOptions,
    *,
    key_heads: int,
    value_heads: int,
    tp_size: int,
    max_cp_size: int,
    deterministic: bool,
    recompute_granularity: str | None,
) -> list[str]:
    """The rules between the CP mode and the layer's head counts, TP size, largest CP size,
    determinism and recompute setting."""
    problems = []
    for name, n in (("linear_num_key_heads", key_heads), ("linear_num_value_heads", value_heads)):
        if n % tp_size:
            problems.append(f"{name}={n} is not divisible by parallel.tp={tp_size}")
        elif options.cp_mode == "headwise" and n % (tp_size * max_cp_size):
            problems.append(
                f"gdn.cp_mode=headwise splits GDN heads over TP x CP but {name}={n} is not divisible by "
                f"parallel.tp x cp = {tp_size} x {max_cp_size}; use gdn.cp_mode=chunkwise or a smaller parallel.cp"
            )
    if max_cp_size > 1 and options.cp_mode == "chunkwise" and deterministic:
        problems.append(
            "gdn.cp_mode=chunkwise uses FLA's non-deterministic CP kernels: set train.deterministic=false "
            "or use gdn.cp_mode=headwise"
        )
    if max_cp_size > 1 and options.cp_mode == "all_gather" and options.training:
        problems += filter(None, [all_gather_recompute_problem(recompute_granularity)])
    return problems


def all_gather_recompute_problem(recompute_granularity: str | None) -> str | None:
    """all_gather CP trains only under whole-layer recompute (None when ``recompute_granularity`` is full)."""
    if recompute_granularity == "full":
        return None
    return (
        "gdn.cp_mode=all_gather recomputes the whole sequence on every CP rank (activations grow with the global "
        f"length): training needs recompute.granularity=full (got {recompute_granularity or 'none'!r})"
    )


def gdn_cp_problems(options: GDNOptions, **layer) -> list[str]:
    """Every rule ``options`` break for a layer described by ``layer`` (the keywords of
    :func:`gdn_shape_problems`): what the layer checks when it is built."""
    return gdn_option_problems(options) + gdn_shape_problems(options, **layer)
