"""Reward models as TRL reads them: a ``reward_funcs`` entry naming a sequence-classification model scores each
prompt with its completion (TRL's text: the conversation through the reward tokenizer's chat template), the first
logit of the last token that is not padding, whatever the batch; a GRPO run trains on its rewards, logged under the
model directory's name; a path that is not a model is refused before anything loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import save_tiny_llama, save_tiny_scorer
from test_trainer import make_config
from transformers import LlamaForSequenceClassification
from trl.data_utils import apply_chat_template

from fastgrpo.config import SpeculationConfig, load_config
from fastgrpo.data import DataConfig
from fastgrpo.grpo.trainer import GRPOTrainer
from fastgrpo.reward_model import RewardModel
from fastgrpo.rewards import resolve_reward_funcs

PROMPTS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
    [{"role": "user", "content": "Count to three."}],
]
COMPLETIONS = ["4", "Blue, or perhaps a longer answer than the others.", "1, 2, 3"]


@pytest.fixture(scope="module")
def scorer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_scorer(tmp_path_factory.mktemp("rm") / "tiny-scorer")


def test_a_reward_model_scores_what_trl_scores_in_any_batch(scorer_dir: Path) -> None:
    (scorer,) = resolve_reward_funcs([str(scorer_dir)])
    assert isinstance(scorer, RewardModel) and scorer.__name__ == "tiny-scorer" and scorer.model is None
    scorer.load(torch.device("cpu"), torch.float32)
    trl_texts = [
        apply_chat_template({"messages": p + [{"role": "assistant", "content": c}]}, scorer.tokenizer)["text"]
        for p, c in zip(PROMPTS, COMPLETIONS, strict=True)
    ]
    assert scorer.texts(PROMPTS, COMPLETIONS) == trl_texts
    each = []
    for text in trl_texts:  # one at a time: no padding
        ids = scorer.tokenizer(text, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            each.append(float(scorer.model(**ids).logits[0, 0]))
    scorer.batch_size = 2  # a batch padded on the right, and one alone
    torch.testing.assert_close(scorer(PROMPTS, COMPLETIONS), each, rtol=1e-5, atol=1e-5)
    assert len(set(each)) == 3
    plain = RewardModel(scorer.model, scorer.tokenizer)  # a loaded model, as TRL takes one
    assert plain(["2 + 2 = "], ["4"]) == scorer(["2 + 2 = "], ["4"])


def test_a_reward_models_template_renders_with_the_runs_chat_template_kwargs(scorer_dir: Path) -> None:
    """TRL renders a reward model's conversations with the run's ``chat_template_kwargs`` (``enable_thinking: false``
    on a Qwen3 template): so does fastgrpo, as its scores show."""
    from fastgrpo.reward_model import load_reward_models

    (scorer,) = resolve_reward_funcs([str(scorer_dir)])
    kwargs = {"enable_thinking": False}
    load_reward_models([scorer], torch.device("cpu"), "float32", kwargs)
    template = scorer.tokenizer.chat_template
    scorer.tokenizer.chat_template = (
        "{% if enable_thinking is defined and not enable_thinking %}/no_think {% endif %}" + template
    )
    turns = zip(PROMPTS, COMPLETIONS, strict=True)
    conversations = [{"messages": p + [{"role": "assistant", "content": c}]} for p, c in turns]
    trl_texts = [apply_chat_template(x, scorer.tokenizer, **kwargs)["text"] for x in conversations]
    assert all(text.startswith("/no_think ") for text in trl_texts)
    assert scorer.texts(PROMPTS, COMPLETIONS) == trl_texts
    thinking = RewardModel(scorer.model, scorer.tokenizer)  # without the run's kwargs the template renders otherwise
    assert thinking(PROMPTS, COMPLETIONS) != scorer(PROMPTS, COMPLETIONS)
    own = RewardModel(scorer.model, scorer.tokenizer, chat_template_kwargs={"enable_thinking": True})
    load_reward_models([own], torch.device("cpu"), "float32", kwargs)
    assert own.chat_template_kwargs == {"enable_thinking": True}, "a reward model's own kwargs win over the run's"


def test_a_grpo_run_trains_on_a_reward_model(scorer_dir: Path, tmp_path: Path) -> None:
    model_dir = save_tiny_llama(tmp_path / "policy", seed=0, tie_word_embeddings=True)
    config = make_config(
        model_dir,
        tmp_path / "run",
        reward_funcs=[str(scorer_dir)],
        dataset=DataConfig(num_examples=8),
        max_steps=1,
        save_steps=1,
        gradient_accumulation_steps=1,
        speculation=SpeculationConfig(mode="off"),
    )
    history = GRPOTrainer(config).train()
    assert history[0]["rewards/tiny-scorer/std"] > 0 and "rewards/tiny-scorer/mean" in history[0]
    logged = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert logged["reward"] == pytest.approx(history[0]["rewards/tiny-scorer/mean"])


def test_a_path_that_is_not_a_model_is_refused_before_loading(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="reward_funcs: ./no/such/scorer does not exist"):
        load_config(None, ["--reward_funcs", "[./no/such/scorer]"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"reward_funcs: .*empty is not a Hugging Face model directory"):
        load_config(None, ["--reward_funcs", f"[{tmp_path / 'empty'}]"])


def test_the_memory_plan_counts_a_reward_model_at_the_runs_dtype(scorer_dir: Path) -> None:
    """A reward model is a model of its own on the policy's device: the plan holds its weights (their count read
    from the directory's safetensors headers) at the run's dtype, at every moment."""
    from fastgrpo.config import GRPOConfig
    from fastgrpo.memory_plan.plan import estimate_memory

    scorer = LlamaForSequenceClassification.from_pretrained(scorer_dir)
    params = sum(p.numel() for p in scorer.parameters())
    assert RewardModel(scorer_dir).parameter_count() == params == RewardModel(scorer, object()).parameter_count()
    for dtype, width in (("float32", 4), ("bfloat16", 2)):
        plan = estimate_memory(GRPOConfig(reward_funcs=["accuracy", str(scorer_dir)], dtype=dtype), scorer.config)
        (item,) = [i for i in plan.items if i.name.startswith("reward model")]
        assert item.name == f"reward model tiny-scorer ({dtype})" and item.bytes == (params * width,) * 4
    plain = estimate_memory(GRPOConfig(reward_funcs=["accuracy"]), scorer.config)
    assert not [i for i in plain.items if i.name.startswith("reward model")]
