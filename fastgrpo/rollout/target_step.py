"""The target's half of a decoding step as two functions of the step's tensors: `plain_step` (one token per row: the
forward, the LM head, sampling) and `tree_step` (a draft tree per row: the forward, the lossless acceptance walk, the
accepted path's cache entries moved into place). Neither reads a value back from the device nor branches on one, so
each is one graph for ``torch.compile(fullgraph=True)``; `TargetStep` runs them eagerly or compiled.

Compiled, a step's rows are padded up to a bucket (a power of two) and the keys' extent is rounded up to a multiple
of `EXTENT_BLOCK` (masked past each row's length), so that a whole rollout meets a handful of shapes; on CUDA the
inductor backend captures each shape as a CUDA graph (``mode="reduce-overhead"``). Padded rows repeat the last live
row: they write only into cache rows no live row uses (finished rows are compacted away), and their results are
dropped. The compiled graphs read the model's own parameters, so an optimizer step or a LoRA merge, which write them in
place, reaches the next step without compiling again. Inductor keeps what it compiled in its on-disk cache, so a
second process compiles faster.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from fastgrpo.config.grpo import COMPILE_CHOICES
from fastgrpo.rollout.cache import RowCache
from fastgrpo.rollout.forward import forward_block, forward_chain
from fastgrpo.rollout.host import host_to_device
from fastgrpo.rollout.sampling import process_logits, sample
from fastgrpo.rollout.tree import DraftTree
from fastgrpo.rollout.verify import accept
from fastgrpo.sampling_params import SamplingParams

EXTENT_BLOCK = 256  # compiled steps read the keys in extents of this many slots


def compile_backend(choice: str, device: torch.device) -> str | None:
    """The ``torch.compile`` backend the ``compile`` option asks for on ``device``: ``on`` compiles with inductor,
    ``off`` runs eagerly, ``auto`` compiles on a GPU only (on a CPU the compiled step measured slower at 8 rows
    than the eager one with the engine's linear routes, `benchmarks/bench_compile.py`)."""
    if choice not in COMPILE_CHOICES:
        raise ValueError(f"compile must be one of {', '.join(COMPILE_CHOICES)}, got {choice!r}")
    if choice == "auto":
        return "inductor" if device.type == "cuda" else None
    return "inductor" if choice == "on" else None


def plain_step(
    decoder: nn.Module,
    head: nn.Module,
    cache: RowCache,
    pending: torch.Tensor,
    row_len: torch.Tensor,
    uniforms: torch.Tensor | None,
    params: SamplingParams,
    extent: int,
    equal_lengths: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Feed each row its ``pending`` ``[B]`` token after its ``row_len`` ``[B]`` cached ones and draw the next token
    with ``uniforms`` ``[B]`` (None when greedy); ``extent`` and ``equal_lengths`` as in `forward_block`.

    Returns ``[B]`` tokens, ``[B]`` their log-probabilities and ``[B, 1, H]`` the hidden states they were drawn from."""
    hidden = forward_chain(
        decoder, cache, row_len, input_ids=pending[:, None], extent=extent, equal_lengths=equal_lengths
    )
    logprobs = process_logits(head(hidden[:, -1]), params)
    tokens = sample(logprobs, params, uniforms)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1), hidden


def tree_step(
    decoder: nn.Module,
    head: nn.Module,
    cache: RowCache,
    tree: DraftTree,
    row_len: torch.Tensor,
    uniforms: torch.Tensor | None,
    params: SamplingParams,
    extent: int,
) -> tuple[torch.Tensor, ...]:
    """Verify each row's ``tree`` (``N`` nodes) after its ``row_len`` ``[B]`` cached tokens in one forward, accept a
    path with ``uniforms`` ``[B, D]`` (``D = tree.levels + 1``; None when greedy), and move the path's cache entries
    to the slots right after the row's context.

    Returns ``[B, D]`` emitted tokens and their log-probabilities, ``[B]`` how many each row emits, ``[B, D, H]`` the
    hidden states they were drawn from, ``[B, D - 1]`` the score rank of each accepted draft node (``N`` past the
    accepted ones) and ``[B]`` the deepest node of each row's tree."""
    n = tree.tokens.shape[1]
    offsets = torch.arange(n, device=tree.tokens.device)
    positions = row_len[:, None] + tree.depth
    hidden = forward_block(
        decoder, cache, row_len, offsets, positions, tree.ancestors, input_ids=tree.tokens, extent=extent
    )
    result = accept(tree, head(hidden), params, uniforms)
    path = result.path
    steps = torch.arange(path.shape[1], device=path.device)[None, :]
    cache.move_slots(row_len[:, None] + torch.where(path >= 0, path, steps), row_len[:, None] + steps)
    path_hidden = hidden.gather(1, path.clamp(min=0)[:, :, None].expand(-1, -1, hidden.shape[-1]))
    drafted = path[:, 1:]
    path_rank = torch.where(drafted >= 0, tree.rank.gather(1, drafted.clamp(min=0)), n)
    return result.tokens, result.logprobs, result.length, path_hidden, path_rank, tree.depth.max(dim=1).values


def row_bucket(rows: int) -> int:
    """The smallest power of two at or above ``rows``."""
    return 1 << (rows - 1).bit_length()


class TargetStep:
    """Runs `plain_step` and `tree_step` eagerly (``backend`` None) or compiled by ``torch.compile`` with
    ``backend`` (``"inductor"``; another backend, such as ``"aot_eager"``, checks the graphs without generating
    code) and ``fullgraph=True``, over padded rows and bucketed extents.

    ``compile_seconds`` adds up the wall time of the calls that compiled a graph."""

    def __init__(self, backend: str | None = None):
        self.backend = backend
        self.compile_seconds = 0.0
        self._compiled: dict[str, Callable] = {}

    @property
    def compiled(self) -> bool:
        return self.backend is not None

    def rows(self, live: int) -> int:
        """The rows a step over ``live`` rows computes (and the caches must hold)."""
        return row_bucket(live) if self.compiled else live

    def _function(self, name: str, device: torch.device) -> Callable:
        if name not in self._compiled:
            fn = plain_step if name == "plain" else tree_step
            graphs = device.type == "cuda" and self.backend == "inductor"
            mode = "reduce-overhead" if graphs else None
            self._compiled[name] = torch.compile(fn, fullgraph=True, backend=self.backend, mode=mode)
        return self._compiled[name]

    def _run(self, name: str, device: torch.device, *args) -> tuple[torch.Tensor, ...]:
        fn = self._function(name, device)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        if device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        t0 = time.perf_counter()
        out = fn(*args)
        if torch._dynamo.utils.counters["stats"]["unique_graphs"] != graphs:
            self.compile_seconds += time.perf_counter() - t0
        # A captured graph writes its outputs into the same memory at its next replay: keep copies.
        return tuple(t.clone() for t in out) if device.type == "cuda" else out

    def _extent(self, needed: int, cache: RowCache) -> int:
        if not self.compiled:
            return needed
        return min(-(-needed // EXTENT_BLOCK) * EXTENT_BLOCK, cache.max_len)

    def plain(
        self,
        decoder: nn.Module,
        head: nn.Module,
        cache: RowCache,
        pending: torch.Tensor,
        row_len: torch.Tensor,
        lengths: list[int],
        uniforms: torch.Tensor | None,
        params: SamplingParams,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`plain_step` over the live rows (``lengths``: ``row_len`` on the host)."""
        longest = max(lengths)
        if not self.compiled:
            equal = min(lengths) == longest
            return plain_step(decoder, head, cache, pending, row_len, uniforms, params, longest + 1, equal)
        live, pad = len(lengths), _padding(len(lengths), pending.device)
        args = [_pad(t, pad) for t in (pending, row_len, uniforms)]
        extent = self._extent(longest + 1, cache)
        out = self._run("plain", pending.device, decoder, head, cache, *args, params, extent, False)
        return tuple(t[:live] for t in out)

    def tree(
        self,
        decoder: nn.Module,
        head: nn.Module,
        cache: RowCache,
        tree: DraftTree,
        row_len: torch.Tensor,
        lengths: list[int],
        uniforms: torch.Tensor | None,
        params: SamplingParams,
    ) -> tuple[torch.Tensor, ...]:
        """`tree_step` over the live rows (``lengths``: ``row_len`` on the host)."""
        extent = self._extent(max(lengths) + tree.tokens.shape[1], cache)
        if not self.compiled:
            return tree_step(decoder, head, cache, tree, row_len, uniforms, params, extent)
        live, pad = len(lengths), _padding(len(lengths), row_len.device)
        padded = DraftTree(
            *(_pad(t, pad) for t in (tree.tokens, tree.parent, tree.depth, tree.ancestors, tree.rank)), tree.levels
        )
        args = (padded, _pad(row_len, pad), _pad(uniforms, pad), params, extent)
        out = self._run("tree", row_len.device, decoder, head, cache, *args)
        return tuple(t[:live] for t in out)


def _padding(live: int, device: torch.device) -> torch.Tensor | None:
    """``[row_bucket(live)]`` the row each padded row repeats (None when ``live`` is a bucket)."""
    rows = row_bucket(live)
    if rows == live:
        return None
    return host_to_device(list(range(live)) + [live - 1] * (rows - live), device)


def _pad(t: torch.Tensor | None, index: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or index is None else t[index]
