"""transformers' Qwen3.5 on its pure-torch kernels, where FLA's cannot run.

When ``fla`` (FLA's kernels, the ``fla-core`` package installed here for training) imports,
transformers binds Qwen3.5's gated-delta-rule and causal-conv handles to FLA's Triton kernels
once, when ``modeling_qwen3_5`` is imported; no config field or ``from_pretrained`` argument
chooses otherwise. Triton needs a GPU, so on a CPU ``model(...)`` and ``generate()`` fail with
``RuntimeError: 0 active drivers``. Each handle keeps transformers' own pure-torch function as
``__wrapped__``: :func:`use_torch_kernels_in_transformers` binds the module's names to those,
whatever was imported before, and returns the function that binds them back (a process that
installs a :class:`relax_gdn.runtime.Runtime` asks it instead, which binds them back when it closes). (Without relax_gdn at hand: ``sys.modules["fla"] = None`` before
transformers loads the model has transformers pick its torch path itself.)
"""

from __future__ import annotations

from collections.abc import Callable

# the module-level names modeling_qwen3_5's GatedDeltaNet calls
KERNEL_HANDLES = (
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
    "causal_conv1d_fn",
    "causal_conv1d_update",
)


def use_torch_kernels_in_transformers() -> Callable[[], None]:
    """Bind transformers' Qwen3.5 GDN and conv kernels to its pure-torch functions (for CPU
    inference, or exact comparisons). Returns the function that binds back what they pointed to
    (:meth:`relax_gdn.runtime.Runtime.use_torch_kernels_in_transformers` calls it at close)."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as modeling

    rebound = {}
    for name in KERNEL_HANDLES:
        handle = getattr(modeling, name)
        torch_fn = getattr(handle, "__wrapped__", handle)
        if torch_fn.__module__ != modeling.__name__:
            raise RuntimeError(
                f"transformers' {modeling.__name__}.{name} wraps {torch_fn.__module__}.{torch_fn.__name__}, "
                "not its own torch function: this transformers version binds its kernels differently"
            )
        if handle is not torch_fn:
            setattr(modeling, name, torch_fn)
            rebound[name] = handle

    def bind_back() -> None:
        for name, handle in rebound.items():
            setattr(modeling, name, handle)

    return bind_back
