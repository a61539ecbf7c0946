"""A KV cache with static per-row buffers and per-row lengths, plugged into transformers through its `Cache` API.

Every row owns a contiguous region of ``max_len`` slots. Before each forward the engine says, per row, which
slots the new tokens go to (``slots``, shape ``[B, T]``) and how many leading slots the attention reads
(``kv_len``); each layer's ``update`` writes the new keys and values there and returns views of the first
``kv_len`` slots of the first ``B`` rows. Rows can therefore append any number of tokens at their own offsets
(ragged prompts, one token per row, or a draft tree per row), and the 4D attention mask built by the engine
decides which slots each query sees.

All layers' keys and values live in one tensor, so moving slots within rows is one indexing operation for the
whole model, not two per layer (selecting rows still copies layer by layer, which is faster for whole rows). A cache
for compiled steps (``compiled=True``) gives each layer buffers of its own instead, marked as static addresses so
that a CUDA graph writes them in place: a compiled graph that writes into
several views of one tensor whose sizes it treats as symbolic fails to compile in torch 2.13, and the compiler fuses
the per-layer moves anyway.
Writes use index assignment, never ``scatter_``: on CPU, ``scatter_`` into a bfloat16 buffer runs a kernel orders
of magnitude slower than the same assignment by index.
"""

from __future__ import annotations

import itertools

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin

from fastgrpo.memory.shapes import kv_dims
from fastgrpo.rollout.host import host_to_device

_SERIALS = itertools.count()  # `RowCache.serial`


def call_length(prompt_len: int, max_new_tokens: int) -> int:
    """Tokens a row of a generation call may hold: its prompt, its completion and the pending token after it."""
    return prompt_len + max_new_tokens + 1


SLOT_ALIGN = 8  # a cache's slots per row are a multiple of it (see `cache_slots`)


