"""The decoding-speed sections of `gpu_check`: the engine's plain step on a Qwen2.5-7B-shaped model against
transformers' ``generate`` and the weight-read time, verification forwards against a plain one, and the speed targets
read from them."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from gpu_check_budget import DECODE_STEP_GRAPHS, DECODE_VERIFY_GRAPHS
from gpu_check_common import (
    QWEN25_7B_SHAPE,
    TINY_QWEN2_SHAPE,
    Check,
    GiB,
    MiB,
    Section,
    compile_backend_for,
    decode_model,
    free_memory,
    median_seconds,
    random_prompts,
    release,
    synchronize,
)
from torch import nn
from transformers import LogitsProcessor, LogitsProcessorList, PretrainedConfig, PreTrainedModel, Qwen2Config

from fastgrpo.rollout.attention import rollout_attention
from fastgrpo.rollout.cache import RowCache
from fastgrpo.rollout.compiled import Compiled
from fastgrpo.rollout.engine import RolloutEngine
from fastgrpo.rollout.forward import decoder_and_head, forward_chain
from fastgrpo.rollout.linear import rollout_linears
from fastgrpo.rollout.sampling import process_logits
from fastgrpo.sampling_params import SamplingParams

COMPILED_NODES = 8  # the verification size the decode section also times compiled
DECODE_ROWS = [1, 8, 16, 64]
DECODE_CONTEXTS = [512, 4096]
# The points timed compiled too (the others eagerly only), at the shorter context: those the speed targets read, so
# that the section compiles a few graphs of the 7B-shaped model (docs/benchmarks.md: what each graph costs).
COMPILED_STEP_ROWS = (1, 16)
COMPILED_VERIFY_ROWS = (1, 8)
FIRST_ROWS = [16, 64]  # ``--first``: the rows of the trainer's default batch and of a large one

# Published peak memory bandwidths (bytes/s), matched against `torch.cuda.get_device_name` in order.
PEAK_BANDWIDTH = (
    ("H200", 4.8e12),
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),  # SXM: "NVIDIA H100 80GB HBM3"
    ("A100-SXM4-80GB", 2.039e12),
    ("A100-SXM4-40GB", 1.555e12),
)


# ------------------------------------------------------------------------------------------------ decoding speed


class StepClock(LogitsProcessor):
    """Notes the time (after synchronising the device) each time `generate` has a new token's logits."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        synchronize(self.device)
        self.stamps.append(time.perf_counter())
        return scores


def estimate_params(config: PretrainedConfig) -> int:
    """Parameters of a Qwen2-style decoder from its config: embeddings, LM head, per-layer projections (with the
    QKV biases) and norms."""
    h, i, v, n = config.hidden_size, config.intermediate_size, config.vocab_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    layer = h * q + 2 * h * kv + q * h + q + 2 * kv + 3 * h * i + 2 * h
    return v * h * (1 if config.tie_word_embeddings else 2) + n * layer + h


def kv_bytes_per_token(config: PretrainedConfig, dtype: torch.dtype) -> int:
    """Bytes of keys and values one cached token holds over all layers."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * dtype.itemsize


def activation_bytes(config: PretrainedConfig, tokens: int, dtype: torch.dtype) -> int:
    """An estimate of the transient memory of a forward over ``tokens`` tokens: one layer's MLP intermediates and a
    few hidden-state copies at a time."""
    return tokens * (2 * config.intermediate_size + 4 * config.hidden_size) * dtype.itemsize


def weight_bytes_read(model: PreTrainedModel) -> int:
    """Bytes of weights a decoding step reads: every parameter but the input embedding table (of which it reads a
    row per token), the LM head included."""
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if embed.data_ptr() != head.data_ptr():
        total -= embed.numel() * embed.element_size()
    return total


def copy_bandwidth(device: torch.device, size: int) -> float:
    """Measured device-to-device copy bandwidth in bytes/s (bytes read plus bytes written, per second)."""
    src = torch.ones(size // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * size / median_seconds(partial(dst.copy_, src), device, repeats=10, warmup=3)


def peak_bandwidth(device: torch.device) -> float | None:
    """The card's published peak memory bandwidth (bytes/s), None when its name is not in `PEAK_BANDWIDTH`."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((bw for key, bw in PEAK_BANDWIDTH if key in name), None)


