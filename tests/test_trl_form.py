"""TRL's constructor on fastgrpo's trainer: ``from fastgrpo import GRPOConfig, GRPOTrainer`` and TRL 1.16's
``GRPOTrainer(model=..., reward_funcs=..., args=..., train_dataset=datasets.Dataset)`` trains what fastgrpo's own form
trains, with TRL's ``trainer.state.log_history`` and ``trainer.save_model()``; what TRL takes that fastgrpo does
otherwise is refused by name before anything loads."""

from __future__ import annotations

import json
import re
from pathlib import Path

import datasets
import pytest
import torch
from conftest import save_tiny_llama
from peft import LoraConfig
from transformers import AutoModelForCausalLM

from fastgrpo import GRPOConfig, GRPOTrainer
from fastgrpo.data import DataConfig, make_arithmetic
from fastgrpo.grpo.trl_form import from_trl


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"), seed=0, tie_word_embeddings=True)


def trl_args(out: Path, **overrides) -> GRPOConfig:
    values = dict(
        num_generations=4,
        per_device_train_batch_size=4,
        max_completion_length=8,
        learning_rate=1e-3,
        max_steps=1,
        output_dir=str(out),
        progress_bar=False,
        log_completions=False,
        logging_steps=1,
    )
    return GRPOConfig(**{**values, **overrides})


ROWS = make_arithmetic(DataConfig(num_examples=8))


def length_reward(completion_ids: list[list[int]], **kwargs) -> list[float]:
    """A reward that varies across random completions (so advantages are non-zero), read from their token ids: the
    same whether completions come as text or as messages."""
    return [float(len(ids) % 7) for ids in completion_ids]


def test_trls_form_trains_what_fastgrpos_form_trains(tiny_model_dir: Path, tmp_path: Path) -> None:
    """One step of TRL's keyword form on a `datasets.Dataset`, TRL's positional form on rows, and fastgrpo's form:
    the same rewards, loss and gradient norm; the arguments given are left as they were; then TRL's
    ``trainer.state`` and ``save_model``."""
    args = trl_args(tmp_path / "trl")
    trl = GRPOTrainer(
        model=str(tiny_model_dir), reward_funcs=length_reward, args=args, train_dataset=datasets.Dataset.from_list(ROWS)
    )
    assert args.model != str(tiny_model_dir) and args.reward_funcs == ["accuracy"], "TRL's args are not changed"
    positional = GRPOTrainer(str(tiny_model_dir), [length_reward], trl_args(tmp_path / "positional"), ROWS)
    config = trl_args(tmp_path / "own", model=str(tiny_model_dir), reward_funcs=[length_reward])
    own = GRPOTrainer(config, dataset=ROWS)
    logs = [trainer.train()[-1] for trainer in (trl, positional, own)]
    for key in ("reward", "loss", "grad_norm", "completions/mean_length"):
        assert logs[0][key] == logs[1][key] == logs[2][key], key
    assert trl.dataset == ROWS
    state = trl.state  # TRL's trainer.state after train(): one entry per logged optimizer step, then the summary
    assert state.global_step == 1 and [e["step"] for e in state.log_history] == [1, 1]
    assert state.log_history[0]["reward"] == logs[0]["reward"] and state.log_history[0]["epoch"] == 1 / 8
    summary = state.log_history[-1]
    assert summary["train_loss"] == logs[0]["loss"] and summary["train_steps_per_second"] > 0
    trl.save_model(tmp_path / "final")  # TRL's save_model: the policy and tokenizer in transformers' format
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    for (name, mine), theirs in zip(trl.model.state_dict().items(), saved.state_dict().values(), strict=True):
        assert torch.equal(mine, theirs), name
    assert (tmp_path / "final" / "tokenizer_config.json").is_file()


