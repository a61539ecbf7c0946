"""The bad-input matrix: what a user can get wrong on the command line, each case with the outcome it must have.

A case runs ``fastgrpo ARGV`` in this process, or as a job of processes forked from it (one of them killed mid-run),
on a tiny random Llama (with the SmolLM2 tokenizer) and is classified:
``message`` (exit 2, no traceback, the expected words), ``other message`` (exit 2, other words), ``late message``
(the expected words, but after a model loaded though the fact was knowable before), ``warned`` and ``correct`` (ran,
saying what it should), ``silent`` (ran although it should have refused, or without the warning), ``traceback``.
``tests/test_bad_input_matrix.py`` asserts each case's outcome; ``python tests/bad_input_matrix.py`` prints every
case's outcome and the counts, for whatever ``fastgrpo`` is importable (an older checkout on ``PYTHONPATH`` too).
Signals, a disk that fills mid-save, concurrent runs and resumed runs have tests of their own in
``tests/test_bad_inputs.py``.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import io
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import yaml
from conftest import free_port, save_tiny_llama

REFUSED, WARNS, RUNS = "refused", "warns", "runs"
GOOD = {REFUSED: "message", WARNS: "warned", RUNS: "correct"}


# Reward functions the cases name as bad_input_matrix:NAME.
def length_reward(completions: list, **kwargs: Any) -> list[float]:
    return [float(len(c) % 7) for c in completions]


def inf_reward(completions: list, **kwargs: Any) -> list[float]:
    return [math.inf] * len(completions)


def none_reward(completions: list, **kwargs: Any) -> list[None]:
    return [None] * len(completions)


def nan_reward(completions: list, **kwargs: Any) -> list[float]:
    return [math.nan] * len(completions)


def text_reward(completions: list, **kwargs: Any) -> list[str]:
    return ["1"] * len(completions)


def bool_reward(completions: list, **kwargs: Any) -> list[bool]:
    return [len(c) % 2 == 0 for c in completions]


def half_nan_reward(completions: list, **kwargs: Any) -> list[float]:
    return [math.nan if i % 2 else 1.0 for i in range(len(completions))]


async def never_reward(completions: list, **kwargs: Any) -> list[float]:
    await asyncio.Event().wait()
    return [1.0] * len(completions)


def raising_reward(completions: list, **kwargs: Any) -> list[float]:
    return [1.0 / (len(c) - len(c)) for c in completions]


def short_reward(completions: list, **kwargs: Any) -> list[float]:
    return [1.0]


def scalar_reward(completions: list, **kwargs: Any) -> float:
    return 1.0


def exit_reward(completions: list, **kwargs: Any) -> list[float]:
    sys.exit(3)


def exit_zero_reward(completions: list, **kwargs: Any) -> list[float]:
    sys.exit(0)


def huge_reward(completions: list, **kwargs: Any) -> list[float]:
    return [1e308 * (-1) ** i for i in range(len(completions))]


def tool_result_reward(completions: list, **kwargs: Any) -> list[float]:
    """1 for a completion (a list of messages, with tools) in which a tool returned ``5``."""
    return [float(any(m["role"] == "tool" and m["content"] == "5" for m in c)) for c in completions]


def _add_tool(body: Callable[[int, int], Any]) -> Callable[..., Any]:
    """A tool named ``add``, with one schema whatever ``body`` does (so that the prompt is the one the tool caller
    learnt to answer with a call)."""

    def add(a: int, b: int) -> str:
        """Add two numbers.

        Args:
            a: the first number.
            b: the second number.
        """
        return body(a, b)

    return add


# Tools the cases name as bad_input_matrix:NAME: `add` that works, and `add` with each fault a tool can have.
add_works = _add_tool(lambda a, b: str(a + b))
add_raises = _add_tool(lambda a, b: str(a / (b - b)))
add_exits = _add_tool(lambda a, b: sys.exit(3))
add_hangs = _add_tool(lambda a, b: str(threading.Event().wait(30)))
add_number = _add_tool(lambda a, b: a + b)
add_huge = _add_tool(lambda a, b: "5" * 10_000)
add_surrogate = _add_tool(lambda a, b: "5\ud800")


def subtract(a: int, b: int) -> str:
    """Subtract two numbers.

    Args:
        a: the first number.
        b: the second number.
    """
    return str(a - b)


def _add_text(a: str, b: int) -> str:
    """Add two numbers.

    Args:
        a: the first number.
        b: the second number.
    """
    return a + str(b)


def _add_three(a: int, b: int, c: int) -> str:
    """Add two numbers.

    Args:
        a: the first number.
        b: the second number.
        c: a third number.
    """
    return str(a + b + c)


# `add` as the caller calls it (a=2, b=3) fits neither: a string `a`, a required `c`.
add_text, add_three = _add_text, _add_three
add_text.__name__ = add_three.__name__ = "add"


def untyped_tool(a):  # noqa: ANN001, ANN201 - the fault is the missing hints
    """A tool without type hints.

    Args:
        a: a value.
    """
    return a


def undocumented_tool(a: int) -> str:
    return str(a)


class NoResetEnvironment:
    """An environment without ``reset``."""

    def add(self, a: int) -> str:
        """Add.

        Args:
            a: a number.
        """
        return str(a)


class Calculator:
    """An environment with a calculator and no reward of its own."""

    def reset(self, **row: Any) -> None:
        pass

    def add(self, a: int, b: int) -> str:
        """Add two numbers.

        Args:
            a: the first number.
            b: the second number.
        """
        return str(a + b)


class RaisingReset(Calculator):
    """An environment whose reset raises."""

    def reset(self, **row: Any) -> None:
        raise RuntimeError("no episode today")


class NumberReset(Calculator):
    """An environment whose reset returns a number, not text."""

    def reset(self, **row: Any) -> int:
        return 3


class PromptOnlyReset(Calculator):
    """An environment whose reset takes the prompt column alone."""

    def reset(self, prompt: Any) -> None:
        pass


class HangingReset(Calculator):
    """An environment whose reset never returns."""

    def reset(self, **row: Any) -> None:
        threading.Event().wait()


class HangingReward(Calculator):
    """An environment whose async get_reward never returns."""

    async def get_reward(self) -> float:
        await asyncio.Event().wait()
        return 1.0


class SecondFails(Calculator):
    """An environment whose second instance (of the process) cannot be made."""

    made = 0

    def __init__(self) -> None:
        SecondFails.made += 1
        if SecondFails.made > 1:
            raise RuntimeError("only one sandbox")


_CALLER: list[Path] = []  # the tool caller, trained once per process


def tool_caller(tmp: Path) -> None:
    """``{tmp}/caller``: a tiny Llama that answers the question of `tool_run` by calling ``add(a=2, b=3)``
    (`conftest.save_tool_caller`, trained once per process)."""
    from conftest import save_tool_caller

    from fastgrpo.config import GRPOConfig

    if not _CALLER:
        directory = Path(tempfile.mkdtemp(prefix="fastgrpo-caller-"))
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
        names = ("add_works", "subtract", "add_text", "add_three")  # each run's prompt shows one of them
        configs = [GRPOConfig(model="smollm2", tools=[f"bad_input_matrix:{name}"]) for name in names]
        _CALLER.append(save_tool_caller(directory / "caller", configs, {"prompt": QUESTION}))
    shutil.copytree(_CALLER[0], tmp / "caller")


QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]


def tool_run(name: str, expect: str, says: str, tool: str, **options: Any) -> Case:
    """A run of the tool caller on its question, with ``tool`` as its only tool."""
    config = tiny_run(
        model="{tmp}/caller",
        dataset={"name": "{tmp}/question.jsonl"},
        tools=[f"bad_input_matrix:{tool}"],
        reward_funcs=["bad_input_matrix:tool_result_reward"],
        max_completion_length=64,
        **options,
    )
    files = {"question.jsonl": json.dumps({"prompt": QUESTION[0]["content"], "answer": "5"}) + "\n"}
    return Case(name, ("train",), expect, says, config=config, files=files, setup=tool_caller)


def save_two_label_scorer(tmp: Path) -> None:
    """``{tmp}/rm2``: a sequence classifier of two labels, with the SmolLM2 tokenizer."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from fastgrpo.models import load_tokenizer

    tokenizer = load_tokenizer("smollm2")
    size = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    config = LlamaConfig(vocab_size=len(tokenizer), num_labels=2, pad_token_id=tokenizer.pad_token_id, **size)
    LlamaForSequenceClassification(config).save_pretrained(tmp / "rm2")
    tokenizer.save_pretrained(tmp / "rm2")


def tiny_run(**options: Any) -> dict[str, Any]:
    """The options of a one-step run of 1 prompt x 4 completions of 4 tokens, with ``options`` on top."""
    return {
        "model": "{model}",
        "dataset": {"num_examples": 8},
        "reward_funcs": ["bad_input_matrix:length_reward"],
        "num_generations": 4,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 1,
        "max_completion_length": 4,
        "max_steps": 1,
        "save_steps": 1,
        "output_dir": "{tmp}/run",
        "progress_bar": False,
        "log_completions": False,
        "logging_steps": 1,
        "gradient_checkpointing": False,
        "speculation": {"mode": "off"},
        **options,
    }


@dataclass(frozen=True)
class Kill:
    """SIGKILL for process ``rank`` of a job once ``{tmp}/after`` exists."""

    rank: int
    after: str


@dataclass(frozen=True)
class Case:
    """``fastgrpo ARGV`` (``{tmp}`` and ``{model}`` filled in), after ``files`` are written under ``{tmp}``, the
    command ``first`` has run (a run to resume, overwrite or damage), ``setup`` has run and ``env`` is set; with
    ``config``, its options are written to ``{tmp}/c.yaml`` and given as ``--config`` (to ``first`` too)."""

    name: str
    argv: tuple[str, ...]
    expect: str
    says: str | tuple[str, ...]  # words the output must hold (each of them)
    config: dict[str, Any] | None = None
    files: dict[str, str | bytes] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    setup: Callable[[Path], None] | None = None
    needs_model: bool = False  # the fact can only be known once the model has loaded
    first: tuple[str, ...] = ()  # a command run (with the same config) before the case, after ``files``
    processes: int = 1  # the case's command runs as a job of this many processes (`run_job`: loads not counted)
    kill: Kill | None = None  # a process of that job killed mid-run


def train(name: str, expect: str, says: str, needs_model: bool = False, **options: Any) -> Case:
    """A training run of `tiny_run` with ``options``."""
    return Case(name, ("train",), expect, says, config=tiny_run(**options), needs_model=needs_model)


def dataset_file(name: str, says: str, content: str | bytes, suffix: str = ".jsonl", **options: Any) -> Case:
    """A training run on a dataset file holding ``content``."""
    path = "{tmp}/data" + suffix
    config = tiny_run(dataset={"name": path}, **options)
    return Case(name, ("train",), REFUSED, says, config=config, files={"data" + suffix: content})


def prompts_file(name: str, says: str, content: str | bytes, suffix: str = ".jsonl") -> Case:
    """``fastgrpo generate`` of the prompts in a file holding ``content``."""
    argv = ("generate", "--model", "{model}", "--prompts_file", "{tmp}/p" + suffix)
    return Case(name, argv, REFUSED, says, files={"p" + suffix: content})


def save_t5(tmp: Path) -> None:
    """A model directory, with a tokenizer, of a model that is not a causal LM."""
    from transformers import T5Config

    from fastgrpo.models import load_tokenizer

    T5Config(d_model=8, num_layers=1, num_heads=1, d_kv=8, d_ff=8, vocab_size=16).save_pretrained(tmp / "t5")
    load_tokenizer("smollm2").save_pretrained(tmp / "t5")


def save_qwen_draft(tmp: Path) -> None:
    """A draft saved for a Qwen2 model, not for the Llama the runs train."""
    from transformers import Qwen2Config

    from fastgrpo.speculative.eagle.head import DraftHead

    config = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    DraftHead(config, "qwen2").save(tmp / "draft")


def foreign_lock_link(tmp: Path) -> None:
    """A lock file that is a link to a file of the user's."""
    (tmp / "run").mkdir()
    (tmp / "precious.txt").write_text("keep me\n")
    (tmp / "run" / ".fastgrpo.lock").symlink_to(tmp / "precious.txt")


