"""Skip the CP transition summaries of FLA 0.6.0 that no rank reads (gated delta rule, contiguous CP).

Before its scan, FLA's CP forward has every rank but the last summarise its LAST local segment
as ``[h | M]`` (``chunk_cp_fwd_kernel_h``): ``h`` is the state the segment leaves when entered
with zero, ``M`` (K x K per head) what the segment does to the state it is entered with. Later
ranks merge the summaries as ``h_out = M @ h_in + h``, starting from ``h_in = 0`` at the rank
where the sequence begins. So ``M`` is read only when this rank lies strictly inside one
sequence (it neither starts nor ends there). Everywhere else -- at CP = 2 always -- FLA
computes ``M`` and multiplies it by zero, or never reads it.

It is the expensive half: the ``M`` column blocks compose a K x K product per 64-token chunk in
TF32x3 while the ``h`` blocks do K x 64 products in bf16, and the next rank waits for the kernel
(its share of a layer call: ``bench.gdn_layer --profile``, docs/benchmarks.md).
The backward mirrors it for the FIRST local segment (``chunk_cp_bwd_kernel_dh``, ``[dh | dM]``;
``dM``, read under the same condition).

When ``M`` is provably unread this launches FLA's own kernel over the ``h`` column blocks only
(same kernel, same autotuned config, a smaller grid) and leaves ``M`` zero; every other case --
and the zigzag layout and CUDA-graph paths -- goes to FLA unchanged. It replaces two names in
``fla.ops.gated_delta_rule.chunk``, installed once per process by :class:`relax_gdn.runtime.Runtime`
(``install``, after checking the FLA version and that the names are FLA's originals; ``uninstall``
when it closes). The replacements act only on a CP context marked by
:func:`skip_unread_summaries_of` (what a layer with ``GDNOptions.fla_skip_unread_cp_summaries``
does); any other context runs FLA's own functions, so the choice is the layer's, not the process's.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist

FLA_VERSION = "0.6.0"  # the launch geometry below is FLA 0.6.0's ``chunk_cp_fwd_h`` / ``chunk_cp_bwd_dh``
_PATCHED_MODULE = "fla.ops.gated_delta_rule.chunk"
_FWD_NAME = "chunk_gated_delta_rule_fwd_h_pre_process"
_BWD_NAME = "chunk_gated_delta_rule_bwd_dhu_pre_process"


def transition_is_read(context) -> bool:
    """Does another rank read this rank's M (forward) or dM (backward)? Only if the rank lies
    strictly inside one sequence, neither starting nor ending it. Forward: if the last local
    segment starts here, the merge enters it with zero; if it ends here, FLA sends no summary.
    The backward mirrors this for the first local segment."""
    return context.num_seqs == 1 and not context.is_first_rank and not context.is_last_rank


_SKIP_MARK = "relax_gdn_skip_unread_summaries"


def skip_unread_summaries_of(context) -> None:
    """Mark FLA CP ``context`` so the installed pre-processing skips the summaries no rank reads
    for every scan given it, forward and backward (FLA hands the same context to both)."""
    if not installed():
        raise RuntimeError(
            "GDNOptions.fla_skip_unread_cp_summaries needs FLA's CP pre-processing routed through "
            "relax_gdn.gdn.fla_cp_summaries, which relax_gdn.runtime.Runtime installs (the entry points do): "
            "install a Runtime before running the layer, or build it with fla_skip_unread_cp_summaries=False"
        )
    setattr(context, _SKIP_MARK, True)


def _skippable(context, use_graph: bool) -> bool:
    # Only FLA's contiguous, eager branch of a marked context is re-expressed here; the rest stays FLA's.
    return (
        context is not None
        and getattr(context, _SKIP_MARK, False)
        and context.group is not None
        and context.layout == "contiguous"
        and not use_graph
    )


def _value_blocks(K: int) -> int:
    return 32 if K <= 64 else 64  # FLA's BV; the h (dh) blocks are the first cdiv(V, BV) of its grid


def _fwd_h_columns(k, w, u, hm, g, cu_seqlens, chunk_size: int) -> None:
    """FLA's ``chunk_cp_fwd_h`` for a gated delta rule (v aliases u), h column blocks only."""
    import triton
    from fla.ops.cp.chunk_fwd import chunk_cp_fwd_kernel_h

    _, T, H, K = k.shape
    HV, V = u.shape[2:]
    BV = _value_blocks(K)
    chunk_cp_fwd_kernel_h[(triton.cdiv(V, BV), HV)](
        k=k,
        v=u,
        w=w,
        g=g,
        gk=None,
        bg=None,
        u=u,
        hm=hm,
        cu_seqlens=cu_seqlens,
        T=T,
        H=H,
        HV=HV,
        K=K,
        V=V,
        BT=chunk_size,
        BV=BV,
        BK=triton.next_power_of_2(K),
        MULTI_SEQS=False,
    )


