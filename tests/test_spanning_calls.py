"""A generation call that spans generations (`fastgrpo.rollout.decoding.Decoding.extend` and `hand_over`): the next
generation's completions are taken in while the last one decodes, taking its rows as they end, and each generation is
handed over once its completions all ended. Each is exactly what a call of its own makes: greedy, and sampled under
the same uniforms, with no drafter, the EAGLE head, the suffix drafter or both; the drafters may learn between steps
(outside the call's setup, `Decoding.paused`) without touching the rows in flight."""

from __future__ import annotations

import pytest
import torch
from test_refill import PROMPTS, TREE
from test_speculative import EOS, speculative_engine, tiny_model

from fastgrpo.config import DraftTrainConfig, SpeculationConfig
from fastgrpo.rollout.cache import call_length
from fastgrpo.rollout.engine import RolloutEngine
from fastgrpo.sampling_params import SamplingParams
from fastgrpo.speculative.suffix.drafter import PREFIX
from fastgrpo.training_rollouts import TrainingRollouts, step_uniforms

GENERATIONS = [PROMPTS[:2], PROMPTS[2:4], PROMPTS[4:]]  # three generations of 2 prompts x 2 completions
MAX_NEW = 16
AT_ONCE = 3  # fewer rows than a generation's 4 completions: each generation's last ones join the next one's


def spanning(engine: RolloutEngine, params: SamplingParams, uniforms: list[torch.Tensor | None]):
    """The three generations in one call of ``AT_ONCE`` rows, each taken in once every completion before it has
    begun, and handed over as soon as its completions all ended (as a rollout process's call, `_span`); their outputs
    and the most generations whose completions decoded in one step."""
    engine.reserve(AT_ONCE, call_length(max(map(len, PROMPTS)), MAX_NEW))
    outputs, most = [], 0
    with engine.decoding(GENERATIONS[0], params, 2, uniforms=uniforms[0], max_rows=AT_ONCE) as run:
        flight, taken = [list(run.call.seqs)], 1
        while True:
            while flight and run.ended(flight[0]):
                outputs.append(run.hand_over(flight.pop(0)))
            if run.done:
                break
            if not run.waiting.pending and taken < len(GENERATIONS):
                flight.append(run.extend(GENERATIONS[taken], 2, uniforms[taken]))
                taken += 1
            before = [sum(len(s.completion_ids) for s in seqs) for seqs in flight]
            run.step()
            grew = [sum(len(s.completion_ids) for s in seqs) != b for seqs, b in zip(flight, before, strict=True)]
            most = max(most, sum(grew))
    return outputs, most


def noise(params: SamplingParams, seed: int) -> list[torch.Tensor | None]:
    if params.greedy:
        return [None] * len(GENERATIONS)
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.rand(len(p) * 2, MAX_NEW, generator=g, dtype=torch.float64, device="cpu") for p in GENERATIONS]


@pytest.mark.parametrize("drafter", [None, "eagle", "suffix", "eagle+suffix"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_each_generation_of_a_spanning_call_is_what_a_call_of_its_own_makes(
    model_draft, drafter: str | None, temperature: float
) -> None:
    model, draft = model_draft
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=temperature, top_p=0.9 if temperature else 1.0)
    uniforms = noise(params, 3)
    alone = [
        RolloutEngine(model, [EOS]).generate(p, params, 2, uniforms=u)
        for p, u in zip(GENERATIONS, uniforms, strict=True)
    ]
    engine = RolloutEngine(model, [EOS]) if drafter is None else speculative_engine(model, [EOS], drafter, draft, TREE)
    outputs, most = spanning(engine, params, uniforms)
    assert most >= 2, "generations should decode side by side"
    assert len(outputs) == len(GENERATIONS)
    for out, ref in zip(outputs, alone, strict=True):
        assert out.completion_ids == ref.completion_ids
        assert out.finish_reasons == ref.finish_reasons
        torch.testing.assert_close(torch.tensor(sum(out.logprobs, [])), torch.tensor(sum(ref.logprobs, [])))
        assert max(out.stats.concurrency) <= AT_ONCE
    emitted = sum(out.stats.tokens_emitted for out in outputs)  # each step's tokens counted in one part's statistics
    assert emitted == sum(len(c) for out in outputs for c in out.completion_ids)
    if drafter is not None:
        assert sum(len(out.stats.tree_nodes) for out in outputs), "trees should be drafted"


def test_hidden_states_and_noise_rows_of_generations_taken_in(model_draft) -> None:
    """Completions taken in reuse the noise rows of those handed over (the call's noise does not grow with every
    generation), and their captured hidden states are a call of their own's."""
    model, _ = model_draft
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0)
    uniforms = noise(params, 5)
    alone = [
        RolloutEngine(model, [EOS]).generate(p, params, 2, uniforms=u, capture_hidden=True)
        for p, u in zip(GENERATIONS, uniforms, strict=True)
    ]
    engine = RolloutEngine(model, [EOS])
    engine.reserve(AT_ONCE, call_length(max(map(len, PROMPTS)), MAX_NEW))
    with engine.decoding(GENERATIONS[0], params, 2, uniforms=uniforms[0], capture_hidden=True, max_rows=3) as run:
        seqs, later = list(run.call.seqs), run.extend(GENERATIONS[1], 2, uniforms[1])
        while not run.ended(seqs):
            run.step()
        first = run.hand_over(seqs)
        third = run.extend(GENERATIONS[2], 2, uniforms[2])
        assert sorted(s.index for s in third) == sorted(s.index for s in seqs), "the noise rows handed over, reused"
        assert run.call.noise.shape[0] == 8
        run.finish()
        second, last = run.hand_over(later), run.hand_over(third)
    for out, ref in zip([first, second, last], alone, strict=True):
        assert out.completion_ids == ref.completion_ids
        for a, b in zip(out.hidden_states, ref.hidden_states, strict=True):
            torch.testing.assert_close(a, b)