def link_in_run(name: str) -> Callable[[Path], None]:
    """Replace ``name`` in the run's directory by a link to a directory (or file) of the user's."""

    def setup(tmp: Path) -> None:
        target = tmp / "precious"
        target.mkdir()
        (target / "keep.txt").write_text("keep me\n")
        path = tmp / "run" / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        path.symlink_to(target)

    return setup


def move_run(tmp: Path) -> None:
    (tmp / "run").rename(tmp / "moved")


def damage_file(name: str, content: bytes = b"") -> Callable[[Path], None]:
    """Overwrite ``run/NAME`` with ``content`` (a truncated or emptied file)."""

    def setup(tmp: Path) -> None:
        (tmp / "run" / name).write_bytes(content)

    return setup


def remove_file(name: str) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        (tmp / "run" / name).unlink()

    return setup


def tear_metrics(tmp: Path) -> None:
    """The last line of metrics.jsonl cut short, as a kill during its write leaves it."""
    path = tmp / "run" / "metrics.jsonl"
    text = path.read_text()
    path.write_text(text + text.splitlines()[-1][:20])


def another_runs_checkpoint(tmp: Path) -> None:
    """The run's only checkpoint replaced by one of another run (its mark names another id)."""
    (tmp / "run" / "checkpoint-1" / "fastgrpo_run_id").write_text("0" * 32 + "\n")