def engine_step_seconds(engine: RolloutEngine, rows: int, context: int, steps: int) -> float:
    """Median seconds of the engine's plain decoding steps (after the first) at ``rows`` rows reading ``context``
    cached tokens: one prompt of that length replicated to ``rows`` rows, greedy, no EOS."""
    prompt = random_prompts([context], engine.model.config.vocab_size, seed=context)[0]
    params = SamplingParams(max_new_tokens=steps + 2, temperature=0.0)
    try:
        stats = engine.generate([prompt], params, num_generations=rows).stats
    finally:
        engine.release()  # the KV cache goes back before the next measurement
    return statistics.median(stats.step_times[1:])


@torch.inference_mode()
def generate_token_seconds(model: PreTrainedModel, rows: int, context: int, steps: int) -> float:
    """Median seconds per new token of transformers' greedy ``generate`` (dynamic cache) over ``rows`` copies of a
    ``context``-token prompt: the interval between consecutive logits-processor calls, after the first."""
    dev = model.device
    prompt = random_prompts([context], model.config.vocab_size, seed=context)[0]
    ids = torch.tensor([prompt], dtype=torch.long, device=dev).expand(rows, -1).contiguous()  # [B, context]
    clock = StepClock(dev)
    model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=steps + 2,
        min_new_tokens=steps + 2,
        do_sample=False,
        pad_token_id=0,
        logits_processor=LogitsProcessorList([clock]),
    )
    gaps = [b - a for a, b in zip(clock.stamps[:-1], clock.stamps[1:], strict=True)]
    return statistics.median(gaps[1:])


def verification_forward(
    decoder: nn.Module,
    head: nn.Module,
    cache: RowCache,
    base: torch.Tensor,
    ids: torch.Tensor,
    extent: int,
    equal: bool,
    params: SamplingParams,
) -> torch.Tensor:
    """``[B, N, V]`` log-probabilities after feeding ``ids`` ``[B, N]`` after ``base`` ``[B]`` cached tokens per row
    (`forward_chain`, keys over ``extent`` slots; ``equal``: rows of equal length, no mask), the LM head and
    `process_logits`."""
    hidden = forward_chain(decoder, cache, base, input_ids=ids, extent=extent, equal_lengths=equal)
    return process_logits(head(hidden), params)


def verify_seconds(
    model: PreTrainedModel, rows: int, context: int, tokens: int, compiled: Compiled | None = None
) -> float:
    """Median seconds of `verification_forward` over ``rows`` rows of ``tokens`` new tokens each after ``context``
    cached tokens (greedy): a plain step's forward at ``tokens == 1`` (no mask: rows of equal length), an N-node
    verification's otherwise (masked, a chain being as costly as a tree). ``compiled``: run through it (one
    `Compiled` per model, so that every point after the first two reuses its graphs; on CUDA each shape is captured
    as a CUDA graph), its first calls (compilation, capture) not timed."""
    dev = model.device
    decoder, head = decoder_and_head(model)
    cache = RowCache(model.config, rows, context + tokens, model.dtype, dev, compiled=compiled is not None)
    base = torch.full((rows,), context, dtype=torch.long, device=dev)  # [B]
    ids = torch.randint(4, model.config.vocab_size, (rows, tokens), dtype=torch.long, device=dev)  # [B, N]
    args = (decoder, head, cache, base, ids, context + tokens, tokens == 1, SamplingParams(temperature=0.0))
    run = partial(verification_forward, *args) if compiled is None else partial(compiled, dev, *args)
    linears = nullcontext() if compiled is not None else rollout_linears(model)
    with torch.inference_mode(), rollout_attention(model), linears:
        return median_seconds(run, dev, warmup=2 if compiled is None else 3)