def test_a_generation_whose_completions_all_end_in_the_prefill_is_handed_over(model_draft) -> None:
    """One token per completion: every generation ends as it is taken in, and each is handed over all the same."""
    model, _ = model_draft
    params = SamplingParams(max_new_tokens=1, temperature=0)
    alone = [RolloutEngine(model, [EOS]).generate(p, params, 2) for p in GENERATIONS]
    engine = RolloutEngine(model, [EOS])
    engine.reserve(4, call_length(max(map(len, PROMPTS)), MAX_NEW))
    with engine.decoding(GENERATIONS[0], params, 2) as run:
        assert run.done and run.ended(list(run.call.seqs))
        outputs = [run.hand_over(list(run.call.seqs))]
        for generation in GENERATIONS[1:]:
            seqs = run.extend(generation, 2, None)
            run.step()  # (the intakes alone: no decoding step)
            outputs.append(run.hand_over(seqs))
    assert [out.completion_ids for out in outputs] == [ref.completion_ids for ref in alone]


def test_a_spanning_call_refuses_what_it_cannot_take(model_draft) -> None:
    model, _ = model_draft
    engine = RolloutEngine(model, [EOS])
    with engine.decoding([[1, 2]], SamplingParams(max_new_tokens=MAX_NEW, temperature=0), 2) as run:
        with pytest.raises(ValueError, match="a prompt of 8 tokens does not fit the call's caches"):
            run.extend([[3] * 8], 2, None)
        with pytest.raises(RuntimeError, match="has not ended"):
            run.hand_over(list(run.call.seqs))
        with run.paused(), pytest.raises(RuntimeError, match="paused already"), run.paused():
            pass
        run.finish()
        seqs = list(run.call.seqs)
        run.hand_over(seqs)
        with pytest.raises(ValueError, match="each once"):
            run.hand_over(seqs)
    sampled = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0)
    with engine.decoding(
        [[1, 2]], sampled, 2, uniforms=torch.rand(2, MAX_NEW, dtype=torch.float64, device="cpu")
    ) as run:
        with pytest.raises(ValueError, match="takes completions in with their uniforms"):
            run.extend([[3]], 2, None)
        run.finish()


def test_drafters_learn_between_the_steps_of_a_spanning_call(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run's rollouts (`TrainingRollouts`): after each generation is handed over, the EAGLE head trains on it and
    the suffix memory applies its budget, with rows of the next generations in flight; the next generations are still
    plain sampling's, the head's weights changed, and the suffix memory kept every live row's prompt."""
    monkeypatch.setenv("FASTGRPO_CACHE", str(tmp_path))
    model = tiny_model("qwen2")
    spec = SpeculationConfig(mode="static", drafter="eagle+suffix", suffix_memory_tokens=8)
    rollouts = TrainingRollouts(model, None, [EOS], spec, DraftTrainConfig(learning_rate=1e-2), "tiny")
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0)
    rollouts.generate(PROMPTS[::-1], params, 2, step=9)  # builds the EAGLE head (it waits for a rollout)
    rollouts.learn()
    assert not rollouts.waiting
    head = rollouts.drafter("eagle").modules[0]
    before = [p.detach().clone() for p in head.parameters()]
    rollouts.reserve(AT_ONCE, max(map(len, PROMPTS)), MAX_NEW)
    learnt, outputs, live, suffix = [], [], 0, rollouts.drafter("suffix")
    with rollouts.decoding(GENERATIONS[0], params, 2, step=0, max_rows=AT_ONCE) as run:
        flight, taken = [(list(run.call.seqs), GENERATIONS[0])], 1
        while not run.done:
            if not run.waiting.pending and taken < len(GENERATIONS):
                flight.append((rollouts.extend(run, GENERATIONS[taken], 2, step=taken), GENERATIONS[taken]))
                taken += 1
            run.step()
            while flight and run.ended(flight[0][0]):
                seqs, prompts = flight.pop(0)
                outputs.append(rollouts.hand_over(run, seqs, prompts, 2))
                with run.paused():
                    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
                    learnt.append(rollouts.learn())
                    live += len(suffix.rows)
                    for row in suffix.rows:  # each live row's memory kept, its own sequence there as it read it
                        mem, start = row.memory, min(PREFIX, len(row.memory.prompt))
                        assert suffix.learner.prompts[tuple(mem.prompt)] is mem
                        assert mem.store.read(mem.slots[row.sid], start) == row.completion[: row.read]
    assert all("draft/loss" in m for m in learnt) and live, learnt
    assert all(m["suffix/memory_tokens"] < 64 for m in learnt), "the budget applied (live rows' prompts kept)"
    assert any(not torch.equal(a, b) for a, b in zip(before, head.parameters(), strict=True)), "the head learnt"
    for g, out in enumerate(outputs):
        uniforms = step_uniforms(0, g, len(GENERATIONS[g]) * 2, MAX_NEW)
        plain = RolloutEngine(model, [EOS]).generate(GENERATIONS[g], params, 2, uniforms=uniforms)
        assert out.completion_ids == plain.completion_ids
    assert not rollouts.pending and run.handed_over == len(GENERATIONS)
