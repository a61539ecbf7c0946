"""Rows that wait on tools and resume in their own cache (`fastgrpo.rollout.turns`): multi-turn completions equal a
reference that feeds the whole conversation to transformers' ``generate`` turn by turn, speculation stays lossless
across turns, nothing before a tool turn is computed again, and a slow tool holds up only its own row."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch
import torch._inductor.config
from parked_rows import LateTools, frequent_token, watch_parked
from test_speculative import PROMPTS, speculative_engine, tiny_model, trained_draft
from transformers import PreTrainedModel

from fastgrpo.rollout import turns as turns_module
from fastgrpo.rollout.drafter import Drafter
from fastgrpo.rollout.engine import RolloutEngine
from fastgrpo.rollout.sequence import GenerationOutput
from fastgrpo.rollout.tree import TreeShape
from fastgrpo.rollout.turns import Parking
from fastgrpo.sampling_params import SamplingParams
from fastgrpo.speculative.eagle.drafter import EagleDrafter
from fastgrpo.speculative.eagle.head import DraftHead
from fastgrpo.speculative.suffix.drafter import SuffixDrafter

MAX_NEW = 40


@dataclass
class ScriptedTurns:
    """Every turn that ends with the EOS calls a tool, up to ``calls`` per row; its result is ``[20 + turn, 21, row %
    7 + 30]`` (``length`` tokens of it). A row in ``held`` waits until the event is set."""

    calls: int = 2
    length: int = 3
    held: dict[int, threading.Event] = field(default_factory=dict)
    waiting: dict[int, list[int]] = field(default_factory=dict)
    turns: Counter = field(default_factory=Counter)
    blocked: int = 0  # `ready` calls that had to wait
    gather: int = 1  # rows answered together: fewer wait on, unless the engine has no live row

    def result(self, row: int, turn: int) -> list[int]:
        return [20 + turn, 21, row % 7 + 30, 22, 23][: self.length]

    def ended(self, row: int, completion: list[int]) -> bool:
        if self.turns[row] >= self.calls:
            return False
        self.waiting[row] = self.result(row, self.turns[row])
        self.turns[row] += 1
        return True

    def ready(self, block: bool) -> list[tuple[int, list[int] | None]]:
        def done() -> list[int]:
            return [r for r in self.waiting if r not in self.held or self.held[r].is_set()]

        if block and not done():
            self.blocked += 1
            while not done():
                threading.Event().wait(0.001)
        if not block and len(done()) < self.gather:
            return []
        return [(r, self.waiting.pop(r)) for r in done()]


class RaggedTurns(ScriptedTurns):
    """Results of 1 to 5 tokens, by row and turn: rows that resume together feed tool turns of other lengths."""

    def result(self, row: int, turn: int) -> list[int]:
        return [20 + turn, 21, row % 7 + 30, 22, 23][: 1 + (row + 2 * turn) % 5]


TURNS = {"equal": lambda: ScriptedTurns(gather=2), "ragged": lambda: RaggedTurns(gather=2)}


def reference_turns(model: PreTrainedModel, prompt: list[int], eos: int, turns: ScriptedTurns, row: int) -> list[int]:
    """Greedy multi-turn completion: the whole conversation re-fed to ``generate`` at every turn."""
    completion: list[int] = []
    for turn in range(turns.calls + 1):
        ids = torch.tensor([prompt + completion])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_NEW - len(completion),
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=0,
        )
        completion += out[0, ids.shape[1] :].tolist()
        if completion[-1] != eos or turn == turns.calls:
            return completion
        result = turns.result(row, turn)
        if len(completion) + len(result) > MAX_NEW:  # TRL's rollback: the results would not fit
            return completion
        completion += result
        if len(completion) == MAX_NEW:  # they fill the completion, which ends with them
            return completion
    return completion


@pytest.fixture(scope="module")
def model_eos() -> tuple[PreTrainedModel, int, DraftHead]:
    model = tiny_model("llama")
    return model, frequent_token(model, PROMPTS), trained_draft(model, epochs=10)


@pytest.mark.parametrize("kind", ["equal", "ragged"])
def test_greedy_turns_equal_generate_on_the_whole_conversation(model_eos, monkeypatch, kind: str) -> None:
    """Rows whose tools answer in the same step (two at a time here) resume in one forward, tool turns of other
    lengths padded."""
    model, eos, _ = model_eos
    turns, joined = TURNS[kind](), []
    rejoin = Parking._rejoin

    def counted(self, model, cache, drafters, rows, joining):
        joined.append([len(tokens) for _, tokens in joining])
        return rejoin(self, model, cache, drafters, rows, joining)

    monkeypatch.setattr(Parking, "_rejoin", counted)
    out = RolloutEngine(model, [eos]).generate(
        PROMPTS, SamplingParams(max_new_tokens=MAX_NEW, temperature=0), 1, turns=turns
    )
    assert sum(turns.turns.values()) >= 3, "the test needs rows that call tools"
    together = [lengths for lengths in joined if len(lengths) > 1]
    assert together and (kind == "equal" or any(len(set(lengths)) > 1 for lengths in together)), joined
    for row, prompt in enumerate(PROMPTS):
        expected = reference_turns(model, prompt, eos, TURNS[kind](), row)
        assert out.completion_ids[row] == expected
        assert out.finish_reasons[row] == ("stop" if expected[-1] == eos else "length")
    assert set(out.finish_reasons) == {"stop", "length"}
    for ids, mask, logprobs in zip(out.completion_ids, out.tool_masks, out.logprobs, strict=True):
        assert len(mask) == len(ids) == len(logprobs)
        assert all(lp == 0.0 for lp, m in zip(logprobs, mask, strict=True) if not m)
    if kind == "equal":
        assert out.stats.tool_prefill_tokens == 3 * sum(turns.turns.values())
    assert_logprobs_of_one_forward(model, PROMPTS, out)
    assert sum(1 - m for mask in out.tool_masks for m in mask) == out.stats.tool_prefill_tokens


def assert_logprobs_of_one_forward(model: PreTrainedModel, prompts: list[list[int]], out: GenerationOutput) -> None:
    """Every sampled token's log-prob is what one forward over its whole conversation gives it: no cache slot a
    turn or a pad wrote over is read."""
    for row, prompt in enumerate(prompts):
        ids = torch.tensor([prompt + out.completion_ids[row]])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].double()
        ref = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt) :, None])[:, 0]
        sampled = torch.tensor(out.tool_masks[row], dtype=torch.bool)
        torch.testing.assert_close(torch.tensor(out.logprobs[row], dtype=torch.float64)[sampled], ref[sampled])


class ShortAndLongTurns(ScriptedTurns):
    """Row 0's tool turn is 1 token, row 1's 5, answered together."""

    def result(self, row: int, turn: int) -> list[int]:
        return [20, 21, 22, 23, 24][: 1 if row == 0 else 5]


def test_a_short_turn_resuming_beside_a_long_one_keeps_its_slots(model_eos, monkeypatch) -> None:
    """The row whose cache ends last feeds the shorter tool turn: its pads go past its end, not onto its last slot."""
    model, eos, _ = model_eos
    prompts = [[5, 6, 7, 8, 9] * 6, [5, 6, 7]]  # row 0 parks first, with the longer cache
    joined = []
    rejoin = Parking._rejoin

    def counted(self, model, cache, drafters, rows, joining):
        joined.append(sorted(len(tokens) for _, tokens in joining))
        return rejoin(self, model, cache, drafters, rows, joining)

    monkeypatch.setattr(Parking, "_rejoin", counted)
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0)
    out = RolloutEngine(model, [eos]).generate(prompts, params, 1, turns=ShortAndLongTurns(calls=1, gather=2))
    assert [1, 5] in joined, joined
    assert_logprobs_of_one_forward(model, prompts, out)


class StaggeredTools(LateTools):
    """`LateTools` whose results are 1 to 5 tokens and come in batches, every 6 steps (rows 0, 3, 6, ... two batches
    later): rows resume together while others still wait, parked in the cache rows the resuming ones move to."""

    def result(self, row: int, turn: int) -> list[int]:
        return [20 + turn, 21, row % 7 + 30, 22, 23][: 1 + (row + turn) % 5]

    def ended(self, row: int, completion: list[int]) -> bool:
        turn = self.turns.get(row, 0)
        if not super().ended(row, completion):
            return False
        self.waiting[row], self.due[row] = self.result(row, turn), (self.clock // 6 + (3 if row % 3 == 0 else 1)) * 6
        return True


def test_rows_resuming_together_swap_past_rows_still_waiting(model_eos, monkeypatch) -> None:
    """Several rows resume in one forward while others still wait, moved out of the cache rows the resuming ones
    take: greedy turns equal `generate` on the whole conversation, and every log-prob one forward's."""
    model, eos, _ = model_eos
    prompts = [*PROMPTS, [5, 6, 7], [10, 11, 12, 13], [9, 8], [14, 15, 16]]
    swaps, joining_now, move, rejoin = [], [0], turns_module._move, Parking._rejoin

    def recorded(cache, row, target, others):
        swaps.append(joining_now[0] > 1 and row.slot != target and any(other.slot == target for other in others))
        return move(cache, row, target, others)

    def counted(self, model, cache, drafters, rows, joining):
        joining_now[0] = len(joining)
        return rejoin(self, model, cache, drafters, rows, joining)

    monkeypatch.setattr(turns_module, "_move", recorded)
    monkeypatch.setattr(Parking, "_rejoin", counted)
    tools = StaggeredTools()
    out = RolloutEngine(model, [eos]).generate(
        prompts, SamplingParams(max_new_tokens=MAX_NEW, temperature=0), 1, turns=tools
    )
    assert any(swaps), "a row resuming with others took the cache row of one still waiting"
    for row, prompt in enumerate(prompts):
        assert out.completion_ids[row] == reference_turns(model, prompt, eos, StaggeredTools(), row), row
    assert_logprobs_of_one_forward(model, prompts, out)