def measured_if_fits(
    label: str, need: int, fn: Callable[[], float], device: torch.device, section: Section
) -> float | None:
    """``fn()``, or None (recorded as skipped) when ``need`` bytes and a GiB of headroom exceed the free memory or
    it runs out of memory."""
    release(device)
    free = free_memory(device)
    if need + GiB > free:
        section.skipped.append(f"{label}: needs ~{need / GiB:.1f} GiB, {free / GiB:.1f} GiB free")
        return None
    try:
        return fn()
    except torch.OutOfMemoryError:
        section.skipped.append(f"{label}: out of memory (estimated {need / GiB:.1f} GiB, {free / GiB:.1f} free)")
        return None
    finally:
        release(device)


def decode_point(
    engine: RolloutEngine, compiled: RolloutEngine | None, rows: int, context: int, steps: int, section: Section
) -> dict[str, Any]:
    """The engine's plain step, eager and ``compiled`` (None: not timed compiled), and ``generate``'s time per token at
    ``rows`` rows of ``context`` cached tokens."""
    model = engine.model
    config, dtype, dev = model.config, model.dtype, model.device
    kv = rows * (context + steps + 4) * kv_bytes_per_token(config, dtype)
    entry: dict[str, Any] = {"rows": rows, "context": context, "compiled_point": compiled is not None}
    entry["engine"] = measured_if_fits(
        f"engine at {rows} rows x {context}",
        kv + activation_bytes(config, context, dtype),  # one prompt prefilled, its cache rows replicated
        partial(engine_step_seconds, engine, rows, context, steps),
        dev,
        section,
    )
    entry["compiled"] = None
    if compiled is not None:
        entry["compiled"] = measured_if_fits(
            f"compiled engine at {rows} rows x {context}",
            kv + activation_bytes(config, context, dtype),
            partial(engine_step_seconds, compiled, rows, context, steps),
            dev,
            section,
        )
    entry["generate"] = measured_if_fits(
        f"generate at {rows} rows x {context}",
        kv + activation_bytes(config, rows * context, dtype),  # generate prefills every row
        partial(generate_token_seconds, model, rows, context, steps),
        dev,
        section,
    )
    return entry


def verify_point(
    model: PreTrainedModel, compiled: Compiled | None, rows: int, context: int, nodes: list[int], section: Section
) -> dict:
    """Seconds of a target forward over 1 and each of ``nodes`` tokens per row at ``rows`` rows x ``context``, eager,
    and through ``compiled`` (None: not timed compiled) at 1 and `COMPILED_NODES` tokens."""
    config, dtype = model.config, model.dtype
    seconds, compiled_seconds = {}, {}
    ways = [(None, seconds)] + ([] if compiled is None else [(compiled, compiled_seconds)])
    for n in [1, *nodes]:
        need = rows * (context + n) * kv_bytes_per_token(config, dtype) + activation_bytes(config, rows * n, dtype)
        need += rows * n * config.vocab_size * 10  # the logits, their float32 copy and the log-softmax
        for through, into in ways:
            if through is not None and n not in (1, COMPILED_NODES):
                continue
            fn = partial(verify_seconds, model, rows, context, n, through)
            label = f"{'' if through is None else 'compiled '}verification of {n} at {rows} rows x {context}"
            into[n] = measured_if_fits(label, need, fn, model.device, section)
    return {"rows": rows, "context": context, "seconds": seconds, "compiled": compiled_seconds}


def decode_row(entry: dict[str, Any], weights: int, kv_token: int, copy_bw: float, spec_bw: float | None) -> list[Any]:
    """A table row of the decoding comparison: times (eager, compiled), ratios, bytes read per step, the bandwidth the
    faster step reached and its time over the weight-read time at the copy bandwidth."""
    rows, context = entry["rows"], entry["context"]
    engine, compiled, hf = entry["engine"], entry["compiled"], entry["generate"]
    not_compiled = "skipped" if entry["compiled_point"] else "-"
    best = min((t for t in (engine, compiled) if t), default=None)
    read = weights + rows * context * kv_token
    bw = read / best if best else None
    entry.update(bytes_read=read, engine_bandwidth_gb_s=None if bw is None else bw / 1e9)
    return [
        rows,
        context,
        "skipped" if engine is None else f"{1e3 * engine:.2f}",
        not_compiled if compiled is None else f"{1e3 * compiled:.2f}",
        "skipped" if hf is None else f"{1e3 * hf:.2f}",
        f"{hf / best:.2f}x" if best and hf else "-",
        f"{read / MiB:.1f}",
        "-" if bw is None else f"{bw / 1e9:.1f}",
        "-" if bw is None else f"{bw / copy_bw:.0%}",
        "-" if bw is None or spec_bw is None else f"{bw / spec_bw:.0%}",
        "-" if best is None else f"{best / (weights / copy_bw):.2f}x",
    ]


