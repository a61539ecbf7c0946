"""What every section of `gpu_check` shares: the `Check` and `Section` it is handed, the model shapes, building
random models on the device, timing, counting the graphs torch compiled and the CUDA graphs it recorded, and reading
the SDPA backend from a profile."""

from __future__ import annotations

import gc
import math
import os
import random
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from gpu_check_budget import CompileClock
from record import REPO, Record
from transformers import (
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from fastgrpo.models import load_tokenizer
from fastgrpo.speculative.eagle.head import DraftHead

GPU_TOKENIZER = REPO / ".gpu" / "tokenizer"
MiB = 2**20
GiB = 2**30

SMOLLM2_SHAPE = dict(
    hidden_size=576,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    intermediate_size=1536,
    vocab_size=49152,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
)
TINY_LLAMA_SHAPE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=49152,
    tie_word_embeddings=True,
    max_position_embeddings=2048,
)
QWEN25_7B_SHAPE = dict(
    hidden_size=3584,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    intermediate_size=18944,
    vocab_size=152064,
    rope_theta=1e6,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
TINY_QWEN2_SHAPE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=1024,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
# The tiny float64 models of the correctness sections (as in the test suite): wide initialisation, so the logits are
# far from uniform and greedy completions hit a chosen EOS id in some rows.
TINY_VOCAB = 128
TINY_COMMON = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    initializer_range=0.2,
)
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),
}
ATTENTION_WORDS = ("flash", "fmha", "efficient", "cudnn", "attention", "sdp")
SDPA_BACKENDS = (  # aten op name fragment -> backend
    ("_scaled_dot_product_flash_attention_for_cpu", "flash (CPU)"),
    ("_scaled_dot_product_flash_attention", "flash"),
    ("_scaled_dot_product_efficient_attention", "memory-efficient"),
    ("_scaled_dot_product_cudnn_attention", "cuDNN"),
    ("_scaled_dot_product_attention_math", "math"),
    ("_scaled_dot_product_fused_attention_overrideable", "fused (overrideable)"),
)


# ------------------------------------------------------------------------------------------------ the harness


@dataclass
class Check:
    """What every section gets: where to run, how small, the record the tables go to, a scratch directory, when the
    time budget ends (a `time.perf_counter` value, None: no budget), the compile times expected and measured so far,
    whether the preflight found what compiling needs (None: no preflight ran), what earlier sections left (their
    results by section name and the models they built, `shared_model`), and how to write the record with a running
    section's results so far (`save`)."""

    device: torch.device
    quick: bool
    tokenizer: str | None
    record: Record
    scratch: Path
    clock: CompileClock
    deadline: float | None = None
    compile_ok: bool | None = None
    captures_counted: bool | None = None  # whether `counted_captures` saw the preflight's recording (None: not run)
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    models: dict[str, PreTrainedModel] = field(default_factory=dict)
    saver: Callable[[Section], None] | None = None
    first: bool = False  # ``--first``: the sections that sweep measure the points a first GPU run needs

    def seconds_left(self) -> float:
        """Seconds until the end of the time budget (infinite without one)."""
        return math.inf if self.deadline is None else self.deadline - time.perf_counter()

    def shared_model(self, key: str, build: Callable[[], PreTrainedModel]) -> PreTrainedModel:
        """The model ``key`` an earlier section built, or ``build()`` kept for the later ones."""
        if key not in self.models:
            self.models[key] = build()
        return self.models[key]

    def save(self, section: Section) -> None:
        """Write the record now, with what the running ``section`` has measured so far (called after each point)."""
        if self.saver is not None:
            self.saver(section)


