"""The linear layers the rollout engine runs the model with on CPU in full precision.

Decoding multiplies each weight ``W`` ``[out, in]`` by a few rows ``x`` ``[m, in]``, so it should run at the speed
at which the weights stream from memory. ``nn.Linear`` goes through MKL's ``x @ W.T``, which on the AMD EPYC this
project is developed on reads SmolLM2-135M's 30 x 7 decoder matrices (425 MB, weights not in cache; a plain read
of them takes 11 ms) in 27 to 46 ms for 1 to 12 rows and 43 ms for 16. Two faster routes, on the same matrices:

- ``(W @ x.T).T``, one row padded to two: 13 to 16 ms for 1 to 4 rows, then 20 to 48 ms;
- oneDNN's linear (``torch.ops.mkldnn._linear_pointwise``, on the layer's own weight, no packed copy): 17 to 19 ms
  for 1 to 4 rows, 20 to 25 ms for 5 to 16 rows, 34 ms for 32 and half MKL's time for prefills of hundreds of rows.

While rollouts run, float32 CPU ``nn.Linear`` layers therefore take the first route up to `FEW_ROWS` rows and
oneDNN beyond (float64, which oneDNN lacks, keeps ``nn.Linear`` beyond). Where autograd needs the product,
``F.linear`` runs: oneDNN's op has no backward; so it does under autocast, whose casts only ``F.linear`` follows.
bfloat16 keeps ``nn.Linear``, which already runs on oneDNN.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

FEW_ROWS = 4
FULL_PRECISION = (torch.float32, torch.float64)
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def rollout_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` by the fastest route for a full-precision CPU weight (see the module's
    docstring); other weights, and products autograd must differentiate, go through ``F.linear``.

    Args:
        x: ``[..., in]``.
        weight: ``[out, in]``.
        bias: ``[out]`` or None.

    Returns:
        ``[..., out]``.
    """
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    autocast = torch.is_autocast_enabled(x.device.type)  # only F.linear follows autocast's casts
    if needs_grad or autocast or x.dtype != weight.dtype or not _runs_rollout_linear(weight):
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    if m > FEW_ROWS:
        if _ONEDNN and weight.dtype == torch.float32:
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return F.linear(x, weight, bias)
    if m == 1:
        rows = torch.cat([rows, rows])
    out = (weight @ rows.T).T[:m]
    if bias is not None:
        out = out + bias
    return out.contiguous().view(*x.shape[:-1], weight.shape[0])


def _runs_rollout_linear(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype in FULL_PRECISION


def _forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return rollout_linear(x, module.weight, module.bias)


@contextmanager
def rollout_linears(*modules: nn.Module | None) -> Iterator[None]:
    """Run the float32 (and float64) CPU ``nn.Linear`` layers inside ``modules`` (None entries are skipped) with
    `rollout_linear` inside the block, then restore them."""
    found = (m for module in modules if module is not None for m in module.modules())
    # Keyed by identity: a layer reachable from two of the modules is patched (and restored) once.
    patched = list({id(m): m for m in found if type(m) is nn.Linear and _runs_rollout_linear(m.weight)}.values())
    for m in patched:
        m.forward = partial(_forward, m)
    try:
        yield
    finally:
        for m in patched:
            del m.forward