class FirstRowLate(LateTools):
    """`LateTools` whose row 0 gets its first result only after every other row has ended."""

    def ended(self, row: int, completion: list[int]) -> bool:
        if not super().ended(row, completion):
            return False
        if row == 0 and self.turns[row] == 1:
            self.due[row] = self.clock + 10 * MAX_NEW
        return True


def test_a_row_resuming_after_every_other_ended_finds_its_drafters_in_step(model_eos, monkeypatch) -> None:
    """Every live row ends in a step while row 0 still waits on its tool: the drafters drop those rows too, so that
    EAGLE drafts row 0 alone when it resumes, and the greedy completions equal plain decoding's."""
    model, eos, draft = model_eos
    alone, rejoin = [], Parking._rejoin

    def counted(self, model, cache, drafters, rows, joining):
        alone.append(rows.size == 0 and [p.seq.index for p, _ in joining] == [0])
        return rejoin(self, model, cache, drafters, rows, joining)

    monkeypatch.setattr(Parking, "_rejoin", counted)
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0)
    plain = RolloutEngine(model, [eos]).generate(PROMPTS, params, 1, turns=FirstRowLate())
    engine = speculative_engine(model, [eos], "eagle", draft, TreeShape(8, 3, 4))
    out = engine.generate(PROMPTS, params, 1, turns=FirstRowLate())
    assert any(alone), "row 0 resumed after every other row had ended"
    assert out.completion_ids == plain.completion_ids and out.tool_masks == plain.tool_masks


