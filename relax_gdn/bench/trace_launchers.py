"""Which host op launched each GPU kernel of a torch profiler chrome trace, and with which shapes.

A kernel event (``cat == "kernel"``, also ``gpu_memcpy`` / ``gpu_memset``) carries
``args.correlation``; the host's launch call (``cat == "cuda_runtime"``, e.g. ``cudaLaunchKernel``,
or ``cuda_driver``, e.g. ``cuLaunchKernelEx`` as Triton and some cuBLAS paths call it) carries the
same id and lies, in time on its own thread, inside the host ranges that were open when it ran:
``cpu_op`` events (``aten::mm``, an autograd node such as ``MmBackward0``, an autograd Function)
and ``user_annotation`` ones (``record_function`` ranges). With ``record_shapes=True`` an operator's
``args`` hold ``Input Dims`` / ``Input type`` / ``Input Strides``.

:func:`launchers_by_correlation` finds, per launch, the innermost *operator* (``namespace::name``:
``aten::mm``, a ``torch.library`` custom op) enclosing it, with its inputs, and the innermost
other range enclosing that operator (the *context*: the autograd node or Function, a named
range). The innermost context rather than the outermost: the outermost host range is often one
that spans the whole forward or step and names nothing. One sort per thread and a stack sweep:
linear in the events but for the sorts (traces of one step hold ~50k-300k events).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

HOST_RANGE_CATEGORIES = ("cpu_op", "user_annotation")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
# a dispatcher operator: "aten::mm", "c10d::allreduce_", a custom op; not
# "autograd::engine::evaluate_function: MmBackward0" (spaces) nor "MmBackward0" / "ProfilerStep#3"
_OPERATOR = re.compile(r"^\w+::\w+$")
# how the profiler spells dtypes -> what a reader expects in one line
_SHORT_TYPES = {
    "c10::BFloat16": "bf16",
    "c10::Half": "f16",
    "float": "f32",
    "double": "f64",
    "long int": "i64",
    "int": "i32",
    "bool": "bool",
    "c10::Float8_e4m3fn": "f8e4m3",
    "c10::Float8_e5m2": "f8e5m2",
}


@dataclass(frozen=True)
class Launcher:
    """Where one launch came from. ``op`` None: no operator enclosed it (a Triton kernel launched
    from Python inside an autograd Function: ``context`` names the Function), or, with ``context``
    None too, no host range at all. Inputs are tuples (hashable: launchers are counted per kind)."""

    op: str | None = None
    context: str | None = None
    input_dims: tuple | None = None
    input_types: tuple | None = None
    input_strides: tuple | None = None

    def as_dict(self) -> dict:
        return {
            "op": self.op,
            "context": self.context,
            "input_dims": _as_lists(self.input_dims),
            "input_types": _as_lists(self.input_types),
            "input_strides": _as_lists(self.input_strides),
            "launch_found": True,
        }


# a kernel whose launch the trace lacks (no correlation, or its host thread not recorded)
NOT_FOUND = {
    "op": None,
    "context": None,
    "input_dims": None,
    "input_types": None,
    "input_strides": None,
    "launch_found": False,
}


def _as_tuples(value):
    """JSON lists (``[[8192, 4096], [4096, 8], []]``) as nested tuples, to key a dict with."""
    return tuple(_as_tuples(v) for v in value) if isinstance(value, list) else value


def _as_lists(value):
    return [_as_lists(v) for v in value] if isinstance(value, tuple) else value


def _launcher(stack: list[tuple[float, float, dict]], ts: float) -> Launcher:
    """The launcher of a launch at ``ts`` given the host ranges open on its thread, outermost first."""
    op = context = inner_other = None
    for _start, end, event in reversed(stack):
        if end <= ts:  # a range of a badly nested pair, left under a child that outlived it: closed
            continue
        name = event.get("name", "")
        if _OPERATOR.match(name):
            if op is None:
                op = event
        elif op is not None:  # the first non-operator range around the operator: its context
            context = name
            break
        elif inner_other is None:
            inner_other = name
    if op is None:  # e.g. a Triton launch inside an autograd Function: the Function says where
        return Launcher(context=inner_other)
    args = op.get("args") or {}
    return Launcher(
        op=op.get("name"),
        context=context,
        input_dims=_as_tuples(args.get("Input Dims")),
        input_types=_as_tuples(args.get("Input type")),
        input_strides=_as_tuples(args.get("Input Strides")),
    )


def launchers_by_correlation(events: list[dict]) -> dict:
    """Correlation id -> :class:`Launcher` for every host launch event in ``events`` (a chrome
    trace's ``traceEvents``). Events without a timestamp or correlation are skipped; a trace with
    no launch events (CPU-only, or recorded without CUDA activity) gives ``{}``."""
    ranges: dict = defaultdict(list)  # (pid, tid) -> [(start, end, event)]
    launches: dict = defaultdict(list)  # (pid, tid) -> [(ts, correlation)]
    for e in events:
        if e.get("ph") != "X" or "ts" not in e:
            continue
        thread = (e.get("pid"), e.get("tid"))
        if e.get("cat") in HOST_RANGE_CATEGORIES:
            start = float(e["ts"])
            ranges[thread].append((start, start + float(e.get("dur", 0.0)), e))
        elif e.get("cat") in LAUNCH_CATEGORIES:
            correlation = (e.get("args") or {}).get("correlation")
            if correlation is not None:
                launches[thread].append((float(e["ts"]), correlation))
    found = {}
    for thread, calls in launches.items():
        # by start, a parent before the child that starts with it (the longer first)
        spans = sorted(ranges.get(thread, ()), key=lambda r: (r[0], -r[1]))
        calls.sort(key=lambda c: c[0])
        stack: list = []
        i = 0
        for ts, correlation in calls:  # one sweep: open the ranges that started, close the ended
            while i < len(spans) and spans[i][0] <= ts:
                while stack and stack[-1][1] <= spans[i][0]:
                    stack.pop()
                stack.append(spans[i])
                i += 1
            while stack and stack[-1][1] <= ts:
                stack.pop()
            found[correlation] = _launcher(stack, ts)
    return found


def short_dims(dims) -> str:
    """``[[8192, 4096], [4096, 8], [], []]`` -> ``[8192,4096] [4096,8]`` (trailing non-tensor
    arguments, which the profiler records as ``[]``, dropped)."""
    dims = list(dims or [])
    while dims and dims[-1] in ([], ()):
        dims.pop()
    return " ".join(
        "[" + ",".join(str(d) for d in dim) + "]" if isinstance(dim, (list, tuple)) else str(dim)
        for dim in dims
    )


def format_launcher(launcher: dict) -> str:
    """One launcher entry of ``kernel_split``'s ``top_kernels`` as ``context > op dims types``."""
    if not launcher.get("launch_found", True):
        return "(launch not in the trace)"
    if launcher.get("op") is None:
        return launcher.get("context") or "(no enclosing host op)"
    text = launcher["op"]
    if launcher.get("context"):
        text = f"{launcher['context']} > {text}"
    if launcher.get("input_dims"):
        text += " " + short_dims(launcher["input_dims"])
    types = [t for t in launcher.get("input_types") or [] if t and t != "Scalar"]
    if types:
        text += " " + "/".join(dict.fromkeys(_SHORT_TYPES.get(t, t) for t in types))
    return text