def ratio_cells(seconds: dict[int, float | None], sizes: list[int]) -> list[str]:
    """The plain forward's ms (``seconds[1]``), then each of ``sizes``' time over it."""
    plain = seconds[1]
    cells = ["skipped" if plain is None else f"{1e3 * plain:.2f}"]
    for n in sizes:
        s = seconds.get(n)
        cells.append("skipped" if s is None else f"{s / plain:.2f}x" if plain else f"{1e3 * s:.2f} ms")
    return cells


def verify_row(entry: dict[str, Any], nodes: list[int]) -> list[Any]:
    """A table row of the verification sweep: the plain forward's ms, then each N's time over it; then the same
    compiled at N = 1 and N = `COMPILED_NODES` (``-`` where the point is not timed compiled)."""
    compiled = ratio_cells(entry["compiled"], [COMPILED_NODES]) if entry["compiled"] else ["-", "-"]
    return [entry["rows"], entry["context"], *ratio_cells(entry["seconds"], nodes), *compiled]


@dataclass(frozen=True)
class DecodeSweep:
    """The points the decode section measures: row counts, cached tokens, verification sizes and decoding steps per
    point, and the rows (at the first context) timed compiled too: the engine's step and the verification forward."""

    rows: list[int]
    contexts: list[int]
    nodes: list[int]
    steps: int
    step_rows: tuple[int, ...]
    verify_rows: tuple[int, ...]


def decode_sweep(quick: bool, first: bool = False) -> DecodeSweep:
    """The full run's sweep, ``--first``'s (16 and 64 rows of 512 cached tokens, the plain step and an 8-node
    verification, each eager and compiled), or ``--quick``'s single point."""
    if quick:
        return DecodeSweep([1], [48], [4, 8], 4, (1,), (1,))
    if first:
        return DecodeSweep(FIRST_ROWS, DECODE_CONTEXTS[:1], [COMPILED_NODES], 16, tuple(FIRST_ROWS), tuple(FIRST_ROWS))
    return DecodeSweep(DECODE_ROWS, DECODE_CONTEXTS, [4, 8, 16, 32], 16, COMPILED_STEP_ROWS, COMPILED_VERIFY_ROWS)


