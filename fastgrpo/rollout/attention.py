"""The attention function the rollout engine runs the model with: PyTorch SDPA with grouped-query attention, or
flex attention under a block mask.

transformers' ``sdpa`` repeats the key/value heads for every query head whenever an attention mask is given, a copy
of the whole cache per layer and step; ragged rows and draft trees always need a mask. Without a mask SDPA takes the
grouped heads directly (``enable_gqa``); with one, each group's query heads are folded into the query length
(`gqa_sdpa_attention`), so that the keys and values are read once per KV head, by a fused kernel where the device has
one. A compiled step hands the layers a flex-attention ``BlockMask`` instead (`fastgrpo.rollout.forward`), which
`flex_attention` runs with the grouped heads as they are: a fused kernel that skips the blocks no query sees, with
a split over the keys for short queries on a GPU. Rollouts switch the model to this function while they run.

The engine hands every layer a 4-D mask (ragged rows, draft trees), which only SDPA-style functions take: a model
loaded with ``flash_attention_2``, ``eager`` or another implementation (a TRL user's model, say) is switched to this
function for the rollout as well, and back to its own afterwards, for training.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ROLLOUT_ATTENTION = "fastgrpo_gqa_sdpa"
# SDPA's memory-efficient kernel reads a mask whose rows start at multiples of this many elements; it first copies any
# other mask into a padded one, at every layer.
MASK_ALIGNMENT = 8


def mask_width(slots: int) -> int:
    """The row stride of a mask over ``slots`` keys: ``slots`` rounded up to a multiple of `MASK_ALIGNMENT`."""
    return -(-slots // MASK_ALIGNMENT) * MASK_ALIGNMENT


def gqa_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | BlockMask | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """``query`` ``[B, H, T, D]``, ``key``/``value`` ``[B, H_kv, S, D]`` -> ``[B, T, H, D]``.

    With a mask and grouped heads (``H = G * H_kv``), each group's ``G`` query heads are folded into the query length:
    queries ``[B, H_kv, G * T, D]`` against the keys as they are, the ``[B, 1, T, S]`` mask repeated ``G`` times along
    its queries. No kernel then needs both a mask and grouped heads (flash attention takes no mask, and the fused
    kernels that take one do not group heads), so none falls back to repeating the keys and values per query head.
    A ``BlockMask`` (of ``[B, 1, T, S]``) goes to `block_mask_attention`."""
    if isinstance(attention_mask, BlockMask):
        if dropout:
            raise ValueError("flex attention has no dropout: run the rollout's model in eval mode")
        return block_mask_attention(query, key, value, attention_mask, scaling), None
    b, heads, t, d = query.shape
    kv_heads = key.shape[1]
    if attention_mask is None or heads == kv_heads:
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        causal = bool(causal and attention_mask is None and t > 1)
        out = F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=attention_mask,
            dropout_p=dropout,
            scale=scaling,
            is_causal=causal,
            enable_gqa=heads != kv_heads,
        )
        return out.transpose(1, 2).contiguous(), None
    group = heads // kv_heads
    folded = query.reshape(b, kv_heads, group * t, d)  # head h = kv head h // G, query row (h % G) * T + t
    mask = grouped_mask(attention_mask, group)
    out = F.scaled_dot_product_attention(folded, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.reshape(b, heads, t, d).transpose(1, 2).contiguous(), None


def grouped_mask(mask: torch.Tensor, group: int) -> torch.Tensor:
    """``[B, 1, T, S]`` -> ``[B, 1, G * T, S]``: the mask of the folded queries (row ``g * T + t`` is row ``t``).

    A view when ``T`` is 1; otherwise a copy whose rows start at multiples of `MASK_ALIGNMENT` elements, so that a
    fused kernel reads it as it is (a mask built aligned, such as `window_attention_mask`'s, stays aligned)."""
    b, _, t, s = mask.shape
    rows = mask[:, :, None].expand(b, 1, group, t, s)
    if t == 1:
        return rows.reshape(b, 1, group, s)
    out = mask.new_empty(b, 1, group * t, mask_width(s))[..., :s]
    out.view(b, 1, group, t, s).copy_(rows)
    return out


def block_mask_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask: BlockMask, scaling: float | None
) -> torch.Tensor:
    """``query`` ``[B, H, T, D]``, ``key``/``value`` ``[B, H_kv, S, D]``, ``block_mask`` of ``[B, 1, T, S]`` ->
    ``[B, T, H, D]`` by `flex_attention`, each KV head read once for its group of query heads (``enable_gqa``)."""
    grouped = query.shape[1] != key.shape[1]
    out = flex_attention(query, key, value, block_mask=block_mask, scale=scaling, enable_gqa=grouped)
    return out.transpose(1, 2).contiguous()


AttentionInterface.register(ROLLOUT_ATTENTION, gqa_sdpa_attention)
AttentionMaskInterface.register(ROLLOUT_ATTENTION, sdpa_mask)


@contextmanager
def rollout_attention(*modules: nn.Module | None) -> Iterator[None]:
    """Run the transformers models inside ``modules`` (a model, or a module holding one such as a draft head; None
    entries are skipped) with `gqa_sdpa_attention` inside the block, whatever attention they were loaded with, then
    restore each one's own."""
    found = (m for module in modules if module is not None for m in module.modules())
    configs = [m.config.get_text_config() for m in found if isinstance(m, PreTrainedModel)]
    unique = {id(c): c for c in configs}.values()
    switched = [(c, c._attn_implementation) for c in unique if c._attn_implementation != ROLLOUT_ATTENTION]
    for config, _ in switched:
        config._attn_implementation = ROLLOUT_ATTENTION
    try:
        yield
    finally:
        for config, own in switched:
            config._attn_implementation = own