def test_every_key_trl_logs_is_logged_with_trls_values(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Two steps of TRL 1.16's own trainer and of fastgrpo's on the same tiny model, rows and options, sampling the
    top token (``top_k: 1``): fastgrpo's ``log_history`` holds every key of TRL's, each entry with TRL's values but
    for the times (and the entropy, to float32's rounding: TRL computes it in float32)."""
    trl = pytest.importorskip("trl")
    from fastgrpo.models import load_tokenizer

    def reward(completions: list, **kwargs) -> list[float]:
        return [float(len(c[0]["content"]) % 7) for c in completions]

    common = dict(per_device_train_batch_size=4, num_generations=4, max_completion_length=8, learning_rate=1e-3)
    common |= dict(max_steps=2, logging_steps=1, seed=0, top_k=1, report_to="none", use_cpu=True, disable_tqdm=True)
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}]} for i in range(8)]
    theirs = trl.GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        reward_funcs=reward,
        args=trl.GRPOConfig(output_dir=str(tmp_path / "trl"), bf16=False, save_strategy="no", **common),
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=load_tokenizer(str(tiny_model_dir)),
    )
    theirs.train()
    ours = GRPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=reward,
        args=GRPOConfig(output_dir=str(tmp_path / "own"), log_completions=False, **common),
        train_dataset=datasets.Dataset.from_list(rows),
    )
    ours.train()
    expected, logged = theirs.state.log_history, ours.state.log_history
    assert len(expected) == len(logged) == 3
    times = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}
    for entry, mine in zip(expected, logged, strict=True):
        assert not set(entry) - set(mine), set(entry) - set(mine)
        for key in set(entry) - times:
            assert mine[key] == pytest.approx(entry[key], rel=1e-6 if key == "entropy" else 1e-12, abs=1e-12), key


