"""The target's half of a decoding step as two functions of the step's tensors: `plain_step` (one token per row: the
forward, the LM head, sampling) and `tree_step` (a draft tree per row: the forward, the lossless acceptance walk, the
accepted path's cache entries moved into place). Neither reads a value back from the device nor branches on one, so
each is one graph for ``torch.compile(fullgraph=True)``; `TargetStep` runs them eagerly or compiled
(`fastgrpo.rollout.compiled`).

Compiled, a step's rows are padded up to a bucket (a power of two, `RowPadding`) and the keys span the whole cache
(`read_slots`, masked past each row's length: flex attention skips the blocks no query sees), so that a whole run
meets a handful of shapes: with the caches sized once per run (`RolloutEngine.reserve`), the graphs a run compiles
are the plain step's and the tree step's per set of sampling filters (`GraphSampling`: the temperature and greedy
decoding are inputs; the tree's acceptance walk as deep as the deepest tree the run may verify), and the shapes it
records one per row bucket and tree size.
"""

from __future__ import annotations

import torch
from torch import nn

from fastgrpo.rollout.cache import RowCache, read_slots
from fastgrpo.rollout.compiled import Compiled, RowPadding, row_bucket
from fastgrpo.rollout.forward import forward_block, forward_chain
from fastgrpo.rollout.graph_sampling import GraphSampling
from fastgrpo.rollout.sampling import policy_logprobs, process_logits, sample
from fastgrpo.rollout.tree import DraftTree
from fastgrpo.rollout.verify import accept
from fastgrpo.sampling_params import SamplingParams


