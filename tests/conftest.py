"""Shared fixtures: tiny random float64 causal LMs of the supported families, built once per session, and a tiny
Llama saved to disk with the SmolLM2 tokenizer for trainer runs, and a two-process torchrun launcher."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from fastgrpo.models import load_tokenizer
from fastgrpo.rollout.compiled import Compiled
from fastgrpo.rollout.drafter import Drafter
from fastgrpo.rollout.tree import TreeShape
from fastgrpo.speculative.controller import AdaptiveController
from fastgrpo.speculative.eagle.drafter import EagleCost
from fastgrpo.speculative.plugin import cost_probes
from fastgrpo.speculative.profiler import LatencyProfile, ProbeFactory
from fastgrpo.speculative.registry import PLUGINS

FAMILIES = ("llama", "qwen2", "qwen3")
# The modules whose tests take longest together, longest first: `make test`'s two workers (pytest-xdist, a module to a
# worker) start them first, so that no long module is left running alone at the end.
LONGEST_FIRST = (
    "test_gpu_check.py",
    "test_bad_input_matrix.py",
    "test_speculative.py",
    "test_trainer.py",
    "test_fsdp.py",
    "test_end_to_end.py",
    "test_distributed.py",
    "test_tool_turns.py",
    "test_async.py",
    "test_target_step.py",
    "test_bad_inputs.py",
    "test_fused_attention.py",
    "test_embedded_model.py",
    "test_trl_integration.py",
    "test_trl_recipes.py",
    "test_settled_shapes.py",
    "test_controller.py",
    "test_captured_run.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """`LONGEST_FIRST`'s modules first; every module's tests, and the other modules, in their order."""
    place = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: place.get(item.path.name, len(place)))


def pytest_configure(config: pytest.Config) -> None:
    """Under `make test`'s two workers, each computes on one thread: the two together use the two cores, as one
    process on both does alone. The tests, and the processes they start, trace their compiled steps without the fake
    tensors' dispatch cache: over these two-layer models and the one-layer draft its entries are rarely met again,
    and building them costs more than it saves (a third of the tracing of a step and a proposal; a model of many
    layers, which repeats its layers' operations, gains from the cache, so that the package leaves it on)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
    os.environ["TORCH_FAKE_TENSOR_DISPATCH_CACHE"] = "0"
    torch._dynamo.config.fake_tensor_cache_enabled = False


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Tests (and the processes they start) keep latency profiles in a cache of their own, so that a profile saved
    on this machine by a real run changes no test and no test leaves profiles behind; the converted embedded model
    is shared with the user's cache (converted there once)."""
    from fastgrpo.models import resolve_model_path

    converted = Path(resolve_model_path("smollm2"))
    root = tmp_path_factory.mktemp("fastgrpo-cache")
    (root / converted.name).symlink_to(converted)
    before = os.environ.get("FASTGRPO_CACHE")
    os.environ["FASTGRPO_CACHE"] = str(root)
    yield root
    if before is None:
        del os.environ["FASTGRPO_CACHE"]
    else:
        os.environ["FASTGRPO_CACHE"] = before


VOCAB = 128

_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}


