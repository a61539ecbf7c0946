"""Rollouts of a LoRA policy with its adapters merged into the base weights.

A peft LoRA layer computes ``W x + s B A x``: two more products, a dropout and an addition per linear layer, small
work that still costs a call each at the few rows per forward of decoding (`benchmarks/bench_lora.py` measures how
much). During a rollout the adapters do not change, so they are added into the base weights in
place, ``W += s B A`` (the weights stay one copy), the layers run as plain linear layers, and ``s B A`` is subtracted
again afterwards, as TRL does before handing the weights to vLLM.

Subtracting restores ``W`` up to the rounding of the two additions, a fraction of the last bit of float32 or float64.
In bfloat16 that rounding would be about 0.4 % of each weight, every step, so adapters over low-precision base
weights stay unmerged.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

MERGEABLE_DTYPES = (torch.float32, torch.float64)


@contextmanager
def merged_lora(model: nn.Module) -> Iterator[bool]:
    """Inside the block, the active LoRA adapters of ``model`` are merged into its base weights; yields whether they
    were. Nothing is merged when the model has no LoRA layer, when a layer is merged already or its adapters are
    disabled, or when a base weight is not float32 or float64."""
    if "peft" not in sys.modules:  # a model built with peft imported it
        yield False
        return
    from peft.tuners.lora import LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    mergeable = bool(layers) and all(
        not layer.merged and not layer.disable_adapters and layer.get_base_layer().weight.dtype in MERGEABLE_DTYPES
        for layer in layers
    )
    if not mergeable:
        yield False
        return
    with torch.no_grad():
        for layer in layers:
            layer.merge()
    try:
        yield True
    finally:
        with torch.no_grad():
            for layer in layers:
                if layer.merged:
                    layer.unmerge()
