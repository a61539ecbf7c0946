"""The linear layers the rollout engine runs the model with on CPU in float32.

Decoding multiplies each weight ``W`` ``[out, in]`` by a few rows ``x`` ``[m, in]``, so it runs at the speed at which
the weights stream from memory. Through MKL, ``nn.Linear``'s ``x @ W.T`` streams them at about half the rate that
``W @ x.T`` reaches for 2 to 6 rows, and its one-row matrix-vector path is no faster. Measured on SmolLM2-135M's
decoder matrices (30 layers x 7, two cores, weights not in cache): one row takes 39 ms through ``nn.Linear`` and 24 ms
as ``W @ x.T`` with the row doubled; two to four rows 50 to 56 ms against 17 to 32 ms; from 8 rows on neither wins
consistently. While rollouts run, float32 (and float64) ``nn.Linear`` layers on CPU therefore compute products of up
to `FEW_ROWS` rows as ``(W @ x.T).T``, one row padded to two. The weights stay the modules' own tensors.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

FEW_ROWS = 6
FULL_PRECISION = (torch.float32, torch.float64)


def few_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, computed as ``(weight @ x.T).T`` when ``x`` has at most `FEW_ROWS` rows and
    ``weight`` is float32 or float64 on CPU (in bfloat16 ``nn.Linear`` is faster).

    Args:
        x: ``[..., in]``.
        weight: ``[out, in]``.
        bias: ``[out]`` or None.

    Returns:
        ``[..., out]``, contiguous.
    """
    rows = x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    if m > FEW_ROWS or not _runs_few_row(weight):
        return F.linear(x, weight, bias)
    if m == 1:
        rows = torch.cat([rows, rows])
    out = (weight @ rows.T).T[:m]
    if bias is not None:
        out = out + bias
    return out.contiguous().view(*x.shape[:-1], weight.shape[0])


def _runs_few_row(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype in FULL_PRECISION


def _forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return few_row_linear(x, module.weight, module.bias)


@contextmanager
def rollout_linears(*modules: nn.Module | None) -> Iterator[None]:
    """Run the float32 (and float64) CPU ``nn.Linear`` layers inside ``modules`` (None entries are skipped) with
    `few_row_linear` inside the block, then restore them."""
    found = (m for module in modules if module is not None for m in module.modules())
    # Keyed by identity: a layer reachable from two of the modules is patched (and restored) once.
    patched = list({id(m): m for m in found if type(m) is nn.Linear and _runs_few_row(m.weight)}.values())
    for m in patched:
        m.forward = partial(_forward, m)
    try:
        yield
    finally:
        for m in patched:
            del m.forward
