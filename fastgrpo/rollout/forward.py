"""Runs a transformers decoder over per-row token blocks written into a `RowCache`.

Each row ``b`` has ``base_len[b]`` filled slots that every new token sees, then a *window* of ``W`` slots
starting at ``base_len[b]``; the new block's ``T`` tokens are written into the window at ``offsets`` and see
the window slots their ``window_mask`` allows. A chain is a window of ``T`` slots with a causal mask; a draft
tree is a window with the ancestor mask; a draft-tree level sees the levels written before it.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from fastgrpo.rollout.cache import RowCache


def decoder_and_head(model: PreTrainedModel) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The decoder body (returns hidden states) and the LM head of a causal LM, also when peft-wrapped."""
    return model.get_decoder(), model.get_output_embeddings()


def window_attention_mask(
    base_len: torch.Tensor, window_mask: torch.Tensor, dtype: torch.dtype, kv_len: int | None = None
) -> torch.Tensor:
    """Additive 4D attention mask, built on ``base_len``'s device from the lengths alone.

    Args:
        base_len: ``[B]`` slots every query sees.
        window_mask: ``[B, T, W]`` (or broadcastable) bool, query ``t`` sees slot ``base_len + w``.
        kv_len: the slots the keys span, at least ``max(base_len) + W`` (default: exactly that, read from the device).

    Returns:
        ``[B, 1, T, kv_len]``: 0 where attention is allowed, the dtype's minimum elsewhere.
    """
    b = base_len.shape[0]
    t, w = window_mask.shape[-2:]
    if kv_len is None:
        kv_len = int(base_len.max()) + w
    slots = torch.arange(kv_len, device=base_len.device)
    offset = slots[None, :] - base_len[:, None]  # [B, kv]: window index of each slot
    prefix = (offset < 0)[:, None, :]
    in_window = (offset < w)[:, None, :] & ~prefix
    window = window_mask.expand(b, t, w)
    seen = torch.gather(window, 2, offset.clamp(0, w - 1)[:, None, :].expand(b, t, kv_len)) & in_window
    mask = torch.zeros(b, 1, t, kv_len, dtype=dtype, device=base_len.device)
    return mask.masked_fill_(~(prefix | seen)[:, None], torch.finfo(dtype).min)


def forward_block(
    decoder: torch.nn.Module,
    cache: RowCache,
    base_len: torch.Tensor,
    offsets: torch.Tensor,
    positions: torch.Tensor,
    window_mask: torch.Tensor,
    input_ids: torch.Tensor | None = None,
    inputs_embeds: torch.Tensor | None = None,
    extent: int | None = None,
    equal_lengths: bool = False,
) -> torch.Tensor:
    """One decoder forward over ``T`` new tokens per row.

    A decoding loop knows its rows' lengths on the host and passes ``extent`` (the slots the keys span, at least
    ``max(base_len) + W``) and ``equal_lengths`` (every row has the same ``base_len``, and ``extent`` is that plus
    ``W``), so that the forward never reads the device; without ``extent`` it is read from ``base_len`` (one
    synchronisation).

    Args:
        decoder: a transformers base model (``model.get_decoder()``, or a draft's body).
        base_len: ``[B]`` filled slots per row.
        offsets: ``[B, T]`` or ``[T]`` window slot of each new token (written at ``base_len + offset``).
        positions: ``[B, T]`` position ids.
        window_mask: ``[B, T, W]`` or ``[T, W]`` bool, see `window_attention_mask`.
        input_ids / inputs_embeds: ``[B, T]`` ids or ``[B, T, hidden]`` embeddings (exactly one).

    Returns:
        ``[B, T, hidden]`` final hidden states.
    """
    b = base_len.shape[0]
    t, w = positions.shape[-1], window_mask.shape[-1]
    if extent is None:
        extent = int(base_len.max()) + w
    cache.prepare(base_len[:, None] + offsets.expand(b, t), extent)
    if t == 1 and w == 1 and equal_lengths:
        # One token per row and equal lengths: every query sees every slot. Without a mask SDPA runs grouped-query
        # attention directly instead of repeating the key/value heads.
        mask = None
    else:
        dtype = inputs_embeds.dtype if inputs_embeds is not None else next(decoder.parameters()).dtype
        mask = window_attention_mask(base_len, window_mask, dtype, extent)
    out = decoder(
        input_ids=input_ids,
        inputs_embeds=inputs_embeds,
        attention_mask=mask,
        position_ids=positions,
        cache=cache,
        use_cache=True,
    )
    return out.last_hidden_state


def forward_chain(
    decoder: torch.nn.Module,
    cache: RowCache,
    base_len: torch.Tensor,
    input_ids: torch.Tensor | None = None,
    inputs_embeds: torch.Tensor | None = None,
    position_offset: int = 0,
    extent: int | None = None,
    equal_lengths: bool = False,
) -> torch.Tensor:
    """A causal block of ``T`` tokens per row appended after ``base_len`` (prefill, AR step, draft catch-up).

    Token ``t`` of row ``b`` goes to slot ``base_len[b] + t`` at position ``base_len[b] + t + position_offset``;
    ``extent`` and ``equal_lengths`` as in `forward_block`.
    """
    ref = input_ids if input_ids is not None else inputs_embeds
    t = ref.shape[1]
    steps = torch.arange(t, device=ref.device)
    causal = torch.ones(t, t, dtype=torch.bool, device=ref.device).tril()
    positions = base_len[:, None] + steps[None, :] + position_offset
    return forward_block(
        decoder, cache, base_len, steps, positions, causal, input_ids, inputs_embeds, extent, equal_lengths
    )