def _bwd_dh_columns(q, k, w, do, dv, dhm, g, scale, cu_seqlens, chunk_size: int) -> None:
    """FLA's ``chunk_cp_bwd_dh`` for a gated delta rule, dh column blocks only."""
    import triton
    from fla.ops.cp.chunk_bwd import chunk_cp_bwd_kernel_dh

    _, T, H, K = q.shape
    HV, V = do.shape[2:]
    BV = _value_blocks(K)
    chunk_cp_bwd_kernel_dh[(triton.cdiv(V, BV), HV)](
        q=q,
        k=k,
        w=w,
        g=g,
        gk=None,
        do=do,
        dhm=dhm,
        dv=dv,
        cu_seqlens=cu_seqlens,
        scale=scale,
        T=T,
        H=H,
        HV=HV,
        K=K,
        V=V,
        BT=chunk_size,
        BV=BV,
        BK=triton.next_power_of_2(K),
        USE_BG=False,
    )


def _state_zeros(like: torch.Tensor, n: int, HV: int, K: int, V: int, state_v_first: bool) -> torch.Tensor:
    return like.new_zeros(n, HV, *((V, K) if state_v_first else (K, V)), dtype=torch.float32)


# fmt: off
# (FLA's pre-process hooks, their argument lists passed on as FLA writes them: one line per
# call instead of the formatter's one argument per line)
def _make_fwd(original):
    def fwd_h_pre_process(k, w, u, g=None, gk=None, bg=None, v=None, chunk_size=64, state_v_first=False,
                          cu_seqlens=None, initial_state=None, context=None, use_graph=False):
        if (not _skippable(context, use_graph) or transition_is_read(context)
                or gk is not None or bg is not None or v is not None):
            return original(k=k, w=w, u=u, g=g, gk=gk, bg=bg, v=v, chunk_size=chunk_size,
                            state_v_first=state_v_first, cu_seqlens=cu_seqlens, initial_state=initial_state,
                            context=context, use_graph=use_graph)
        from fla.ops.cp.chunk_merge import chunk_cp_merge
        from fla.ops.cp.comm import all_gather_into_tensor

        assert initial_state is None, "When enable CP, the provided initial_state must be None."
        K, (HV, V) = k.shape[-1], u.shape[2:]
        hm = k.new_zeros(HV, K, V + K, dtype=torch.float32)  # M stays zero: nobody reads it
        initial_state = _state_zeros(k, len(cu_seqlens) - 1, HV, K, V, state_v_first)
        if not context.is_last_rank:
            _fwd_h_columns(k, w, u, hm, g, cu_seqlens[-2:], chunk_size)
        ag_hm, _ = all_gather_into_tensor(hm, group=context.group)
        if not context.is_first_rank:
            chunk_cp_merge(
                h=initial_state[0], ag_hm=ag_hm, num_ranks=context.pre_num_ranks,
                rank=dist.get_rank(group=context.group), state_v_first=state_v_first,
                forward=True, h_seq_idx=None, use_graph=False,
            )
        return initial_state

    return fwd_h_pre_process