@pytest.fixture
def no_model_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if any command loads a model (where the commands take ``load_model`` from)."""
    import fastgrpo.models
    from fastgrpo.grpo import trainer

    def load_model(*args: object, **kwargs: object) -> None:
        pytest.fail("a model loaded before the refusal")

    monkeypatch.setattr(fastgrpo.models, "load_model", load_model)
    monkeypatch.setattr(trainer, "load_model", load_model)


def make_tiny_model(family: str, seed: int = 0) -> PreTrainedModel:
    """A seeded random float64 model of ``family`` with SDPA attention, in eval mode.

    Initialisation is widened (std 0.2 instead of 0.02) so the logits are far from uniform: the models then
    emit a few favourite tokens, which gives greedy decoding natural early stops on a chosen EOS id.
    """
    if family == "llama":
        config, cls = LlamaConfig(**_COMMON), LlamaForCausalLM
    elif family == "qwen2":
        config, cls = Qwen2Config(**_COMMON), Qwen2ForCausalLM
    elif family == "qwen3":
        config, cls = Qwen3Config(**_COMMON, head_dim=16), Qwen3ForCausalLM
    else:
        raise ValueError(f"unknown family {family!r}")
    config.initializer_range = 0.2
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = cls(config).double().eval()
    return model


_MODELS: dict[str, PreTrainedModel] = {}


def tiny_model(family: str) -> PreTrainedModel:
    """The session-wide tiny model of ``family`` (built on first use)."""
    if family not in _MODELS:
        _MODELS[family] = make_tiny_model(family)
    return _MODELS[family]


@pytest.fixture(scope="module")
def model_draft() -> tuple[PreTrainedModel, torch.nn.Module]:
    """`test_speculative`'s float64 tiny Qwen2 model and a fresh EAGLE head for it (seeded), which the tests of refilled
    rows and of calls that span generations draft with."""
    from test_speculative import tiny_model as float64_model

    from fastgrpo.speculative.eagle.head import DraftHead

    model = float64_model("qwen2")
    torch.manual_seed(1)
    return model, DraftHead(model.config).double()


@pytest.fixture(params=FAMILIES)
def family_model(request: pytest.FixtureRequest) -> PreTrainedModel:
    """The tiny model of each supported family in turn."""
    return tiny_model(request.param)


@pytest.fixture
def llama_model() -> PreTrainedModel:
    """The tiny Llama model."""
    return tiny_model("llama")


def save_tiny_llama(path: Path, seed: int, tie_word_embeddings: bool, head_scale: float = 1.0) -> Path:
    """A tiny random Llama with the SmolLM2 tokenizer, saved like any Hugging Face model directory."""
    tokenizer = load_tokenizer("smollm2")
    torch.manual_seed(seed)
    config = LlamaConfig(
        **{**_COMMON, "vocab_size": len(tokenizer), "tie_word_embeddings": tie_word_embeddings},
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def tool_call_conversation(config: object, row: dict) -> tuple[list[int], list[int], list[int]]:
    """The prompt ids of ``row`` as a run with ``config``'s tools renders it, and a completion that calls
    ``add(a=2, b=3)``, reads the result ``5`` and answers: its ids and its tool mask."""
    from fastgrpo.grpo.prompts import StepPrompts
    from fastgrpo.grpo.tool_use import RunTools, resolve_run_tools

    tokenizer = load_tokenizer("smollm2")
    run = RunTools(*resolve_run_tools(config, [], [row]), tokenizer, config)
    prompt = StepPrompts([], tokenizer, 1, 0, 1, 0, 1024, render=run.render).encode([row])[0]
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    call_ids = tokenizer(call, add_special_tokens=False)["input_ids"]
    result = run.formats[run.environment(row)].suffix_ids([{"role": "tool", "name": "add", "content": "5"}])
    answer = tokenizer("The answer is 5.", add_special_tokens=False)["input_ids"]
    run.close()
    eos = tokenizer.eos_token_id
    completion = call_ids + [eos] + result + answer + [eos]
    mask = [1] * (len(call_ids) + 1) + [0] * len(result) + [1] * (len(answer) + 1)
    return prompt, completion, mask


def save_tool_caller(path: Path, configs: object | list, row: dict, steps: int = 120) -> Path:
    """A tiny Llama trained until it writes `tool_call_conversation`'s completion after ``row``'s prompt as each of
    ``configs`` renders it (the call, then the answer after the tool's result), its LM head then scaled up so that
    sampling at temperature 1 writes it too; saved at ``path`` with the SmolLM2 tokenizer."""
    save_tiny_llama(path, seed=0, tie_word_embeddings=False)
    conversations = [tool_call_conversation(c, row) for c in (configs if isinstance(configs, list) else [configs])]
    model = LlamaForCausalLM.from_pretrained(path)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    for _ in range(steps):
        optimizer.zero_grad()
        losses = []
        for prompt, completion, _ in conversations:
            ids = torch.tensor([prompt + completion], device="cpu")
            logits = model(ids, logits_to_keep=len(completion) + 1).logits[0, :-1]  # the completion's predictions
            losses.append(torch.nn.functional.cross_entropy(logits, ids[0, len(prompt) :]))
        loss = torch.stack(losses).max()
        torch.stack(losses).sum().backward()
        optimizer.step()
    assert loss.item() < 0.05, loss.item()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)
    return path


def save_tiny_scorer(path: Path, seed: int = 0) -> Path:
    """A tiny random Llama with a one-label classification head (a reward model), saved with the SmolLM2
    tokenizer."""
    tokenizer = load_tokenizer("smollm2")
    torch.manual_seed(seed)
    config = LlamaConfig(**{**_COMMON, "vocab_size": len(tokenizer)}, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    LlamaForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _forked_rank(rank: int, fn: Callable[..., None], *args: object) -> None:
    torch.set_num_threads(1)
    torch._dynamo.reset()  # the graphs this process compiled are the child's own to compile
    logging.getLogger().handlers.clear()  # pytest's capture handlers belong to the parent's reports
    fn(rank, *args)


def fork_ranks(fn: Callable[..., None], args: tuple, nprocs: int = 2) -> None:
    """``fn(rank, *args)`` in ``nprocs`` processes forked from this one, as ``torch.multiprocessing.spawn`` runs
    them (an exception in one is raised here) but without starting interpreters that import torch and transformers
    again; each computes on one thread, with no graph compiled yet."""
    mp.start_processes(_forked_rank, args=(fn, *args), nprocs=nprocs, join=True, start_method="fork")


def torchrun_two(
    args: list[str], env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --nproc_per_node 2 ARGS`` on a free local port, one thread per process,
    with ``env`` added to this process's environment; output captured."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([*cmd, *args], env=full_env, capture_output=True, text=True, timeout=timeout)


class ProfiledLevels(Drafter):
    """Prices trees as the EAGLE head's are priced (`EagleCost`, from a profile's ``eagle`` curve): what a controller
    tested without a drafter of its own is given."""

    def __init__(self, profile: LatencyProfile):
        self.price = EagleCost(profile)

    def cost(self, rows: int, shape: TreeShape, backlog: int = 1) -> float:
        return self.price(rows, shape, backlog)


def adaptive(profile: LatencyProfile, **options) -> AdaptiveController:
    """An adaptive controller over one unnamed drafter (the engine's only one) priced by `ProfiledLevels`."""
    return AdaptiveController(profile, drafters={"": ProfiledLevels(profile)}, **options)


def plugin_probes(
    model: PreTrainedModel, names: tuple[str, ...] = ("eagle",), backend: str | None = None
) -> ProbeFactory:
    """A latency profile's probes of the named drafters' plugins."""
    return cost_probes([PLUGINS[n] for n in names], model, backend)


STEP_SECONDS = {"plain_step": 0.05, "tree_step": 0.055}  # a steady step: a tree costs little more than a plain one
COLD = 100.0  # how much longer a step that compiles takes


@pytest.fixture
def fake_clock(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """The clocks the adaptive controller's prices are read from (the engine's steps, and the drafters' own timing
    of their proposals), advanced by the target's compiled steps alone (`STEP_SECONDS`, times `COLD` for a call
    that compiled or warmed up a graph), so that what the controller measures does not depend on the machine: a
    proposal takes no time."""
    clock = SimpleNamespace(now=0.0)
    fake = SimpleNamespace(perf_counter=lambda: clock.now)
    for module in ("rollout.engine", "speculative.suffix.drafter", "speculative.eagle.drafter"):
        monkeypatch.setattr(f"fastgrpo.{module}.time", fake)
    call = Compiled.__call__

    def timed(self: Compiled, device: torch.device, *args):
        before = self.cold_calls
        out = call(self, device, *args)
        clock.now += STEP_SECONDS.get(self.fn.__name__, 0.0) * (COLD if self.cold_calls > before else 1.0)
        return out

    monkeypatch.setattr(Compiled, "__call__", timed)
    return clock
