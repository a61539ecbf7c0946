"""Bad inputs and faults, as a user meets them on the command line: each mistake ends in the right behaviour or in a
one-paragraph message (no traceback) that names the option, file, row or function; a run killed at any moment
resumes to the same weights and leaves nothing behind."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import interrupted_run
import pytest
import torch
import yaml
from conftest import save_tiny_llama, tiny_model
from safetensors.torch import load_file
from transformers import T5Config

from fastgrpo.cli import main
from fastgrpo.grpo import trainer as trainer_module
from fastgrpo.grpo.checkpoint import LAYOUT, STATE_FILE
from fastgrpo.grpo.policy_update import PolicyUpdate
from fastgrpo.models import load_tokenizer
from fastgrpo.rollout.engine import RolloutEngine

TESTS = Path(__file__).parent


# The runs below name their reward functions as bad_input_matrix:NAME (the tests folder is importable, as pytest
# runs it).


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"), seed=0, tie_word_embeddings=True)


def write_config(path: Path, model_dir: Path, **overrides) -> Path:
    """A YAML config of a tiny run: 1 prompt x 4 completions of 8 tokens a step."""
    values = {
        "model": str(model_dir),
        "dataset": {"num_examples": 16},
        "reward_funcs": ["bad_input_matrix:length_reward"],
        "num_generations": 4,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 1,
        "max_completion_length": 8,
        "learning_rate": 1e-3,
        "max_steps": 1,
        "save_steps": 1,
        "output_dir": str(path.parent / f"{path.stem}-run"),
        "progress_bar": False,
        "log_completions": False,
        "logging_steps": 1,
        "gradient_checkpointing": False,
        "speculation": {"mode": "off"},
    }
    values.update(overrides)
    path.write_text(yaml.safe_dump(values))
    return path


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """Exit code and standard error of ``fastgrpo ARGV`` (0 when it returns)."""
    try:
        main(list(argv))
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    return code, capsys.readouterr().err


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """The one-line message of a command that must stop with exit code 2 and no traceback."""
    code, err = run_cli(capsys, *argv)
    assert code == 2, err
    assert "Traceback" not in err
    return err


# -- refused with a message ----------------------------------------------------------------------------------------

CONFIG_ERRORS = [
    ({"temperature": ".inf"}, "temperature must be a finite number"),
    ({"draft_training": {"learning_rate": ".inf"}}, "draft_training.learning_rate must be a finite number"),
    ({"stop": [""]}, "stop strings must not be empty"),
    ({"model": "/nonexistent/model"}, "model: /nonexistent/model does not exist"),
    ({"speculation": {"mode": "adaptive", "draft": "."}}, "speculation.draft: . is neither a directory saved by"),
]


@pytest.mark.parametrize(("overrides", "message"), CONFIG_ERRORS)
def test_bad_options_are_refused_before_a_model_loads(
    capsys, monkeypatch, model_dir: Path, tmp_path: Path, overrides: dict, message: str
) -> None:
    monkeypatch.setattr(trainer_module, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    config = write_config(tmp_path / "c.yaml", model_dir)
    text = yaml.safe_load(config.read_text()) | overrides
    config.write_text(yaml.safe_dump(text).replace("'.inf'", ".inf"))
    assert message in refused(capsys, "train", "--config", str(config))


def test_output_dir_that_is_a_file(capsys, model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    config = write_config(tmp_path / "c.yaml", model_dir, output_dir=str(tmp_path / "file"))
    assert "is a file, not a directory" in refused(capsys, "train", "--config", str(config))


def test_report_to_tensorboard_without_tensorboard(capsys, monkeypatch, model_dir: Path, tmp_path: Path) -> None:
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else find_spec(name)
    )
    config = write_config(tmp_path / "c.yaml", model_dir, report_to=["jsonl", "tensorboard"])
    assert "pip install tensorboard" in refused(capsys, "train", "--config", str(config))


def test_a_yaml_syntax_error_names_the_file_and_line(capsys, tmp_path: Path) -> None:
    config = tmp_path / "broken.yaml"
    config.write_text("learning_rate: 1e-5\ndataset:\n  name: [gsm8k\n")
    err = refused(capsys, "train", "--config", str(config))
    assert f"{config}, line " in err and "not valid YAML" in err


def test_off_is_the_string_off_for_string_options(model_dir: Path, tmp_path: Path) -> None:
    """YAML 1.1 reads off, on, yes and no as booleans; a string option keeps the word, a boolean one reads it."""
    from fastgrpo.config import load_config

    config = tmp_path / "c.yaml"
    config.write_text("speculation:\n  mode: off\nbf16: no\n")
    loaded = load_config(config, ["--log_completions", "off"])
    assert loaded.speculation.mode == "off" and loaded.bf16 is False and loaded.log_completions is False
    assert load_config(None, ["--speculation.mode", "off"]).speculation.mode == "off"


def test_a_chat_role_outside_the_known_ones(capsys, model_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": [{"role": "wizard", "content": "2 + 2?"}], "answer": "4"}) + "\n")
    config = write_config(tmp_path / "c.yaml", model_dir, dataset={"name": str(data)})
    err = refused(capsys, "train", "--config", str(config))
    assert "line 1" in err and "'wizard'" in err


def test_a_dataset_without_the_column_a_reward_needs(capsys, monkeypatch, model_dir: Path, tmp_path: Path) -> None:
    monkeypatch.setattr(RolloutEngine, "generate", lambda *a, **k: pytest.fail("a rollout ran"))
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i} + 1?"}) + "\n" for i in range(4)))
    config = write_config(tmp_path / "c.yaml", model_dir, dataset={"name": str(data)}, reward_funcs=["accuracy"])
    for command in ("train", "eval"):
        err = refused(capsys, command, "--config", str(config))
        assert "'accuracy' needs the dataset column 'answer'" in err and "row 0" in err


def test_models_that_cannot_load(capsys, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert f"{empty} is not a Hugging Face model directory" in refused(capsys, "generate", "--model", str(empty))
    assert "--model: /no/such/model does not exist" in refused(capsys, "generate", "--model", "/no/such/model")
    seq2seq = tmp_path / "t5"  # a model directory with a tokenizer, of a model that is not a causal LM
    T5Config(d_model=8, num_layers=1, num_heads=1, d_kv=8, d_ff=8, vocab_size=16).save_pretrained(seq2seq)
    load_tokenizer("smollm2").save_pretrained(seq2seq)
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"model": str(seq2seq), "dataset": {"num_examples": 8}}))
    assert f"model: cannot load {seq2seq} as a causal language model" in refused(
        capsys, "eval", "--config", str(config)
    )


def test_commands_load_the_model_on_their_device_and_refuse_a_missing_gpu(
    capsys, monkeypatch, model_dir: Path, tmp_path: Path
) -> None:
    """generate, eval and draft train take a device (``--device``; for the last two the config's ``device``
    option), load the model there, and say so before loading anything when no GPU is there to take it."""
    import fastgrpo.models

    loaded = []
    real = fastgrpo.models.load_model

    def spy(name, dtype="float32", device="cpu"):
        loaded.append((dtype, str(device)))
        return real(name, dtype, device)

    monkeypatch.setattr(fastgrpo.models, "load_model", spy)
    config = write_config(tmp_path / "c.yaml", model_dir, dataset={"num_examples": 2}, max_completion_length=2)
    out = tmp_path / "draft"
    for args in (
        ["generate", "--model", str(model_dir), "--prompt", "hi", "--max-new-tokens", "2", "--device", "cpu"],
        ["eval", "--config", str(config), "--device", "cpu"],
        ["draft", "train", "--config", str(config), "--output", str(out), "--device", "cpu"],
    ):
        main(args)
    assert loaded == [("auto", "cpu")] * 3
    assert "device: cuda was asked for but torch sees no GPU" in refused(
        capsys, "generate", "--prompt", "hi", "--device", "cuda"
    )
    assert "device: cuda was asked for but torch sees no GPU" in refused(
        capsys, "eval", "--config", str(config), "--device", "cuda"
    )
    assert len(loaded) == 3


def test_generate_without_generations(capsys) -> None:
    assert "num_generations must be >= 1, got 0" in refused(
        capsys, "generate", "--prompt", "hi", "--num-generations", "0"
    )


def test_a_draft_for_another_model_and_bad_lora_targets(capsys, model_dir: Path, tmp_path: Path) -> None:
    from fastgrpo.speculative.eagle.head import DraftHead

    DraftHead(tiny_model("qwen2").config, "qwen2").save(tmp_path / "draft")  # a draft for another model
    config = write_config(
        tmp_path / "c.yaml", model_dir, speculation={"mode": "adaptive", "draft": str(tmp_path / "draft")}
    )
    assert "speculation.draft: draft in" in refused(capsys, "train", "--config", str(config))
    config = write_config(tmp_path / "l.yaml", model_dir, use_peft=True, lora_target_modules=["no_such_layer"])
    assert "lora_target_modules ['no_such_layer']" in refused(capsys, "train", "--config", str(config))


# -- rewards ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reward", "message"),
    [
        ("inf_reward", "'inf_reward' returned inf for row 0"),
        ("raising_reward", "'raising_reward' failed on row 0"),
        ("short_reward", "'short_reward' must return a list of 4 floats or None, got length 1"),
        ("scalar_reward", "'scalar_reward' must return a list of 4 floats or None, got float"),
    ],
)
def test_a_bad_reward_stops_the_run_before_any_update(
    capsys, monkeypatch, model_dir: Path, tmp_path: Path, reward: str, message: str
) -> None:
    monkeypatch.setattr(PolicyUpdate, "optimize", lambda *a: pytest.fail("the policy was updated"))
    config = write_config(tmp_path / "c.yaml", model_dir, reward_funcs=[f"bad_input_matrix:{reward}"])
    assert message in refused(capsys, "train", "--config", str(config))


def test_an_infinite_reward_never_reaches_the_weights(model_dir: Path, tmp_path: Path) -> None:
    """Among finite rewards, one infinite row stops the step in which it comes, and the weights stay finite and as
    they were after the step before."""
    from fastgrpo.config import load_config
    from fastgrpo.grpo.trainer import GRPOTrainer

    calls = []

    def late_inf(completions: list, **kwargs) -> list[float]:
        calls.append(1)
        values = [float(len(c) % 7) for c in completions]
        return values if len(calls) < 2 else [*values[:-1], -math.inf]

    config = load_config(write_config(tmp_path / "c.yaml", model_dir, max_steps=3, save_steps=10))
    trainer = GRPOTrainer(config)
    trainer.reward_funcs = [late_inf]
    trainer.train_step(0)
    after_first = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(ValueError, match="'late_inf' returned -inf for row 3"):
        trainer.train_step(1)
    for name, value in trainer.model.state_dict().items():
        assert torch.isfinite(value).all() and torch.equal(value, after_first[name]), name


@pytest.mark.parametrize("reward", ["none_reward", "nan_reward"])
def test_rewards_that_score_nothing_warn(caplog, model_dir: Path, tmp_path: Path, reward: str) -> None:
    config = write_config(tmp_path / "c.yaml", model_dir, reward_funcs=[f"bad_input_matrix:{reward}"])
    with caplog.at_level(logging.WARNING, logger="fastgrpo.rewards"):
        main(["train", "--config", str(config)])
    assert "4 of 4 completions got no reward from any reward function" in caplog.text


def test_a_prompt_longer_than_max_prompt_length_warns(caplog, model_dir: Path, tmp_path: Path) -> None:
    config = write_config(tmp_path / "c.yaml", model_dir, max_prompt_length=8)
    with caplog.at_level(logging.WARNING, logger="fastgrpo.grpo.trainer"):
        main(["train", "--config", str(config)])
    assert caplog.text.count("a prompt is longer than max_prompt_length (8 tokens)") == 1


# -- output directories and checkpoints ------------------------------------------------------------------------------


def test_a_new_run_in_the_directory_of_another_is_refused_unless_overwritten(
    capsys, model_dir: Path, tmp_path: Path
) -> None:
    config = write_config(tmp_path / "c.yaml", model_dir, max_steps=3, save_total_limit=1)
    assert run_cli(capsys, "train", "--config", str(config))[0] == 0
    out = tmp_path / "c-run"
    assert "holds another run (checkpoint-3, config.yaml, metrics.jsonl)" in refused(
        capsys, "train", "--config", str(config)
    )
    # Starting over deletes the earlier run: its higher-numbered checkpoint cannot outlive the new run's.
    code, err = run_cli(capsys, "train", "--config", str(config), "--max_steps", "1", "--overwrite_output_dir", "true")
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint-1"]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1


def test_checkpoints_are_readable_by_the_group(model_dir: Path, tmp_path: Path) -> None:
    config = write_config(tmp_path / "c.yaml", model_dir)
    old = os.umask(0o022)
    try:
        main(["train", "--config", str(config)])
    finally:
        os.umask(old)
    assert (tmp_path / "c-run" / "checkpoint-1").stat().st_mode & 0o777 == 0o755


@pytest.mark.parametrize("damaged", ["model.safetensors", STATE_FILE])
def test_resume_falls_back_to_the_latest_intact_checkpoint(
    caplog, model_dir: Path, tmp_path: Path, damaged: str
) -> None:
    config = write_config(tmp_path / "c.yaml", model_dir, max_steps=2, save_total_limit=None)
    main(["train", "--config", str(config)])
    latest = tmp_path / "c-run" / "checkpoint-2" / damaged
    with open(latest, "r+b") as f:
        f.truncate(latest.stat().st_size // 2)
    with caplog.at_level(logging.INFO, logger="fastgrpo.grpo.restore"):
        main(["train", "--config", str(config), "--resume", "--max_steps", "3"])
    assert f"passing over checkpoint-2: {damaged}" in caplog.text
    assert "resumed from" in caplog.text and "checkpoint-1 at step 1" in caplog.text
    steps = [json.loads(line)["step"] for line in (tmp_path / "c-run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_ctrl_c_says_which_checkpoint_to_resume_from(capsys, monkeypatch, model_dir: Path, tmp_path: Path) -> None:
    step = trainer_module.GRPOTrainer.train_step

    def interrupted(self, index: int) -> dict:
        if index == 1:
            raise KeyboardInterrupt
        return step(self, index)

    monkeypatch.setattr(trainer_module.GRPOTrainer, "train_step", interrupted)
    config = write_config(tmp_path / "c.yaml", model_dir, max_steps=2)
    code, err = run_cli(capsys, "train", "--config", str(config))
    assert code == 130 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"fastgrpo train: interrupted; the latest checkpoint is {tmp_path / 'c-run' / 'checkpoint-1'}; "
        "add --resume to continue from it"
    )


def same_state(a: object, b: object) -> bool:
    """Whether two saved states (nested dicts, lists and tensors) are equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return isinstance(b, list | tuple) and len(a) == len(b) and all(map(same_state, a, b))
    return a == b


