"""Runs the transformers decoder over per-row token blocks written into a `RowCache`."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from fastgrpo.rollout.cache import RowCache


def decoder_and_head(model: PreTrainedModel) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The decoder body (returns hidden states) and the LM head of a causal LM, also when peft-wrapped."""
    return model.get_decoder(), model.get_output_embeddings()


def block_mask(row_len: torch.Tensor, tree_mask: torch.Tensor, kv_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive 4D attention mask for a block of ``T`` new tokens per row.

    Args:
        row_len: ``[B]`` slots already filled per row; the block occupies slots ``row_len[b] + t``.
        tree_mask: ``[B, T, T]`` or ``[T, T]`` bool, ``True`` where new token ``i`` may see new token ``j``
            (causal for a chain, the ancestor mask for a draft tree).
        kv_len: key length the cache returns.

    Returns:
        ``[B, 1, T, kv_len]`` mask: 0 where attention is allowed, the dtype's minimum elsewhere.
    """
    b, t = row_len.shape[0], tree_mask.shape[-1]
    slots = torch.arange(kv_len, device=row_len.device)
    prefix = slots[None, None, :] < row_len[:, None, None]  # [B, 1, kv]
    offset = slots[None, :] - row_len[:, None]  # [B, kv]: block index of each slot
    in_block = (offset >= 0) & (offset < t)
    tree = tree_mask.expand(b, t, t)
    seen = torch.gather(tree, 2, offset.clamp(0, t - 1)[:, None, :].expand(b, t, kv_len)) & in_block[:, None, :]
    allowed = prefix | seen
    mask = torch.zeros(b, 1, t, kv_len, dtype=dtype, device=row_len.device)
    return mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)


def forward_block(
    model: PreTrainedModel,
    cache: RowCache,
    input_ids: torch.Tensor,
    row_len: torch.Tensor,
    depth: torch.Tensor,
    tree_mask: torch.Tensor,
) -> torch.Tensor:
    """One decoder forward over ``[B, T]`` new tokens placed after each row's ``row_len`` filled slots.

    Args:
        input_ids: ``[B, T]`` token ids.
        row_len: ``[B]`` filled slots per row (the block is written at ``row_len[b] + arange(T)``).
        depth: ``[B, T]`` or ``[T]`` depth of each token (position = ``row_len + depth``); ``arange(T)``
            for a chain.
        tree_mask: see `block_mask`.

    Returns:
        ``[B, T, hidden]`` final hidden states (apply the LM head to the positions you need).
    """
    b, t = input_ids.shape
    decoder, _ = decoder_and_head(model)
    slots = row_len[:, None] + torch.arange(t, device=input_ids.device)[None, :]
    kv_len = int(row_len.max()) + t
    cache.prepare(slots, kv_len)
    positions = row_len[:, None] + depth.expand(b, t)
    mask = block_mask(row_len, tree_mask, kv_len, model.dtype)
    out = decoder(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
    )
    return out.last_hidden_state