class FillingTurns(ScriptedTurns):
    """Each row's first turn that ends with the EOS calls a tool whose result is exactly the tokens left."""

    def ended(self, row: int, completion: list[int]) -> bool:
        if self.turns[row]:
            return False
        self.waiting[row] = [20 + row % 3] * (MAX_NEW - len(completion))
        self.turns[row] += 1
        return True


def test_results_that_fill_the_completion_end_it_with_them(model_eos) -> None:
    """As TRL's loop keeps them: a tool's results that exactly fill the completion's budget end it (finish reason
    ``length``), the results last and masked; nothing is decoded after them."""
    model, eos, _ = model_eos
    turns = FillingTurns()
    out = RolloutEngine(model, [eos]).generate(
        PROMPTS, SamplingParams(max_new_tokens=MAX_NEW, temperature=0), 1, turns=turns
    )
    assert turns.turns, "the test needs rows that call tools"
    for row, prompt in enumerate(PROMPTS):
        ids, mask = out.completion_ids[row], out.tool_masks[row]
        if not turns.turns[row]:
            continue
        first = mask.index(0)
        assert len(ids) == MAX_NEW and out.finish_reasons[row] == "length" and ids[first - 1] == eos
        assert ids[first:] == [20 + row % 3] * (MAX_NEW - first) and not any(mask[first:])
        assert ids[:first] == reference_turns(model, prompt, eos, ScriptedTurns(calls=0), row)[:first]
    assert out.stats.tool_prefill_tokens == 0, "nothing was fed: the rows ended"