@dataclass
class Section:
    """One section's outcome: its results (JSON-ready), the checks that did not hold, what was skipped, the rows of
    its tables measured so far (`draft`), and how long its points have taken (`in_time`)."""

    name: str
    results: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    drafts: dict[str, dict[str, Any]] = field(default_factory=dict)
    point_started: float | None = None  # when the last point `in_time` let start began
    longest_point: float = 0.0  # the longest interval between the starts of two points so far

    def expect(self, condition: bool, message: str) -> bool:
        """Record ``message`` as a failure unless ``condition`` holds; returns ``condition``."""
        if not condition:
            self.failures.append(message)
        return condition

    def in_time(self, check: Check, label: str, graphs: int = 0, layers: int = 0) -> bool:
        """Whether ``label`` (a point of a sweep) may still start: the time left holds what it is expected to take,
        the longest interval between two points of this section so far and, when it may compile ``graphs`` graphs of
        a ``layers``-layer model, their expected seconds (`Check.clock`). Otherwise it is recorded as skipped, with
        the reason."""
        now = time.perf_counter()
        if self.point_started is not None:
            self.longest_point = max(self.longest_point, now - self.point_started)
        left = check.seconds_left()
        compiling = graphs * check.clock.graph_seconds(layers) if graphs else 0.0
        if left <= 0:
            self.skipped.append(f"{label}: the time budget is spent")
        elif compiling > left:
            source = check.clock.source(layers)
            self.skipped.append(
                f"{label}: compiling {graphs} graph(s) needs ~{compiling:.0f} s ({source}), {left:.0f} s left"
            )
        elif self.longest_point > left:
            self.skipped.append(f"{label}: a point has taken up to {self.longest_point:.0f} s, {left:.0f} s left")
        else:
            self.point_started = now
            return True
        return False

    def draft(self, title: str, columns: list[str], rows: list[list[Any]]) -> None:
        """Keep table ``title`` as measured so far: the record written meanwhile (`Check.save`) holds it until the
        section ends and prints its final table."""
        self.drafts[title] = {"title": title, "columns": columns, "rows": [[str(c) for c in r] for r in rows]}

    def table(self, check: Check, title: str, columns: list[str], rows: list[list[Any]]) -> None:
        """Print table ``title`` and keep it in the record (`Record.table`), in place of its draft."""
        self.drafts.pop(title, None)
        check.record.table(title, columns, rows)


def jsonable(value: Any) -> Any:
    """``value`` with tensors, tuples and non-finite floats turned into what JSON holds (NaN and inf: None)."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return jsonable(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device: torch.device) -> None:
    """Give freed memory back: Python's garbage first, then CUDA's cached blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def free_memory(device: torch.device) -> int:
    """Bytes that can still be allocated: free GPU memory, or the host's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def median_seconds(fn: Callable[[], Any], device: torch.device, repeats: int = 5, warmup: int = 2) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after ``warmup``: CUDA events on a GPU, perf_counter on a
    CPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def compile_backend_for(device: torch.device, aot: bool = True) -> str:
    """Inductor on a GPU. On a CPU (``--quick`` runs in the test suite) no code is generated, so the CPU's compiled
    columns check the graphs, not inductor's speed: ``aot_eager`` captures the graphs inductor receives (AOT's trace
    included), and without ``aot`` Dynamo's capture runs as captured (``eager``: the same graphs and graph counts at
    about half the compile time, where AOT's trace of the same steps is checked elsewhere)."""
    if device.type == "cuda":
        return "inductor"
    return "aot_eager" if aot else "eager"


def cudagraph_skips() -> int:
    """Compiled graphs inductor has run without capturing them as CUDA graphs so far (its reasons are logged)."""
    return int(torch._dynamo.utils.counters["inductor"]["cudagraph_skips"])


@dataclass
class Captures:
    """CUDA graph recordings counted while `counted_captures` is active (None: the count is unavailable)."""

    count: int | None = 0


@contextmanager
def counted_captures() -> Iterator[Captures]:
    """Count the CUDA graphs recorded inside the block: every recording, inductor's CUDA graph trees included, begins
    with `torch.cuda.CUDAGraph.capture_begin`, which is wrapped meanwhile (the count stays None where torch has no
    such method)."""
    captures = Captures()
    graph = getattr(torch.cuda, "CUDAGraph", None)
    original = getattr(graph, "capture_begin", None)
    if original is None:
        captures.count = None
        yield captures
        return
    own = graph.__dict__.get("capture_begin")

    def capture_begin(self: Any, *args: Any, **kwargs: Any) -> Any:
        captures.count += 1
        return original(self, *args, **kwargs)

    graph.capture_begin = capture_begin
    try:
        yield captures
    finally:
        if own is None:
            del graph.capture_begin
        else:
            graph.capture_begin = own


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Inside the block, floating tensors are made in ``dtype`` (models built there are born in it)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@contextmanager
def private_cache(path: Path) -> Iterator[None]:
    """Latency profiles and linear-layer routes measured inside the block go to ``path``, not the user's cache: the
    random models' profiles are calibrated afresh and nothing is left behind."""
    before = os.environ.get("FASTGRPO_CACHE")
    os.environ["FASTGRPO_CACHE"] = str(path)
    try:
        yield
    finally:
        if before is None:
            del os.environ["FASTGRPO_CACHE"]
        else:
            os.environ["FASTGRPO_CACHE"] = before


# ------------------------------------------------------------------------------------------------ models


def build_model(
    cls: type[PreTrainedModel], config: PretrainedConfig, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> PreTrainedModel:
    """A randomly initialised ``cls(config)`` made directly on ``device`` in ``dtype`` (transformers' normal
    initialisation, seeded), with SDPA attention, in eval mode."""
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device), default_dtype(dtype):
        model = cls(config)
    return model.eval()


