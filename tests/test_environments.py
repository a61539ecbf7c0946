"""Environments (TRL's ``environment_factory``): refused before any model loads when they cannot be used, one
instance per completion whose methods are that completion's tools, ``reset`` text appended to the prompt,
``get_reward`` a reward source under the class's name; and a GRPO step end to end on a tiny model trained to call a
tool, whose tool results stay out of the loss and of the draft's targets."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import save_tool_caller, tool_call_conversation
from transformers import AutoTokenizer

from fastgrpo.config import GRPOConfig
from fastgrpo.grpo.prompts import StepPrompts
from fastgrpo.grpo.scoring import reward_inputs, reward_weights
from fastgrpo.grpo.tool_use import RunTools, resolve_run_tools
from fastgrpo.models import resolve_model_path
from fastgrpo.rollout.sequence import GenerationOutput
from fastgrpo.speculative.eagle.training import DraftTrainer, rollout_samples
from fastgrpo.tools.environments import Environments
from fastgrpo.tools.functions import calculator, resolve_tools

QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]


class Tally:
    """Adds numbers into a running total; rewarded by it."""

    made = 0

    def __init__(self) -> None:
        Tally.made += 1
        self.total = 0

    def reset(self, **row) -> None:
        self.total = 0

    def add(self, a: int, b: int) -> str:
        """Add two numbers to the tally.

        Args:
            a: the first number.
            b: the second number.
        """
        self.total += a + b
        return str(self.total)

    def get_reward(self) -> float:
        return float(self.total)

    def _hidden(self) -> None:
        """Private: not a tool."""


class Noisy(Tally):
    """Its reset tells each completion a different number."""

    def reset(self, **row) -> str:
        self.total = 0
        return f" Start from {random.randint(0, 10**6)}."


class Hinted(Tally):
    """Its reset gives every completion of a row the same hint."""

    def reset(self, **row) -> str:
        self.total = 0
        return f" Hint: {row['answer']}."


class NoReset:
    def add(self, a: int) -> str:
        """Add.

        Args:
            a: a number.
        """
        return str(a)


class Undocumented:
    def reset(self, **row) -> None:
        pass

    def add(self, a: int) -> str:
        return str(a)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model_path("smollm2"))


@pytest.mark.parametrize(
    ("spec", "tools", "message"),
    [
        (NoReset, [], "NoReset has no reset method"),
        (Undocumented, [], r"environment_factory \(Undocumented\): tool 'add' cannot be described"),
        ("nowhere_module:Env", [], "cannot import module 'nowhere_module' for environment_factory factory"),
        ({}, [], "environment_factory is an empty mapping"),
        ({"sum": Tally}, [calculator, Tally().add], r"environment_factory\['sum'\]: Tally's methods \['add'\]"),
        (lambda: 1 / 0, [], "making an environment raised ZeroDivisionError"),
    ],
)
def test_bad_environments_are_refused_naming_them(spec, tools, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Environments(spec, resolve_tools(tools))


def test_bad_environments_are_refused_before_the_model_loads(tmp_path, no_model_loads) -> None:
    from fastgrpo.grpo.trainer import GRPOTrainer

    rows = [{"prompt": QUESTION, "answer": "5", "environment": "tally"}, {"prompt": QUESTION, "answer": "5"}]
    config = GRPOConfig(
        model="smollm2", environment_factory={"tally": "test_environments:Tally"}, output_dir=str(tmp_path / "r")
    )
    with pytest.raises(ValueError, match="dataset row 1: environment None is not among the environments"):
        GRPOTrainer(config, dataset=rows)
    config = GRPOConfig(model="smollm2", reward_funcs=[], environment_factory="test_environments:NoReset")
    with pytest.raises(ValueError, match="NoReset has no reset method"):
        GRPOTrainer(config, dataset=rows)


def test_no_reward_source_is_refused() -> None:
    with pytest.raises(ValueError, match="reward_funcs must name at least one"):
        GRPOConfig(model="smollm2", reward_funcs=[]).validate()

    class Plain(Tally):
        get_reward = None  # not a function: no reward source

    config = GRPOConfig(model="smollm2", reward_funcs=[], environment_factory="x:y")
    config.environment_factory = Plain
    with pytest.raises(ValueError, match="no reward source"):
        resolve_run_tools(config, [], [{"prompt": QUESTION}])


def test_tools_refuse_plain_string_prompts_before_the_model_loads() -> None:
    config = GRPOConfig(model="smollm2", tools=["calculator"])
    with pytest.raises(ValueError, match="dataset row 1: its prompt is a plain string; tools need chat prompts"):
        resolve_run_tools(config, [], [{"prompt": QUESTION}, {"prompt": "What is 2 + 3?"}])


def prompts_for(tokenizer, tools: RunTools) -> StepPrompts:
    return StepPrompts([], tokenizer, 1, 0, 1, 0, 512, render=tools.render)


def test_each_completion_gets_its_own_environment_and_tools(tokenizer) -> None:
    config = GRPOConfig(model="smollm2", reward_funcs=["accuracy"], environment_factory=Hinted)
    funcs: list = []
    tools, environments = resolve_run_tools(config, funcs, [])
    assert [f.__name__ for f in funcs] == ["Hinted"] and [t.name for t in environments.tools[None]] == ["add"]
    run = RunTools(tools, environments, tokenizer, config)
    rows = [{"prompt": QUESTION, "answer": "5"}, {"prompt": QUESTION, "answer": "7"}]
    made = Tally.made
    ids, per_prompt, turns = run.start(rows, 3, prompts_for(tokenizer, run))
    assert per_prompt == 3 and len(ids) == 2, "each group's completions share their prompt: one prefill per group"
    assert " Hint: 7." in tokenizer.decode(ids[1]) and " Hint: 7." not in tokenizer.decode(ids[0])
    assert len(set(map(id, turns.environments))) == 6 and Tally.made - made == 5, "the probe's instance is reused"
    turns.row_tools[4]["add"].function(a=1, b=2)
    assert [e.total for e in turns.environments] == [0, 0, 0, 0, 3, 0]
    out = GenerationOutput([[1]] * 6, [[0.0]] * 6, ["stop"] * 6, None)
    prompts, _, given = reward_inputs(turns, [r for r in rows for _ in range(3)], out, tokenizer)
    assert prompts[3][-1]["content"].endswith(" Hint: 7.") and given["environments"] is turns.environments
    assert funcs[0](**given) == [0.0, 0.0, 0.0, 0.0, 3.0, 0.0]
    assert reward_weights(GRPOConfig(reward_weights=[2.0]), 2) == [2.0, 1.0]
    again = run.start(rows, 3, prompts_for(tokenizer, run))[2]
    assert again.environments == turns.environments and Tally.made - made == 5, "instances are reused across steps"
    run.close()


def test_completions_whose_resets_differ_get_their_own_prompts(tokenizer) -> None:
    config = GRPOConfig(model="smollm2", environment_factory=Noisy)
    run = RunTools(*resolve_run_tools(config, [], []), tokenizer, config)
    random.seed(0)
    ids, per_prompt, turns = run.start([{"prompt": QUESTION}], 4, prompts_for(tokenizer, run))
    assert per_prompt == 1 and len(ids) == 4 and len({tuple(i) for i in ids}) == 4
    assert all(p[-1]["content"].startswith("What is 2 + 3? Start from") for p in turns.prompts)
    run.close()


# -- end to end ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def caller_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = GRPOConfig(model="smollm2", environment_factory=Tally)
    return save_tool_caller(tmp_path_factory.mktemp("caller"), config, {"prompt": QUESTION})


def test_a_grpo_step_with_an_environment_calls_its_tools_and_masks_their_results(
    caller_dir: Path, tmp_path, capsys
) -> None:
    from test_trainer import make_config

    from fastgrpo.grpo.trainer import GRPOTrainer

    config = make_config(
        caller_dir,
        tmp_path / "run",
        reward_funcs=[],
        environment_factory=Tally,  # a class, as Python gives it: config.yaml names it
        max_completion_length=64,
        max_prompt_length=512,
        max_steps=1,
        save_steps=1,
        log_completions=True,
        log_completions_steps=1,
    )
    rows = [{"prompt": QUESTION, "answer": "5"}] * 2
    trainer = GRPOTrainer(config, dataset=rows)
    prompt_ids, out, turns = trainer.rollout(0, trainer.prompts.rows(0))
    _, completion, mask = tool_call_conversation(config, rows[0])
    assert out.completion_ids == [completion] * 8 and out.tool_masks == [mask] * 8
    assert all(e.total == 5 for e in turns.environments)
    assert [m["role"] for m in turns.rows[0].messages] == ["assistant", "tool", "assistant"]
    assert all(lp == 0.0 for lp, m in zip(out.logprobs[0], mask, strict=True) if not m)
    (metrics,) = trainer.train()
    assert metrics["tools/call_frequency"] == 1.0 and metrics["tools/failure_frequency"] == 0.0
    assert metrics["rewards/Tally/mean"] == 5.0
    assert metrics["completions/mean_length"] == sum(mask)
    trainer.close()
    printed = capsys.readouterr()
    assert "[add returned] 5" in printed.out + printed.err and "The answer is 5." in printed.out + printed.err
    assert "environment_factory: test_environments:Tally" in (tmp_path / "run" / "config.yaml").read_text()


def test_a_tools_results_are_not_the_drafts_targets() -> None:
    """Pair ``j`` of a draft sample learns token ``j + 2``: never a token a tool returned."""
    prompt, completion, mask = [1, 2, 3], [4, 5, 6, 7, 8, 9], [1, 1, 0, 0, 1, 1]
    hidden = [torch.zeros(len(prompt) + len(completion) - 1, 4)]
    out = GenerationOutput([completion], [[0.0] * 6], ["stop"], None, hidden_states=hidden, tool_masks=[mask])
    plain = GenerationOutput([completion], [[0.0] * 6], ["stop"], None, hidden_states=hidden)
    stand_in = SimpleNamespace(draft=torch.nn.Linear(1, 1))
    (_, _, _, train), (_, _, _, everything) = (
        DraftTrainer._batch(stand_in, rollout_samples([prompt], o, 1)) for o in (out, plain)
    )
    assert everything[0].tolist() == [False, True, True, True, True, True, True, False]
    assert train[0].tolist() == [False, True, True, False, False, True, True, False]


def test_a_drafter_that_cannot_park_rows_is_refused_with_tools(tmp_path, monkeypatch, no_model_loads) -> None:
    from fastgrpo.config import SpeculationConfig
    from fastgrpo.grpo.trainer import GRPOTrainer
    from fastgrpo.speculative import registry
    from fastgrpo.speculative.plugin import DrafterPlugin

    class Forgetful(DrafterPlugin):
        name = "forgetful"

    monkeypatch.setitem(registry.PLUGINS, "forgetful", Forgetful())
    config = GRPOConfig(
        model="smollm2",
        tools=["calculator"],
        speculation=SpeculationConfig(drafter="suffix+forgetful"),
        output_dir=str(tmp_path / "run"),
    )
    with pytest.raises(ValueError, match="speculation.drafter: forgetful cannot draft for rows that wait on tools"):
        GRPOTrainer(config, dataset=[{"prompt": QUESTION, "answer": "5"}])
    config.speculation.drafter = "eagle+suffix"
    registry.check_tools(config.speculation, tools=True)


def test_a_run_with_an_environment_resumes_as_it_would_have_gone_on(caller_dir: Path, tmp_path) -> None:
    """Checkpoints hold nothing of the environments (each rollout resets its own): a resumed run's next step is the
    uninterrupted run's."""
    from test_trainer import make_config

    from fastgrpo.grpo.trainer import GRPOTrainer

    rows = [{"prompt": QUESTION, "answer": "5"}] * 2

    def run(out: Path, steps: int, resume: bool = False) -> list[dict[str, float]]:
        options = dict(reward_funcs=[], environment_factory="test_environments:Tally", max_completion_length=64)
        config = make_config(caller_dir, out, max_steps=steps, save_steps=1, max_prompt_length=512, **options)
        return GRPOTrainer(config, dataset=rows, resume=resume).train()

    full = run(tmp_path / "full", 2)
    run(tmp_path / "cut", 1)
    (again,) = run(tmp_path / "cut", 2, resume=True)
    for key in ("step", "reward", "tools/call_frequency", "completions/mean_length"):
        assert again[key] == full[1][key], key
    assert again["loss"] == pytest.approx(full[1]["loss"], rel=1e-6, abs=1e-9)
