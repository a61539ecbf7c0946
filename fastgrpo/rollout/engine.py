"""Batched rollout engine with continuous batching over a static per-row KV cache.

A call prefills each distinct prompt once, replicates its cache rows for the ``num_generations`` samples, then
decodes. Every `step` is four stages: a controller chooses the tree budget for the live number of rows (schedule),
a drafter proposes a tree per row (propose), one target forward verifies every tree and accepts a path per row
(verify), and the emitted tokens are appended, finished rows dropped and the caches compacted (postprocess). A plain
step verifies the pending token alone and emits one token per row; a speculative step emits the accepted path plus
one. A row that ends (EOS, a stop string or the length limit) leaves the batch at once, so the concurrency falls
during the call (it is recorded per step), unless the call decodes fewer rows at once than it has: then the completions
waiting take the finished rows' places (`fastgrpo.rollout.decoding.Refill`, prefilled by `fastgrpo.rollout.prefill`).
A step reads the device once, in postprocess (`HostStep`): the host keeps every length it needs itself, so that on a
GPU the host runs ahead of the device (`fastgrpo.rollout.host`); with a compile ``backend`` the verification runs as a
compiled graph (`fastgrpo.rollout.target_step`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fastgrpo.rollout.cache import RowCache, cache_slots, call_length
from fastgrpo.rollout.call_setup import CallSetup
from fastgrpo.rollout.decoding import CompiledSoFar, Decoding, Refill, check_prompts
from fastgrpo.rollout.drafter import Drafter, DrafterTeams, Emitted, Proposal
from fastgrpo.rollout.forward import decoder_and_head
from fastgrpo.rollout.host import HostStep, Verified, host_to_device
from fastgrpo.rollout.linear import LinearRoutes
from fastgrpo.rollout.lora import MergedAdapters
from fastgrpo.rollout.prefill import prefill
from fastgrpo.rollout.scheduling import Controller, StaticController
from fastgrpo.rollout.sequence import ActiveRows, Generation, GenerationOutput, Sequence, fill_holes
from fastgrpo.rollout.shape_menu import settle_engine, walk_depth
from fastgrpo.rollout.target_step import TargetStep
from fastgrpo.rollout.tree import TreeShape
from fastgrpo.rollout.turns import Parking, Turns
from fastgrpo.sampling_params import SamplingParams
from fastgrpo.threads import ThreadGovernor


class RolloutEngine:
    """Generates completions with a transformers causal LM, driving its decoder directly.

    Args:
        model: the policy; its weights are used as they are (no copy).
        eos_token_ids: ids that end a completion.
        tokenizer: needed only for stop strings.
        drafter: proposes draft trees for speculative steps (None: autoregressive only; see
            `fastgrpo.rollout.drafter`), or a list of drafters, of which the controller picks one (or all, their trees
            merged) at every step by their names (`TreeShape.drafter`).
        tree: a static tree shape for every speculative step; ``nodes == 1`` is a plain autoregressive step.
        controller: instead of ``tree``, chooses each step's shape (and drafter) from the number of active rows.
        merge_lora: run a peft LoRA policy with its adapters merged into the base weights during each call (see
            `fastgrpo.rollout.lora`; ``merged.unmerged()`` takes them apart while new adapter weights come).
        backend: the ``torch.compile`` backend the target's step runs with (``"inductor"``), None: eager (see
            `fastgrpo.rollout.target_step`).

    Set ``threads`` to a `fastgrpo.threads.ThreadGovernor` to have every step follow the cores the process has.
    ``routes`` (`fastgrpo.rollout.linear.LinearRoutes`) routes the CPU products of the model and the drafters; what its
    owner has not measured (`LinearRoutes.measure`) is measured when a call first runs those layers.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        eos_token_ids: list[int],
        tokenizer: PreTrainedTokenizerBase | None = None,
        drafter: Drafter | list[Drafter] | None = None,
        tree: TreeShape | None = None,
        controller: Controller | None = None,
        merge_lora: bool = True,
        backend: str | None = None,
    ):
        self.model = model
        self.eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long, device="cpu")
        self.tokenizer = tokenizer
        self.merge_lora = merge_lora
        self.merged = MergedAdapters()  # the LoRA layers merged while a call runs (`decoding`)
        self.target = TargetStep(backend)
        self.routes = LinearRoutes()  # the CPU routes of the model's and the drafters' products (measured on use)
        self.threads: ThreadGovernor | None = None  # consulted at every step when set (see `schedule`)
        self.cache: RowCache | None = None
        self.reserved = (0, 0)  # rows and tokens every cache is made for at least (`reserve`)
        self.drafters: dict[str, Drafter] = {}
        self.controller: Controller | None = None
        self.speculate(drafter, tree, controller)

    def speculate(
        self,
        drafter: Drafter | list[Drafter] | None,
        tree: TreeShape | None = None,
        controller: Controller | None = None,
    ) -> None:
        """From the next call on, draft with ``drafter`` (one or several) and trees of ``tree`` or those
        ``controller`` chooses (None, None, None: autoregressive only)."""
        if tree is not None and controller is not None:
            raise ValueError("give a static tree shape or a controller, not both")
        if tree is not None:
            controller = StaticController(tree)
        drafters = [] if drafter is None else drafter if isinstance(drafter, list) else [drafter]
        if bool(drafters) != (controller is not None):
            raise ValueError("speculative decoding needs both a drafter and a tree shape or controller")
        self.teams = DrafterTeams(drafters)
        self.settled: set[tuple] = set()  # sampling filters and caches whose shapes have all run (`settle`)
        self.drafters, self.controller = self.teams.drafters, controller
        self.drafters_of, self.tree_depth = self.teams.of, self.teams.depth
        self.walk_levels = walk_depth(self)  # a compiled tree step's acceptance walk, whatever the tree

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def reserve(self, rows: int, length: int) -> None:
        """Make the caches, when a call next makes them, large enough for any call of up to ``rows`` completions of
        ``length`` tokens each (`call_length`), so that a run's calls all write the same buffers: compiled steps meet
        the same addresses and extents in every call, and a GPU's graphs are captured once per run."""
        self.reserved = (rows, length)

    def release(self) -> None:
        """Free the KV caches kept for the next call (the target's and the drafters'), which makes them anew."""
        self.cache = None
        for drafter in self.drafters.values():
            drafter.release()

    def generate(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        num_generations: int = 1,
        generator: torch.Generator | None = None,
        capture_hidden: bool = False,
        uniforms: torch.Tensor | None = None,
        turns: Turns | None = None,
        max_rows: int | None = None,
    ) -> GenerationOutput:
        """Sample ``num_generations`` completions for each prompt (token id lists, no padding).

        ``capture_hidden`` also returns the target's hidden states (for draft training). When sampling, the token at
        each (completion, position) is chosen by one uniform: ``uniforms`` ``[len(prompt_ids) * num_generations,
        max_new_tokens]`` gives them, otherwise they are drawn from ``generator``. With ``turns`` (the call's tools,
        `fastgrpo.rollout.turns`), a completion goes on after the tool calls its turns end with: its rows wait on
        their tools aside while the others decode. With ``max_rows``, at most that many completions decode at once: the
        others join in order as rows finish (rows refilled, `fastgrpo.rollout.decoding.Refill`)."""
        args = (prompt_ids, params, num_generations, generator, capture_hidden, uniforms, turns, max_rows)
        with self.decoding(*args) as run:
            run.finish()
        return run.output()

    @contextmanager
    def decoding(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        num_generations: int = 1,
        generator: torch.Generator | None = None,
        capture_hidden: bool = False,
        uniforms: torch.Tensor | None = None,
        turns: Turns | None = None,
        max_rows: int | None = None,
    ) -> Iterator[Decoding]:
        """`generate` one step at a time: the call, prefilled, to `Decoding.step` until `Decoding.done` inside the
        block, then `Decoding.output`. Each step runs inside the block's setup (inference mode, the rollout's
        attention, linear routes and merged LoRA), so that the steps of two engines' calls can alternate (their
        blocks nested) and be timed side by side. The call may take in more completions as it runs and hand over those
        of each generation as they end (`Decoding.extend`, `Decoding.hand_over`)."""
        check_prompts(prompt_ids, num_generations, params, uniforms)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need the engine to be built with a tokenizer")
        if max_rows is not None and max_rows < 1:
            raise ValueError(f"max_rows must be at least 1, got {max_rows}")
        setup = CallSetup(self)
        try:
            total = len(prompt_ids) * num_generations
            noise = params.noise(total, generator, uniforms, self.device)
            parking = None if turns is None else Parking(turns)
            eos = self.eos.to(self.device)
            call = Generation.start(total, params, eos, noise, self.tokenizer, capture_hidden, parking)
            compiled_before = self.compiled_so_far()  # what `settle` compiles counts towards the call
            at_once = total if max_rows is None else min(total, max_rows)
            waiting = Refill(self.admit, at_once)
            waiting.add(prompt_ids, call.seqs, num_generations)
            length = self._begin(call, at_once, max(map(len, prompt_ids)))
            begun, row_prompt, seqs = waiting.take(at_once)
            rows = prefill(self, begun, row_prompt, seqs, call, waiting=waiting.waiting)
            compiled = self.compiled_so_far, compiled_before, self.target.compiled
            run = Decoding(self.step, *compiled, call, rows, waiting, setup, length)
            yield run
            if run.done and not run.handed_over:
                run.output()  # made inside the block, as the steps' tensors were
        finally:
            setup.close()

    def compiled_so_far(self) -> CompiledSoFar:
        """Wall time spent so far in steps that compiled a graph, the graphs they compiled, the shapes they met, and
        the calls of each compiled function that ran eagerly (the target's and the drafters')."""
        return CompiledSoFar.of([self.target, *self.drafters.values()])

    def _begin(self, call: Generation, rows: int, prompt_len: int) -> int:
        """Size the caches for ``rows`` rows at once of prompts up to ``prompt_len`` tokens, or for the reserved calls
        when larger (reused when big enough; zeroed once at allocation, so always finite) and tell the controller a
        call starts; returns the tokens of prompt and completion per row they are sized for."""
        rows = self.target.rows(max(rows, self.reserved[0]))
        length = max(call_length(prompt_len, call.params.max_new_tokens), self.reserved[1])
        bound = self.controller.max_shape if self.controller is not None else None
        slots = cache_slots(length, bound.nodes if bound is not None else 1)
        if self.cache is None or not self.cache.holds(rows, slots):
            self.cache = None  # freed before the new one is made
            config, dtype, compiled = self.model.config, self.model.dtype, self.target.compiled
            self.cache = RowCache(config, rows, slots, dtype, self.device, compiled)
        if self.drafters:
            changed = [d.begin(rows, length, bound) for d in self.drafters.values()]
            self.controller.begin(draft_changed=any(changed))
        self.settle(call.params)
        return length

    def settle(self, params: SamplingParams) -> None:
        """Before a call's first step, run every shape its compiled steps can meet (`settle_engine`)."""
        settle_engine(self, params)

    def admit(
        self,
        rows: ActiveRows,
        prompt_ids: list[list[int]],
        row_prompt: list[int],
        seqs: list[Sequence],
        call: Generation,
    ) -> ActiveRows:
        """Take the completions ``seqs`` (row ``i`` of prompt ``prompt_ids[row_prompt[i]]``) into the call beside the
        live ``rows`` (`prefill`, into the cache rows past them, where rows waiting on tools make way); returns the live
        rows followed by the new ones."""
        if call.parking is not None:
            call.parking.vacate(self.cache, rows.size, len(seqs))
        return prefill(self, prompt_ids, row_prompt, seqs, call, rows)

    def step(self, rows: ActiveRows, call: Generation) -> ActiveRows:
        """One decoding step over the active rows (and those that rejoin them after their tools returned); returns
        those still active after it."""
        if call.parking is not None:
            rows = call.parking.resume(self.model, self.cache, list(self.drafters.values()), rows, call)
            call.stats.waiting.append(len(call.parking.rows))
            if not rows.size:
                return rows
        start, cold = time.perf_counter(), self.cold_calls()
        shape = self.schedule(rows)
        proposal = self.propose(rows, shape, call)
        verified = self.verify(rows, proposal, call)
        return self.postprocess(rows, shape, proposal, verified, call, start, cold != self.cold_calls())

    def cold_calls(self) -> int:
        """Compiled calls so far that compiled or warmed up a graph, the target's and the drafters'
        (`fastgrpo.rollout.compiled.Compiled.cold_calls`): a step that made one is timed as the compiler, not as a
        step."""
        return self.target.cold_calls + sum(d.cold_calls for d in self.drafters.values())

    def schedule(self, rows: ActiveRows) -> TreeShape | None:
        """The tree budget of this step for the live rows (None or one node: a plain step); with a thread governor,
        also the threads the step runs on."""
        if self.threads is not None:
            self.threads.update()
        if self.controller is None:
            return None
        return self.controller.choose(rows.size, max(d.backlog() for d in self.drafters.values()))

    def propose(self, rows: ActiveRows, shape: TreeShape | None, call: Generation) -> Proposal | None:
        """A draft tree per row when ``shape`` asks for one (the trees of several drafters merged into one of
        ``shape.nodes`` nodes)."""
        if shape is None or not shape.speculative:
            return None
        t0 = time.perf_counter()
        # a drafter that merges the others' trees inside its own compiled step drafts last (a stable sort)
        first, *others = sorted(self.drafters_of(shape), key=lambda d: d.merges_inside)
        proposal = first.propose(rows, shape)
        for other in others:
            proposal = other.propose_merged(rows, shape, proposal)
        if self.target.compiled:  # one walk depth for every tree: one graph (its loop unrolled), the one `settle` ran
            proposal.tree = dataclasses.replace(proposal.tree, levels=self.walk_levels)
        call.stats.draft_forwards += proposal.forwards
        call.stats.draft_time += time.perf_counter() - t0
        return proposal

    def verify(self, rows: ActiveRows, proposal: Proposal | None, call: Generation) -> Verified:
        """One target forward over each row's pending token (and its tree), accepting the tokens each row emits
        (`fastgrpo.rollout.target_step`)."""
        t0 = time.perf_counter()
        decoder, head = decoder_and_head(self.model)
        args = (decoder, head, self.cache)
        if proposal is None:
            uniforms = call.uniforms(rows, 1)
            uniforms = None if uniforms is None else uniforms[:, 0]
            out = self.target.plain(*args, rows.pending, rows.row_len, rows.host_len, uniforms, call.params)
            tokens, logprobs, hidden = out
            verified = Verified(tokens[:, None], logprobs[:, None], torch.ones_like(tokens), hidden)
        else:
            tree = proposal.tree
            uniforms = call.uniforms(rows, tree.levels + 1)
            out = self.target.tree(*args, tree, rows.row_len, rows.host_len, uniforms, call.params)
            verified = Verified(*out)
            call.stats.tree_nodes.append(tree.tokens.shape[1])
        rows.row_len = rows.row_len + verified.count
        call.stats.target_forwards += 1
        call.stats.verify_time += time.perf_counter() - t0
        return verified

    def postprocess(
        self,
        rows: ActiveRows,
        shape: TreeShape | None,
        proposal: Proposal | None,
        verified: Verified,
        call: Generation,
        start: float,
        cold: bool = False,
    ) -> ActiveRows:
        """Read the step's result back (the step's one synchronisation), hand the drafters what they need of it, append
        the emitted tokens, drop finished rows and tell the controller what the step cost and accepted: its time only
        when it was not ``cold`` (it compiled or warmed up a graph, and its time says nothing of the step's)."""
        stats = call.stats
        stats.concurrency.append(rows.size)
        host = HostStep.read(verified, call.eos)
        if self.drafters:
            emitted = Emitted(verified.tokens, verified.hidden, verified.count, host.count)
            for drafter in self.drafters.values():
                drafter.accepted(rows, emitted)
        if call.capture:
            for seq, hidden, n in zip(rows.seqs, verified.hidden, host.count, strict=True):
                seq.hidden.append(hidden[:n])
        accepted = [n - 1 for n in host.count]
        if host.deepest is not None:
            stats.record_depths(host.deepest, accepted)
            stats.record_drafter(shape.drafter or next(iter(self.drafters)), accepted)
            for drafter in self.drafters_of(shape):
                stats.drafter_trees[drafter.name] = stats.drafter_trees.get(drafter.name, 0) + 1
        emitted_before = stats.tokens_emitted
        rows.host_len = [length + n for length, n in zip(rows.host_len, host.count, strict=True)]
        remaining = self.append(rows, verified, host, call)
        stats.tokens_per_forward.append(stats.tokens_emitted - emitted_before)
        stats.step_times.append(time.perf_counter() - start)
        stats.cold_steps += cold
        if shape is not None:
            timed = None if cold else stats.step_times[-1] - (proposal.backlog_seconds if proposal else 0.0)
            stats.time_saved += self.controller.observe(rows.size, shape, timed, accepted, host.path_rank) or 0.0
        return remaining

    def append(self, rows: ActiveRows, verified: Verified, host: HostStep, call: Generation) -> ActiveRows:
        """Append the first ``count[b]`` emitted tokens to each row's sequence and drop the rows that ended, moving
        kept rows into the freed cache rows (`fill_holes`) and rows whose turn called tools past them
        (`fastgrpo.rollout.turns`)."""
        keep, paused = [], []
        for pos, (seq, toks, lps, eos, n) in enumerate(
            zip(rows.seqs, host.tokens, host.logprobs, host.eos, host.count, strict=True)
        ):
            before = len(seq.completion_ids)
            if not seq.append(toks[:n], lps[:n], eos[:n], call):
                keep.append(pos)
            elif call.parking is not None and call.parking.pauses(seq):
                paused.append(pos)
            call.stats.tokens_emitted += len(seq.completion_ids) - before
        count = verified.count
        rows.pending = verified.tokens.gather(1, (count - 1).clamp(min=0)[:, None]).squeeze(1)
        rows.emitted = rows.emitted + count
        if len(keep) == rows.size:
            return rows
        order = fill_holes(keep)
        index = host_to_device(order, rows.ids.device)
        moves = order
        if paused:
            drafted = [drafter.park(paused) for drafter in self.drafters.values()]
            moves = call.parking.park(rows, order, paused, drafted, self.cache.max_rows)
        if keep or paused or (call.parking is not None and call.parking.rows):  # rows to resume into later
            self.cache.select_rows(moves, upto=max(rows.host_len))
        for drafter in self.drafters.values():  # (also when none is left: rows may be taken in after them)
            drafter.select(order, index)
        return rows.select(order, index)
