"""Rollouts of a LoRA policy with its adapters merged into the base weights.

A peft LoRA layer computes ``W x + s B A x``: two more products, a dropout and an addition per linear layer, small
work that still costs a call each at the few rows per forward of decoding (`benchmarks/bench_lora.py` measures how
much). During a rollout the adapters do not change, so they are added into the base weights in
place, ``W += s B A`` (the weights stay one copy), the layers run as plain linear layers, and ``s B A`` is subtracted
again afterwards, as TRL does before handing the weights to vLLM.

Subtracting restores ``W`` up to the rounding of the two additions, a fraction of the last bit of float32 or float64.
In bfloat16 or float16 that rounding would be about 0.4 % of each weight, every step, so there a copy of each adapted
base weight is kept while the adapters are merged and written back afterwards: exact, for the memory of the adapted
weights during the rollout.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

SUBTRACTED_DTYPES = (torch.float32, torch.float64)  # unmerged by subtraction; others are restored from a copy


def _plain(layer: nn.Module) -> bool:
    """Whether a LoRA layer merges into its base weight alone, an ordinary floating-point parameter: not a quantized
    one (bitsandbytes replaces it by a new object when merging), nor a DoRA layer (whose merge also keeps a cache)."""
    weight = layer.get_base_layer().weight
    dora = any(layer.use_dora.values())
    return type(weight) is nn.Parameter and weight.dtype.is_floating_point and not dora


class MergedAdapters:
    """The LoRA layers a `merged_lora` block merged into their base weights (none: falsy, and `unmerged` does
    nothing), with ``saved``, per layer, copies of what its merge writes (its base weight, then its bias if any) in
    16-bit dtypes, None where subtraction unmerges it."""

    def __init__(self, layers: list[nn.Module] | None = None, saved: list[list[torch.Tensor] | None] | None = None):
        self.layers, self.saved = layers or [], saved or []

    def __bool__(self) -> bool:
        return bool(self.layers)

    @contextmanager
    def unmerged(self) -> Iterator[None]:
        """Inside the block the base weights are as before the merge (exactly, where copies are kept), so that the
        adapters may change (new weights taken between decoding steps); afterwards the adapters, as they are then, are
        merged again."""
        if not self.layers:
            yield
            return
        self.unmerge()
        try:
            yield
        finally:
            with torch.no_grad():
                for layer, copies in zip(self.layers, self.saved, strict=True):
                    if copies is not None:  # a base parameter taken meanwhile is what the call's end restores
                        for p, copy in zip(_merged_params(layer), copies, strict=True):
                            copy.copy_(p)
                    layer.merge()

    def unmerge(self) -> None:
        """Take the adapters out of the base weights: float32 and float64 ones by subtraction, others from the
        copies."""
        with torch.no_grad():
            for layer, copies in zip(self.layers, self.saved, strict=True):
                if not layer.merged:
                    continue
                if copies is None:
                    layer.unmerge()
                else:
                    for p, copy in zip(_merged_params(layer), copies, strict=True):
                        p.copy_(copy)
                    layer.merged_adapters.clear()


def _merged_params(layer: nn.Module) -> list[torch.Tensor]:
    """What a LoRA layer's merge writes: its base weight, and its bias where it has one (peft's lora_bias)."""
    base = layer.get_base_layer()
    return [p for p in (base.weight, getattr(base, "bias", None)) if p is not None]


@contextmanager
def merged_lora(model: nn.Module) -> Iterator[MergedAdapters]:
    """Inside the block, the active LoRA adapters of ``model`` are merged into its base weights; yields the layers
    merged (`MergedAdapters`, falsy when none were). Nothing is merged when the model has no LoRA layer, or when a
    layer is merged already, its adapters are disabled, its base weight is quantized or it is a DoRA layer.
    Afterwards float32 and float64 base weights are unmerged by subtraction, others restored exactly."""
    if "peft" not in sys.modules:  # a model built with peft imported it
        yield MergedAdapters()
        return
    from peft.tuners.lora import LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    if not layers or any(layer.merged or layer.disable_adapters or not _plain(layer) for layer in layers):
        yield MergedAdapters()
        return
    with torch.no_grad():
        merged = [_merged_params(layer) for layer in layers]
        saved = [None if ps[0].dtype in SUBTRACTED_DTYPES else [p.detach().clone() for p in ps] for ps in merged]
        for layer in layers:
            layer.merge()
    adapters = MergedAdapters(layers, saved)
    try:
        yield adapters
    finally:
        adapters.unmerge()
        adapters.layers, adapters.saved = [], []  # inert once the block ends