def plain_step(
    decoder: nn.Module,
    head: nn.Module,
    cache: RowCache,
    pending: torch.Tensor,
    row_len: torch.Tensor,
    uniforms: torch.Tensor | None,
    params: SamplingParams | GraphSampling,
    extent: int,
    equal_lengths: bool,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Feed each row its ``pending`` ``[B]`` token after its ``row_len`` ``[B]`` cached ones and draw the next token
    with ``uniforms`` ``[B]`` (None when greedy); ``extent``, ``equal_lengths`` and ``rows`` (the cache row each row
    writes) as in `forward_block`.

    Returns ``[B]`` tokens, ``[B]`` their log-probabilities (`policy_logprobs`) and ``[B, 1, H]`` the hidden states
    they were drawn from."""
    hidden = forward_chain(
        decoder, cache, row_len, input_ids=pending[:, None], extent=extent, equal_lengths=equal_lengths, rows=rows
    )
    logits = head(hidden[:, -1])
    logprobs = process_logits(logits, params)
    tokens = sample(logprobs, params, uniforms)
    return tokens, policy_logprobs(logits, logprobs, tokens, params), hidden


def tree_step(
    decoder: nn.Module,
    head: nn.Module,
    cache: RowCache,
    tree: DraftTree,
    row_len: torch.Tensor,
    uniforms: torch.Tensor | None,
    params: SamplingParams | GraphSampling,
    extent: int,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Verify each row's ``tree`` (``N`` nodes) after its ``row_len`` ``[B]`` cached tokens in one forward, accept a
    path with ``uniforms`` ``[B, D]`` (``D = tree.levels + 1``; None when greedy), and move the path's cache entries
    to the slots right after the row's context (in cache row ``rows[b]``, default ``b``).

    Returns ``[B, D]`` emitted tokens and their log-probabilities, ``[B]`` how many each row emits, ``[B, D, H]`` the
    hidden states they were drawn from, ``[B, D - 1]`` the score rank of each accepted draft node (``N`` past the
    accepted ones) and ``[B]`` the deepest node of each row's tree."""
    n = tree.tokens.shape[1]
    offsets = torch.arange(n, device=tree.tokens.device)
    positions = row_len[:, None] + tree.node_depth
    hidden = forward_block(
        decoder, cache, row_len, offsets, positions, tree.ancestors, input_ids=tree.tokens, extent=extent, rows=rows
    )
    result = accept(tree, head(hidden), params, uniforms)
    path = result.path
    steps = torch.arange(path.shape[1], device=path.device)[None, :]
    cache.move_slots(row_len[:, None] + torch.where(path >= 0, path, steps), row_len[:, None] + steps, rows)
    path_hidden = hidden.gather(1, path.clamp(min=0)[:, :, None].expand(-1, -1, hidden.shape[-1]))
    drafted = path[:, 1:]
    path_rank = torch.where(drafted >= 0, tree.rank.gather(1, drafted.clamp(min=0)), n)
    return result.tokens, result.logprobs, result.length, path_hidden, path_rank, tree.node_depth.max(dim=1).values


def step_rows(live: int, compiled: bool) -> int:
    """The rows a step over ``live`` rows computes: compiled, padded to a power of two (a graph per bucket)."""
    return row_bucket(live) if compiled else live


class TargetStep:
    """Runs `plain_step` and `tree_step` eagerly (``backend`` None) or compiled by ``torch.compile`` with
    ``backend`` (``"inductor"``; another backend, such as ``"aot_eager"``, checks the graphs without generating
    code), over padded rows and the whole cache's keys, sampling as `GraphSampling` says (greedy decoding drawn
    from zero uniforms, then replaced by the argmax)."""

    def __init__(self, backend: str | None = None):
        self._plain = Compiled(plain_step, backend, "plain_step")
        self._tree = Compiled(tree_step, backend, "tree_step")
        self._settings: dict[tuple, GraphSampling] = {}  # `_sampling`'s

    @property
    def compiled(self) -> bool:
        return self._plain.compiled

    @property
    def compile_seconds(self) -> float:
        """Wall time of the calls that compiled a graph."""
        return self._plain.seconds + self._tree.seconds

    @property
    def compile_graphs(self) -> int:
        """Graphs compiled so far."""
        return self._plain.graphs + self._tree.graphs

    @property
    def cold_calls(self) -> int:
        """Steps so far that compiled or warmed up a graph (`Compiled.cold_calls`)."""
        return self._plain.cold_calls + self._tree.cold_calls

    @property
    def compile_shapes(self) -> int:
        """Shapes met so far (`Compiled.shapes`: on a GPU, the CUDA graphs recorded)."""
        return self._plain.shapes + self._tree.shapes

    @property
    def eager_calls(self) -> dict[str, int]:
        """Steps so far that ran eagerly though compiled (`Compiled.eager_calls`), per step kind."""
        return {f.name: f.eager_calls for f in (self._plain, self._tree)}

    def warm_calls(self, device: torch.device) -> int:
        """Calls of a new shape before its graph replays (`Compiled.warm_calls`)."""
        return self._plain.warm_calls(device)

    def rows(self, live: int) -> int:
        """The rows a step over ``live`` rows computes (and the caches must hold)."""
        return step_rows(live, self.compiled)

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
        rows = RowPadding(len(lengths), pending.device)
        noise = uniforms if uniforms is not None else torch.zeros(len(lengths), dtype=torch.float64, device=rows.device)
        args = [rows.pad(t) for t in (pending, row_len, noise)]
        extent, sampling = read_slots(cache.max_len), self._sampling(params, rows.device)
        step = self._plain(rows.device, decoder, head, cache, *args, sampling, extent, False, rows.cache_rows(cache))
        return rows.cut(step)

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
        extent = max(lengths) + tree.tokens.shape[1]
        if not self.compiled:
            return tree_step(decoder, head, cache, tree, row_len, uniforms, params, extent)
        rows = RowPadding(len(lengths), row_len.device)
        padded = DraftTree(
            *(rows.pad(t) for t in (tree.tokens, tree.parent, tree.node_depth, tree.ancestors, tree.rank)), tree.levels
        )
        if uniforms is None:  # the graph draws, then takes the argmax (`GraphSampling`)
            uniforms = torch.zeros(len(lengths), tree.levels + 1, dtype=torch.float64, device=rows.device)
        extent, sampling = read_slots(cache.max_len), self._sampling(params, rows.device)
        args = (padded, rows.pad(row_len), rows.pad(uniforms), sampling, extent, rows.cache_rows(cache))
        return rows.cut(self._tree(row_len.device, decoder, head, cache, *args))

    def _sampling(self, params: SamplingParams, device: torch.device) -> GraphSampling:
        """``params`` as the compiled steps take them, made once per setting and device."""
        key = (params.temperature, params.top_k, params.top_p, params.min_p, device)
        if key not in self._settings:
            self._settings[key] = GraphSampling.of(params, device)
        return self._settings[key]