def tiny_model(family: str, device: torch.device, seed: int = 0) -> PreTrainedModel:
    """A tiny float64 model of ``family`` (2 layers, hidden 32, vocabulary `TINY_VOCAB`) on ``device``."""
    config_cls, model_cls, extra = FAMILIES[family]
    return build_model(model_cls, config_cls(**TINY_COMMON, **extra), torch.float64, device, seed)


def tiny_draft(model: PreTrainedModel, device: torch.device, seed: int = 1) -> DraftHead:
    """An untrained draft head for ``model`` in its dtype, made on ``device``."""
    torch.manual_seed(seed)
    with torch.device(device), default_dtype(model.dtype):
        return DraftHead(model.config, "gpu-check")


def decode_model(check: Check) -> PreTrainedModel:
    """The bfloat16 model the decoding sections measure, built once: a random Qwen2.5-7B-shaped model (a tiny Qwen2
    with ``--quick``), no gradients."""

    def build() -> PreTrainedModel:
        config = Qwen2Config(**(TINY_QWEN2_SHAPE if check.quick else QWEN25_7B_SHAPE))
        return build_model(Qwen2ForCausalLM, config, torch.bfloat16, check.device).requires_grad_(False)

    return check.shared_model("decode", build)


def small_model(check: Check) -> PreTrainedModel:
    """The model the host-time and calibration sections measure, built once: a random SmolLM2-135M-shaped model in
    bfloat16 on a GPU (a tiny Llama of 1,024 tokens with ``--quick`` or on a CPU), no gradients."""

    def build() -> PreTrainedModel:
        tiny = check.quick or check.device.type == "cpu"
        shape = dict(TINY_LLAMA_SHAPE, vocab_size=1024) if tiny else SMOLLM2_SHAPE
        dtype = torch.bfloat16 if check.device.type == "cuda" else torch.float32
        return build_model(LlamaForCausalLM, LlamaConfig(**shape), dtype, check.device).requires_grad_(False)

    return check.shared_model("small", build)


def random_prompts(lengths: list[int], vocab: int, seed: int, low: int = 4) -> list[list[int]]:
    """Prompts of random token ids in ``[low, vocab)`` of the given lengths."""
    rng = random.Random(seed)
    return [[rng.randrange(low, vocab) for _ in range(n)] for n in lengths]


def tokenizer_from_dir(path: str | Path) -> PreTrainedTokenizerBase:
    """A tokenizer saved with ``save_pretrained`` (no model config needed), left padding and a pad token, as
    `fastgrpo.models.load_tokenizer` sets them."""
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def check_tokenizer(option: str | None) -> tuple[PreTrainedTokenizerBase, str]:
    """The tokenizer of ``--tokenizer``; else the embedded SmolLM2's; else ``.gpu/tokenizer``. Returns it and where
    it came from."""
    if option is not None:
        return tokenizer_from_dir(option), option
    try:
        return load_tokenizer("smollm2"), "smollm2 (embedded)"
    except (ValueError, FileNotFoundError, OSError, ImportError) as e:
        if GPU_TOKENIZER.is_dir():
            return tokenizer_from_dir(GPU_TOKENIZER), str(GPU_TOKENIZER)
        raise RuntimeError(f"no tokenizer: the embedded model is unavailable ({e}); pass --tokenizer DIR") from e


def smollm2_config(tokenizer: PreTrainedTokenizerBase, quick: bool) -> LlamaConfig:
    """SmolLM2-135M's shape (a tiny Llama with ``quick``), its vocabulary widened to cover ``tokenizer``."""
    shape = dict(TINY_LLAMA_SHAPE if quick else SMOLLM2_SHAPE)
    shape["vocab_size"] = max(shape["vocab_size"], len(tokenizer))
    return LlamaConfig(
        **shape,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


# ------------------------------------------------------------------------------------------------ SDPA backends


def profiled_names(fn: Callable[[], Any], device: torch.device) -> tuple[list[str], list[str]]:
    """Run ``fn`` under `torch.profiler`; return the attention-like aten op names and GPU kernel names it ran."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        synchronize(device)
    ops, kernels = set(), set()
    for event in prof.events():
        names = [(event.name, str(getattr(event, "device_type", "")))]
        names += [(k.name, "DeviceType.CUDA") for k in getattr(event, "kernels", [])]
        for name, where in names:
            if not any(w in name.lower() for w in ATTENTION_WORDS):
                continue
            (kernels if "CUDA" in where else ops).add(name)
    return sorted(ops), sorted(kernels)


def backend_of(ops: list[str]) -> str:
    """The SDPA backend the aten op names show."""
    found = [label for fragment, label in SDPA_BACKENDS if any(fragment in op for op in ops)]
    return found[0] if found else "none found"


def ms(seconds: float | None) -> str:
    """Seconds as a table cell in milliseconds (``-`` when not measured)."""
    return "-" if seconds is None else f"{1e3 * seconds:.2f}"