def test_trls_callbacks_see_the_loops_events_and_can_stop_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    """transformers' ``TrainerCallback`` events through its own ``CallbackHandler``: init end, train begin, each
    step's begin and end and log, a save where ``save_steps`` falls, train end, with transformers' ``TrainerState``;
    a callback that sets ``should_training_stop`` ends the run after that step, with a checkpoint of it; ``add``,
    ``pop`` and ``remove_callback`` as on TRL's trainer. ``trainer.state`` is a ``TrainerState``."""
    from transformers import TrainerCallback, TrainerState

    class Recorder(TrainerCallback):
        def __init__(self) -> None:
            self.events: list[tuple[str, int]] = []

        def __getattribute__(self, name: str):
            if name.startswith("on_"):
                return lambda args, state, control, **kw: self.events.append((name, state.global_step))
            return super().__getattribute__(name)

    class StopAtTwo(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            assert isinstance(state, TrainerState) and args.max_steps == 4 and kwargs["model"] is not None
            control.should_training_stop = state.global_step == 2
            return control

    recorder = Recorder()
    args = trl_args(tmp_path / "run", max_steps=4, save_steps=3, learning_rate=1e-4)
    trainer = GRPOTrainer(
        model=str(tiny_model_dir), reward_funcs=length_reward, args=args, train_dataset=ROWS, callbacks=[recorder]
    )
    trainer.add_callback(StopAtTwo)
    assert isinstance(trainer.pop_callback(StopAtTwo), StopAtTwo)
    trainer.add_callback(StopAtTwo())
    history = trainer.train()
    assert [m["step"] for m in history] == [1, 2], "stopped after step 2"
    assert (tmp_path / "run" / "checkpoint-2").is_dir(), "with a checkpoint of the last step"
    step = [("on_step_begin", 0), ("on_step_end", 1), ("on_log", 1), ("on_step_begin", 1), ("on_step_end", 2)]
    assert recorder.events == [
        ("on_init_end", 0),
        ("on_train_begin", 0),
        *step,
        ("on_log", 2),
        ("on_save", 2),
        ("on_train_end", 2),
    ]
    state = trainer.state
    assert isinstance(state, TrainerState) and state.global_step == 2 and state.log_history[-1]["step"] == 2
    trainer.remove_callback(recorder)
    assert recorder not in trainer.events.handler.callbacks


def test_trls_reward_functions_get_message_lists_from_conversational_rows(tiny_model_dir: Path, tmp_path: Path) -> None:
    """TRL's own `trl.rewards` functions train on a conversational dataset: its rows' prompts are messages and each
    completion comes as ``[{"role": "assistant", "content": text}]``; rows whose prompt is a string give text."""
    from trl.rewards import accuracy_reward, think_format_reward

    seen: list[tuple] = []

    def recording(prompts, completions, **kwargs) -> list[float]:
        seen.append((prompts[0], completions[0]))
        return [0.0] * len(completions)

    rows = [{**row, "solution": row["answer"]} for row in ROWS]
    funcs = [think_format_reward, accuracy_reward, recording]
    trainer = GRPOTrainer(str(tiny_model_dir), funcs, trl_args(tmp_path / "chat"), datasets.Dataset.from_list(rows))
    log = trainer.train()[-1]
    assert "rewards/think_format_reward/mean" in log and "rewards/accuracy_reward/mean" in log
    prompt, completion = seen[-1]
    assert isinstance(prompt, list) and prompt[-1]["role"] == "user"
    assert len(completion) == 1 and completion[0]["role"] == "assistant" and isinstance(completion[0]["content"], str)
    seen.clear()
    text_rows = [{"prompt": row["prompt"][-1]["content"], "answer": row["answer"]} for row in ROWS]
    GRPOTrainer(str(tiny_model_dir), [recording], trl_args(tmp_path / "text"), text_rows).train()
    assert isinstance(seen[-1][0], str) and isinstance(seen[-1][1], str)
    # the same from a file named in the config: messages in the file, message completions; text, text
    for name, chat in (("chat", True), ("text", False)):
        path = tmp_path / f"{name}.jsonl"
        lines = [{"prompt": r["prompt"] if chat else r["prompt"][-1]["content"], "answer": r["answer"]} for r in ROWS]
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        seen.clear()
        data = DataConfig(name=str(path), instruction="")
        config = trl_args(tmp_path / f"file-{name}", model=str(tiny_model_dir), reward_funcs=[recording], dataset=data)
        GRPOTrainer(config).train()
        assert isinstance(seen[-1][1], list) is chat and isinstance(seen[-1][0], list)


def test_a_loaded_model_and_tokenizer_and_a_lora_config(tiny_model_dir: Path, tmp_path: Path) -> None:
    from fastgrpo.models import load_model, load_tokenizer

    model = load_model(str(tiny_model_dir), "float32", torch.device("cpu"))
    tokenizer = load_tokenizer(str(tiny_model_dir))
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    given = from_trl(model, "accuracy", trl_args(tmp_path), ROWS, processing_class=tokenizer, peft_config=lora)
    assert given.model is model and given.tokenizer is tokenizer and given.config.model == str(tiny_model_dir)
    config = given.config
    assert (config.use_peft, config.lora_r, config.lora_alpha, config.lora_dropout) == (True, 4, 8, 0.0)
    assert config.lora_target_modules == ["q_proj", "v_proj"]
    all_linear = LoraConfig(target_modules="all-linear")
    assert from_trl("m", "accuracy", peft_config=all_linear).config.lora_target_modules is None


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (dict(args=object()), TypeError, "args: got a builtins.object; give fastgrpo's GRPOConfig"),
        (dict(callbacks=[object()]), TypeError, "callbacks[0]: a transformers TrainerCallback (or its class)"),
        (dict(optimizers=(object(), None)), ValueError, "optimizers: not taken"),
        (dict(reward_processing_classes=[object()]), ValueError, "a reward model is scored with the tokenizer"),
        (dict(generation_config=1), TypeError, "unexpected keyword argument 'generation_config'"),
        (dict(train_dataset=[{"prompt": "x"}, {"question": "y"}]), ValueError, "train_dataset row 1: no 'prompt'"),
        (dict(train_dataset=[{"prompt": ""}]), ValueError, "train_dataset row 0: prompt is an empty string"),
        (dict(train_dataset="rows.jsonl"), TypeError, "train_dataset: a datasets.Dataset or a list of rows"),
        (dict(peft_config=LoraConfig(use_dora=True)), ValueError, "peft_config.use_dora=True: fastgrpo's LoRA"),
        (dict(peft_config=LoraConfig(r=8)), ValueError, "peft_config.target_modules is None"),
        (dict(peft_config=LoraConfig(target_modules="all-linear", rank_pattern={"q": 2})), ValueError, "rank_pattern"),
    ],
)
def test_what_fastgrpo_does_otherwise_is_refused_by_name(call: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        from_trl(**{"model": "smollm2", "reward_funcs": "accuracy", **call})


def test_a_model_built_in_memory_needs_its_tokenizer() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    size = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, **size))
    assert not model.name_or_path
    with pytest.raises(ValueError, match="no directory to read a tokenizer from: give processing_class"):
        from_trl(model, "accuracy")


