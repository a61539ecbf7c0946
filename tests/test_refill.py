"""Rows refilled as they finish (`fastgrpo.rollout.decoding.Refill`): a call that decodes at most ``max_rows``
completions at once takes the next completions into the rows of finished ones (a prompt's completions split across
intakes where they do not all fit), and its output is still exactly the output of one call that decodes them all at
once: greedy and sampled under the same uniforms, with the EAGLE head, the suffix drafter or both drafting, and with
rows waiting on tools beside the refilled ones."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from parked_rows import LateTools, frequent_token, watch_parked
from test_speculative import EOS, speculative_engine
from test_tool_turns import MAX_NEW, assert_logprobs_of_one_forward

from fastgrpo.rollout.engine import RolloutEngine
from fastgrpo.rollout.tree import TreeShape
from fastgrpo.rollout.turns import Parking
from fastgrpo.sampling_params import SamplingParams

# prompts of other lengths, so that refilled rows prefill beside rows at other positions
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19], [4], [40, 41, 42], [50, 51, 52, 53, 54, 55]]
TREE = TreeShape(8, 3, 4)


def refilled(out, max_rows: int) -> None:
    """At most ``max_rows`` rows decoded at once, and the prompts that did not fit taken in as rows finished."""
    assert max(out.stats.concurrency) <= max_rows
    assert out.stats.refills >= 2, out.stats.concurrency


@pytest.mark.parametrize(
    ("drafter", "max_rows"), [(None, 2), (None, 5), ("eagle", 5), ("suffix", 2), ("eagle+suffix", 5)]
)
def test_greedy_with_refilled_rows_equals_one_call(model_draft, drafter: str | None, max_rows: int) -> None:
    """With the suffix drafter twice: the second call also drafts from the first call's completions."""
    model, draft = model_draft
    params = SamplingParams(max_new_tokens=16, temperature=0)
    reference = RolloutEngine(model, [EOS]).generate(PROMPTS, params, 2)
    engine = RolloutEngine(model, [EOS]) if drafter is None else speculative_engine(model, [EOS], drafter, draft, TREE)
    for _ in range(2 if drafter and "suffix" in drafter else 1):
        out = engine.generate(PROMPTS, params, 2, max_rows=max_rows)
        assert out.completion_ids == reference.completion_ids
        assert out.finish_reasons == reference.finish_reasons
        torch.testing.assert_close(torch.tensor(sum(out.logprobs, [])), torch.tensor(sum(reference.logprobs, [])))
    refilled(out, max_rows)
    if drafter is not None:
        assert out.stats.tree_nodes, "trees should be drafted for the refilled rows"


