"""Runs a transformers decoder over per-row token blocks written into a `RowCache`.

Each row ``b`` has ``base_len[b]`` filled slots that every new token sees, then a *window* of ``W`` slots
starting at ``base_len[b]``; the new block's ``T`` tokens are written into the window at ``offsets`` and see
the window slots their ``window_mask`` allows. A chain is a window of ``T`` slots with a causal mask; a draft
tree is a window with the ancestor mask; a draft-tree level sees the levels written before it.

Run eagerly, the layers get a dense additive mask (none when every row is equal and the keys end where they do),
whose rows start at aligned addresses (`fastgrpo.rollout.attention.MASK_ALIGNMENT`). Traced by ``torch.compile``,
they get the same mask as a flex-attention ``BlockMask`` (`window_block_mask`): flex attention is a fused kernel only
when compiled, and a compiled step's keys span a bucketed extent, which a mask must cut at each row's length.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask
from transformers import PreTrainedModel

from fastgrpo.rollout.attention import mask_width
from fastgrpo.rollout.cache import RowCache

FLEX_BLOCK = 128  # slots per block of a `window_block_mask`, on both axes (flex attention's default)
# The dtypes a compiled forward takes flex attention in: its kernel on a CPU takes no other, and float64 has no fused
# attention kernel on any device.
FLEX_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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
        kv_len: the slots the keys span, past every slot a query sees (default: ``max(base_len) + W``, read from the
            device).

    Returns:
        ``[B, 1, T, kv_len]``: 0 where attention is allowed, the dtype's minimum elsewhere; a view of a mask over
        `mask_width` ``(kv_len)`` slots, so that each row starts at an aligned address.
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
    mask = torch.zeros(b, 1, t, mask_width(kv_len), dtype=dtype, device=base_len.device)[..., :kv_len]
    return mask.masked_fill_(~(prefix | seen)[:, None], torch.finfo(dtype).min)


def window_mask_mod(base_len: torch.Tensor, window: torch.Tensor) -> Callable[..., torch.Tensor]:
    """`window_attention_mask` as a flex-attention ``mask_mod``: query ``q`` of row ``b`` sees slot ``kv`` when it
    lies before ``base_len[b]`` (``[B]``), or at window slot ``w = kv - base_len[b]`` with ``window[b, q, w]``
    (``[B, T, W]`` bool)."""
    w = window.shape[-1]

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        offset = kv - base_len[b]
        return (offset < 0) | ((offset < w) & window[b, q, offset.clamp(0, w - 1)])

    return mask_mod


def window_block_mask(base_len: torch.Tensor, window_mask: torch.Tensor, kv_len: int) -> BlockMask:
    """`window_attention_mask` as a flex-attention ``BlockMask`` of ``[B, 1, T, kv_len]``, from the lengths alone
    (nothing read from the device, one graph for ``torch.compile``).

    Blocks are `FLEX_BLOCK` slots wide. Those wholly before ``base_len[b]`` are full (every query sees every slot:
    no mask is evaluated there); those from the one holding slot ``base_len[b]`` to the one holding the window's last
    slot are partial (`window_mask_mod` decides per slot); the rest, past the row's window, are skipped.

    Args:
        base_len: ``[B]`` slots every query sees.
        window_mask: ``[B, T, W]`` (or broadcastable) bool, query ``t`` sees slot ``base_len + w``.
        kv_len: the slots the keys span, past every slot a query sees.
    """
    b = base_len.shape[0]
    t, w = window_mask.shape[-2:]
    q_blocks, kv_blocks = -(-t // FLEX_BLOCK), -(-kv_len // FLEX_BLOCK)
    full = base_len // FLEX_BLOCK  # [B]
    partial = (base_len + w + FLEX_BLOCK - 1) // FLEX_BLOCK - full  # [B], at least 1
    index = torch.arange(kv_blocks, device=base_len.device)
    partial_index = (full[:, None] + index).clamp(max=kv_blocks - 1)  # [B, kv_blocks]: the first `partial` count

    def per_query_block(x: torch.Tensor) -> torch.Tensor:
        """``[B, ...]`` -> ``[B, 1, q_blocks, ...]`` int32, the same for every query block."""
        return x[:, None, None].expand(b, 1, q_blocks, *x.shape[1:]).to(torch.int32).contiguous()

    return BlockMask.from_kv_blocks(
        per_query_block(partial),
        per_query_block(partial_index),
        per_query_block(full),
        per_query_block(index.expand(b, kv_blocks)),
        FLEX_BLOCK,
        window_mask_mod(base_len, window_mask.expand(b, t, w)),
        (t, kv_len),
        compute_q_blocks=False,  # the queries' view of the blocks serves a backward pass only
    )


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
    first: int = 0,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decoder forward over ``T`` new tokens per row.

    A decoding loop knows its rows' lengths on the host and passes ``extent`` (the slots the keys span: past every
    slot a query sees, ``max(base_len) + W`` where every row fills its window) and ``equal_lengths`` (every row has
    the same ``base_len``, and ``extent`` is that plus ``W``), so that the forward never reads the device; without
    ``extent`` it is read from ``base_len`` (one synchronisation).

    Args:
        decoder: a transformers base model (``model.get_decoder()``, or a draft's body).
        base_len: ``[B]`` filled slots per row.
        offsets: ``[B, T]`` or ``[T]`` window slot of each new token (written at ``base_len + offset``).
        positions: ``[B, T]`` position ids.
        window_mask: ``[B, T, W]`` or ``[T, W]`` bool, see `window_attention_mask`.
        input_ids / inputs_embeds: ``[B, T]`` ids or ``[B, T, hidden]`` embeddings (exactly one).
        first / rows: the cache rows the forward reads (``first`` to ``first + B``) and writes (``rows`` ``[B]``,
            default the same), see `RowCache.prepare`.

    Returns:
        ``[B, T, hidden]`` final hidden states.
    """
    b = base_len.shape[0]
    t, w = positions.shape[-1], window_mask.shape[-1]
    if extent is None:
        extent = int(base_len.max()) + w
    cache.prepare(base_len[:, None] + offsets.expand(b, t), extent, first, rows)
    if t == 1 and w == 1 and equal_lengths:
        # One token per row and equal lengths: every query sees every slot. Without a mask SDPA runs grouped-query
        # attention directly instead of repeating the key/value heads.
        mask = None
    else:
        dtype = inputs_embeds.dtype if inputs_embeds is not None else next(decoder.parameters()).dtype
        if torch.compiler.is_compiling() and dtype in FLEX_DTYPES:
            mask = window_block_mask(base_len, window_mask, extent)
        else:
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
    first: int = 0,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """A causal block of ``T`` tokens per row appended after ``base_len`` (prefill, AR step, draft catch-up).

    Token ``t`` of row ``b`` goes to slot ``base_len[b] + t`` at position ``base_len[b] + t + position_offset``;
    ``extent``, ``equal_lengths``, ``first`` and ``rows`` as in `forward_block`.
    """
    ref = input_ids if input_ids is not None else inputs_embeds
    t = ref.shape[1]
    steps = torch.arange(t, device=ref.device)
    causal = torch.ones(t, t, dtype=torch.bool, device=ref.device).tril()
    positions = base_len[:, None] + steps[None, :] + position_offset
    return forward_block(
        decoder, cache, base_len, steps, positions, causal, input_ids, inputs_embeds, extent, equal_lengths, first, rows
    )