def section_decode(check: Check, section: Section) -> None:
    """The engine's plain step, eager and compiled, against ``generate`` and the weight-read time, and verification
    forwards against a plain one (see the module `gpu_check`). What it compiles is what it measures: one compiled
    engine (its step at the rows of `DecodeSweep.step_rows`) and one `Compiled` verification forward, shared by every
    point. Each compile and each point starts only when it fits the time left, and the record is written after each."""
    dev, dtype, sweep = check.device, torch.bfloat16, decode_sweep(check.quick, check.first)
    if dev.type == "cpu" and not check.quick:
        section.skipped.append("the 7B-shaped model decodes on a GPU: run with --quick on a CPU")
        return
    config = Qwen2Config(**(TINY_QWEN2_SHAPE if check.quick else QWEN25_7B_SHAPE))
    weights, free = estimate_params(config) * dtype.itemsize, free_memory(dev)
    if "decode" not in check.models and weights + 2 * GiB > free:
        section.skipped.append(f"the model needs {weights / GiB:.1f} GiB, {free / GiB:.1f} GiB free")
        return
    t0 = time.perf_counter()
    model = decode_model(check)
    name = "tiny Qwen2" if check.quick else "Qwen2.5-7B-shaped"
    read, kv_token = weight_bytes_read(model), kv_bytes_per_token(config, dtype)
    copy_bw, spec_bw = copy_bandwidth(dev, 64 * MiB if check.quick else GiB), peak_bandwidth(dev)
    section.results.update(
        model=name,
        parameters=sum(p.numel() for p in model.parameters()),
        build_seconds=time.perf_counter() - t0,
        weight_bytes_read=read,
        copy_bandwidth_gb_s=copy_bw / 1e9,
        weight_read_seconds=read / copy_bw,
        published_bandwidth_gb_s=None if spec_bw is None else spec_bw / 1e9,
        compile_seconds=0.0,
        compiled_rows=[],
    )
    check.save(section)
    backend = compile_backend_for(dev, aot=False)  # on a CPU: AOT's trace of these steps is checked elsewhere
    engine, compiled = RolloutEngine(model, []), RolloutEngine(model, [], backend=backend)
    engine_step_seconds(engine, 2, 16, 3)  # one-off costs of both sides
    generate_token_seconds(model, 2, 16, 3)
    layers = config.num_hidden_layers
    for rows in sweep.step_rows:  # compiles and captures what the timed call below meets (the same rows and extents)
        label = f"compiling the engine's step at {rows} rows"
        if not section.in_time(check, label, graphs=DECODE_STEP_GRAPHS, layers=layers):
            continue
        t0 = time.perf_counter()
        with check.clock.timing(layers):
            engine_step_seconds(compiled, rows, sweep.contexts[0], sweep.steps)
        section.results["compile_seconds"] += time.perf_counter() - t0
        section.results["compiled_rows"].append(rows)
        check.save(section)
    steps_table(check, section, engine, compiled, sweep, (read, kv_token, copy_bw, spec_bw))
    verification_table(check, section, model, Compiled(verification_forward, backend), sweep)


def steps_table(
    check: Check,
    section: Section,
    engine: RolloutEngine,
    compiled: RolloutEngine,
    sweep: DecodeSweep,
    reads: tuple[int, int, float, float | None],
) -> None:
    """The sweep of decoding steps (`decode_point`), the engine timed compiled at the rows it compiled
    (``compiled_rows``) of the first context; ``reads``: the weight bytes a step reads, the KV bytes per cached token,
    the measured copy bandwidth and the published one."""
    name, dev = section.results["model"], check.device
    copy_bw, spec_bw = reads[2], reads[3]
    title = (
        f"Plain decoding step of a random {name} model, bfloat16, {dev}: the engine's step against generate's time "
        f"per new token (copy bandwidth {copy_bw / 1e9:.0f} GB/s, published "
        f"{'unknown' if spec_bw is None else f'{spec_bw / 1e9:.0f} GB/s'}); the faster engine step sets the last "
        "five columns; compiled ms `-`: timed eagerly only"
    )
    columns = ["rows", "context", "engine ms", "compiled ms", "generate ms", "generate / engine", "MB read per step"]
    columns += ["engine GB/s", "of copy bandwidth", "of published", "over weight read"]
    points = section.results["steps"] = []
    for context in sweep.contexts:
        for rows in sweep.rows:
            if not section.in_time(check, f"decoding at {rows} rows x {context}"):
                continue
            timed = context == sweep.contexts[0] and rows in section.results["compiled_rows"]
            points.append(decode_point(engine, compiled if timed else None, rows, context, sweep.steps, section))
            section.draft(title, columns, [decode_row(entry, *reads) for entry in points])
            check.save(section)
    section.table(check, title, columns, [decode_row(entry, *reads) for entry in points])


def verification_table(
    check: Check, section: Section, model: PreTrainedModel, forward: Compiled, sweep: DecodeSweep
) -> None:
    """The sweep of verification forwards (`verify_point`), also through ``forward`` at `DecodeSweep.verify_rows` of
    the first context where its compiles fit the time left (two graphs a point at most: N = 1 and N = 8)."""
    layers, name = model.config.num_hidden_layers, section.results["model"]
    title = (
        f"Target forward over N tokens per row against a plain one, {name}, bfloat16, {check.device}: ms at N = 1, "
        "then the ratio to it; compiled `-`: timed eagerly only"
    )
    columns = ["rows", "context", "N=1 ms"] + [f"N={n}" for n in sweep.nodes]
    columns += ["compiled N=1 ms", f"compiled N={COMPILED_NODES}"]
    points = section.results["verification"] = []
    for context in sweep.contexts:
        for rows in sweep.rows:
            label = f"verification at {rows} rows x {context}"
            if not section.in_time(check, label):
                continue
            timed = context == sweep.contexts[0] and rows in sweep.verify_rows
            timed = timed and section.in_time(check, f"compiled {label}", graphs=DECODE_VERIFY_GRAPHS, layers=layers)
            points.append(verify_point(model, forward if timed else None, rows, context, sweep.nodes, section))
            section.draft(title, columns, [verify_row(entry, sweep.nodes) for entry in points])
            check.save(section)
    section.table(check, title, columns, [verify_row(entry, sweep.nodes) for entry in points])


