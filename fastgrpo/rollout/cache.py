"""A KV cache with static per-row buffers and per-row lengths, plugged into transformers through its `Cache` API.

Every row owns a contiguous region of ``max_len`` slots. Before each forward the engine says, per row, which
slots the new tokens go to (``slots``, shape ``[B, T]``) and how many leading slots the attention reads
(``kv_len``); each layer's ``update`` writes the new keys and values there and returns views of the first
``kv_len`` slots of the first ``B`` rows. Rows can therefore append any number of tokens at their own offsets
(ragged prompts, one token per row, or a draft tree per row), and the 4D attention mask built by the engine
decides which slots each query sees.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin


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
        b = key_states.shape[0]
        index = self.owner.scatter_index(key_states.shape)
        self.keys[:b].scatter_(2, index, key_states)
        self.values[:b].scatter_(2, index, value_states)
        kv_len = self.owner.kv_len
        return self.keys[:b, :, :kv_len], self.values[:b, :, :kv_len]

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
    """

    def __init__(self, config: PretrainedConfig, max_rows: int, max_len: int, dtype: torch.dtype, device: torch.device):
        text_config = config.get_text_config()
        heads = text_config.num_key_value_heads or text_config.num_attention_heads
        head_dim = getattr(text_config, "head_dim", None) or (
            text_config.hidden_size // text_config.num_attention_heads
        )
        shape = (max_rows, heads, max_len, head_dim)
        layers = [
            RowLayer(
                self,
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
            for _ in range(text_config.num_hidden_layers)
        ]
        super().__init__(layers=layers)
        self.max_rows = max_rows
        self.max_len = max_len
        self.slots = torch.zeros(0, 0, dtype=torch.long, device=device)
        self.kv_len = 0
        self._index: torch.Tensor | None = None

    def prepare(self, slots: torch.Tensor, kv_len: int) -> None:
        """Set where the next forward writes (``slots``: ``[B, T]`` slot per new token) and how much it reads."""
        if int(slots.max()) >= self.max_len or kv_len > self.max_len:
            raise ValueError(f"cache overflow: a row needs more than max_len={self.max_len} slots")
        self.slots = slots
        self.kv_len = kv_len
        self._index = None

    def scatter_index(self, shape: torch.Size) -> torch.Tensor:
        """The ``[B, H, T, D]`` scatter index of the prepared slots (built once per forward, shared by layers)."""
        if self._index is None or self._index.shape != shape:
            b, h, t, d = shape
            self._index = self.slots[:, None, :, None].expand(b, h, t, d)
        return self._index

    def select_rows(self, rows: torch.Tensor, upto: int | None = None) -> None:
        """Keep (or replicate) rows: row ``i`` becomes old row ``rows[i]``, for ``i < len(rows)``.

        Only the first ``upto`` slots (default: all) are copied; the rest of the new rows is left as it was.
        """
        if rows.numel() > self.max_rows:
            raise ValueError(f"cannot hold {rows.numel()} rows in a cache of {self.max_rows}")
        n, upto = rows.numel(), upto or self.max_len
        for layer in self.layers:
            layer.keys[:n, :, :upto] = layer.keys[:, :, :upto].index_select(0, rows)
            layer.values[:n, :, :upto] = layer.values[:, :, :upto].index_select(0, rows)

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Within each of the first ``B`` rows, copy slot ``src[b, j]`` to slot ``dst[b, j]`` (both ``[B, J]``).

        Used to compact accepted tree tokens into contiguous positions after a verification.
        """
        b, j = src.shape
        for layer in self.layers:
            for buf in (layer.keys, layer.values):
                _, h, _, d = buf.shape
                gathered = buf[:b].gather(2, src[:, None, :, None].expand(b, h, j, d))
                buf[:b].scatter_(2, dst[:, None, :, None].expand(b, h, j, d), gathered)