def checkpoint_state(checkpoint: Path) -> dict[str, object]:
    """What a checkpoint holds that a resumed run must reproduce, by file: every tensor file (the policy, the draft),
    every state file (optimizer, scheduler, RNG, the draft's optimizer, the suffix memory; not the options, which name
    the run's directory) and what the controller learnt."""
    state: dict[str, object] = {}
    for path in sorted(p for p in checkpoint.rglob("*") if p.is_file()):
        name = str(path.relative_to(checkpoint))
        if path.suffix == ".safetensors":
            state[name] = load_file(path)
        elif path.suffix == ".pt":
            loaded = torch.load(path, weights_only=False)
            state[name] = {k: v for k, v in loaded.items() if k != "config"}
        elif path.name == "schedule.json":
            state[name] = json.loads(path.read_text())
    return state


@dataclass
class Forked:
    """How a forked run ended: its exit code (the negated signal number when a signal killed it) and what it wrote
    to stderr."""

    returncode: int
    stderr: str


def forked(function: Callable[..., object], args: tuple, env: dict[str, str], log: Path) -> Forked:
    """``function(*args)`` in a child forked from this process, with ``env`` as its environment and one torch thread,
    its stdout and stderr written to ``log``: a run as a new process would run it, without starting an interpreter
    and importing torch and transformers again. Exit code 0 when it returns, a `SystemExit`'s code, 1 on an exception
    (its traceback in the log)."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.environ.clear()
            os.environ.update(env)
            torch.set_num_threads(1)
            sys.stdout = sys.stderr = open(log, "w", buffering=1)  # noqa: SIM115 (the child ends with os._exit)
            logging.getLogger().handlers.clear()  # pytest's capture handlers write into the parent's reports
            function(*args)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return Forked(os.waitstatus_to_exitcode(status), log.read_text())


def test_a_run_killed_at_any_moment_resumes_to_the_same_state(model_dir: Path, tmp_path: Path) -> None:
    """Adaptive speculation (the EAGLE head and the suffix memory learning online). SIGKILL mid-rollout, mid-save and
    mid-prune, and SIGTERM mid-rollout and mid-save, then --resume: the final checkpoint (policy, draft, the draft's
    optimizer, the suffix memory, what the controller learnt) equals an uninterrupted run's bit for bit, and no
    temporary or incomplete checkpoint is left. SIGTERM ends the run as Ctrl-C does: one line naming the checkpoint
    to resume from, its temporary removed at once, exit code 143. The clock is fake (`interrupted_run.fake_clock`), so
    that the controller's choices, which the draft's learning follows, do not depend on the machine's timing noise."""
    options = {"max_steps": 4, "save_total_limit": 2, "speculation": {"mode": "adaptive"}}
    env = {**os.environ, "FAKE_CLOCK": "1"}
    env["FASTGRPO_CACHE"] = str(tmp_path / "cache")  # the profile is calibrated on the fake clock, then read back
    runs = iter(range(100))

    def run(config: Path, moment: str, step: int = 0, how: str = "KILL", *extra: str) -> Forked:
        return forked(interrupted_run.main, (str(config), moment, step, how, *extra), env, tmp_path / f"{next(runs)}")

    whole = run(write_config(tmp_path / "whole.yaml", model_dir, **options), "never")
    assert whole.returncode == 0, whole.stderr[-3000:]
    expected = checkpoint_state(tmp_path / "whole-run" / "checkpoint-4")
    assert {"draft/draft.safetensors", "draft/learners.pt", "draft/schedule.json"} <= expected.keys()
    assert expected["draft/learners.pt"]["suffix"]["prompts"], "the suffix memory holds completions"
    cases = (
        ("rollout", 3, "KILL"),
        ("save", 2, "KILL"),
        ("prune", 3, "KILL"),
        ("rollout", 3, "TERM"),
        ("save", 2, "TERM"),
    )
    for moment, step, how in cases:
        name = f"{moment}-{how}"
        config = write_config(tmp_path / f"{name}.yaml", model_dir, **options)
        killed = run(config, moment, step, how)
        out = tmp_path / f"{name}-run"
        if how == "KILL":
            assert killed.returncode == -9, killed.stderr[-3000:]
        else:
            assert killed.returncode == 143, killed.stderr[-3000:]
            last = killed.stderr.strip().splitlines()[-1]
            kept = "checkpoint-2; add --resume" if moment == "rollout" else "checkpoint-1; add --resume"
            assert last.startswith("fastgrpo train: terminated (SIGTERM); ") and kept in last, last
            assert not [p.name for p in out.iterdir() if p.name.startswith(".checkpoint")], "a temporary was left"
        resumed = run(config, "never", 0, "KILL", "--resume")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == ["checkpoint-3", "checkpoint-4"]
        got = checkpoint_state(out / "checkpoint-4")
        assert got.keys() == expected.keys(), name
        assert all(same_state(got[k], expected[k]) for k in expected), (
            name,
            [k for k in expected if not same_state(got[k], expected[k])],
        )


