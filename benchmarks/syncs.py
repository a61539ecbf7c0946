"""Counting what a piece of code dispatches to torch: every aten op, and the ones that make the host wait for the
device (host synchronisations), so that a decoding step's launch overhead and its stalls can be counted on a CPU.

A synchronisation is an op whose result the host must see before it can go on: a scalar read (``int(t)``,
``t.item()``, ``bool(t)``), a compaction whose size depends on values (``nonzero``, boolean-mask indexing,
``masked_select``, ``unique``), a ``repeat_interleave`` without its output size, and a copy of a tensor into host
memory (``tolist``, ``numpy``). On a CPU none of them waits, but each would on a GPU. Scalar reads and host copies
are counted where Python asks for them (under ``torch.inference_mode`` a CPU tensor's scalar never reaches the
dispatcher), the rest as they are dispatched.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_SYNCING = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten.is_nonzero.default,
    aten.equal.default,
    aten._unique2.default,
    aten.unique_consecutive.default,
    aten.unique_dim.default,
}
_INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
_HOST_READS = ("tolist", "numpy", "item", "__int__", "__float__", "__bool__", "__index__")


def _is_sync(func: Any, args: tuple, kwargs: dict) -> bool:
    if func in _SYNCING:
        return True
    if func in _INDEXING:  # a boolean mask among the indices compacts by value
        return any(i is not None and i.dtype == torch.bool for i in args[1])
    if func is aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    return False


class DispatchCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside it (``ops``) and the host synchronisations among them (``syncs``, by
    op or method name; `counting_dispatch` adds the host reads Python makes)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.syncs: Counter[str] = Counter()
        self.reading = False  # inside a counted host read, whose own ops are not counted again

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        if not self.reading and _is_sync(func, args, kwargs):
            self.syncs[str(func.overloadpacket.__name__)] += 1
        return func(*args, **kwargs)

    @property
    def sync_count(self) -> int:
        return sum(self.syncs.values())

    def reset(self) -> None:
        self.ops = 0
        self.syncs.clear()


@contextmanager
def counting_dispatch() -> Iterator[DispatchCounter]:
    """A `DispatchCounter` active inside the block, which also counts the tensor methods that read values into Python
    (``tolist``, ``numpy``, ``item``, ``int()``, ``float()``, ``bool()``, use as an index); the methods are restored
    after the block."""
    counter = DispatchCounter()
    saved = {name: getattr(torch.Tensor, name) for name in _HOST_READS}

    def counted(name: str, method: Callable) -> Callable:
        def call(self: torch.Tensor, *args, **kwargs):
            if counter.reading:
                return method(self, *args, **kwargs)
            counter.syncs[name.strip("_")] += 1
            counter.reading = True
            try:
                return method(self, *args, **kwargs)
            finally:
                counter.reading = False

        return call

    for name, method in saved.items():
        setattr(torch.Tensor, name, counted(name, method))
    try:
        with counter:
            yield counter
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
