"""The attention function the rollout engine runs the model with: PyTorch SDPA with grouped-query attention.

transformers' ``sdpa`` repeats the key/value heads for every query head whenever an attention mask is given, a copy
of the whole cache per layer and step; ragged rows and draft trees always need a mask. Without a mask SDPA takes the
grouped heads directly (``enable_gqa``); with one, each group's query heads are folded into the query length
(`gqa_sdpa_attention`), so that the keys and values are read once per KV head, by a fused kernel where the device has
one. Rollouts switch the model to this function while they run.

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
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ROLLOUT_ATTENTION = "fastgrpo_gqa_sdpa"


def gqa_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """``query`` ``[B, H, T, D]``, ``key``/``value`` ``[B, H_kv, S, D]`` -> ``[B, T, H, D]``.

    With a mask and grouped heads (``H = G * H_kv``), each group's ``G`` query heads are folded into the query length:
    queries ``[B, H_kv, G * T, D]`` against the keys as they are, the ``[B, 1, T, S]`` mask repeated ``G`` times along
    its queries. No kernel then needs both a mask and grouped heads (flash attention takes no mask, and the fused
    kernels that take one do not group heads), so none falls back to repeating the keys and values per query head."""
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
    mask = attention_mask[:, :, None].expand(b, 1, group, t, -1).reshape(b, 1, group * t, -1)  # a view when T is 1
    out = F.scaled_dot_product_attention(folded, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.reshape(b, heads, t, d).transpose(1, 2).contiguous(), None


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