def test_fastgrpos_form_refuses_trls_keywords(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="takes no reward_funcs: TRL's arguments go with TRL's form"):
        GRPOTrainer(trl_args(tmp_path), reward_funcs=length_reward)
    with pytest.raises(TypeError, match="multiple values for argument 'reward_funcs'"):
        GRPOTrainer("smollm2", length_reward, reward_funcs=length_reward)
    with pytest.raises(TypeError, match="give eval_dataset and the arguments after it by keyword"):
        GRPOTrainer("smollm2", length_reward, trl_args(tmp_path), ROWS, ROWS)  # TRL's fifth: eval_dataset


@pytest.mark.parametrize("given", ["path", "bfloat16 model in memory", "bfloat16 model in memory, float32 masters"])
def test_train_resume_from_checkpoint_goes_on_as_the_uninterrupted_run(
    tiny_model_dir: Path, tmp_path: Path, given: str
) -> None:
    """TRL's ``trainer.train(resume_from_checkpoint=True)``: a trainer built beside a run that stopped at a checkpoint
    is not refused; ``train()`` alone is, naming ``resume_from_checkpoint``, as is a path that is not the newest
    checkpoint; resumed, the run's last two steps log what the uninterrupted run's did and end on its weights (a
    model given in memory takes the checkpoint's weights, where no float32 masters hold them, and the first build's
    gradient hooks are gone where they do), and the callbacks see one ``on_init_end``. A run with no step left is
    refused before anything of the trainer is undone."""
    from transformers import TrainerCallback

    class StopAtTwo(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 2
            return control

    class Inits(TrainerCallback):
        count = 0

        def on_init_end(self, args, state, control, **kwargs):
            Inits.count += 1

    def token_reward(completion_ids: list[list[int]], **kwargs) -> list[float]:
        return [float(sum(ids) % 5) for ids in completion_ids]  # varies where every completion is as long

    def trainer(out: Path, callbacks: list) -> GRPOTrainer:
        model = (
            str(tiny_model_dir)
            if given == "path"
            else AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
        )
        masters = given != "bfloat16 model in memory"
        args = trl_args(out, max_steps=4, save_steps=2, temperature=1.0, master_weights=masters)
        return GRPOTrainer(model=model, reward_funcs=token_reward, args=args, train_dataset=ROWS, callbacks=callbacks)

    whole = trainer(tmp_path / "whole", [])
    expected = whole.train()
    trainer(tmp_path / "cut", [StopAtTwo()]).train()
    resumed = trainer(tmp_path / "cut", [Inits()])  # the directory holds a run: TRL's constructor does not refuse
    with pytest.raises(ValueError, match=r"holds a run that saved checkpoints: .*train\(resume_from_checkpoint=True\)"):
        resumed.train()
    with pytest.raises(ValueError, match="not True nor the newest checkpoint"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-1"))
    history = resumed.train(resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-2"))
    assert [m["step"] for m in history] == [3, 4] and Inits.count == 1
    for ours, theirs in zip(history, expected[2:], strict=True):
        assert ours["reward"] == theirs["reward"] and ours["loss"] == pytest.approx(theirs["loss"], rel=1e-6)
    first = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    for (name, mine), theirs in zip(resumed.model.state_dict().items(), whole.model.state_dict().values(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7, msg=name)
        assert name.endswith("norm.weight") or not torch.equal(mine.float(), first[name]), f"{name} trained"
    assert resumed.state.global_step == 4
    with pytest.raises(ValueError, match=r"has trained its max_steps \(4\): raise max_steps"):
        resumed.train(resume_from_checkpoint=True)
    resumed.save_model(tmp_path / "final")  # the trainer is whole


def test_a_trl_script_config_runs_as_trls_script_reads_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A YAML written for TRL's ``trl grpo`` script (``ModelConfig``'s and ``ScriptArguments``' keys beside
    ``GRPOConfig``'s, its reward names and a dotted path) is read as that script reads it, and trains; its keys that
    would change the run are refused by name."""
    import yaml

    from fastgrpo.config import load_config
    from fastgrpo.config.trl_script import finish_script_options, read_script_options

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": r["prompt"], "answer": r["answer"]}) + "\n" for r in ROWS))
    script = {
        "model_name_or_path": str(tiny_model_dir),
        "model_revision": "main",
        "dtype": "float32",
        "attn_implementation": None,
        "lora_task_type": "CAUSAL_LM",
        "load_in_4bit": False,
        "dataset_name": str(rows),
        "dataset_train_split": "train",
        "dataset_test_split": "test",
        "dataset_streaming": False,
        "reward_funcs": ["think_format_reward", "get_soft_overlong_punishment", "bad_input_matrix.length_reward"],
        "output_dir": str(tmp_path / "run"),
        "num_generations": 4,
        "per_device_train_batch_size": 4,
        "max_completion_length": 8,
        "max_steps": 1,
        "logging_steps": 1,
        "report_to": "none",
        "use_cpu": True,
        "disable_tqdm": True,
    }
    path = tmp_path / "script.yaml"
    path.write_text(yaml.safe_dump(script))
    config = load_config(path, [])
    assert config.model == str(tiny_model_dir) and config.dataset.name == str(rows) and config.dataset.split == "train"
    log = GRPOTrainer(config).train()[-1]
    for name in ("think_format_reward", "soft_overlong_punishment_reward", "length_reward"):
        assert f"rewards/{name}/mean" in log, name
    with_eval = load_config(path, ["--eval_strategy", "steps", "--dataset_name", "org/data", "--dataset_config", "c"])
    assert (with_eval.dataset.name, with_eval.dataset.config, with_eval.eval_dataset.split) == ("org/data", "c", "test")
    scored = finish_script_options(
        read_script_options({"reward_model_name_or_path": "org/scorer", "reward_funcs": ["think_format_reward"]})
    )
    assert scored == {"reward_funcs": ["org/scorer", "think_format_reward"]}, "the reward model first, as TRL's script"
    assert load_config(path, ["--model", "smollm2"]).model == "smollm2", "the command line overrides the file"
    flags = ["--use_rslora", "0", "--use_dora", "no", "--dataset_config", "1.0", "--dataset_name", "org/data"]
    assert load_config(path, flags).dataset.config == "1.0", "read as TRL's parser reads them"
    own = load_config(path, ["--eval_strategy", "steps", "--eval_dataset.name", "arithmetic"]).eval_dataset
    assert own.name == "arithmetic" and own.split == "train", "an eval_dataset given is kept"
    for extra, message in (
        (["--load_in_4bit", "true"], "load_in_4bit: quantized loading is not supported"),
        (["--model", "smollm2", "--model_name_or_path", "x"], "model_name_or_path and model set one option"),
        (["--dataset_name", "null", "--dataset_config", "c"], "dataset_config: names a part of dataset_name's"),
        (["--dataset_streaming", "true"], "dataset_streaming: the dataset's rows are read whole"),
    ):
        with pytest.raises(ValueError, match=message):
            load_config(path, extra)
