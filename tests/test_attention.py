"""The rollout's attention (`fastgrpo.rollout.attention`) reads each KV head once: with a mask and grouped heads it
folds each group's query heads into the query length instead of repeating the keys and values per query head, and
decodes the tokens that SDPA over repeated keys and values decodes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import make_tiny_model
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AttentionInterface

from fastgrpo.rollout.attention import ROLLOUT_ATTENTION, gqa_sdpa_attention
from fastgrpo.rollout.engine import RolloutEngine
from fastgrpo.rollout.tree import TreeShape
from fastgrpo.sampling_params import SamplingParams
from fastgrpo.speculative.eagle.drafter import EagleDrafter
from fastgrpo.speculative.eagle.head import DraftHead

PROMPTS = [[5, 17, 3, 8, 8, 21, 40, 2, 9, 11, 60, 7], [1, 90, 4, 4, 30]]  # ragged: every step has a mask
PARAMS = {
    "greedy": SamplingParams(max_new_tokens=6, temperature=0.0),
    "sampled": SamplingParams(max_new_tokens=6, temperature=1.0),
}


def repeated_kv_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The reference: SDPA over keys and values repeated for every query head."""
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    causal = attention_mask is None and query.shape[2] > 1
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling, is_causal=causal)
    return out.transpose(1, 2).contiguous(), None


class GroupCopies(TorchDispatchMode):
    """Counts the dispatched ops and records those that copy keys or values per query head: an op returning a tensor
    of ``[B, heads, S, head_dim]`` whose query heads of one group are equal and not all zero, and an SDPA given both a
    mask and grouped heads (no fused kernel takes both, and SDPA's fallback repeats the keys and values inside)."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.ops = 0
        self.copies: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops += 1
        if func is torch.ops.aten.scaled_dot_product_attention.default:
            query, key = args[0], args[1]
            mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
            if mask is not None and query.shape[1] != key.shape[1]:
                self.copies.append((str(func), tuple(key.shape)))
        for t in out if isinstance(out, tuple | list) else [out]:
            if self.repeated(t):
                self.copies.append((str(func), tuple(t.shape)))
        return out

    def repeated(self, t: object) -> bool:
        if not (isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() == 4):
            return False
        if t.shape[1] != self.heads or t.shape[3] != self.head_dim or t.shape[2] < 2:
            return False
        groups = t.unflatten(1, (self.kv_heads, self.heads // self.kv_heads))
        return bool(torch.equal(groups, groups[:, :, :1].expand_as(groups)) and groups.abs().sum() > 0)


def engine(model, tree: bool) -> RolloutEngine:
    if not tree:
        return RolloutEngine(model, [])
    draft = DraftHead(model.config).double()
    return RolloutEngine(model, [], drafter=EagleDrafter(draft, model), tree=TreeShape(4, 2, 2))


def generate(model, tree: bool, params: SamplingParams):
    uniforms = torch.rand(len(PROMPTS) * 2, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return engine(model, tree).generate(PROMPTS, params, num_generations=2, uniforms=uniforms)


@pytest.mark.parametrize("sampling", PARAMS)
@pytest.mark.parametrize("tree", [False, True], ids=["plain", "tree"])
def test_decoding_holds_no_per_group_copy_of_the_keys_and_values(
    sampling: str, tree: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = make_tiny_model("llama")
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    head_dim = model.config.hidden_size // heads
    assert heads > kv_heads, "a grouped-query model"
    dispatched = GroupCopies(heads, kv_heads, head_dim)
    with dispatched:
        out = generate(model, tree, PARAMS[sampling])
    assert dispatched.ops > 0 and not dispatched.copies, f"keys or values repeated per query head: {dispatched.copies}"
    monkeypatch.setitem(AttentionInterface._global_mapping, ROLLOUT_ATTENTION, repeated_kv_attention)
    reference = generate(model, tree, PARAMS[sampling])
    assert out.completion_ids == reference.completion_ids
    for a, b in zip(out.logprobs, reference.logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-12)


def test_the_folded_queries_give_the_repeated_keys_result_under_any_mask() -> None:
    """Grouped heads (3 query heads per KV head), a ragged additive mask: the fold equals SDPA over repeated keys."""
    torch.manual_seed(0)
    b, heads, kv_heads, t, s, d = 3, 6, 2, 4, 9, 8
    query = torch.randn(b, t, heads, d, dtype=torch.float64).transpose(1, 2)  # as a model's projection leaves it
    key, value = (torch.randn(b, kv_heads, s, d, dtype=torch.float64) for _ in range(2))
    mask = torch.zeros(b, 1, t, s, dtype=torch.float64)
    mask[0, :, :, 6:] = mask[1, :, 2, 3] = torch.finfo(torch.float64).min

    class Module:
        is_causal = True

    out, _ = gqa_sdpa_attention(Module(), query, key, value, mask)
    ref, _ = repeated_kv_attention(Module(), query, key, value, mask)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