def aligned(slots: int) -> int:
    """``slots`` rounded up to a multiple of `SLOT_ALIGN`."""
    return -(-slots // SLOT_ALIGN) * SLOT_ALIGN


def cache_slots(length: int, tree_nodes: int) -> int:
    """Slots per row of the target's cache for a call of ``length`` tokens verifying trees of up to ``tree_nodes``
    nodes (1: plain steps), rounded up to a multiple of `SLOT_ALIGN`, and `SLOT_ALIGN` more: the extent a compiled
    step reads (`read_slots`) is then a multiple of it and below the cache's length: its slice of the keys is never
    the contiguous whole (torch guards on contiguity, and would compile again for a step that read it all)."""
    return aligned(length + tree_nodes) + SLOT_ALIGN


def read_slots(max_len: int) -> int:
    """The most slots a compiled step reads of a cache of ``max_len`` slots per row (see `cache_slots`)."""
    return max_len - SLOT_ALIGN


def physical_rows(rows: int, compiled: bool) -> int:
    """Rows a `RowCache` of ``rows`` rows allocates: one more when ``compiled``, the scratch row that the padded rows
    of a compiled step write (`RowCache.scratch`)."""
    return rows + int(compiled)


def cache_bytes(dims: tuple[int, int, int], rows: int, slots: int, itemsize: int) -> int:
    """Bytes of a `RowCache` of ``rows`` x ``slots`` for a decoder of ``dims`` (`kv_dims`): keys and values of
    ``[rows, kv heads, slots, head dim]`` per layer."""
    layers, heads, head_dim = dims
    return layers * 2 * rows * heads * slots * head_dim * itemsize


class RowLayer(CacheLayerMixin):
    """One layer's buffers: keys and values of shape ``[rows, kv_heads, max_len, head_dim]``."""

    def __init__(self, owner: RowCache, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.owner = owner
        self.keys = keys
        self.values = values
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Buffers are allocated up front; nothing to do."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``[B, H, T, D]`` states at the owner's slots; return ``[B, H, kv_len, D]`` views."""
        b, first = key_states.shape[0], self.owner.plan["first"]
        rows, slots = self.owner.rows, self.owner.slots
        self.keys[rows, :, slots] = key_states.transpose(1, 2)  # [B, T, H, D] at (row, slot)
        self.values[rows, :, slots] = value_states.transpose(1, 2)
        kv_len = self.owner.kv_len
        return self.keys[first : first + b, :, :kv_len], self.values[first : first + b, :, :kv_len]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.kv_len, 0

    def get_seq_length(self) -> int:
        return self.owner.kv_len

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class RowCache(Cache):
    """Static per-row KV cache for a decoder built from ``config``.

    Args:
        config: the model config (layer count, KV heads and head size are read from it).
        max_rows: rows the buffers hold.
        max_len: slots per row (prompt + completion + draft tree).

    A cache for compiled steps holds one row more, ``scratch``, past the ``max_rows`` rows: a compiled step's rows are
    padded up to a bucket (`fastgrpo.rollout.compiled.RowPadding`), and its padded rows write there, never into a row
    past the live ones, where a row waiting on its tools keeps its keys and values (`fastgrpo.rollout.turns`).

    ``serial`` numbers the caches made in this process: two caches never share one, whereas a new cache may reuse a
    freed one's ``id`` (what compiled steps met, and what was settled, is keyed by it).
    """

    def __init__(
        self,
        config: PretrainedConfig,
        max_rows: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        compiled: bool = False,
    ):
        n_layers, heads, head_dim = kv_dims(config)
        shape = (physical_rows(max_rows, compiled), heads, max_len, head_dim)
        self.kv: torch.Tensor | None = None
        if compiled:  # keys and values of each layer in tensors of their own, at addresses a CUDA graph keeps
            pairs = [[torch.zeros(shape, dtype=dtype, device=device) for _ in range(2)] for _ in range(n_layers)]
            for buf in (b for pair in pairs for b in pair):
                torch._dynamo.mark_static_address(buf)
                torch._dynamo.mark_static(buf)  # constant sizes, never unified with a step's symbolic rows
        else:  # [layers, keys/values, rows, kv heads, slots, head dim]; each layer's buffers are views of it
            self.kv = torch.zeros(n_layers, 2, *shape, dtype=dtype, device=device)
            pairs = [[kv[0], kv[1]] for kv in self.kv]
        super().__init__(layers=[RowLayer(self, keys, values) for keys, values in pairs])
        self.max_rows = max_rows
        self.max_len = max_len
        self.scratch: int | None = max_rows if compiled else None
        self.serial = next(_SERIALS)
        # What the next forward writes and reads (`prepare`), in a dict rather than in attributes: torch.compile (2.13)
        # loses an attribute written both before and after a flex-attention call within one graph, as a draft's
        # expansion, several forwards in one graph, writes them.
        self.plan: dict[str, torch.Tensor | int] = {
            "rows": torch.zeros(0, 1, dtype=torch.long, device=device),
            "slots": torch.zeros(0, 0, dtype=torch.long, device=device),
            "kv_len": 0,
            "first": 0,
        }

    @property
    def rows(self) -> torch.Tensor:
        """``[B, 1]`` the rows the next forward writes."""
        return self.plan["rows"]

    @property
    def slots(self) -> torch.Tensor:
        """``[B, T]`` the slot of each new token of the next forward."""
        return self.plan["slots"]

    @property
    def kv_len(self) -> int:
        """The leading slots the next forward reads."""
        return self.plan["kv_len"]

    def holds(self, rows: int, slots: int) -> bool:
        """Whether it has room for ``rows`` rows of ``slots`` slots (a call that needs more gets a new cache)."""
        return self.max_rows >= rows and self.max_len >= slots

    def prepare(self, slots: torch.Tensor, kv_len: int, first: int = 0, rows: torch.Tensor | None = None) -> None:
        """Set where the next forward writes (``slots``: ``[B, T]`` slot per new token, each below ``kv_len``) and how
        much it reads, in rows ``first`` to ``first + B`` (decoding steps: the first ``B`` rows; a row resuming
        after a tool call: its own row past them); checked on the host, without reading ``slots``. ``rows`` ``[B]``
        (default: those rows) is the row each one writes: a compiled step's padded rows write `scratch`
        (`fastgrpo.rollout.compiled.RowPadding.cache_rows`)."""
        if kv_len > self.max_len:
            raise ValueError(f"cache overflow: a row needs more than max_len={self.max_len} slots")
        if rows is None:
            rows = first + torch.arange(slots.shape[0], device=slots.device)
        self.plan["rows"] = rows[:, None]
        self.plan["slots"] = slots
        self.plan["kv_len"] = kv_len
        self.plan["first"] = first

    def select_rows(self, rows: list[int], upto: int | None = None) -> None:
        """Keep (or replicate) rows: row ``i`` becomes old row ``rows[i]``, for ``i < len(rows)``.

        Only the first ``upto`` slots (default: all) of the rows that change (``rows[i] != i``) are copied; the
        rest is left as it was. ``rows`` is a host list, so the copy needs no read of the device.
        """
        if len(rows) > self.max_rows:
            raise ValueError(f"cannot hold {len(rows)} rows in a cache of {self.max_rows}")
        moves = [(i, r) for i, r in enumerate(rows) if r != i]
        if not moves:
            return
        changed, src = (host_to_device(list(part), self.layers[0].keys.device) for part in zip(*moves, strict=True))
        upto = upto or self.max_len
        for layer in self.layers:  # per layer: faster than one indexing of the 6-D tensor
            for buf in (layer.keys, layer.values):
                buf[changed, :, :upto] = buf[src, :, :upto]

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Within cache row ``rows[b]`` (``[B]``, default the first ``B`` rows), copy slot ``src[b, j]`` to slot
        ``dst[b, j]`` (both ``[B, J]``).

        Used to compact accepted tree tokens into contiguous positions after a verification.
        """
        rows = (torch.arange(src.shape[0], device=src.device) if rows is None else rows)[:, None]
        if self.kv is not None:
            self.kv[:, :, rows, :, dst] = self.kv[:, :, rows, :, src]  # [B, J, layers, 2, H, D] on both sides
            return
        for layer in self.layers:
            for buf in (layer.keys, layer.values):
                buf[rows, :, dst] = buf[rows, :, src]  # [B, J, H, D] on both sides