def save_model_without_tokenizer(tmp: Path) -> None:
    """A model directory with its weights and config.json but none of its tokenizer's files."""
    save_tiny_llama(tmp / "bare", seed=0, tie_word_embeddings=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        (tmp / "bare" / name).unlink(missing_ok=True)


def _under(path: str | os.PathLike[str], tmp: Path) -> bool:
    return Path(path).absolute().is_relative_to(tmp)


def fill_disk(tmp: Path) -> None:
    """A disk with 1000 bytes free, as ``shutil.disk_usage`` reports it for the paths under ``tmp`` (those only: the
    patch stays for the rest of the process, and no other case writes there)."""
    real = shutil.disk_usage
    shutil.disk_usage = lambda path: real(path)._replace(free=1000) if _under(path, tmp) else real(path)


def fail_draft_writes(tmp: Path) -> None:
    """The disk fills while a draft's weights are written under ``tmp`` (as `fill_disk`, for those paths only)."""
    from safetensors import SafetensorError

    from fastgrpo.speculative.eagle import head

    real = head.save_file

    def save_file(tensors: dict, filename: str, *args: Any, **kwargs: Any) -> None:
        if not _under(filename, tmp):
            return real(tensors, filename, *args, **kwargs)
        Path(filename).write_bytes(b"part")
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")

    head.save_file = save_file


def room_for_two_checkpoints(tmp: Path) -> None:
    """A disk with room for two of the tiny run's checkpoints (as `fill_disk`, for the paths under ``tmp`` only)."""
    real, free = shutil.disk_usage, 50 * 2**20  # a tiny run's checkpoint is about 20 MiB
    shutil.disk_usage = lambda path: real(path)._replace(free=free) if _under(path, tmp) else real(path)


class PickledCall:
    """What a tampered state file holds: unpickling it calls ``os.system``, which would write ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def pickled_call_in(name: str) -> Callable[[Path], None]:
    """Add a pickled ``os.system`` call to the state file ``NAME`` (under ``tmp``), whose call would write
    ``tmp/pwned``."""

    def setup(tmp: Path) -> None:
        import torch

        path = tmp / name
        state = torch.load(path, map_location="cpu", weights_only=True) if path.is_file() else {}
        state["extra"] = PickledCall(tmp / "pwned")
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, path)

    return setup


def set_layout(value: Any) -> Callable[[Path], None]:
    """Set the layout recorded in the run's checkpoint-1 trainer state to ``value``."""

    def setup(tmp: Path) -> None:
        import torch

        path = tmp / "run" / "checkpoint-1" / "trainer_state.pt"
        state = torch.load(path, map_location="cpu", weights_only=True)
        torch.save({**state, "layout": value}, path)

    return setup


def broken_model(kind: str) -> Callable[[Path], None]:
    """A tiny model saved at ``tmp/bad`` whose weights are broken as ``kind`` says: ``empty``, ``truncated``,
    ``garbage``, ``header`` (the header without the data), ``shape`` (config.json of other sizes), ``missing`` (a
    weight left out), ``nan`` or ``inf`` (one value)."""

    def setup(tmp: Path) -> None:
        import struct

        from safetensors.torch import load_file, save_file

        path = save_tiny_llama(tmp / "bad", seed=0, tie_word_embeddings=True)
        weights = path / "model.safetensors"
        data = weights.read_bytes()
        if kind == "empty":
            weights.write_bytes(b"")
        elif kind == "truncated":
            weights.write_bytes(data[: len(data) // 2])
        elif kind == "garbage":
            weights.write_bytes(bytes(range(256)) * 4)
        elif kind == "header":
            weights.write_bytes(data[: 8 + struct.unpack("<Q", data[:8])[0]])
        elif kind == "shape":
            config = json.loads((path / "config.json").read_text())
            (path / "config.json").write_text(json.dumps({**config, "intermediate_size": 72}))
        else:
            tensors = load_file(weights)
            if kind == "missing":
                del tensors["model.norm.weight"]
            else:
                tensors["model.layers.0.mlp.up_proj.weight"][0, 0] = math.nan if kind == "nan" else math.inf
            save_file(tensors, weights, metadata={"format": "pt"})

    return setup


BROKEN_WEIGHTS = {  # kind: what the refusal says, whether only loading can tell
    "empty": ("{tmp}/bad/model.safetensors is not a readable safetensors file (0 bytes", False),
    "truncated": ("{tmp}/bad/model.safetensors is not a readable safetensors file", False),
    "garbage": ("{tmp}/bad/model.safetensors is not a readable safetensors file (1024 bytes", False),
    "header": ("incomplete metadata, file not fully covered", False),
    "shape": (
        "model.safetensors holds model.layers.0.mlp.down_proj.weight of shape [32, 64], but "
        "{tmp}/bad/config.json makes it [32, 72]",
        False,
    ),
    "missing": ("{tmp}/bad/model.safetensors lacks the weight model.norm.weight", True),
    "nan": ("{tmp}/bad/model.safetensors holds NaN in model.layers.0.mlp.up_proj.weight", True),
    "inf": ("holds an infinite value in model.layers.0.mlp.up_proj.weight", True),
}
BROKEN_ARGV = {  # command: its argv, and its config (None: none)
    "train": (("train",), True),
    "generate": (("generate", "--model", "{tmp}/bad", "--prompt", "hi", "--max_completion_length", "2"), False),
    "eval": (("eval",), True),
    "profile": (
        (
            "profile",
            "--model",
            "{tmp}/bad",
            "--tokens",
            "1,2",
            "--repeats",
            "1",
            "--context_length",
            "8",
            "--output",
            "{tmp}/p.json",
        ),
        False,
    ),
    "draft train": (("draft", "train", "--output", "{tmp}/d"), True),
}


def broken_weights(command: str, kind: str) -> Case:
    """``command`` on a model whose weights are broken as ``kind`` says (`broken_model`)."""
    argv, with_config = BROKEN_ARGV[command]
    says, needs_model = BROKEN_WEIGHTS[kind]
    config = tiny_run(model="{tmp}/bad") if with_config else None
    return Case(
        f"{command} on {kind} weights",
        argv,
        REFUSED,
        says,
        config=config,
        setup=broken_model(kind),
        needs_model=needs_model,
    )


def own_model(tmp: Path) -> None:
    """A tiny model of the case's own at ``tmp/own`` (a case that could harm it does not touch the shared one)."""
    save_tiny_llama(tmp / "own", seed=0, tie_word_embeddings=True)


def link(name: str, target: str) -> Callable[[Path], None]:
    """``tmp/NAME``, a symbolic link to ``tmp/TARGET``."""

    def setup(tmp: Path) -> None:
        (tmp / name).symlink_to(tmp / target)

    return setup


# A run of one training and one rollout process, of more steps than it makes before a kill ends it: no sample may be
# stale, so the rollout process makes each generation only once the weights of the step before it came.
KILLED = dict(rollout_processes=1, max_staleness=0, max_steps=20, heartbeat_stale_after_s=10, ddp_timeout=60)
ROLLOUT_KILLED = Kill(1, "run/checkpoint-1")  # its rollout process, once the first checkpoint is written


def killed_rollout_process(tmp: Path) -> None:
    """The case's run, its rollout process killed once the first checkpoint is written."""
    code, err, _ = run_job(["train", "--config", str(tmp / "c.yaml")], {}, tmp, 2, ROLLOUT_KILLED)
    assert code not in (0, None), err[-2000:]


def no_checkpoint_yet(tmp: Path) -> None:
    """The run as a kill during its first rollout leaves it: claimed, with no checkpoint."""
    shutil.rmtree(tmp / "run" / "checkpoint-1")


def save_learners(states: Any) -> Callable[[Path], None]:
    """Replace checkpoint-2's ``draft/learners.pt`` by ``states`` (a callable: of the names of the saved ones)."""

    def setup(tmp: Path) -> None:
        import torch

        path = tmp / "run" / "checkpoint-2" / "draft" / "learners.pt"
        saved = torch.load(path, map_location="cpu", weights_only=True)
        torch.save(states(saved) if callable(states) else states, path)

    return setup


def suffix_price(price: Any) -> Callable[[Path], None]:
    """Set the suffix drafter's price in checkpoint-2's ``draft/schedule.json`` to ``price``."""

    def setup(tmp: Path) -> None:
        path = tmp / "run" / "checkpoint-2" / "draft" / "schedule.json"
        schedule = json.loads(path.read_text())
        schedule["drafters"]["suffix"]["price"] = price
        path.write_text(json.dumps(schedule))

    return setup


def remove_tree(name: str) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        shutil.rmtree(tmp / "run" / name)

    return setup


def resumed_adaptive(name: str, says: str, setup: Callable[[Path], None]) -> Case:
    """Resuming a 2-step adaptive run (both drafters) whose checkpoint-2 ``setup`` damaged: warned, and run."""
    return Case(
        name,
        ("train", "--resume", "--max_steps", "3"),
        WARNS,
        says,
        first=("train",),
        setup=setup,
        config=tiny_run(max_steps=2, speculation={"mode": "adaptive"}),
    )


FOREIGN_CHECKPOINT = {"run/checkpoint-2/trainer_state.json": "{}", "run/checkpoint-2/optimizer.pt": b"state"}
METRICS = '{"step": 1, "reward": 0.5, "time/step": 2.0}\n'
CUT_DRAFT = {"draft/draft_config.json": '{"target": {"model_type": "llama", "hidden_si', "draft/draft.safetensors": b""}
UNTARGETED_DRAFT = {"draft/draft_config.json": '{"target_name": "tiny"}', "draft/draft.safetensors": b""}
GSM8K_ROW = '{"question": "Sam has 2 apples and buys 2 more. How many?", "answer": "2 + 2 = 4\\n#### 4"}\n'
DUPLICATE_KEY = "max_steps: 1\nmax_steps: 2\n"
HOME = {"HOME": "{tmp}"}
TRAIN_ROW = '{"prompt": "What is 2 + 2?", "answer": "4"}\n'

# fmt: off
CASES: list[Case] = [
    # -- options that cannot work, refused before a model loads ---------------------------------------------------
    train("learning rate negative", REFUSED, "learning_rate", learning_rate=-1.0),
    train("learning rate infinite", REFUSED, "learning_rate must be a finite number", learning_rate=math.inf),
    train("temperature 0 in training", REFUSED, "temperature", temperature=0.0),
    train("temperature infinite", REFUSED, "temperature must be a finite number", temperature=math.inf),
    train("temperature negative", REFUSED, "temperature", temperature=-1.0),
    train("top_p 0", REFUSED, "top_p", top_p=0.0),
    train("top_p above 1", REFUSED, "top_p", top_p=1.5),
    train("top_k negative", REFUSED, "top_k", top_k=-1),
    train("min_p 1", REFUSED, "min_p", min_p=1.0),
    train("one generation per prompt", REFUSED, "num_generations", num_generations=1),
    train("batch not a multiple of the group", REFUSED, "per_device_train_batch_size", per_device_train_batch_size=6),
    train("no accumulation steps", REFUSED, "gradient_accumulation_steps", gradient_accumulation_steps=0),
    train("no completion tokens", REFUSED, "max_completion_length", max_completion_length=0),
    train("completions beyond the context", REFUSED, "max_position_embeddings", max_completion_length=10**9),
    train("no prompt tokens", REFUSED, "max_prompt_length", max_prompt_length=0),
    train("no steps", REFUSED, "max_steps", max_steps=0),
    train("save every 0 steps", REFUSED, "save_steps", save_steps=0),
    train("keep 0 checkpoints", REFUSED, "save_total_limit", save_total_limit=0),
    train("negative KL weight", REFUSED, "beta", beta=-1.0),
    train("negative clip range", REFUSED, "epsilon", epsilon=-0.1),
    train("Adam beta1 of 1", REFUSED, "adam_beta1", adam_beta1=1.0),
    train("Adam beta2 negative", REFUSED, "adam_beta2", adam_beta2=-0.1),
    train("negative seed", REFUSED, "seed", seed=-1),
    train("seed beyond 64 bits", REFUSED, "seed", seed=2**64),
    train("LoRA rank 0", REFUSED, "lora_r", use_peft=True, lora_r=0),
    train("rollout processes without torchrun", REFUSED, "start at least 2 processes with torchrun",
          rollout_processes=1),
    train("weights sent less often than the staleness bound allows", REFUSED, "weight_sync_steps (3) must be at most",
          rollout_processes=1, max_staleness=1, weight_sync_steps=3),
    train("a rollout queue too short for one step", REFUSED, "queue_maxsize (2) must hold", rollout_processes=1,
          queue_maxsize=2),
    train("a staleness bound without rollout processes", REFUSED, "max_staleness has no effect", max_staleness=2),
    Case("a rollout process killed mid-run", ("train",), REFUSED,
         ("rollout process rank 1: ", "; the run stops (continue from {tmp}/run/checkpoint-"),
         config=tiny_run(**KILLED), processes=2, kill=ROLLOUT_KILLED, needs_model=True),
    Case("the training process killed mid-run", ("train",), REFUSED,
         ("rollout process rank 1: the training processes are gone (", "; the run stops (continue from {tmp}/run/"),
         config=tiny_run(**KILLED), processes=2, kill=Kill(0, "run/checkpoint-1"), needs_model=True),
    Case("resuming a run whose rollout process was killed", ("train", "--resume", "--max_steps", "3"), RUNS,
         ("resumed from {tmp}/run/checkpoint-", "done: "), config=tiny_run(**KILLED), processes=2,
         setup=killed_rollout_process),
    train("no completion decoding at once", REFUSED, "max_inflight_tasks must be at least 1", max_inflight_tasks=0),
    train("LoRA dropout above 1", REFUSED, "lora_dropout", use_peft=True, lora_dropout=1.5),
    train("log completions every 0 steps", REFUSED, "log_completions_steps", log_completions_steps=0),
    train("unknown loss type", REFUSED, "loss_type", loss_type="ppo"),
    train("unknown scheduler", REFUSED, "lr_scheduler_type", lr_scheduler_type="sawtooth"),
    train("warmup ratio above 1", REFUSED, "warmup_ratio", warmup_ratio=2.0),
    train("negative gradient clip", REFUSED, "max_grad_norm", max_grad_norm=-1.0),
    train("empty output_dir", REFUSED, "output_dir", output_dir=""),
    train("unknown speculation mode", REFUSED, "speculation.mode", speculation={"mode": "turbo"}),
    train("a tree of 5000 nodes", REFUSED, "nodes", speculation={"mode": "static", "nodes": 5000}),
    train("a tree 100 levels deep", REFUSED, "depth", speculation={"mode": "static", "depth": 100}),
    train("draft learning rate infinite", REFUSED, "draft_training.learning_rate must be a finite number",
          draft_training={"learning_rate": math.inf}),
    train("an empty stop string", REFUSED, "stop strings must not be empty", stop=[""]),
    Case("a misspelt option", ("train", "--learnig_rate", "1e-5"), REFUSED, "did you mean learning_rate?"),
    train("unknown dtype", REFUSED, "dtype", dtype="float8"),
    train("a GPU that is not there", REFUSED, "device: cuda was asked for but torch sees no GPU", device="cuda"),
    train("unknown report_to", REFUSED, "report_to", report_to=["wandb"]),
    train("unknown reward name", REFUSED, "unknown reward function 'acuracy'", reward_funcs=["acuracy"]),
    train("reward module missing", REFUSED, "cannot import module 'no_such_module'", reward_funcs=["no_such_module:f"]),
    train("reward function missing", REFUSED, "has no callable 'missing'", reward_funcs=["bad_input_matrix:missing"]),
    train("reward weights of another length", REFUSED, "reward_weights", reward_weights=[1.0, 2.0]),
    train("zero-digit numbers", REFUSED, "dataset.digits", dataset={"digits": 0}),
    train("an operator it cannot draw", REFUSED, "dataset.operators", dataset={"operators": "/"}),
    train("an arithmetic split that is not one", REFUSED, "dataset.split", dataset={"split": "validation"}),
    train("keep 0 rows", REFUSED, "dataset.limit", dataset={"limit": 0}),
    train("0 arithmetic rows", REFUSED, "dataset.num_examples", dataset={"num_examples": 0}),
    train("fewer rows than a step's prompts", REFUSED, "fewer than the 2 prompts per generation",
          dataset={"num_examples": 1}, gradient_accumulation_steps=2),
    # -- config files -----------------------------------------------------------------------------------------------
    Case("YAML syntax error", ("train", "--config", "{tmp}/bad.yaml"), REFUSED, "bad.yaml, line 4, column 1: not valid",
         files={"bad.yaml": "learning_rate: 1e-5\ndataset:\n  name: [gsm8k\n"}),
    Case("YAML that is a list", ("train", "--config", "{tmp}/list.yaml"), REFUSED, "must hold a mapping of options",
         files={"list.yaml": "- a\n- b\n"}),
    Case("a config that is not UTF-8", ("train", "--config", "{tmp}/latin.yaml"), REFUSED, "not UTF-8 text",
         files={"latin.yaml": "model: caf\xe9\n".encode("latin-1")}),
    Case("a config that does not exist", ("train", "--config", "{tmp}/none.yaml"), REFUSED, "does not exist"),
    Case("a config that is a directory", ("train", "--config", "{tmp}"), REFUSED, "is a directory, not a file"),
    Case("an option without its value", ("train", "--learning_rate"), REFUSED, "needs a value"),
    # -- models and drafts ------------------------------------------------------------------------------------------
    train("a model that does not exist", REFUSED, "model: /nonexistent/model does not exist",
          model="/nonexistent/model"),
    Case("an empty model directory", ("train",), REFUSED, "is not a Hugging Face model directory",
         config=tiny_run(model="{tmp}/empty"), files={"empty/.keep": ""}),
    Case("a model that is not a causal LM", ("train",), REFUSED, "cannot load {tmp}/t5 as a causal language model",
         config=tiny_run(model="{tmp}/t5"), setup=save_t5),
    train("a directory that is not a draft", REFUSED, "is neither a directory saved by",
          speculation={"mode": "adaptive", "draft": "{tmp}"}),
    train("an unknown drafter", REFUSED, "speculation.drafter must be one of ['eagle', 'suffix']",
          speculation={"drafter": "medusa"}),
    Case("a draft for another model", ("train",), REFUSED, "speculation.draft: draft in", setup=save_qwen_draft,
         config=tiny_run(speculation={"mode": "adaptive", "draft": "{tmp}/draft"}), needs_model=True),
    train("LoRA on layers the model lacks", REFUSED, "lora_target_modules ['no_such_layer']", needs_model=True,
          use_peft=True, lora_target_modules=["no_such_layer"]),
    # -- dataset files ----------------------------------------------------------------------------------------------
    dataset_file("a binary dataset", "line 1, column 1: not UTF-8 text", bytes(range(128, 256))),
    dataset_file("a Latin-1 dataset", "line 1, column 16: not UTF-8 text (byte 0xe9)",
                 '{"prompt": "caf\xe9 2+2?", "answer": "4"}\n'.encode("latin-1")),
    dataset_file("a row that is not an object", "line 2: expected an object with named columns, got list",
                 TRAIN_ROW + "[1, 2]\n"),
    dataset_file("a row that is not JSON", "line 2 is not valid JSON", TRAIN_ROW + "{prompt\n"),
    dataset_file("an empty prompt", "line 1: prompt column 'prompt' is an empty string", '{"prompt": " "}\n'),
    dataset_file("a prompt that is a number", "line 1: prompt column 'prompt' must be", '{"prompt": 5}\n'),
    dataset_file("a prompt with a lone surrogate", "line 1: prompt column 'prompt' holds a lone surrogate (U+D800)",
                 '{"prompt": "a \\ud800 b", "answer": "1"}\n'),
    dataset_file("a chat role it does not know", "line 1: prompt column 'prompt' has a message with role 'wizard'",
                 json.dumps({"prompt": [{"role": "wizard", "content": "2 + 2?"}], "answer": "4"}) + "\n"),
    dataset_file("rows without the prompt column", "missing prompt column 'prompt'", '{"question": "2+2?"}\n'),
    dataset_file("rows without the answer a reward needs", "'accuracy' needs the dataset column 'answer'",
                 '{"prompt": "2 + 2?"}\n' * 4, reward_funcs=["accuracy"]),
    dataset_file("a JSON file that is not a list", "expected a JSON list of objects", '{"a": 1}', suffix=".json"),
    dataset_file("a file type it cannot read", "unsupported file type '.csv'", "prompt\n2+2\n", suffix=".csv"),
    train("a dataset file that does not exist", REFUSED, "dataset file not found",
          dataset={"name": "gsm8k", "path": "{tmp}/missing.jsonl"}),
    # -- rewards (each needs a rollout to be known) -----------------------------------------------------------------
    train("an infinite reward", REFUSED, "'inf_reward' returned inf for row 0", needs_model=True,
          reward_funcs=["bad_input_matrix:inf_reward"]),
    train("a reward that raises", REFUSED, "'raising_reward' failed on row 0", needs_model=True,
          reward_funcs=["bad_input_matrix:raising_reward"]),
    train("a reward of the wrong length", REFUSED, "got length 1", needs_model=True,
          reward_funcs=["bad_input_matrix:short_reward"]),
    train("a reward that is a scalar", REFUSED, "got float", needs_model=True,
          reward_funcs=["bad_input_matrix:scalar_reward"]),
    train("rewards all None", WARNS, "4 of 4 completions got no reward", reward_funcs=["bad_input_matrix:none_reward"]),
    train("rewards all NaN", WARNS, "4 of 4 completions got no reward", reward_funcs=["bad_input_matrix:nan_reward"]),
    train("an async reward function that never returns", REFUSED,
          "reward function 'never_reward' did not return within reward_timeout (0.5 s)", needs_model=True,
          reward_funcs=["bad_input_matrix:never_reward"], reward_timeout=0.5),
    train("rewards as text", REFUSED, "reward function 'text_reward' returned the text '1' for",
          needs_model=True, reward_funcs=["bad_input_matrix:text_reward"]),
    train("rewards as True/False", WARNS, "reward function 'bool_reward' returned True/False: read as 1/0",
          reward_funcs=["bad_input_matrix:bool_reward"]),
    train("a NaN reward beside another function's", WARNS,
          "reward function 'half_nan_reward' returned NaN: read as None",
          reward_funcs=["bad_input_matrix:length_reward", "bad_input_matrix:half_nan_reward"]),
    train("a prompt longer than max_prompt_length", WARNS, "a prompt is longer than max_prompt_length (8 tokens)",
          max_prompt_length=8),
    train("more threads than cores", WARNS, "cpu_threads", cpu_threads=1000),
    # -- tools and environments: refused before a model loads, or every fault of a call an error message ------------
    train("a tool that does not import", REFUSED, "cannot import module 'nowhere_module' for tools entry",
          tools=["nowhere_module:f"]),
    train("a tool without type hints", REFUSED, "tool 'untyped_tool' cannot be described to the model",
          tools=["bad_input_matrix:untyped_tool"]),
    train("a tool without a docstring", REFUSED, "tool 'undocumented_tool' cannot be described to the model",
          tools=["bad_input_matrix:undocumented_tool"]),
    train("two tools of one name", REFUSED, "two tools are named 'calculator'",
          tools=["calculator", "fastgrpo.tools.functions:calculator"]),
    train("an unknown built-in tool", REFUSED, "unknown tool 'abacus'", tools=["abacus"]),
    train("no tool timeout", REFUSED, "tool_timeout", tools=["calculator"], tool_timeout=0),
    train("no tool workers", REFUSED, "tool_workers", tools=["calculator"], tool_workers=0),
    train("negative tool-calling iterations", REFUSED, "max_tool_calling_iterations", tools=["calculator"],
          max_tool_calling_iterations=-1),
    train("strict tool calls without tools", REFUSED, "strict_tool_calls has no effect with no tools",
          strict_tool_calls=True),
    train("an environment without reset", REFUSED, "NoResetEnvironment has no reset method",
          environment_factory="bad_input_matrix:NoResetEnvironment"),
    train("an environment method clashing with a tool", REFUSED, "Calculator's methods ['add'] have the names",
          environment_factory="bad_input_matrix:Calculator", tools=["bad_input_matrix:add_works"]),
    train("a row naming no environment", REFUSED, "dataset row 0: environment None is not among the environments",
          environment_factory={"calc": "bad_input_matrix:Calculator"}),
    train("no reward source", REFUSED, "no reward source", reward_funcs=[],
          environment_factory="bad_input_matrix:Calculator"),
    train("an environment whose reset raises", REFUSED,
          "RaisingReset.reset raised on completion 0: RuntimeError: no episode today", needs_model=True,
          environment_factory="bad_input_matrix:RaisingReset"),
    train("an environment whose reset returns a number", REFUSED,
          "NumberReset.reset returned int on completion 0", needs_model=True,
          environment_factory="bad_input_matrix:NumberReset"),
    train("an environment whose reset takes no **row", REFUSED,
          "dataset row 0: PromptOnlyReset.reset cannot take the row's columns",
          environment_factory="bad_input_matrix:PromptOnlyReset"),
    Case("a dataset column named self with an environment", ("train",), REFUSED,
         "dataset row 0: Calculator.reset cannot take the row's columns ['answer', 'prompt', 'self']",
         config=tiny_run(dataset={"name": "{tmp}/data.jsonl"}, environment_factory="bad_input_matrix:Calculator"),
         files={"data.jsonl": '{"prompt": "What is 2 + 3?", "answer": "5", "self": 1}\n'}),
    train("an environment whose reset never returns", REFUSED,
          "HangingReset.reset did not return within tool_timeout (0.5 s) on completion 0", needs_model=True,
          environment_factory="bad_input_matrix:HangingReset", tool_timeout=0.5),
    train("an environment whose async get_reward never returns", REFUSED,
          "reward function 'HangingReward' did not return within reward_timeout (0.5 s)", needs_model=True,
          environment_factory="bad_input_matrix:HangingReward", reward_timeout=0.5),
    train("an environment whose second instance cannot be made", REFUSED,
          "environment_factory: making environment 2 raised RuntimeError: only one sandbox", needs_model=True,
          environment_factory="bad_input_matrix:SecondFails"),
    tool_run("a tool that works", RUNS, "mean reward of the last 1: 1.000", "add_works"),
    tool_run("a tool that raises", RUNS, "a call of tool 'add' ended in an error", "add_raises"),
    tool_run("a tool that kills its worker", RUNS, "{'error': '3'}", "add_exits"),
    tool_run("a tool that kills its worker, strictly", RUNS, "raised SystemExit", "add_exits", strict_tool_calls=True),
    tool_run("a tool that hangs", RUNS, "did not return within 0.2 seconds", "add_hangs", tool_timeout=0.2),
    tool_run("a tool that returns a non-string, strictly", RUNS, "returned int, not a string", "add_number",
             strict_tool_calls=True),
    tool_run("a tool that returns a huge result", RUNS, "returned 10000 characters", "add_huge"),
    tool_run("a tool timeout shorter than any call", RUNS, "did not return within 1e-09 seconds", "add_works",
             tool_timeout=1e-9),
    tool_run("a tool that returns a lone surrogate", RUNS, "returned text that holds a lone surrogate (U+D800)",
             "add_surrogate"),
    train("the policy's own directory as a reward model", REFUSED,
          "reward_funcs: {model} is a LlamaForCausalLM, not a sequence-classification model",
          reward_funcs=["bad_input_matrix:length_reward", "{model}"]),
    Case("a reward model of two labels", ("train",), REFUSED, "reward_funcs: {tmp}/rm2 classifies into 2 labels",
         config=tiny_run(reward_funcs=["bad_input_matrix:length_reward", "{tmp}/rm2"]), setup=save_two_label_scorer),
    train("a tool entry without a module", REFUSED, "tools entry ':' must be 'module.path:function'", tools=[":"]),
    Case("a tool module that raises at import", ("train",), REFUSED,
         "cannot import module 'raising_tools' for tools entry 'raising_tools:f': importing it raised RuntimeError: "
         "no tools today", config=tiny_run(tools=["raising_tools:f"]),
         setup=lambda tmp: sys.path.insert(0, str(tmp)),
         files={"raising_tools.py": "raise RuntimeError('no tools today')\n"}),
    Case("a tool module with a syntax error", ("train",), REFUSED,
         "importing it raised SyntaxError: invalid syntax (broken_tools.py, line 1)",
         config=tiny_run(tools=["broken_tools:f"]), setup=lambda tmp: sys.path.insert(0, str(tmp)),
         files={"broken_tools.py": "def f(:\n"}),
    train("chat_template_kwargs setting add_generation_prompt", REFUSED,
          "chat_template_kwargs: add_generation_prompt is fastgrpo's to set",
          chat_template_kwargs={"add_generation_prompt": False}),
    train("chat_template_kwargs setting tokenize", REFUSED, "chat_template_kwargs: tokenize is fastgrpo's to set",
          chat_template_kwargs={"tokenize": False}),
    train("chat_template_kwargs setting tools", REFUSED,
          "chat_template_kwargs: tools is fastgrpo's to set (give tools in the tools option",
          chat_template_kwargs={"tools": []}),
    train("tool_timeout without tools", REFUSED, "tool_timeout has no effect with no tools", tool_timeout=5),
    train("max_tool_calling_iterations without tools", REFUSED,
          "max_tool_calling_iterations has no effect with no tools", max_tool_calling_iterations=2),
    train("a draft vocabulary for the suffix drafter alone", REFUSED,
          "speculation.draft_vocab_size has no effect with speculation.drafter: suffix",
          speculation={"mode": "adaptive", "drafter": "suffix", "draft_vocab_size": 64}),
    Case("draft train with tools", ("draft", "train", "--output", "{tmp}/d"), REFUSED,
         "fastgrpo draft train generates without tools", config=tiny_run(tools=["calculator"])),
    train("a reward model's path with a typo", REFUSED,
          "reward_funcs: tests/no_such_reward_model does not exist (tests/ is a local directory",
          reward_funcs=["bad_input_matrix:length_reward", "tests/no_such_reward_model"]),
    tool_run("a call of an unknown tool", RUNS, "{'error': 'Tool add not found.'}", "subtract"),
    tool_run("a call of an unknown tool, strictly", RUNS, "unknown tool 'add'; the tools are ['subtract']", "subtract",
             strict_tool_calls=True),
    tool_run("a call missing an argument", RUNS, "missing 1 required positional argument: 'c'", "add_three"),
    tool_run("a call missing an argument, strictly", RUNS, "missing ['c']", "add_three", strict_tool_calls=True),
    tool_run("a call with an argument of the wrong type, strictly", RUNS, "argument 'a' of tool 'add' must be string",
             "add_text", strict_tool_calls=True),
    # -- places it writes ---------------------------------------------------------------------------------------------
    Case("output_dir is a file", ("train",), REFUSED, "is a file, not a directory",
         config=tiny_run(output_dir="{tmp}/f"), files={"f": ""}),
    Case("output_dir under a file", ("train",), REFUSED, "cannot be written",
         config=tiny_run(output_dir="{tmp}/f/run"), files={"f": ""}),
    Case("FASTGRPO_CACHE is a file (train)", ("train",), REFUSED, "FASTGRPO_CACHE: {tmp}/f is a file",
         config=tiny_run(), files={"f": ""}, env={"FASTGRPO_CACHE": "{tmp}/f"}),
    Case("another tool's checkpoint in output_dir", ("train",), REFUSED, "holds files that no fastgrpo run wrote",
         config=tiny_run(), files=FOREIGN_CHECKPOINT),
    Case("overwriting another tool's checkpoint", ("train", "--overwrite_output_dir", "true"), REFUSED,
         "holds checkpoint-2, which no fastgrpo run wrote", config=tiny_run(), files=FOREIGN_CHECKPOINT),
    Case("--resume with no checkpoint", ("train", "--resume"), REFUSED, "--resume: no checkpoint under",
         config=tiny_run(), files=FOREIGN_CHECKPOINT),
    # -- a run writes only what it owns, through no link, and refuses before it deletes -----------------------------
    Case("overwriting a directory with the user's config.yaml", ("train", "--overwrite_output_dir", "true"), REFUSED,
         "holds config.yaml, which no fastgrpo run wrote", config=tiny_run(), files={"run/config.yaml": "mine: 1\n"}),
    Case("overwriting a directory with the user's metrics.jsonl", ("train", "--overwrite_output_dir", "true"),
         REFUSED, "holds metrics.jsonl, which no fastgrpo run wrote", config=tiny_run(),
         files={"run/metrics.jsonl": "{}\n", "run/notes.txt": "mine\n"}),
    Case("overwriting a directory with the user's report/", ("train", "--overwrite_output_dir", "true"), REFUSED,
         "holds report, which no fastgrpo run wrote", config=tiny_run(), files={"run/report/a.png": b"png"}),
    Case("overwriting a directory with the user's tensorboard/", ("train", "--overwrite_output_dir", "true"),
         REFUSED, "holds tensorboard, which no fastgrpo run wrote", config=tiny_run(),
         files={"run/tensorboard/events": b"ev"}),
    Case("overwriting a directory with a temporary of another run", ("train", "--overwrite_output_dir", "true"),
         REFUSED, "holds .checkpoint-3.abc, which no fastgrpo run wrote", config=tiny_run(),
         files={"run/.checkpoint-3.abc/fastgrpo_run_id": "f" * 32}),
    Case("overwriting with a run file that is not JSON", ("train", "--overwrite_output_dir", "true"), REFUSED,
         "holds fastgrpo_run.json", config=tiny_run(), files={"run/fastgrpo_run.json": "{", "run/x.txt": "x"}),
    Case("overwriting, then refused for temperature 0", ("train", "--overwrite_output_dir", "true", "--temperature",
         "0"), REFUSED, "temperature: 0 samples greedily", config=tiny_run(), first=("train",)),
    Case("overwriting, then refused for a context overflow", ("train", "--overwrite_output_dir", "true",
         "--max_completion_length", "100000"), REFUSED, "exceed the model's context", config=tiny_run(),
         first=("train",)),
    Case("overwriting, then refused for LoRA layers the model lacks", ("train", "--overwrite_output_dir", "true",
         "--use_peft", "true", "--lora_target_modules", "[no_such_layer]"), REFUSED,
         "lora_target_modules ['no_such_layer']", config=tiny_run(), first=("train",), needs_model=True),
    Case("a lock file that is a link", ("train",), REFUSED, ".fastgrpo.lock is a symbolic link", config=tiny_run(),
         setup=foreign_lock_link),
    Case("a lock file that is a directory", ("train",), REFUSED, ".fastgrpo.lock: Is a directory", config=tiny_run(),
         files={"run/.fastgrpo.lock/x": ""}),
    Case("overwriting a run whose report/ is a link", ("train", "--overwrite_output_dir", "true"), REFUSED,
         "report is a symbolic link", config=tiny_run(), first=("train",), setup=link_in_run("report")),
    Case("resuming a run whose config.yaml is a link", ("train", "--resume", "--max_steps", "2"), REFUSED,
         "config.yaml is a symbolic link", config=tiny_run(), first=("train",), setup=link_in_run("config.yaml")),
    Case("resuming a run whose config.yaml has an unknown key", ("train", "--resume", "--max_steps", "2"), REFUSED,
         "config.yaml holds learning_rat, which no fastgrpo option is named", config=tiny_run(), first=("train",),
         setup=lambda tmp: (tmp / "run" / "config.yaml").write_text(
             (tmp / "run" / "config.yaml").read_text() + "learning_rat: 0.5\n")),
    Case("resuming a run whose checkpoint is a link", ("train", "--resume", "--max_steps", "2"), REFUSED,
         "checkpoint-1 is a symbolic link", config=tiny_run(), first=("train",), setup=link_in_run("checkpoint-1")),
    Case("overwriting a run whose metrics.jsonl is a link", ("train", "--overwrite_output_dir", "true"), REFUSED,
         "metrics.jsonl is a symbolic link", config=tiny_run(), first=("train",), setup=link_in_run("metrics.jsonl")),
    # -- no checkpoint with a non-finite weight ---------------------------------------------------------------------
    train("a learning rate of 1000", REFUSED, "the run stops before saving anything of it", needs_model=True,
          learning_rate=1000.0, lr_scheduler_type="constant", max_steps=3, save_steps=3),
    train("rewards of +-1e308", REFUSED, "give advantages that are inf or nan", needs_model=True,
          reward_funcs=["bad_input_matrix:huge_reward"]),
    # -- resumed by the run's identity --------------------------------------------------------------------------------
    Case("resuming with a trailing slash", ("train", "--resume", "--max_steps", "2", "--output_dir", "{tmp}/run/"),
         RUNS, "resumed from", config=tiny_run(), first=("train",)),
    Case("resuming a moved run", ("train", "--resume", "--max_steps", "2", "--output_dir", "{tmp}/moved"), RUNS,
         "resumed from", config=tiny_run(), first=("train",), setup=move_run),
    Case("resuming with config.yaml deleted and another learning rate", ("train", "--resume", "--max_steps", "2",
         "--learning_rate", "0.5"), REFUSED, "learning_rate: 1e-06 when started, 0.5 now", config=tiny_run(),
         first=("train",), setup=remove_file("config.yaml")),
    Case("resuming with config.yaml empty and another seed", ("train", "--resume", "--max_steps", "2", "--seed", "7"),
         REFUSED, "seed: 42 when started, 7 now", config=tiny_run(), first=("train",),
         setup=damage_file("config.yaml")),
    Case("resuming with config.yaml deleted", ("train", "--resume", "--max_steps", "2"), WARNS,
         "config.yaml is missing: it is written again", config=tiny_run(), first=("train",),
         setup=remove_file("config.yaml")),
    Case("resuming with config.yaml not YAML", ("train", "--resume", "--max_steps", "2"), WARNS,
         "config.yaml is unreadable", config=tiny_run(), first=("train",),
         setup=damage_file("config.yaml", b"a: [\n")),
    Case("resuming with a damaged learners' state", ("train", "--resume", "--max_steps", "3"), WARNS,
         "passing over checkpoint-2: draft/learners.pt is unreadable", first=("train",),
         config=tiny_run(max_steps=2, speculation={"mode": "adaptive"}),
         setup=damage_file("checkpoint-2/draft/learners.pt", b"PK")),
    Case("resuming with a damaged draft config", ("train", "--resume", "--max_steps", "3"), WARNS,
         "passing over checkpoint-2: draft/draft_config.json is unreadable", first=("train",),
         config=tiny_run(max_steps=2, speculation={"mode": "adaptive"}),
         setup=damage_file("checkpoint-2/draft/draft_config.json", b"{")),
    Case("resuming with a damaged controller state", ("train", "--resume", "--max_steps", "3"), WARNS,
         "passing over checkpoint-2: draft/schedule.json is unreadable", first=("train",),
         config=tiny_run(max_steps=2, speculation={"mode": "adaptive"}),
         setup=damage_file("checkpoint-2/draft/schedule.json", b"{")),
    Case("resuming with a torn last metrics line", ("train", "--resume", "--max_steps", "2"), WARNS,
         "line 2: dropped, cut short", config=tiny_run(), first=("train",), setup=tear_metrics),
    Case("resuming with a broken metrics line", ("train", "--resume", "--max_steps", "2"), REFUSED,
         "metrics.jsonl, line 1: not a line of metrics", config=tiny_run(), first=("train",),
         setup=damage_file("metrics.jsonl", b"oops\n{\"step\": 1}\n")),
    Case("resuming from another run's checkpoint", ("train", "--resume", "--max_steps", "2"), REFUSED,
         "checkpoint-1 was written by another run", config=tiny_run(), first=("train",),
         setup=another_runs_checkpoint),
    Case("resuming with fewer steps than done", ("train", "--resume", "--max_steps", "1"), REFUSED,
         "max_steps 1 is not beyond the 2 steps", config=tiny_run(max_steps=2), first=("train",)),
    Case("resuming with as many steps as done", ("train", "--resume"), REFUSED, "max_steps 1 is not beyond the 1 steps",
         config=tiny_run(), first=("train",)),
    # -- generate -----------------------------------------------------------------------------------------------------
    Case("generate 0 completions", ("generate", "--prompt", "hi", "--num_generations", "0"), REFUSED,
         "num_generations must be >= 1"),
    Case("generate 0 tokens", ("generate", "--prompt", "hi", "--max_completion_length", "0"), REFUSED,
         "max_completion_length must be >= 1"),
    Case("generate at temperature NaN", ("generate", "--prompt", "hi", "--temperature", "nan"), REFUSED,
         "temperature must be a finite number"),
    Case("generate with top_p 2", ("generate", "--prompt", "hi", "--top_p", "2"), REFUSED, "top_p must be in"),
    Case("generate with a negative seed", ("generate", "--prompt", "hi", "--seed", "-1"), REFUSED, "seed must be in"),
    Case("generate without a prompt", ("generate",), REFUSED, "give at least one --prompt"),
    Case("generate from a missing file", ("generate", "--prompts_file", "{tmp}/none.txt"), REFUSED, "is not a file"),
    prompts_file("generate from a Latin-1 file", "p.txt, line 1, column 4: not UTF-8 text",
                 "caf\xe9\n".encode("latin-1"), suffix=".txt"),
    prompts_file("generate from a row that is a string", "line 1: expected an object with a 'prompt' column, got str",
                 '"2+2"\n'),
    prompts_file("generate from a row that is a number", "line 1: expected an object with a 'prompt' column, got int",
                 "5\n"),
    prompts_file("generate a prompt that is a number", "line 1: 'prompt' must be a non-empty string",
                 '{"prompt": 5}\n'),
    prompts_file("generate a prompt with a lone surrogate", "line 1: 'prompt' holds a lone surrogate",
                 '{"prompt": "a \\udcff"}\n'),
    Case("generate an argument of invalid bytes", ("generate", "--model", "{model}", "--prompt", "caf\udce9"), REFUSED,
         "--prompt 1 holds a lone surrogate (U+DCE9)"),
    Case("generate with an empty model directory", ("generate", "--model", "{tmp}/empty"), REFUSED,
         "is not a Hugging Face model directory", files={"empty/.keep": ""}),
    Case("generate with a missing model", ("generate", "--model", "/no/such/model"), REFUSED, "does not exist"),
    Case("generate into a path under a file", ("generate", "--model", "{model}", "--prompt", "hi", "--output",
         "{tmp}/f/out.jsonl"), REFUSED, "--output: {tmp}/f is a file", files={"f": ""}),
    Case("generate into a directory", ("generate", "--model", "{model}", "--prompt", "hi", "--output", "{tmp}"),
         REFUSED, "is a directory, not a file"),
    Case("generate with FASTGRPO_CACHE a file", ("generate", "--model", "{model}", "--prompt", "hi"), REFUSED,
         "FASTGRPO_CACHE: {tmp}/f is a file", files={"f": ""}, env={"FASTGRPO_CACHE": "{tmp}/f"}),
    Case("generate on a GPU that is not there", ("generate", "--prompt", "hi", "--device", "cuda"), REFUSED,
         "device: cuda was asked for but torch sees no GPU"),
    Case("generate with an unknown option", ("generate", "--prompt", "hi", "--bogus", "1"), REFUSED,
         "unknown option bogus"),
    Case("generate with train's option names", ("generate", "--model", "{model}", "--prompt", "hi",
         "--max_completion_length", "2", "--top_p", "0.9", "--temperature", "1", "--num_generations", "2"), RUNS,
         "4 tokens in"),
    # -- eval and draft train ---------------------------------------------------------------------------------------
    Case("eval a batch of 0", ("eval", "--batch_size", "0"), REFUSED, "batch_size must be >= 1, got 0",
         config=tiny_run()),
    Case("eval with tools", ("eval",), REFUSED, "fastgrpo eval generates without tools",
         config=tiny_run(tools=["calculator"])),
    Case("eval without the answer column", ("eval",), REFUSED, "'accuracy' needs the dataset column 'answer'",
         config=tiny_run(dataset={"name": "{tmp}/d.jsonl"}, reward_funcs=["accuracy"]),
         files={"d.jsonl": '{"prompt": "2 + 2?"}\n'}),
    Case("eval arithmetic on questions training never drew", ("eval",), RUNS, "training never draws",
         config=tiny_run(reward_funcs=["accuracy"])),
    Case("draft train with a greedy fraction of 1.5", ("draft", "train", "--output", "{tmp}/d", "--greedy_fraction",
         "1.5"), REFUSED, "greedy_fraction must be in [0, 1], got 1.5", config=tiny_run()),
    Case("draft train a batch of -2", ("draft", "train", "--output", "{tmp}/d", "--batch_size", "-2"), REFUSED,
         "batch_size must be >= 1, got -2", config=tiny_run()),
    Case("draft train into a path under a file", ("draft", "train", "--output", "{tmp}/f/d"), REFUSED,
         "--output: {tmp}/f/d cannot be created", config=tiny_run(), files={"f": ""}),
    Case("draft train a vocabulary of 0", ("draft", "train", "--output", "{tmp}/d", "--draft_vocab_size", "0"),
         REFUSED, "speculation.draft_vocab_size must be >= 2", config=tiny_run()),
    # -- report -----------------------------------------------------------------------------------------------------
    Case("report a directory that is not a run", ("report", "{tmp}"), REFUSED, "is not a fastgrpo run directory"),
    Case("report a line that is not an object", ("report", "{tmp}/r"), REFUSED,
         "line 2: expected a JSON object of metrics, got list",
         files={"r/metrics.jsonl": METRICS + "[1, 2]\n"}),
    Case("report metrics that are not UTF-8", ("report", "{tmp}/r"), REFUSED, "line 2, column 1: not UTF-8 text",
         files={"r/metrics.jsonl": METRICS.encode() + b"\xff\n"}),
    Case("report lines without a reward", ("report", "{tmp}/r"), REFUSED, "no line has a 'reward'",
         files={"r/metrics.jsonl": '{"step": 1, "time/step": 2.0}\n'}),
    Case("report a reward that is text", ("report", "{tmp}/r"), REFUSED, "'reward' is \"high\", not a number",
         files={"r/metrics.jsonl": '{"step": 1, "reward": "high", "time/step": 2.0}\n'}),
    Case("report a run without steps", ("report", "{tmp}/r"), REFUSED, "has no steps yet",
         files={"r/metrics.jsonl": ""}),
    Case("report into a path under a file", ("report", "{tmp}/r", "--output", "{tmp}/f/plots"), REFUSED,
         "--output: {tmp}/f/plots cannot be created", files={"r/metrics.jsonl": METRICS, "f": ""}),
    # -- profile ------------------------------------------------------------------------------------------------------
    Case("profile 0 tokens", ("profile", "--tokens", "0,1"), REFUSED, "tokens must be increasing positive"),
    Case("profile tokens that are not numbers", ("profile", "--tokens", "a,b"), REFUSED, "comma-separated integers"),
    Case("profile 0 repeats", ("profile", "--repeats", "0"), REFUSED, "repeats must be >= 1"),
    Case("profile a draft that is not there", ("profile", "--draft", "{tmp}/none"), REFUSED, "is not a directory"),
    Case("profile into a path under a file", ("profile", "--model", "{model}", "--output", "{tmp}/f/p.json"),
         REFUSED, "--output: {tmp}/f is a file", files={"f": ""}),
    Case("profile a missing model", ("profile", "--model", "/no/such/model"), REFUSED, "does not exist"),
    # -- the process, rewards that exit, models without a tokenizer, drafts that cannot be read or written -------
    Case("FASTGRPO_MALLOC unknown (train)", ("train",), REFUSED, "FASTGRPO_MALLOC must be 'keep' or 'system'",
         config=tiny_run(), env={"FASTGRPO_MALLOC": "bogus"}),
    Case("FASTGRPO_MALLOC unknown (generate)", ("generate", "--prompt", "hi"), REFUSED,
         "FASTGRPO_MALLOC must be 'keep' or 'system', got 'jemalloc'", env={"FASTGRPO_MALLOC": "jemalloc"}),
    Case("--version", ("--version",), RUNS, f"fastgrpo {version('fastgrpo')}"),
    train("a reward that calls sys.exit(3)", REFUSED, "'exit_reward' failed on row 0", needs_model=True,
          reward_funcs=["bad_input_matrix:exit_reward"]),
    train("a reward that calls sys.exit(0)", REFUSED, "it called sys.exit(0)", needs_model=True,
          reward_funcs=["bad_input_matrix:exit_zero_reward"]),
    Case("eval a reward that calls sys.exit(3)", ("eval",), REFUSED, "it called sys.exit(3)", needs_model=True,
         config=tiny_run(reward_funcs=["bad_input_matrix:exit_reward"])),
    Case("train a model without a tokenizer", ("train",), REFUSED, "model: {tmp}/bare holds no tokenizer files",
         config=tiny_run(model="{tmp}/bare"), setup=save_model_without_tokenizer),
    Case("eval a model without a tokenizer", ("eval",), REFUSED, "model: {tmp}/bare holds no tokenizer files",
         config=tiny_run(model="{tmp}/bare"), setup=save_model_without_tokenizer),
    Case("generate with a model without a tokenizer", ("generate", "--model", "{tmp}/bare", "--prompt", "hi"),
         REFUSED, "{tmp}/bare holds no tokenizer files (tokenizer.json", setup=save_model_without_tokenizer),
    Case("draft train a model without a tokenizer", ("draft", "train", "--output", "{tmp}/d"), REFUSED,
         "model: {tmp}/bare holds no tokenizer files", config=tiny_run(model="{tmp}/bare"),
         setup=save_model_without_tokenizer),
    Case("a draft_config.json cut short", ("train",), REFUSED,
         "speculation.draft: {tmp}/draft/draft_config.json: not valid JSON", files=CUT_DRAFT,
         config=tiny_run(speculation={"mode": "adaptive", "draft": "{tmp}/draft"})),
    Case("a draft_config.json without its target", ("train",), REFUSED,
         "{tmp}/draft/draft_config.json: expected a JSON object whose 'target'", files=UNTARGETED_DRAFT,
         config=tiny_run(speculation={"mode": "adaptive", "draft": "{tmp}/draft"})),
    Case("profile a draft_config.json cut short", ("profile", "--model", "{model}", "--draft", "{tmp}/draft",
         "--tokens", "1,2", "--repeats", "1", "--context_length", "8", "--output", "{tmp}/p.json"), REFUSED,
         "{tmp}/draft/draft_config.json: not valid JSON", files=CUT_DRAFT),
    Case("draft train onto a full disk", ("draft", "train", "--output", "{tmp}/d"), REFUSED,
         "--output: {tmp}/d needs about", config=tiny_run(), setup=fill_disk),
    Case("draft train when the disk fills as the draft is saved", ("draft", "train", "--output", "{tmp}/d"),
         REFUSED, "could not write the draft to {tmp}/d", config=tiny_run(), setup=fail_draft_writes,
         needs_model=True),
    Case("a 1-step run keeping up to 100 checkpoints on a disk with room for 2", ("train", "--save_total_limit",
         "100"), RUNS, "done: 1 steps", config=tiny_run(), setup=room_for_two_checkpoints),
    # -- a key twice in a config file -----------------------------------------------------------------------------
    Case("a key twice in a config file", ("train", "--config", "{tmp}/dup.yaml"), REFUSED,
         "{tmp}/dup.yaml: max_steps appears twice, on lines 1 and 2", files={"dup.yaml": DUPLICATE_KEY}),
    Case("a nested key twice in a config file", ("train", "--config", "{tmp}/dup.yaml"), REFUSED,
         "dup.yaml: speculation.mode appears twice, on lines 2 and 3",
         files={"dup.yaml": "speculation:\n  mode: off\n  mode: static\n"}),
    Case("a whole section twice in a config file", ("train", "--config", "{tmp}/dup.yaml"), REFUSED,
         "dup.yaml: speculation appears twice, on lines 1 and 4",
         files={"dup.yaml": "speculation:\n  mode: off\nmax_steps: 1\nspeculation:\n  nodes: 4\n"}),
    Case("a key twice in eval's config file", ("eval", "--config", "{tmp}/dup.yaml"), REFUSED,
         "dup.yaml: max_steps appears twice, on lines 1 and 2", files={"dup.yaml": DUPLICATE_KEY}),
    Case("a key twice in draft train's config file", ("draft", "train", "--output", "{tmp}/d", "--config",
         "{tmp}/dup.yaml"), REFUSED, "dup.yaml: dataset.digits appears twice, on lines 2 and 3",
         files={"dup.yaml": "dataset:\n  digits: 1\n  digits: 2\n"}),
    Case("a key twice in generate's config file", ("generate", "--config", "{tmp}/dup.yaml"), REFUSED,
         "dup.yaml: prompt appears twice, on lines 1 and 2", files={"dup.yaml": "prompt: hi\nprompt: ho\n"}),
    # -- ~ in paths -------------------------------------------------------------------------------------------------
    Case("~ in the --config path", ("train", "--config", "~/dup.yaml"), REFUSED,
         "{tmp}/dup.yaml: max_steps appears twice", files={"dup.yaml": DUPLICATE_KEY}, env=HOME),
    Case("~ in output_dir", ("train",), RUNS, "run in {tmp}/run", config=tiny_run(output_dir="~/run"), env=HOME),
    Case("~ in a model that does not exist", ("train",), REFUSED, "model: {tmp}/none does not exist",
         config=tiny_run(model="~/none"), env=HOME),
    Case("~ in generate's model", ("generate", "--model", "~/model", "--prompt", "hi", "--max_completion_length",
         "2"), RUNS, "tokens in", env={"HOME": "{model}/.."}),
    Case("~ in dataset.name", ("eval",), RUNS, '"dataset": "{tmp}/d.jsonl"', env=HOME,
         config=tiny_run(dataset={"name": "~/d.jsonl"}), files={"d.jsonl": TRAIN_ROW}),
    Case("~ in speculation.draft", ("train",), REFUSED, "speculation.draft: {tmp}/x is neither a directory",
         config=tiny_run(speculation={"mode": "adaptive", "draft": "~/x"}), files={"x/.keep": ""}, env=HOME),
    Case("~ in generate's --output", ("generate", "--model", "{model}", "--prompt", "hi", "--output",
         "~/f/out.jsonl"), REFUSED, "--output: {tmp}/f is a file", files={"f": ""}, env=HOME),
    Case("~ in draft train's --output", ("draft", "train", "--output", "~/f/d"), REFUSED,
         "--output: {tmp}/f/d cannot be created", config=tiny_run(), files={"f": ""}, env=HOME),
    # -- options that do not apply ----------------------------------------------------------------------------------
    Case("eval a local file's test split", ("eval", "--dataset.split", "test"), REFUSED,
         "dataset.split applies to hub datasets and the arithmetic generator, not to the local file {tmp}/d.jsonl",
         config=tiny_run(dataset={"name": "{tmp}/d.jsonl"}), files={"d.jsonl": TRAIN_ROW}),
    Case("train on a local file's test split", ("train",), REFUSED, "dataset.split applies to hub datasets",
         config=tiny_run(dataset={"name": "gsm8k", "path": "{tmp}/g.jsonl", "split": "test"}),
         files={"g.jsonl": GSM8K_ROW}),
    Case("arithmetic rows of a GSM8K file", ("train",), REFUSED,
         "dataset.num_examples applies to the arithmetic generator only, not to the dataset gsm8k",
         config=tiny_run(dataset={"name": "gsm8k", "path": "{tmp}/g.jsonl", "num_examples": 256}),
         files={"g.jsonl": GSM8K_ROW}),
    Case("eval a GSM8K file with arithmetic digits", ("eval", "--dataset.digits", "2"), REFUSED,
         "dataset.digits applies to the arithmetic generator only", files={"g.jsonl": GSM8K_ROW},
         config=tiny_run(dataset={"name": "gsm8k", "path": "{tmp}/g.jsonl"})),
    # -- the dry run checks what training checks ----------------------------------------------------------------
    Case("dry run at temperature 0", ("train", "--dry-run"), REFUSED, "temperature: 0 samples greedily",
         config=tiny_run(temperature=0.0)),
    Case("dry run beyond the context", ("train", "--dry-run"), REFUSED,
         "exceed the model's context of 2048 tokens", config=tiny_run(max_completion_length=4000)),
    Case("dry run with an unknown drafter", ("train", "--dry-run"), REFUSED,
         "speculation.drafter must be one of ['eagle', 'suffix']",
         config=tiny_run(speculation={"mode": "off", "drafter": "medusa"})),
    # -- sizes bounded ------------------------------------------------------------------------------------------------
    Case("generate beyond the context", ("generate", "--model", "{model}", "--prompt", "hi",
         "--max_completion_length", "100000000"), REFUSED, "exceed the model's context of 2048 tokens"),
    Case("eval beyond the context", ("eval", "--max_completion_length", "3000"), REFUSED,
         "exceed the model's context of 2048 tokens", config=tiny_run()),
    Case("draft train beyond the context", ("draft", "train", "--output", "{tmp}/d", "--max_prompt_length", "2048"),
         REFUSED, "exceed the model's context of 2048 tokens", config=tiny_run()),
    train("a billion arithmetic rows", REFUSED, "dataset.num_examples: 1000000000 arithmetic rows (operands: 2, "
          "digits: 1) would take about", dataset={"num_examples": 10**9}),
    train("arithmetic questions of 10**8 operands", REFUSED, "arithmetic rows (operands: 100000000, digits: 1)",
          dataset={"operands": 10**8}),
    train("arithmetic answers of 5000 digits", REFUSED, "dataset.digits: answers of 5000-digit numbers",
          dataset={"digits": 5000}),
    Case("dry run of a billion arithmetic rows", ("train", "--dry-run"), REFUSED,
         "dataset.num_examples: 1000000000 arithmetic rows", config=tiny_run(dataset={"num_examples": 10**9})),
    train("more arithmetic rows than questions", WARNS,
          "has 67 distinct questions, fewer than num_examples (100): they repeat", dataset={"num_examples": 100}),
    Case("eval a batch of a billion", ("eval", "--batch_size", "1000000000"), RUNS, '"examples": 8',
         config=tiny_run()),
    Case("draft train a batch of a billion", ("draft", "train", "--output", "{tmp}/d", "--batch_size",
         "1000000000"), RUNS, '"draft": "{tmp}/d"', config=tiny_run()),
    # -- checkpoints are data: a pickled call is refused, never run -------------------------------------------------
    Case("resuming a trainer state holding a pickled call", ("train", "--resume", "--max_steps", "2"), REFUSED,
         "checkpoint-1/trainer_state.pt holds more than data (a pickled reference to posix.system)", config=tiny_run(),
         first=("train",), setup=pickled_call_in("run/checkpoint-1/trainer_state.pt")),
    Case("resuming learners' state holding a pickled call", ("train", "--resume", "--max_steps", "3"), REFUSED,
         "draft/learners.pt holds more than data (a pickled reference to posix.system)", first=("train",),
         config=tiny_run(max_steps=2, speculation={"mode": "adaptive"}),
         setup=pickled_call_in("run/checkpoint-2/draft/learners.pt")),
    Case("a draft's learners' state holding a pickled call", ("train",), REFUSED,
         "{tmp}/x/learners.pt holds more than data (a pickled reference to posix.system)",
         config=tiny_run(speculation={"mode": "adaptive", "draft": "{tmp}/x"}), setup=pickled_call_in("x/learners.pt"),
         needs_model=True),
    Case("resuming a checkpoint whose layout is the string '2'", ("train", "--resume", "--max_steps", "2"), REFUSED,
         "holds layout '2', not the whole-number layout", config=tiny_run(), first=("train",), setup=set_layout("2")),
    # -- broken weights, named before the model computes anything ---------------------------------------------------
    *(broken_weights(command, kind) for command in ("train", "generate") for kind in BROKEN_WEIGHTS),
    *(broken_weights(command, kind) for command in ("eval", "profile", "draft train")
      for kind in ("empty", "header", "shape", "nan")),
    # -- float options a float32 cannot hold, and NaN in lists --------------------------------------------------------
    train("delta of 1e308", REFUSED, "delta must fit a float32", delta=1e308),
    train("epsilon of 1e308", REFUSED, "epsilon must fit a float32", epsilon=1e308),
    train("cispo's epsilon_high of 1e39", REFUSED, "epsilon_high must fit a float32", loss_type="cispo",
          epsilon_high=1e39),
    train("sapo's positive temperature of 1e39", REFUSED, "sapo_temperature_pos must fit a float32", loss_type="sapo",
          sapo_temperature_pos=1e39),
    train("sapo's negative temperature of 1e-40", REFUSED, "sapo_temperature_neg must be 0 or at least 1.175e-38",
          loss_type="sapo", sapo_temperature_neg=1e-40),
    train("a learning rate of 1e39", REFUSED, "learning_rate must fit a float32", learning_rate=1e39),
    train("a draft learning rate of 1e39", REFUSED, "draft_training.learning_rate must fit a float32",
          draft_training={"learning_rate": 1e39}),
    train("a KL weight of 1e39", REFUSED, "beta must fit a float32", beta=1e39),
    train("a temperature of 1e-40", REFUSED, "temperature must be 0 or at least 1.175e-38", temperature=1e-40),
    train("a reward weight that is NaN", REFUSED, "reward_weights[0] must be a finite number, got nan",
          reward_weights=[math.nan]),
    train("a reward weight of 1e39", REFUSED, "reward_weights[0] must fit a float32", reward_weights=[1e39]),
    train("a gradient clip of 1e39", REFUSED, "max_grad_norm must fit a float32", max_grad_norm=1e39),
    train("an importance-sampling cap of 1e39", REFUSED, "importance_sampling_clip_max must fit a float32",
          importance_sampling_correction=True, importance_sampling_clip_max=1e39),
    Case("generate at a temperature of 1e-40", ("generate", "--prompt", "hi", "--temperature", "1e-40"), REFUSED,
         "temperature must be 0 or at least 1.175e-38"),
    Case("generate with min_p 1e-45", ("generate", "--prompt", "hi", "--min_p", "1e-45"), REFUSED,
         "min_p must be 0 or at least 1.175e-38"),
    Case("eval at a temperature of 1e-40", ("eval", "--temperature", "1e-40"), REFUSED,
         "temperature must be 0 or at least 1.175e-38", config=tiny_run()),
    Case("draft train a draft learning rate of 1e39", ("draft", "train", "--output", "{tmp}/d",
         "--draft_training.learning_rate", "1e39"), REFUSED, "draft_training.learning_rate must fit a float32",
         config=tiny_run()),
    Case("draft train a greedy fraction of 1e-40", ("draft", "train", "--output", "{tmp}/d", "--greedy_fraction",
         "1e-40"), REFUSED, "greedy_fraction must be 0 or at least 1.175e-38", config=tiny_run()),
    # -- outputs never overwrite inputs -------------------------------------------------------------------------------
    Case("generate into its prompts file", ("generate", "--model", "{model}", "--prompts_file", "{tmp}/p.txt",
         "--output", "{tmp}/p.txt"), REFUSED, "--output: {tmp}/p.txt is --prompts_file {tmp}/p.txt (the same path)",
         files={"p.txt": "hi\n"}),
    Case("generate into a link to its prompts file", ("generate", "--model", "{model}", "--prompts_file",
         "{tmp}/p.txt", "--output", "{tmp}/out.jsonl"), REFUSED, "--output: {tmp}/out.jsonl is --prompts_file",
         files={"p.txt": "hi\n"}, setup=link("out.jsonl", "p.txt")),
    Case("generate into its prompts file through a linked directory", ("generate", "--model", "{model}",
         "--prompts_file", "{tmp}/p.txt", "--output", "{tmp}/ln/p.txt"), REFUSED, "is --prompts_file {tmp}/p.txt",
         files={"p.txt": "hi\n"}, setup=link("ln", ".")),
    Case("generate into its config file", ("generate", "--model", "{model}", "--config", "{tmp}/g.yaml", "--output",
         "{tmp}/g.yaml"), REFUSED, "--output: {tmp}/g.yaml is --config {tmp}/g.yaml", files={"g.yaml": "prompt: hi\n"}),
    Case("generate into the model's config.json", ("generate", "--model", "{tmp}/own", "--prompt", "hi", "--output",
         "{tmp}/own/config.json"), REFUSED, "--output: {tmp}/own/config.json is a file of --model {tmp}/own",
         setup=own_model),
    Case("profile into the model's config.json", ("profile", "--model", "{tmp}/own", "--tokens", "1,2", "--repeats",
         "1", "--context_length", "8", "--output", "{tmp}/own/config.json"), REFUSED,
         "--output: {tmp}/own/config.json is a file of --model {tmp}/own", setup=own_model),
    Case("draft train into the model's directory", ("draft", "train", "--output", "{tmp}/own"), REFUSED,
         "--output: {tmp}/own is model {tmp}/own (the same path)", config=tiny_run(model="{tmp}/own"),
         setup=own_model),
    Case("overwriting the run a checkpoint of which is the model", ("train", "--overwrite_output_dir", "true",
         "--model", "{tmp}/run/checkpoint-1"), REFUSED,
         "overwrite_output_dir: model {tmp}/run/checkpoint-1 is inside output_dir", config=tiny_run(),
         first=("train",)),
    # -- ~ everywhere, unknown users refused ---------------------------------------------------------------------------
    Case("~ in FASTGRPO_CACHE", ("generate", "--model", "{model}", "--prompt", "hi"), REFUSED,
         "FASTGRPO_CACHE: {tmp}/f is a file", files={"f": ""}, env={"FASTGRPO_CACHE": "~/f", "HOME": "{tmp}"}),
    Case("an unknown user in FASTGRPO_CACHE", ("generate", "--model", "{model}", "--prompt", "hi"), REFUSED,
         "FASTGRPO_CACHE: ~nosuchuser_fastgrpo/c starts with ~ but the user 'nosuchuser_fastgrpo' is not known",
         env={"FASTGRPO_CACHE": "~nosuchuser_fastgrpo/c"}),
    train("an unknown user in output_dir", REFUSED, "output_dir: ~nosuchuser_fastgrpo/run starts with ~ but the user",
          output_dir="~nosuchuser_fastgrpo/run"),
    train("an unknown user in the model", REFUSED, "model: ~nosuchuser_fastgrpo/m starts with ~ but the user",
          model="~nosuchuser_fastgrpo/m"),
    Case("an unknown user in the --config path", ("train", "--config", "~nosuchuser_fastgrpo/c.yaml"), REFUSED,
         "--config: ~nosuchuser_fastgrpo/c.yaml starts with ~ but the user"),
    Case("~ in report's run directory", ("report", "~/r"), RUNS, "plots: {tmp}/r/report", env=HOME,
         files={"r/metrics.jsonl": METRICS}),
    Case("~ in report's --output", ("report", "{tmp}/r", "--output", "~/plots"), RUNS, "plots: {tmp}/plots/curves.png",
         env=HOME, files={"r/metrics.jsonl": METRICS}),
    Case("an unknown user in report's run directory", ("report", "~nosuchuser_fastgrpo/r"), REFUSED,
         "report: ~nosuchuser_fastgrpo/r starts with ~ but the user"),
    # -- the remaining messages made true ------------------------------------------------------------------------------
    Case("WORLD_SIZE that is not a number", ("train",), REFUSED,
         "the environment variable WORLD_SIZE must be a whole number (torchrun sets it), got 'four'", config=tiny_run(),
         env={"WORLD_SIZE": "four", "RANK": "0"}),
    Case("dry run with WORLD_SIZE that is not a number", ("train", "--dry-run"), REFUSED,
         "the environment variable WORLD_SIZE must be a whole number", config=tiny_run(), env={"WORLD_SIZE": "four"}),
    Case("a dataset path that links to a directory", ("train",), REFUSED,
         "dataset: {tmp}/d.jsonl (a link to {tmp}/dir) is a directory, not a dataset file",
         config=tiny_run(dataset={"name": "{tmp}/d.jsonl"}), files={"dir/x": ""}, setup=link("d.jsonl", "dir")),
    Case("starting again in a run killed before its first checkpoint", ("train",), REFUSED,
         "holds another run that saved no checkpoint yet (so --resume cannot continue it)", config=tiny_run(),
         first=("train",), setup=no_checkpoint_yet),
    Case("generate with a train config holding stop", ("generate", "--config", "{tmp}/t.yaml", "--prompt", "hi"),
         REFUSED, "unknown option stop (stop is an option of fastgrpo train that this command does not use",
         files={"t.yaml": "stop: [END]\n"}),
    Case("generate --stop", ("generate", "--prompt", "hi", "--stop", "[END]"), REFUSED,
         "stop is an option of fastgrpo train that this command does not use"),
    Case("a dangling link as output_dir", ("train",), REFUSED,
         "output_dir {tmp}/run is a link to {tmp}/gone, which does not exist", config=tiny_run(),
         setup=link("run", "gone")),
    # -- inputs --------------------------------------------------------------------------------------------------------
    dataset_file("a user message with empty content", "line 1: prompt column 'prompt' has a user message whose "
                 "content is empty", json.dumps({"prompt": [{"role": "user", "content": " "}], "answer": "4"}) + "\n"),
    prompts_file("generate a user message with empty content", "line 1: 'prompt' has a user message whose content is "
                 "empty", json.dumps({"prompt": [{"role": "user", "content": ""}]}) + "\n"),
    Case("generate from a .txt file with a byte-order mark", ("generate", "--model", "{model}", "--prompts_file",
         "{tmp}/p.txt", "--max_completion_length", "2"), RUNS, "--- hi\n", files={"p.txt": "\ufeffhi\n".encode()}),
    # -- every option acts or is refused -------------------------------------------------------------------------------
    train("an importance-sampling cap with the correction off", REFUSED,
          "importance_sampling_clip_max has no effect with importance_sampling_correction is false",
          importance_sampling_clip_max=2.0),
    train("an importance-sampling mode with the correction off", REFUSED,
          "importance_sampling_mode has no effect with importance_sampling_correction is false",
          importance_sampling_mode="token_mask"),
    train("a masking correction whose range leaves out 1", REFUSED, "importance_sampling_clip_max 0.5 leaves out a "
          "ratio of 1", importance_sampling_correction=True, importance_sampling_mode="token_mask",
          importance_sampling_clip_max=0.5),
    train("a sequence mask from a ratio above 1", REFUSED, "importance_sampling_clip_min 1.5 leaves out a ratio of 1",
          importance_sampling_correction=True, importance_sampling_clip_min=1.5),
    train("delta with cispo", REFUSED, "delta has no effect with loss_type cispo", loss_type="cispo",
          epsilon_high=5.0, delta=10.0),
    train("delta with sapo", REFUSED, "delta has no effect with loss_type sapo", loss_type="sapo", delta=10.0),
    train("a sapo temperature with dapo", REFUSED, "sapo_temperature_pos has no effect with loss_type dapo",
          sapo_temperature_pos=2.0),
    train("a vespo option with grpo", REFUSED, "vespo_k_neg has no effect with loss_type grpo", loss_type="grpo",
          vespo_k_neg=2.0),
    train("delta with vespo", REFUSED, "delta has no effect with loss_type vespo", loss_type="vespo", delta=10.0),
    train("vespo with sequence weights", REFUSED, "importance_sampling_mode sequence_mask: loss_type vespo takes",
          loss_type="vespo", importance_sampling_correction=True),
    Case("eval a sapo temperature with grpo", ("eval", "--sapo_temperature_neg", "2"), REFUSED,
         "sapo_temperature_neg has no effect with loss_type grpo", config=tiny_run(loss_type="grpo")),
    train("a saved draft with speculation off", REFUSED, "speculation.draft has no effect with speculation.mode: off",
          speculation={"mode": "off", "draft": "{tmp}"}),
    train("draft options with the suffix drafter alone", REFUSED, "draft_training.learning_rate (0.001): no effect "
          "with speculation.drafter suffix (it learns no draft network)",
          speculation={"mode": "static", "drafter": "suffix"}, draft_training={"learning_rate": 1e-3}),
    train("draft options with speculation off", REFUSED, "draft_training.epochs (2), draft_training.unroll (2): no "
          "effect with speculation.mode: off", speculation={"mode": "off"}, draft_training={"epochs": 2, "unroll": 2}),
    Case("a dry run with draft options and the suffix drafter", ("train", "--dry-run"), REFUSED,
         "draft_training.epochs (3): no effect with speculation.drafter suffix",
         config=tiny_run(speculation={"drafter": "suffix"}, draft_training={"epochs": 3})),
    Case("eval with num_generations 4", ("eval", "--num_generations", "4"), WARNS,
         "num_generations (4) is not used: eval samples one completion per prompt", config=tiny_run()),
    Case("eval with num_generations 1", ("eval", "--num_generations", "1"), WARNS,
         "num_generations (1) is not used", config=tiny_run()),
    Case("profile an EAGLE draft for the suffix drafter", ("profile", "--model", "{model}", "--draft", "{tmp}/draft",
         "--speculation.drafter", "suffix"), REFUSED, "speculation.draft: {tmp}/draft is neither a directory saved by "
         "a drafter of speculation.drafter (suffix", setup=save_qwen_draft),
    # -- drafters as a list --------------------------------------------------------------------------------------------
    Case("drafters as a YAML list", ("train", "--dry-run"), RUNS, "memory plan of",
         config=tiny_run(speculation={"drafter": ["eagle", "suffix"]})),
    Case("drafters as a list on the command line", ("train", "--dry-run", "--speculation.drafter", "[eagle, suffix]"),
         RUNS, "memory plan of", config=tiny_run(speculation={"mode": "adaptive"})),
    Case("a list of drafters naming an unknown one", ("train", "--dry-run"), REFUSED,
         "speculation.drafter must be one of ['eagle', 'suffix'] or several joined by '+' (each once), got "
         "'eagle+medusa'", config=tiny_run(speculation={"drafter": ["eagle", "medusa"]})),
    Case("a list of drafters that are not names", ("train", "--dry-run"), REFUSED,
         "speculation.drafter must be of type str", config=tiny_run(speculation={"drafter": [1, 2]})),
    Case("profile drafters as a list", ("profile", "--speculation.drafter", "[suffix, medusa]"), REFUSED,
         "speculation.drafter must be one of ['eagle', 'suffix'] or several joined by '+' (each once), got "
         "'suffix+medusa'"),
    # -- damaged run state, named and passed over ----------------------------------------------------------------------
    resumed_adaptive("resuming with learners.pt deleted", "draft/learners.pt is missing: the learners of",
                     remove_file("checkpoint-2/draft/learners.pt")),
    resumed_adaptive("resuming with learners.pt an empty dict", "learners.pt holds no state for the suffix drafter: "
                     "its learner starts afresh", save_learners({})),
    resumed_adaptive("resuming with learners.pt of another structure", "drafter's state does not fit its learner",
                     save_learners(lambda saved: {name: {"x": 1} for name in saved})),
    resumed_adaptive("resuming with learners.pt a list", "learners.pt holds a list, not learners' states",
                     save_learners([1, 2])),
    resumed_adaptive("resuming with a price that is text", "schedule.json: not used, the controller and the drafters' "
                     "prices start afresh (ValueError: drafters.suffix.price[0]: expected a number, got 'abc'",
                     suffix_price(["abc", 1, 1, 1, 1])),
    resumed_adaptive("resuming with a price of two numbers", "drafters.suffix.price: expected a list of 5",
                     suffix_price([1.0, 2.0])),
    resumed_adaptive("resuming with schedule.json deleted", "draft/schedule.json is missing: the controller",
                     remove_file("checkpoint-2/draft/schedule.json")),
    resumed_adaptive("resuming with the draft directory deleted", "checkpoint-2/draft is missing: the drafters",
                     remove_tree("checkpoint-2/draft")),
]
# fmt: on


def _fill(value: Any, tmp: Path, model: Path) -> Any:
    if isinstance(value, str):
        return value.replace("{tmp}", str(tmp)).replace("{model}", str(model))
    if isinstance(value, dict):
        return {k: _fill(v, tmp, model) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_fill(v, tmp, model) for v in value)
    return value


@dataclass
class Result:
    outcome: str
    code: int | None
    output: str  # standard error, then the log records


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def run_case(case: Case, tmp: Path, model: Path) -> Result:
    """Run ``case`` in ``tmp`` (an empty directory) against the tiny ``model`` and classify what it did."""
    import fastgrpo.models

    for name, content in case.files.items():
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    argv, first = list(_fill(case.argv, tmp, model)), list(_fill(case.first, tmp, model))
    if case.config is not None:
        config = tmp / "c.yaml"
        config.write_text(yaml.safe_dump(_fill(case.config, tmp, model)))
        argv += ["--config", str(config)]
        first += ["--config", str(config)] if first else []
    if first:
        _run_first(first)
    if case.setup is not None:
        case.setup(tmp)
    loaded = []
    real_load = fastgrpo.models.load_model

    def load_model(*args: Any, **kwargs: Any) -> Any:
        loaded.append(args[0])
        return real_load(*args, **kwargs)

    env = _fill(case.env, tmp, model)
    patched = _patch(load_model)
    try:
        if case.processes > 1:
            code, err, rest = run_job(argv, env, tmp, case.processes, case.kill)
        else:
            code, err, rest = _invoke(argv, env)
    finally:
        _unpatch(patched)
    if code is None:
        return Result("traceback", None, err)
    text = err + rest
    says = _fill(case.says, tmp, model)
    said = all(part in text for part in ((says,) if isinstance(says, str) else says))
    if "Traceback" in err:
        outcome = "traceback"
    elif code != 0:
        if case.expect != REFUSED:
            outcome = "refused wrongly"
        elif not said:
            outcome = "other message"
        else:
            outcome = "late message" if loaded and not case.needs_model else "message"
    elif case.expect == REFUSED:
        outcome = "silent"
    else:
        outcome = GOOD[case.expect] if said else "silent"
    return Result(outcome, code, text)


def _invoke(argv: list[str], env: dict[str, str]) -> tuple[int | None, str, str]:
    """``fastgrpo ARGV`` in this process with ``env`` set: its exit code (None: it raised, and the traceback is
    returned as its standard error), its standard error, and its log records and standard output."""
    from fastgrpo.cli import main

    saved_env = {k: os.environ.get(k) for k in env}
    records, root = _Records(), logging.getLogger()
    err, out = io.StringIO(), io.StringIO()
    root.addHandler(records)
    old_level = root.level
    root.setLevel(logging.INFO)
    os.environ.update(env)
    code: int | None
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            main(argv)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 2
    except Exception:
        return None, traceback.format_exc(limit=-3), ""
    finally:
        root.removeHandler(records)
        root.setLevel(old_level)
        for k, v in saved_env.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    return code, err.getvalue(), "\n".join(records.lines) + out.getvalue()


def run_job(
    argv: list[str], env: dict[str, str], tmp: Path, processes: int, kill: Kill | None = None
) -> tuple[int | None, str, str]:
    """``fastgrpo ARGV`` as a job of ``processes`` processes forked from this one, each given RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT as a launcher without an agent gives them (srun, mpirun): rank 0 holds the job's store,
    and nothing stops the others when one dies. ``kill``: a process killed once its file exists. What `_invoke`
    returns for the first process not killed; exit code None (a failure) also when a process did not end within
    300 s, the kill did not land while the file existed, or another process not killed raised, or failed where the
    judged one succeeded."""
    import multiprocessing

    port, context = free_port(), multiprocessing.get_context("fork")
    outputs = [tmp / f"rank{rank}.json" for rank in range(processes)]
    for output in outputs:
        output.unlink(missing_ok=True)
    jobs = [
        context.Process(target=_job_process, args=(argv, env, rank, processes, port, outputs[rank]))
        for rank in range(processes)
    ]
    deadline, landed = time.monotonic() + 300, kill is None
    try:
        for process in jobs:
            process.start()
        if kill is not None:
            victim = jobs[kill.rank]
            while not (tmp / kill.after).exists() and victim.is_alive() and time.monotonic() < deadline:
                time.sleep(0.02)
            landed = victim.is_alive() and (tmp / kill.after).exists()
            victim.kill()
        for process in jobs:
            process.join(max(0.0, deadline - time.monotonic()))
    finally:
        for process in jobs:
            if process.is_alive():
                process.kill()
                process.join()
    if not landed:
        return None, f"the kill of rank {kill.rank} did not land once {kill.after} existed", ""
    results = {rank: json.loads(output.read_text()) for rank, output in enumerate(outputs) if output.exists()}
    judged = 1 if kill is not None and kill.rank == 0 else 0
    if judged not in results:
        return None, f"rank {judged} ended without a result (exit code {jobs[judged].exitcode})", ""
    code, err, rest = results[judged]
    for rank in range(processes):
        if rank == judged or (kill is not None and rank == kill.rank):
            continue
        other, other_err, _ = results.get(rank, (None, f"no result (exit code {jobs[rank].exitcode})", ""))
        if other is None or "Traceback" in other_err or (code == 0 and other != 0):
            return None, f"rank {rank} (exit code {other}): {other_err}", ""
    return code, err, rest


def _job_process(argv: list[str], env: dict[str, str], rank: int, world: int, port: int, output: Path) -> None:
    """Process ``rank`` of `run_job`'s job: `_invoke`'s result written to ``output``."""
    import torch

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    logging.getLogger().handlers.clear()  # the parent's handlers report the parent's tests
    output.write_text(json.dumps(_invoke(argv, env)))
    os._exit(0)


def _run_first(argv: list[str]) -> None:
    """Run ``fastgrpo ARGV``, which must succeed, quietly."""
    from fastgrpo.cli import main

    quiet = io.StringIO()
    with contextlib.redirect_stderr(quiet), contextlib.redirect_stdout(quiet):
        try:
            main(argv)
        except SystemExit as e:
            raise RuntimeError(f"the case's first command failed: {quiet.getvalue()[-2000:]}") from e


def _patch(load_model: Callable[..., Any]) -> list[tuple[Any, str, Any]]:
    """Count model loads wherever the commands take ``load_model`` from."""
    import importlib

    patched = []
    for module_name in ("fastgrpo.models", "fastgrpo.grpo.trainer"):
        module = importlib.import_module(module_name)
        if hasattr(module, "load_model"):
            patched.append((module, "load_model", module.load_model))
            module.load_model = load_model
    return patched


def _unpatch(patched: list[tuple[Any, str, Any]]) -> None:
    for module, name, value in patched:
        setattr(module, name, value)


def main() -> None:
    """Run every case (each in a fresh directory) and print its outcome and the counts."""
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        root_path = Path(root)
        os.environ["FASTGRPO_CACHE"] = str(root_path / "cache")
        model = save_tiny_llama(root_path / "model", seed=0, tie_word_embeddings=True)
        counts: Counter[str] = Counter()
        for index, case in enumerate(CASES):
            tmp = root_path / f"case{index}"
            tmp.mkdir()
            result = run_case(case, tmp, model)
            counts[result.outcome] += 1
            last = result.output.strip().splitlines()[-1][:160] if result.output.strip() else ""
            print(f"{result.outcome:15} | {case.name} | {last}", flush=True)
    print(f"\n{len(CASES)} cases: " + ", ".join(f"{n} {outcome}" for outcome, n in counts.most_common()))


if __name__ == "__main__":
    main()
