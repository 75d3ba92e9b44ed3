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
    """The GDN layer's context-parallel options (the ``gdn.*`` keys, plus the largest CP size a
    micro-batch can run on and whether the layer trains), built once per run and passed
    builder -> spec -> layer.

    ``recompute_core``: recompute the layer's conv -> gates -> scan -> gated norm in backward
    (``recompute.modules: gdn_core`` under selective recompute).

    ``swap_transport`` and ``max_recomputed_prefix`` set to None follow the process-wide A/B
    switches (``relax_gdn.layout.swap_transport_set_to``,
    ``relax_gdn.gdn.layer.prefixes_recomputed_up_to``) that benchmarks and tests flip around
    already-built layers; a training run always gives them."""

    cp_mode: CPMode = "chunkwise"
    route: RouteStrategy = "lazy_cache"
    kernel_backend: KernelBackend = "auto"
    swap_transport: SwapTransport | None = None
    max_recomputed_prefix: int | None = None
    max_cp_size: int | None = None  # None: the CP group the layer is built with
    training: bool = True
    recompute_core: bool = False


def _is_count(value: object, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def max_recomputed_prefix_problem(tokens: object) -> str | None:
    """The rule for ``gdn.max_recomputed_prefix`` (None when ``tokens`` keeps it)."""
    if _is_count(tokens, 0):
        return None
    return (f"gdn.max_recomputed_prefix={tokens!r} must be an integer >= 0 tokens (0: chunkwise always passes the "
            f"recurrent state between ranks; the default is {DEFAULT_MAX_RECOMPUTED_PREFIX})")


def gdn_option_problems(options: GDNOptions) -> list[str]:
    """The options that are not one of their choices (or a negative prefix limit)."""
    return [p for p in (
        choice_problem("gdn.cp_mode", options.cp_mode, CP_MODES),
        choice_problem("gdn.route", options.route, ROUTE_STRATEGIES),
        choice_problem("gdn.kernel_backend", options.kernel_backend, KERNEL_BACKENDS),
        None if options.swap_transport is None else
        choice_problem("gdn.swap_transport", options.swap_transport, SWAP_TRANSPORTS),
        None if options.max_recomputed_prefix is None else max_recomputed_prefix_problem(options.max_recomputed_prefix),
    ) if p]


def gdn_shape_problems(
    options: GDNOptions, *, key_heads: int, value_heads: int, tp_size: int, max_cp_size: int,
    deterministic: bool, recompute_granularity: str | None,
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
                f"parallel.tp x cp = {tp_size} x {max_cp_size}; use gdn.cp_mode=chunkwise or a smaller parallel.cp")
    if max_cp_size > 1 and options.cp_mode == "chunkwise" and deterministic:
        problems.append("gdn.cp_mode=chunkwise uses FLA's non-deterministic CP kernels: set train.deterministic=false "
                        "or use gdn.cp_mode=headwise")
    if max_cp_size > 1 and options.cp_mode == "all_gather" and options.training:
        problems += filter(None, [all_gather_recompute_problem(recompute_granularity)])
    return problems


def all_gather_recompute_problem(recompute_granularity: str | None) -> str | None:
    """all_gather CP trains only under whole-layer recompute (None when ``recompute_granularity`` is full)."""
    if recompute_granularity == "full":
        return None
    return ("gdn.cp_mode=all_gather recomputes the whole sequence on every CP rank (activations grow with the global "
            f"length): training needs recompute.granularity=full (got {recompute_granularity or 'none'!r})")


def gdn_cp_problems(options: GDNOptions, **layer) -> list[str]:
    """Every rule ``options`` break for a layer described by ``layer`` (the keywords of
    :func:`gdn_shape_problems`): what the layer checks when it is built."""
    return gdn_option_problems(options) + gdn_shape_problems(options, **layer)