def test_a_batch_size_below_one_is_refused_before_a_model_loads(capsys, model_dir: Path, tmp_path: Path) -> None:
    config = write_config(tmp_path / "c.yaml", model_dir, dataset={"num_examples": 2})
    assert "batch_size must be >= 1, got 0" in refused(capsys, "eval", "--config", str(config), "--batch-size", "0")
    assert "batch_size must be >= 1, got -2" in refused(
        capsys, "draft", "train", "--config", str(config), "--output", str(tmp_path / "d"), "--batch-size", "-2"
    )


def test_a_run_deletes_nothing_it_did_not_write(capsys, caplog, model_dir: Path, tmp_path: Path) -> None:
    """Another tool's checkpoint-2 (a TRL one, optimizer included) and any other file survive: a new run refuses
    the directory, ``--overwrite_output_dir`` keeps them (and refuses a name its own checkpoints would take)."""
    config = write_config(tmp_path / "c.yaml", model_dir, max_steps=2, save_total_limit=1)
    out = tmp_path / "c-run"
    trl = out / "checkpoint-2"
    trl.mkdir(parents=True)
    (trl / "trainer_state.json").write_text("{}")
    (trl / "optimizer.pt").write_bytes(b"state")
    (out / "notes.txt").write_text("mine")
    err = refused(capsys, "train", "--config", str(config))
    assert "holds files that no fastgrpo run wrote (checkpoint-2, notes.txt)" in err
    err = refused(capsys, "train", "--config", str(config), "--overwrite_output_dir", "true")
    assert "holds checkpoint-2, which no fastgrpo run wrote" in err
    assert "--resume: no checkpoint under" in refused(capsys, "train", "--config", str(config), "--resume")
    (trl / "trainer_state.json").rename(out / "trainer_state.json")
    shutil.rmtree(trl)
    with caplog.at_level(logging.WARNING, logger="fastgrpo.grpo.run_dir"):
        code, err = run_cli(capsys, "train", "--config", str(config), "--overwrite_output_dir", "true")
    assert code == 0, err
    assert (out / "notes.txt").read_text() == "mine" and (out / "trainer_state.json").is_file()
    assert "kept what no fastgrpo run wrote there: notes.txt, trainer_state.json" in caplog.text
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint-2"]
    # a second run over this one deletes that run's files and still keeps the foreign ones
    code, err = run_cli(capsys, "train", "--config", str(config), "--overwrite_output_dir", "true", "--max_steps", "1")
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "checkpoint-1",
        "config.yaml",
        "fastgrpo_run.json",
        "metrics.jsonl",
        "notes.txt",
        "trainer_state.json",
    ]


