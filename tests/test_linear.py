"""Tests for the few-row linear layers the rollout engine runs with on CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model
from torch import nn

from fastgrpo.rollout.linear import FEW_ROWS, few_row_linear, rollout_linears


@pytest.mark.parametrize("shape", [(1, 16), (2, 16), (3, 16), (1, 1, 16), (2, 3, 16), (1, FEW_ROWS + 3, 16)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_few_row_linear_equals_linear(shape: tuple[int, ...], with_bias: bool) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    weight = torch.randn(24, 16, generator=g, dtype=torch.float64)
    bias = torch.randn(24, generator=g, dtype=torch.float64) if with_bias else None
    out = few_row_linear(x, weight, bias)
    assert out.shape == (*shape[:-1], 24) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=0, atol=1e-12)


def test_few_row_linear_leaves_bfloat16_to_linear() -> None:
    x = torch.randn(2, 16, dtype=torch.bfloat16)
    weight = torch.randn(8, 16, dtype=torch.bfloat16)
    assert torch.equal(few_row_linear(x, weight), F.linear(x, weight))


def test_rollout_linears_patches_every_linear_and_restores_them() -> None:
    model = tiny_model("llama")
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    assert linears
    ids = torch.tensor([[3, 5, 7]])
    with torch.no_grad():
        plain = model(ids, use_cache=False).logits
        with rollout_linears(model, None):
            assert all("forward" in m.__dict__ for m in linears)
            patched = model(ids[:, :1], use_cache=False).logits  # one row: the padded path
        assert all("forward" not in m.__dict__ for m in linears)
        with pytest.raises(RuntimeError), rollout_linears(model):
            raise RuntimeError("inside")
        assert all("forward" not in m.__dict__ for m in linears)
        with rollout_linears(model, model.get_output_embeddings()):  # a layer reached twice is restored once
            pass
        assert all("forward" not in m.__dict__ for m in linears)
    torch.testing.assert_close(patched, plain[:, :1], rtol=0, atol=1e-10)


def test_rollout_linears_leaves_bfloat16_layers_alone() -> None:
    layer = nn.Linear(16, 8).to(torch.bfloat16)
    with rollout_linears(layer):
        assert "forward" not in layer.__dict__