# ------------------------------------------------------------------------------------------------ speed targets

TARGETS = (
    "compiled plain step <= 1.3x the weight-read time, 1 to 16 rows",
    "compiled 8-token verification <= 1.3x a compiled plain forward, 1 to 8 rows",
    "compiled plain step >= 3x faster than generate's token, 1 row",
    "CUDA graphs recorded after the first of four rollouts (plain) = 0",
)


def worst(values: list[float], largest: bool = True) -> float | None:
    """The largest (or smallest) of ``values``; None when there are none."""
    if not values:
        return None
    return max(values) if largest else min(values)


def target_values(decode: dict[str, Any], recordings: dict[str, Any]) -> list[tuple[str, float | None, bool | None]]:
    """Each speed target of `TARGETS`, what the runs measured of it (its worst point) and whether that meets it (None:
    not measured), from the JSON results of the ``decode`` and ``recordings`` sections (empty: not run)."""
    context = min((p["context"] for p in decode.get("steps", [])), default=None)
    read = decode.get("weight_read_seconds")
    over_read = [
        p["compiled"] / read
        for p in decode.get("steps", [])
        if p["context"] == context and p["rows"] <= 16 and p["compiled"] is not None and read
    ]
    verify = [
        p["compiled"]["8"] / p["compiled"]["1"]
        for p in decode.get("verification", [])
        if p["context"] == context and p["rows"] <= 8 and p["compiled"].get("8") and p["compiled"].get("1")
    ]
    speedup = [
        p["generate"] / p["compiled"]
        for p in decode.get("steps", [])
        if p["rows"] == 1 and p["compiled"] and p["generate"] is not None
    ]
    later = [r["captures"] for r in recordings.get("plain", {}).get("rollouts", [])[1:]]
    recorded = None if not later or None in later else float(sum(later))
    measured = [worst(over_read), worst(verify), worst(speedup, largest=False), recorded]
    limits = [lambda v: v <= 1.3, lambda v: v <= 1.3, lambda v: v >= 3.0, lambda v: v == 0]
    return [
        (name, value, None if value is None else ok(value))
        for name, value, ok in zip(TARGETS, measured, limits, strict=True)
    ]


def verdict(met: bool | None, device: torch.device, quick: bool) -> str:
    """A target's table cell: met or not, or why it does not apply."""
    if device.type != "cuda":
        return "n/a (cpu)"
    if quick:
        return "n/a (quick: tiny model)"
    return "not measured" if met is None else "met" if met else "not met"


def section_targets(check: Check, section: Section) -> None:
    """The speed targets of a 7B-shaped bfloat16 model on a GPU, read from the ``decode`` and ``recordings``
    sections' results: reported met or not met (a target not met is not a failure of the check); on a CPU or with
    ``--quick`` they do not apply."""
    values = target_values(check.results.get("decode", {}), check.results.get("recordings", {}))
    rows, results = [], []
    for name, value, met in values:
        cell = verdict(met, check.device, check.quick)
        results.append({"target": name, "measured": value, "verdict": cell})
        rows.append([name, "-" if value is None else f"{value:.2f}", cell])
    section.results["targets"] = results
    context = min(DECODE_CONTEXTS)
    check.record.table(
        f"Speed targets of a Qwen2.5-7B-shaped model in bfloat16 on {check.device} ({context} cached tokens; the worst "
        "point of each)",
        ["target", "measured", "verdict"],
        rows,
    )