@pytest.mark.parametrize(
    "drafter", ["eagle", "suffix", "eagle+suffix", "suffix without tool results", "eagle+suffix ragged turns"]
)
def test_sampled_turns_with_speculation_equal_plain_sampling(model_eos, drafter: str) -> None:
    model, eos, draft = model_eos
    kind = "ragged" if drafter.endswith("ragged turns") else "equal"
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, top_p=0.9)
    uniforms = torch.rand(len(PROMPTS) * 2, MAX_NEW, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    plain = RolloutEngine(model, [eos]).generate(PROMPTS, params, 2, uniforms=uniforms, turns=TURNS[kind]())
    engine = speculative_engine(model, [eos], drafter.split()[0], draft, TreeShape(8, 3, 4))
    if drafter.endswith("without tool results"):
        engine.drafters["suffix"].reads_tool_results = False
    turns = TURNS[kind]()
    out = engine.generate(PROMPTS, params, 2, uniforms=uniforms, turns=turns)
    assert sum(turns.turns.values()) >= 3
    assert out.completion_ids == plain.completion_ids
    assert out.tool_masks == plain.tool_masks
    torch.testing.assert_close(torch.tensor(sum(out.logprobs, [])), torch.tensor(sum(plain.logprobs, [])))
    assert out.stats.accept_length > 1.0


def test_a_tool_turn_is_fed_once_and_the_slots_before_it_stay(model_eos, monkeypatch) -> None:
    """The forwards of a call feed each token once: the prompts, then per step the pending tokens, then the tool
    turns' tokens; and the cache slots a row filled before its tool turn are the same after it."""
    model, eos, _ = model_eos
    engine = RolloutEngine(model, [eos])
    seen: list[torch.Tensor] = []
    decoder = model.get_decoder()
    original = type(decoder).forward

    def counting(self, *args, **kwargs):
        seen.append(kwargs["input_ids"])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(decoder), "forward", counting)
    turns = ScriptedTurns(calls=1)
    out = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=MAX_NEW, temperature=0), 1, turns=turns)
    assert turns.turns[0] == 1 and out.stats.tool_prefill_tokens == 3
    fed = [t.shape[1] for t in seen]
    # the prompt, then one token per step, and one forward of the EOS and two of the three tool tokens
    assert fed[0] == len(PROMPTS[0]) and sorted(fed[1:]) == [1] * (len(fed) - 2) + [3]
    assert sum(fed) == len(PROMPTS[0]) + len(out.completion_ids[0]) - 1