def test_a_second_run_in_the_same_directory_is_refused_while_the_first_runs(model_dir: Path, tmp_path: Path) -> None:
    """The first run holds the directory's lock from the moment it is built until it ends; a lock file left by a
    process that is gone does not count."""
    from fastgrpo.config import load_config
    from fastgrpo.grpo.trainer import GRPOTrainer

    config = load_config(write_config(tmp_path / "c.yaml", model_dir), [])
    out = Path(config.output_dir)
    out.mkdir()
    (out / ".fastgrpo.lock").write_text("pid 999999 on a host that is gone\n")  # stale: no process holds it
    first = GRPOTrainer(config)
    with pytest.raises(ValueError, match=r"is in use by another run \(pid \d+ on .*, started .*\)"):
        GRPOTrainer(config, resume=True)
    first.train()  # ends, giving the lock back
    second = GRPOTrainer(load_config(write_config(tmp_path / "c.yaml", model_dir, max_steps=2), []), resume=True)
    assert second.start_step == 1
    second.close()


def test_resume_keeps_the_options_the_run_was_started_with(capsys, caplog, model_dir: Path, tmp_path: Path) -> None:
    """A resumed run may run longer and log or save differently (each change named); a change of what it learns
    (learning rate, model, group size, ...) is refused with every differing option's old and new value."""
    config = write_config(tmp_path / "c.yaml", model_dir, max_steps=1)
    assert run_cli(capsys, "train", "--config", str(config))[0] == 0
    err = refused(
        capsys, "train", "--config", str(config), "--resume", "--learning_rate", "0.002", "--num_generations", "2"
    )
    assert "a resumed run keeps them: learning_rate: 0.001 when started, 0.002 now; num_generations: 4" in err
    saved = (tmp_path / "c-run" / "config.yaml").read_text()
    assert "learning_rate: 0.001" in saved
    with caplog.at_level(logging.WARNING, logger="fastgrpo.grpo.trainer"):
        code, err = run_cli(capsys, "train", "--config", str(config), "--resume", "--max_steps", "2")
    assert code == 0, err
    assert "--resume: max_steps changes from 1 to 2" in caplog.text
    assert "max_steps: 2" in (tmp_path / "c-run" / "config.yaml").read_text()  # what the run now uses