def _make_bwd(original):
    def bwd_dhu_pre_process(q, k, w, do, dv, g=None, gk=None, bg=None, scale=None, state_v_first=False,
                            cu_seqlens=None, dht=None, initial_state=None, context=None, chunk_size=64,
                            use_graph=False):
        if (not _skippable(context, use_graph) or transition_is_read(context)
                or gk is not None or bg is not None):
            return original(q=q, k=k, w=w, do=do, dv=dv, g=g, gk=gk, bg=bg, scale=scale,
                            state_v_first=state_v_first, cu_seqlens=cu_seqlens, dht=dht,
                            initial_state=initial_state, context=context, chunk_size=chunk_size,
                            use_graph=use_graph)
        from fla.ops.cp.chunk_merge import chunk_cp_merge
        from fla.ops.cp.comm import all_gather_into_tensor

        assert dht is None, "When enable CP, the provided dht must be None."
        K, (HV, V) = q.shape[-1], do.shape[2:]
        dhm = q.new_zeros(HV, K, V + K, dtype=torch.float32)  # dM stays zero: nobody reads it
        dht = _state_zeros(q, len(cu_seqlens) - 1, HV, K, V, state_v_first)
        if not context.is_first_rank:
            _bwd_dh_columns(q, k, w, do, dv, dhm, g, scale, cu_seqlens[:2], chunk_size)
        ag_dhm, _ = all_gather_into_tensor(dhm, group=context.group)
        if not context.is_last_rank:
            chunk_cp_merge(
                h=dht[-1], ag_hm=ag_dhm, num_ranks=context.post_num_ranks,
                rank=dist.get_rank(group=context.group), state_v_first=state_v_first,
                forward=False, h_seq_idx=None, use_graph=False,
            )
        return dht, None

    return bwd_dhu_pre_process
# fmt: on


def _parameters(fn) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def install() -> None:
    """Route FLA's gated-delta-rule CP pre-processing through the versions above (idempotent); they
    act on marked contexts only (:func:`skip_unread_summaries_of`)."""
    import importlib

    import fla

    if fla.__version__ != FLA_VERSION:
        raise RuntimeError(
            f"relax_gdn.gdn.fla_cp_summaries re-launches FLA {FLA_VERSION}'s CP summary kernels, but FLA "
            f"{fla.__version__} is installed: install fla-core=={FLA_VERSION} (pyproject.toml)"
        )
    from fla.ops.cp import chunk_delta_h

    chunk = importlib.import_module(_PATCHED_MODULE)
    for name, make in ((_FWD_NAME, _make_fwd), (_BWD_NAME, _make_bwd)):
        current = getattr(chunk, name)
        if getattr(current, "relax_gdn_original", None) is not None:
            continue  # already installed
        if current is not getattr(chunk_delta_h, name):
            raise RuntimeError(
                f"{_PATCHED_MODULE}.{name} is not FLA's own function; something else replaced it"
            )
        replacement = make(current)
        # Same parameters as FLA's, so every call FLA makes is understood (checked once, here,
        # instead of binding arguments on every call).
        if _parameters(replacement) != _parameters(current):
            raise RuntimeError(f"FLA's {name} signature changed: {inspect.signature(current)}")
        replacement.relax_gdn_original = current
        setattr(chunk, name, replacement)


def installed() -> bool:
    """Whether FLA's pre-processing names are the versions above."""
    import importlib

    chunk = importlib.import_module(_PATCHED_MODULE)
    return all(
        getattr(getattr(chunk, n), "relax_gdn_original", None) is not None for n in (_FWD_NAME, _BWD_NAME)
    )


def uninstall() -> None:
    """Back to FLA's own functions (what :meth:`relax_gdn.runtime.Runtime.close` does)."""
    import importlib

    chunk = importlib.import_module(_PATCHED_MODULE)
    for name in (_FWD_NAME, _BWD_NAME):
        original = getattr(getattr(chunk, name), "relax_gdn_original", None)
        if original is not None:
            setattr(chunk, name, original)