def test_a_slow_tool_holds_up_only_its_own_row(model_eos) -> None:
    """Row 0's tool waits until the other rows have decoded on for several steps: they never wait for it, and the
    call waits on it only when no row is left to decode."""
    model, eos, _ = model_eos
    gate = threading.Event()
    turns = ScriptedTurns(calls=1, held={0: gate})
    engine = RolloutEngine(model, [eos])
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0)
    steps_while_held = 0
    with engine.decoding(PROMPTS, params, 1, turns=turns) as run:
        while not run.done:
            if 0 in run.call.parking.rows and run.rows.size:
                steps_while_held += 1
                if steps_while_held == 5:
                    gate.set()
            run.step()
        out = run.output()
    assert steps_while_held >= 5
    assert out.completion_ids[0] == reference_turns(model, PROMPTS[0], eos, ScriptedTurns(calls=1), 0)
    assert max(out.stats.waiting) >= 1


def test_a_suffix_memory_without_tool_results_keeps_the_models_turns_only(model_eos) -> None:
    """``reads_tool_results=False``: no result of the scripted tools is in the memory, which is saved and restored
    (each turn after a tool's results a sequence of its own)."""
    from fastgrpo.speculative.suffix.drafter import SuffixMemory

    model, eos, draft = model_eos
    engine = speculative_engine(model, [eos], "suffix", draft, TreeShape(8, 3, 4))
    engine.drafters["suffix"].reads_tool_results = False
    turns = ScriptedTurns()
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW, temperature=0), 2, turns=turns)
    assert sum(turns.turns.values()) >= 3
    memory = engine.drafters["suffix"].learner
    memory.learn([])
    state = memory.state_dict()
    kept = [c for _, completions, _ in state["prompts"] for c in completions]
    assert sum(len(c) for c in kept) == sum(sum(m) for m in out.tool_masks), "the model's tokens, no tool's"
    restored = SuffixMemory()
    restored.load_state_dict(state)
    assert restored.state_dict()["prompts"] == state["prompts"]


@pytest.fixture(scope="module")
def compiled(model_eos) -> tuple[RolloutEngine, dict[str, Drafter]]:
    """An engine whose target steps and EAGLE proposals run compiled (the ``eager`` backend: Dynamo's graphs run as
    captured; inductor's own code for them is the last test's), and its drafters: the tests switch drafters on the
    same engine, whose compiled steps are then traced once for the module (the cases are ordered so that each traces
    little that an earlier one did not)."""
    model, eos, draft = model_eos
    drafters = {"eagle": EagleDrafter(draft, model, "eager"), "suffix": SuffixDrafter()}
    return RolloutEngine(model, [eos], backend="eager"), drafters


@pytest.mark.parametrize(
    ("drafter", "temperature"),
    [("", 0.0), ("eagle+suffix", 0.0), ("suffix", 1.0), ("eagle+suffix", 1.0)],
)
def test_compiled_steps_leave_parked_rows_as_they_were(model_eos, compiled, drafter, temperature):
    """Compiled steps run over rows padded to a power of two; with tools answering four steps late, rows wait parked
    past the live ones while the padded rows are computed: every resumed row finds its keys and values as it left
    them, and the completions equal eager decoding's, token for token (8-node trees of ``drafter``, or none)."""
    model, eos, _ = model_eos
    engine, drafters = compiled
    if drafter:
        tree = TreeShape(8, 3, 4, drafter=drafter)
        engine.speculate([drafters[name] for name in drafter.split("+")], tree=tree)
    else:
        engine.speculate(None)
    parked_rows_hold(engine, model, eos, temperature)


