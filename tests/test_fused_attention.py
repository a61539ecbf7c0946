"""Attention a fused kernel can run: compiled steps hand their layers a flex-attention block mask built from the rows'
lengths and the trees' ancestry (`fastgrpo.rollout.forward.window_block_mask`), never a dense mask, and give the
eager engine's tokens; dense masks start each row at an aligned address, so that no kernel copies them first.

Flex attention serves float32 and narrower dtypes only, so the compiled engines here run a float32 model (their
log-probabilities agree with the eager ones to float32's rounding, not bit for bit)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from conftest import make_tiny_model, tiny_model
from test_attention import PROMPTS as RAGGED
from test_target_step import MAX_NEW, PARAMS, PROMPTS, same_outputs
from torch._dynamo.comptime import comptime
from torch.nn.attention.flex_attention import BlockMask, create_mask, flex_attention

from fastgrpo.rollout import attention
from fastgrpo.rollout.attention import MASK_ALIGNMENT
from fastgrpo.rollout.engine import RolloutEngine
from fastgrpo.rollout.forward import FLEX_BLOCK, window_attention_mask, window_block_mask
from fastgrpo.rollout.tree import TreeShape
from fastgrpo.speculative.eagle.drafter import EagleDrafter
from fastgrpo.speculative.eagle.head import DraftHead

ATOL = 1e-5  # float32: the compiled step's flex attention rounds unlike the eager step's SDPA


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch._dynamo.reset()
    return make_tiny_model("llama").float()


class AttentionCalls:
    """Spies on the SDPA and flex-attention calls of the rollout's attention function. ``calls`` holds one entry per
    eager call and one per call site torch.compile traced (``"compiled flex block gqa=True"``, ``"eager sdpa
    dense"``...); ``strides`` the strides of every dense mask given eagerly. What is traced is recorded at compile
    time (`comptime`), so that the graphs carry no side effect to replay and guard on."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.calls: list[str] = []
        self.strides: list[tuple[int, ...]] = []
        sdpa, flex = F.scaled_dot_product_attention, attention.flex_attention

        def traced(ctx) -> None:
            self.calls.append(f"compiled {ctx.get_local('call').as_python_constant()}")

        def spy_sdpa(query, key, value, attn_mask=None, *args, **kwargs):
            call = "sdpa none" if attn_mask is None else "sdpa dense"
            comptime(traced, lambda: self.eager(call, attn_mask))
            return sdpa(query, key, value, attn_mask, *args, **kwargs)

        def spy_flex(query, key, value, *args, block_mask=None, enable_gqa=False, **kwargs):
            call = f"flex block gqa={enable_gqa}" if isinstance(block_mask, BlockMask) else "flex none"
            comptime(traced, lambda: self.eager(call, None))
            return flex(query, key, value, *args, block_mask=block_mask, enable_gqa=enable_gqa, **kwargs)

        monkeypatch.setattr(F, "scaled_dot_product_attention", spy_sdpa)
        monkeypatch.setattr(attention, "flex_attention", spy_flex)

    def eager(self, call: str, mask: torch.Tensor | None) -> None:
        self.calls.append(f"eager {call}")
        if mask is not None:
            self.strides.append(tuple(mask.stride()))

    def only_block_masks_compiled(self) -> None:
        """Every call site torch.compile traced is flex attention under a block mask, with grouped heads."""
        compiled = {call for call in self.calls if call.startswith("compiled")}
        assert compiled == {"compiled flex block gqa=True"}, compiled


def test_compiled_one_token_steps_of_equal_rows_take_no_dense_mask(model, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows of equal length (no row ends: one row bucket, one graph) sample through flex attention when compiled,
    with the eager engine's tokens under the same uniforms."""
    prompts, params = [[5, 17, 3], [40, 2, 9]], PARAMS["top-p"]
    uniforms = torch.rand(4, MAX_NEW, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    eager, compiled = (RolloutEngine(model, [], backend=backend) for backend in (None, "aot_eager"))
    a = eager.generate(prompts, params, num_generations=2, uniforms=uniforms)
    spy = AttentionCalls(monkeypatch)
    b = compiled.generate(prompts, params, num_generations=2, uniforms=uniforms)
    assert b.stats.metrics()["compile/graphs"] > 0
    spy.only_block_masks_compiled()
    assert b.completion_ids == a.completion_ids
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(y), torch.tensor(x), rtol=0, atol=ATOL)


def test_compiled_tree_steps_verify_under_a_block_mask(
    model, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Ragged rows verifying draft trees, sampled with top-k and top-p under the same uniforms: the compiled tree step
    (the graph of those filters, which AOT traces here alone) and the compiled draft expansion (two forwards in one
    graph) attend through flex attention, compile without falling back, and give the eager engine's tokens."""
    draft = DraftHead(model.config, "tiny").float()
    shape = TreeShape(4, 2, 3)
    assert shape.levels == 3, "the expansion runs two draft forwards"
    eager, compiled = (
        RolloutEngine(model, [], drafter=EagleDrafter(draft, model, backend), tree=shape, backend=backend)
        for backend in (None, "aot_eager")
    )
    spy = AttentionCalls(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="fastgrpo.rollout.compiled"):
        a, b = same_outputs(eager, compiled, PARAMS["top-p"], atol=ATOL)
    assert not caplog.records, "every compiled function ran compiled"
    assert b.stats.target_forwards == a.stats.target_forwards and len(b.completion_ids) == 2 * len(PROMPTS)
    spy.only_block_masks_compiled()


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_the_block_mask_is_the_dense_mask_block_by_block() -> None:
    """Ragged rows around block boundaries and a draft tree's ancestry: the block mask's ``mask_mod`` allows exactly
    what the dense mask allows, its full blocks are wholly visible, the blocks it skips wholly hidden, and flex
    attention under it gives SDPA's output under the dense mask, with grouped heads."""
    torch.manual_seed(0)
    base = torch.tensor([0, FLEX_BLOCK - 1, FLEX_BLOCK, 250, 300])
    b, t, kv = base.shape[0], 5, 400
    ancestors = (torch.rand(b, t, t) < 0.5).tril() | torch.eye(t, dtype=torch.bool)
    block_mask = window_block_mask(base, ancestors, kv)
    dense = window_attention_mask(base, ancestors, torch.float64, kv)
    allowed = dense == 0  # [B, 1, T, kv]
    assert torch.equal(create_mask(block_mask.mask_mod, b, 1, t, kv, device="cpu"), allowed)
    blocks = -(-kv // FLEX_BLOCK)
    padded = torch.zeros(b, t, blocks * FLEX_BLOCK, dtype=torch.bool)
    padded[:, :, :kv] = allowed[:, 0]
    per_block = padded.view(b, t, blocks, FLEX_BLOCK)
    for row in range(b):
        full = block_mask.full_kv_indices[row, 0, 0, : block_mask.full_kv_num_blocks[row, 0, 0]].tolist()
        partial = block_mask.kv_indices[row, 0, 0, : block_mask.kv_num_blocks[row, 0, 0]].tolist()
        assert not set(full) & set(partial)
        assert all(per_block[row, :, j].all() for j in full)
        assert not any(per_block[row, :, j].any() for j in range(blocks) if j not in full + partial)
    query = torch.randn(b, 6, t, 16, dtype=torch.float64)
    key, value = (torch.randn(b, 2, kv, 16, dtype=torch.float64) for _ in range(2))
    out = flex_attention(query, key, value, block_mask=block_mask, enable_gqa=True)
    repeated = [x.repeat_interleave(3, dim=1) for x in (key, value)]
    ref = F.scaled_dot_product_attention(query, *repeated, attn_mask=dense)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


def test_dense_masks_reach_sdpa_with_aligned_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eagerly, the prefill's mask (over 12 keys, its queries folded for grouped heads) and the ragged steps' masks
    start every row at a multiple of `MASK_ALIGNMENT` elements: SDPA's fused kernels read them without a padded
    copy."""
    spy = AttentionCalls(monkeypatch)
    RolloutEngine(tiny_model("llama"), []).generate(RAGGED, PARAMS["greedy"], num_generations=2)
    assert spy.calls and set(spy.calls) == {"eager sdpa dense"}, "ragged rows: a mask at every step"
    strides = set(spy.strides)
    assert all(s[-1] == 1 and all(x % MASK_ALIGNMENT == 0 for x in s[:-1]) for s in strides), strides
