"""Trainable parameters that got no gradient are named after the first step
(relax_gdn/train/gradient_check.py). The graph is cut the two ways it happens: the decoder's input
without a gradient under whole-layer recompute (what a frozen embedding under LoRA gave before the
model marked that input), and a tensor detached between layers."""

from __future__ import annotations

import pytest

from tests.distributed import job_runtime
from tests.helpers import small_config


def _first_step(cut: str, overrides: dict) -> dict:
    """Two steps of the small demo on this rank with the graph cut at ``cut``: what rank 0 logged,
    what the run reports (``TrainResult.params_without_gradient``), what the check finds after the
    last step, and the trainable parameters' names."""
    import logging

    import torch
    import torch.distributed as dist

    from relax_gdn.config import validate
    from relax_gdn.train.gradient_check import parameters_without_gradient
    from relax_gdn.train.loop import Trainer

    cfg = small_config(train__steps=2, **overrides)
    trainer = Trainer(
        cfg,
        None,
        dims=validate(cfg, dist.get_world_size()),
        device=torch.device("cpu"),
        bf16=False,
        runtime=job_runtime(),
    )
    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    check_logger = logging.getLogger("relax_gdn.train.gradient_check")
    check_logger.addHandler(handler)
    try:
        trainer.setup()
        model = trainer.core_model
        if cut == "decoder_input":  # the decoder's input detached: no gradient upstream of layer 0
            model.decoder.register_forward_pre_hook(
                lambda module, args, kwargs: (
                    args,
                    {**kwargs, "hidden_states": kwargs["hidden_states"].detach()},
                ),
                with_kwargs=True,
            )
        elif cut == "after_layer_1":  # layer 1's output detached: the embedding, layers 0 and 1 cut off
            model.decoder.layers[1].register_forward_hook(
                lambda module, args, output: (output[0].detach(), *output[1:])
            )
        reported = trainer.run().params_without_gradient
        found = parameters_without_gradient(model, torch.device("cpu"))
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    finally:
        check_logger.removeHandler(handler)
        trainer.close()
    assert reported == found, (reported, found)  # the same cut in both steps
    return {"logged": logged, "found": found, "trainable": trainable}


@pytest.mark.parametrize("cut", ["none", "after_layer_1"])
def test_a_full_fine_tuning_step_names_what_a_detached_tensor_cut_off(gloo, cut):
    # CP 2, chunkwise: the flags are OR-ed over the ranks
    ranks = gloo(_first_step, 2, cut, {"parallel.cp": 2, "gdn.cp_mode": "chunkwise"})
    expected = (
        []
        if cut == "none"
        else [
            n
            for n in ranks[0]["trainable"]
            if n.startswith(("embedding.", "decoder.layers.0.", "decoder.layers.1."))
        ]
    )
    for rank in ranks:
        assert rank["found"] == expected
    if expected:
        assert (
            len(ranks[0]["logged"]) == 1
            and f"step 1: {len(expected)} trainable parameters got no gradient" in ranks[0]["logged"][0]
        ), ranks[0]["logged"]
        assert expected[0] in ranks[0]["logged"][0] and ranks[1]["logged"] == []  # rank 0 tells
    else:
        assert ranks[0]["logged"] == [] and ranks[1]["logged"] == []


# recompute setting -> the layers (of 4) recomputed whole: full recompute keeps the last layer
# (recompute.skip_unused), mixed the first full_layers. (With every layer recomputed whole and the
# output layer frozen, nothing in the loss needs a gradient and backward itself raises.)
WHOLE = {
    "full": ({"recompute.granularity": "full"}, range(3)),
    "mixed": ({"recompute.granularity": "mixed", "recompute.full_layers": 2}, range(2)),
    "none": ({}, range(0)),
}


@pytest.mark.parametrize("recompute", list(WHOLE))
def test_lora_adapters_cut_off_by_a_decoder_input_without_gradient_are_named(gloo, recompute):
    """Under whole-layer recompute a decoder input that needs no gradient leaves every adapter of
    the recomputed layers without one (the B factors; A's gradient is zero by construction while B
    is); without recompute, or with the model's own input, they all train."""
    overrides, whole = WHOLE[recompute]
    overrides = {"model.lora.rank": 4, **overrides}
    cut = gloo(_first_step, 1, "decoder_input", overrides)[0]
    expected = [
        n
        for n in cut["trainable"]
        if n.endswith("lora_B") and any(n.startswith(f"decoder.layers.{i}.") for i in whole)
    ]
    assert cut["found"] == expected
    assert bool(cut["logged"]) == bool(expected), cut["logged"]
    uncut = gloo(_first_step, 1, "none", overrides)[0]
    assert uncut["found"] == [] and uncut["logged"] == []