def test_writes_are_checked_before_the_work_and_a_full_disk_mid_save_loses_nothing(
    capsys, monkeypatch, model_dir: Path, tmp_path: Path
) -> None:
    """An output_dir that cannot be made, or whose disk cannot hold the checkpoints, is refused before a model loads;
    a disk that fills while a checkpoint is written stops the run with one line, no temporary left, and --resume
    continues from the last complete checkpoint."""
    (tmp_path / "a-file").write_text("")
    config = write_config(tmp_path / "c.yaml", model_dir, max_steps=3, output_dir=str(tmp_path / "a-file" / "run"))
    assert "cannot be written" in refused(capsys, "train", "--config", str(config))

    config = write_config(tmp_path / "d.yaml", model_dir, max_steps=3)
    real_usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real_usage(path)._replace(free=1000))
    assert "more than the 1.0 KiB free on its disk" in refused(capsys, "train", "--config", str(config))
    monkeypatch.setattr(shutil, "disk_usage", real_usage)

    from fastgrpo.grpo import checkpoint

    real_save = torch.save

    def full_disk(obj, path, *args, **kwargs):
        if str(path).endswith(checkpoint.STATE_FILE) and obj["step"] == 2:
            raise RuntimeError("[enforce fail at inline_container.cc] . unexpected pos 4096 vs 0")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "save", full_disk)
    err = refused(capsys, "train", "--config", str(config))
    out = tmp_path / "d-run"
    assert "could not write" in err and "checkpoint-2" in err and "the latest complete checkpoint is" in err
    assert "checkpoint-1: make room and continue with --resume" in err
    assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == ["checkpoint-1"]
    monkeypatch.setattr(checkpoint.torch, "save", real_save)
    code, err = run_cli(capsys, "train", "--config", str(config), "--resume")
    assert code == 0, err
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_a_checkpoint_of_an_older_layout_is_refused_with_one_line(capsys, model_dir: Path, tmp_path: Path) -> None:
    """A checkpoint whose state holds another layout, or none (an older fastgrpo), and a directory with no run mark
    are refused by --resume, naming the checkpoint or the directory, before a model loads; nothing is deleted."""
    config = write_config(tmp_path / "c.yaml", model_dir, max_steps=1)
    assert run_cli(capsys, "train", "--config", str(config))[0] == 0
    out = tmp_path / "c-run"
    state_file = out / "checkpoint-1" / "trainer_state.pt"
    state = torch.load(state_file, weights_only=False)
    assert state.pop("layout") == LAYOUT
    torch.save(state, state_file)
    err = refused(capsys, "train", "--config", str(config), "--resume", "--max_steps", "2")
    (line,) = [line for line in err.splitlines() if line.startswith("fastgrpo train: error:")]
    assert f"checkpoint-1 was written by an older fastgrpo (checkpoint layout 1, this one reads {LAYOUT})" in line
    (out / "fastgrpo_run.json").unlink()
    err = refused(capsys, "train", "--config", str(config), "--resume", "--max_steps", "2")
    assert "older than its run marks cannot be resumed" in err and (out / "checkpoint-1").is_dir()
