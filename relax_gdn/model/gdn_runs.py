"""Keep the residual stream in the contiguous layout through each run of consecutive GDN layers.

Chunkwise GDN scans each CP rank's contiguous slice of the packed micro-batch, while attention
(and the data, labels and loss) use the per-document zigzag split (docs/design/LAYOUTS.md §1). A GDN layer on
its own swaps zigzag -> contiguous before its scan and back after it: two all-to-alls per layer,
six per Qwen3.5 block of [GDN, GDN, GDN, attention]. Everything else in a layer (norms, MLP,
residual adds) works token by token and does not care which rows a rank holds, so the residual
stream can instead stay contiguous from the first GDN layer of a run to the last one: two swaps
per run, of hidden-width rows, forward and backward.

:func:`residual_layouts` decides, from the layer pattern alone, the layout of the residual stream
at every layer boundary; :class:`ContiguousGDNLayer` is the ``TransformerLayer`` of a GDN layer
that touches a contiguous boundary: it converts its input and/or output (inside its own forward,
so full recompute replays the conversion with the layer) and its mixer, built with
``hidden_layout="contiguous"``, swaps nothing. The model's input (embeddings) and output (final
norm, logits, loss against the zigzag labels) stay zigzag: the stream is zigzag at the first and
last boundary whatever the pattern.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer

from relax_gdn.gdn.layer import CPGatedDeltaNet
from relax_gdn.layout import CP_LAYOUT_PAIR

ZIGZAG, CONTIGUOUS = CP_LAYOUT_PAIR


def residual_layouts(
    is_gdn: Sequence[bool], *, contiguous_between_layers: bool, cp_mode: str, sequence_parallel: bool
) -> tuple[str, ...]:
    """Layout of the residual stream at each of the ``len(is_gdn) + 1`` layer boundaries
    (boundary ``i`` is the input of layer ``i``; the last one is the decoder's output).

    A boundary between two GDN layers is contiguous when the switch is on, the GDN layers scan
    contiguous slices (``chunkwise``) and the stream is not split over TP ranks (sequence
    parallelism splits each rank's rows again; there GDN swaps its projected rows itself). Every
    other boundary is zigzag: before and after attention, at the embeddings and at the loss.
    """
    keep = contiguous_between_layers and cp_mode == "chunkwise" and not sequence_parallel
    return tuple(
        CONTIGUOUS if keep and 0 < i < len(is_gdn) and is_gdn[i - 1] and is_gdn[i] else ZIGZAG
        for i in range(len(is_gdn) + 1)
    )


class ContiguousGDNLayer(TransformerLayer):
    """A GDN ``TransformerLayer`` whose mixer runs on the contiguous layout. The residual stream
    arrives in ``input_layout`` and leaves in ``output_layout`` (at least one of them contiguous:
    a GDN layer between two zigzag boundaries is a plain ``TransformerLayer`` whose mixer swaps
    around its own scan). The conversions happen inside ``forward``, so Megatron-Core's full
    recompute, which checkpoints whole layers, replays them with the layer."""

    def __init__(self, *args, input_layout: str, output_layout: str, **kwargs):
        super().__init__(*args, **kwargs)
        mixer = self.self_attention
        if not isinstance(mixer, CPGatedDeltaNet) or mixer.hidden_layout != CONTIGUOUS:
            raise ValueError(
                "ContiguousGDNLayer needs a CPGatedDeltaNet mixer built with hidden_layout='contiguous', "
                f"got {type(mixer).__name__} (hidden_layout={getattr(mixer, 'hidden_layout', None)!r})"
            )
        layouts = (input_layout, output_layout)
        if CONTIGUOUS not in layouts or not set(layouts) <= set(CP_LAYOUT_PAIR):
            raise ValueError(
                f"ContiguousGDNLayer layouts must be in {CP_LAYOUT_PAIR} with at least one contiguous, "
                f"got input_layout={input_layout!r}, output_layout={output_layout!r}"
            )
        self.input_layout, self.output_layout = input_layout, output_layout

    def forward(self, hidden_states, *args, **kwargs):
        packed_seq_params = kwargs.get("packed_seq_params")
        convert = self.self_attention.convert_hidden_layout
        if self.input_layout != CONTIGUOUS:
            hidden_states = convert(hidden_states, packed_seq_params, self.input_layout, CONTIGUOUS)
        output, context = super().forward(hidden_states, *args, **kwargs)
        if self.output_layout != CONTIGUOUS:
            output = convert(output, packed_seq_params, CONTIGUOUS, self.output_layout)
        return output, context


def with_contiguous_gdn_runs(
    block: TransformerBlockSubmodules,
    *,
    contiguous_between_layers: bool,
    cp_mode: str,
    sequence_parallel: bool,
) -> TransformerBlockSubmodules:
    """``block`` with every GDN layer that touches a contiguous boundary (:func:`residual_layouts`)
    turned into a :class:`ContiguousGDNLayer` whose mixer has ``hidden_layout="contiguous"``."""
    is_gdn = [_is_gdn_layer(spec) for spec in block.layer_specs]
    layouts = residual_layouts(
        is_gdn,
        contiguous_between_layers=contiguous_between_layers,
        cp_mode=cp_mode,
        sequence_parallel=sequence_parallel,
    )
    layers = [
        _in_layouts(spec, before, after) if CONTIGUOUS in (before, after) else spec
        for spec, before, after in zip(block.layer_specs, layouts, layouts[1:])
    ]
    return dataclasses.replace(block, layer_specs=layers)


def _is_gdn_layer(spec: ModuleSpec) -> bool:
    mixer = spec.submodules.self_attention
    return isinstance(mixer.module, type) and issubclass(mixer.module, CPGatedDeltaNet)


def _in_layouts(spec: ModuleSpec, input_layout: str, output_layout: str) -> ModuleSpec:
    if spec.module is not TransformerLayer:
        raise ValueError(f"a contiguous GDN run needs plain TransformerLayer specs, got {spec.module}")
    mixer = spec.submodules.self_attention
    mixer = dataclasses.replace(mixer, params={**mixer.params, "hidden_layout": CONTIGUOUS})
    return dataclasses.replace(
        spec,
        module=ContiguousGDNLayer,
        params={**spec.params, "input_layout": input_layout, "output_layout": output_layout},
        submodules=dataclasses.replace(spec.submodules, self_attention=mixer),
    )