def test_compiled_steps_refill_rows_beside_parked_rows(model_eos, compiled) -> None:
    """Six of the twelve completions decoding at once under compiled steps (`fastgrpo.rollout.decoding.Refill`): the
    prompts taken in are prefilled where parked rows made way, and the completions are still eager decoding's."""
    model, eos, _ = model_eos
    engine, drafters = compiled
    engine.speculate([drafters["eagle"], drafters["suffix"]], tree=TreeShape(8, 3, 4, drafter="eagle+suffix"))
    out = parked_rows_hold(engine, model, eos, 1.0, max_rows=6)
    assert out.stats.refills >= 1 and max(out.stats.concurrency) <= 6


def test_inductor_steps_leave_parked_rows_as_they_were_and_follow_the_weights(model_eos) -> None:
    """The same with inductor's own code for the target steps and the EAGLE proposals, sampled, with merged trees: no
    resumed row's keys and values change and the completions equal eager decoding's; after an in-place update of the
    policy's and the draft's weights (an optimizer step writes them so), the compiled steps compute with the new
    weights, in new caches, without compiling again; and no step fell back to eager (which would pass for the wrong
    reason). Inductor's C++ kernels are built without SIMD: the same graphs, lowerings and fusions, in simpler C++ for
    the compiler to build. (The model computes in float64: in float32 and bfloat16, inductor's CPU flex-attention
    template fails to build these graphs in torch 2.13 and every step would run eagerly, as
    `compile/eager_fallbacks` then says; a GPU lowers flex attention through Triton's template instead.)"""
    model, eos, draft = model_eos
    weights = [*model.parameters(), *draft.parameters()]
    saved = [p.detach().clone() for p in weights]
    with torch._inductor.config.patch({"cpp.vec_isa_ok": False}):
        engine = RolloutEngine(model, [eos], backend="inductor")
        tree = TreeShape(8, 3, 4, drafter="eagle+suffix")
        engine.speculate([EagleDrafter(draft, model, "inductor"), SuffixDrafter()], tree=tree)
        before = parked_rows_hold(engine, model, eos, temperature=1.0)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        engine.release()  # the next call makes new caches, at other addresses
        try:
            with torch.no_grad():
                for p in weights:
                    noise = torch.randn(p.shape, generator=torch.Generator().manual_seed(7), dtype=p.dtype)
                    p.add_(0.05 * noise.to(p.device))
            after = parked_rows_hold(engine, model, eos, temperature=1.0)
        finally:
            with torch.no_grad():
                for p, value in zip(weights, saved, strict=True):
                    p.copy_(value)
    assert after.completion_ids != before.completion_ids, "the update changed what the policy samples"
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, "nothing was compiled again"
    assert after.stats.compile_time == 0
    assert engine.compiled_so_far().eager_calls == {"plain_step": 0, "tree_step": 0, "eagle_proposal": 0}


def parked_rows_hold(
    engine: RolloutEngine, model, eos: int, temperature: float, max_rows: int | None = None
) -> GenerationOutput:
    """``engine``'s completions with tools answering late (at most ``max_rows`` decoding at once) equal an eager
    engine's, and every resumed row finds its keys and values as it left them; returns ``engine``'s output."""
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=temperature)
    uniforms = None
    if temperature:
        uniforms = torch.rand(
            len(PROMPTS) * 3, MAX_NEW, generator=torch.Generator().manual_seed(5), dtype=torch.float64
        )
    eager = RolloutEngine(model, [eos]).generate(PROMPTS, params, 3, uniforms=uniforms, turns=LateTools())
    with watch_parked(engine) as parked:
        out = engine.generate(PROMPTS, params, 3, uniforms=uniforms, turns=LateTools(), max_rows=max_rows)
    assert parked.changed == []
    assert out.completion_ids == eager.completion_ids
    assert out.tool_masks == eager.tool_masks
    assert parked.resumed >= 4 and max(out.stats.waiting) >= 2, "the test needs rows that wait while others decode"
    return out