@pytest.mark.parametrize("drafter", ["eagle", "suffix", "eagle+suffix"])
def test_sampled_with_refilled_rows_equals_plain_sampling(model_draft, drafter: str) -> None:
    model, draft = model_draft
    params = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.9)
    uniforms = torch.rand(len(PROMPTS) * 2, 16, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    plain = RolloutEngine(model, [EOS]).generate(PROMPTS, params, 2, uniforms=uniforms)
    engine = speculative_engine(model, [EOS], drafter, draft, TREE)
    engine.generate(PROMPTS, params, 2, uniforms=uniforms.flip(0))  # the suffix drafter's memory, for trees to accept
    out = engine.generate(PROMPTS, params, 2, uniforms=uniforms, max_rows=4)
    assert out.completion_ids == plain.completion_ids
    torch.testing.assert_close(torch.tensor(sum(out.logprobs, [])), torch.tensor(sum(plain.logprobs, [])))
    refilled(out, 4)
    assert out.stats.accept_length > 1.0


def test_hidden_states_of_refilled_rows_are_those_of_one_call(model_draft) -> None:
    model, _ = model_draft
    params = SamplingParams(max_new_tokens=16, temperature=0)
    reference = RolloutEngine(model, [EOS]).generate(PROMPTS, params, 2, capture_hidden=True)
    out = RolloutEngine(model, [EOS]).generate(PROMPTS, params, 2, capture_hidden=True, max_rows=2)
    for a, b in zip(out.hidden_states, reference.hidden_states, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("drafter", [None, "eagle+suffix"])
def test_refilled_rows_beside_rows_waiting_on_tools(model_draft, drafter: str | None) -> None:
    """Rows waiting on tools (answering four steps late) sit past the live ones, where refilled rows are prefilled:
    they move out of the way with their caches (each resumed row finds its keys and values as it left them), and the
    drafters keep the parked rows' state through the refills."""
    model, draft = model_draft
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, top_p=0.9)
    uniforms = torch.rand(len(PROMPTS) * 2, MAX_NEW, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    eos = frequent_token(model, PROMPTS)  # turns end often
    plain = RolloutEngine(model, [eos]).generate(PROMPTS, params, 2, uniforms=uniforms, turns=LateTools())
    engine = RolloutEngine(model, [eos]) if drafter is None else speculative_engine(model, [eos], drafter, draft, TREE)
    vacated = []
    vacate = Parking.vacate

    def counted(self, cache, first, count):
        vacated.append(sum(first <= p.slot < first + count for p in self.rows.values()))
        return vacate(self, cache, first, count)

    with mock.patch.object(Parking, "vacate", counted), watch_parked(engine) as parked:
        out = engine.generate(PROMPTS, params, 2, uniforms=uniforms, turns=LateTools(), max_rows=4)
    assert any(vacated), "the test needs rows waiting on tools where rows are taken in"
    assert parked.resumed >= 2 and parked.changed == []
    assert out.completion_ids == plain.completion_ids
    assert out.tool_masks == plain.tool_masks
    assert_logprobs_of_one_forward(model, [p for p in PROMPTS for _ in range(2)], out)
    refilled(out, 4)


def test_rows_ending_at_their_first_token_while_prompts_wait(model_draft) -> None:
    """One token per completion: every row taken in ends at once, and the next prompts are taken in at once too."""
    model, _ = model_draft
    params = SamplingParams(max_new_tokens=1, temperature=0)
    reference = RolloutEngine(model, [EOS]).generate(PROMPTS, params, 2)
    out = RolloutEngine(model, [EOS]).generate(PROMPTS, params, 2, max_rows=3)
    assert out.completion_ids == reference.completion_ids and out.stats.target_forwards == 0
    assert out.stats.refills == 3  # 3 completions at the start, then 3 at each intake (all end at once): 12 in all


def test_a_call_needs_a_row(model_draft) -> None:
    model, _ = model_draft
    with pytest.raises(ValueError, match="max_rows must be at least 1, got 0"):
        RolloutEngine(model, [EOS]).generate(PROMPTS, SamplingParams(max_new_tokens=4), 4, max_rows=0)


def test_a_prompts_completions_split_across_intakes_prefill_it_each_time(model_draft, monkeypatch) -> None:
    """Three rows at once of two completions per prompt: an intake may take one completion of a prompt and the next
    intake the other, each prefilling the prompt (its forward over the prompt's tokens); each intake takes as many
    rows as are free, in order."""
    from fastgrpo.rollout import engine as engine_module

    model, _ = model_draft
    params = SamplingParams(max_new_tokens=16, temperature=0)
    reference = RolloutEngine(model, [EOS]).generate(PROMPTS, params, 2)
    intakes = []
    prefill = engine_module.prefill

    def counted(engine, prompt_ids, row_prompt, seqs, call, live=None, waiting=None):
        intakes.append((len(prompt_ids), [s.index for s in seqs]))
        return prefill(engine, prompt_ids, row_prompt, seqs, call, live, waiting)

    monkeypatch.setattr(engine_module, "prefill", counted)
    out = RolloutEngine(model, [EOS]).generate(PROMPTS, params, 2, max_rows=3)
    assert out.completion_ids == reference.completion_ids
    assert intakes[0] == (2, [0, 1, 2])  # prompt 1's first completion begins; its second waits
    assert [index for _, taken in intakes for index in taken] == list(range(12))
    assert all(1 <= len(taken) <= 3 for _, taken in intakes)
    assert sum(prompts for prompts, _ in intakes) > len(PROMPTS), "prompts split across intakes are prefilled twice"


def test_a_run_with_max_inflight_tasks_trains_what_one_without_trains(tmp_path) -> None:
    """`max_inflight_tasks` 4 of 8 completions per generation: the same rewards, losses and weights (float64)."""
    from conftest import save_tiny_llama
    from test_trainer import make_config, make_trainer

    model_dir = save_tiny_llama(tmp_path / "model", seed=0, tie_word_embeddings=True)

    def run(name: str, rows: int) -> tuple[list[dict], list[torch.Tensor]]:
        trainer = make_trainer(make_config(model_dir, tmp_path / name, dtype="float64", max_inflight_tasks=rows))
        history = trainer.train()
        return history, [p.detach().clone() for p in trainer.model.parameters()]

    (whole, weights), (refilled, weights_refilled) = run("whole", -1), run("refilled", 4)
    for key in ("reward", "loss", "completions/mean_length"):
        assert [m[key] for m in whole] == [m[key] for m in refilled], key
    assert all(torch.equal(a, b) for a, b in zip(weights, weights_refilled, strict=True))
    assert max(m["spec/concurrency_mean"] for m in refilled) <= 4 < max(m["spec/concurrency_mean"] for m in whole)
