"""The rollout sections of `gpu_check`: what four training rollouts compile, record as CUDA graphs and reserve; the
host's share of a decoding step (plain, EAGLE, suffix); and the latency profile's calibration against steady-state
replays of the same forwards."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from gpu_check_budget import HOST_GRAPHS, RECORDING_GRAPHS, compiled_graphs
from gpu_check_common import (
    Check,
    MiB,
    Section,
    compile_backend_for,
    counted_captures,
    cudagraph_skips,
    decode_model,
    ms,
    private_cache,
    random_prompts,
    release,
    small_model,
    synchronize,
    tiny_draft,
)
from transformers import PreTrainedModel

import fastgrpo.rollout.host as host_module
from fastgrpo.config import DraftTrainConfig, SpeculationConfig
from fastgrpo.rollout.compiled import compile_backend
from fastgrpo.rollout.engine import RolloutEngine
from fastgrpo.rollout.sequence import ActiveRows, Generation
from fastgrpo.rollout.tree import TreeShape
from fastgrpo.sampling_params import SamplingParams
from fastgrpo.speculative.eagle.drafter import EagleDrafter
from fastgrpo.speculative.plugin import cost_probes
from fastgrpo.speculative.profiler import LatencyProfile, calibrate, measure
from fastgrpo.speculative.registry import PLUGINS
from fastgrpo.speculative.suffix.drafter import SuffixDrafter
from fastgrpo.training_rollouts import TrainingRollouts

TREE = TreeShape(8, 3, 4)  # the static tree of the speculative rollouts and steps measured here

# ------------------------------------------------------------------------------------------------ recordings


def rollout_variants() -> dict[str, SpeculationConfig]:
    """The rollouts measured: plain decoding, and static 8-node trees drafted by a fresh EAGLE head and the suffix
    drafter, merged."""
    tree = dict(nodes=TREE.nodes, top_k=TREE.top_k, depth=TREE.max_levels)
    return {
        "plain": SpeculationConfig(mode="off"),
        "speculative": SpeculationConfig(mode="static", drafter="eagle+suffix", **tree),
    }


def four_rollouts(
    check: Check,
    model: PreTrainedModel,
    speculation: SpeculationConfig,
    entries: list[dict[str, Any]],
    saved: Callable[[], None],
) -> None:
    """Four rollouts through `TrainingRollouts` (compiled with `compile_backend_for` the device, on a CPU without AOT's
    trace, which the decode section checks for plain steps and the suite's FSDP2 bfloat16 run for tree steps; online
    draft learning on), built and reserved as `GRPOTrainer` builds them (`TrainingRollouts.reserve` where the rollouts
    have it), of prompts of a different length each, with what `GRPOTrainer.train_step` does between rollouts: the
    drafters learn, the captured hidden states are dropped and `TrainingRollouts.release` is called (the trainer
    releases on a GPU only; here on every device). Per rollout: the graphs compiled, the CUDA graphs recorded (None: not
    counted), the compiled graphs run without CUDA graphs, and on CUDA the memory reserved after it, at its peak and
    after the release (MiB), appended to ``entries``; ``saved()`` is called after each."""
    dev = check.device
    lengths = [6, 12, 3, 9] if check.quick else [32, 96, 16, 64]
    prompts, copies = (2, 2) if check.quick else (4, 4)
    params = SamplingParams(max_new_tokens=8 if check.quick else 32, temperature=1.0)
    backend = compile_backend_for(dev, aot=False)
    rollouts = TrainingRollouts(model, None, [], speculation, DraftTrainConfig(), "gpu-check-rollouts", backend=backend)
    if hasattr(rollouts, "reserve"):
        rollouts.reserve(prompts * copies, max(lengths), params.max_new_tokens)
    cuda = dev.type == "cuda"
    counted = cuda and check.captures_counted is not False
    layers = model.config.num_hidden_layers
    for step, length in enumerate(lengths):
        prompt_ids = random_prompts([length] * prompts, model.config.vocab_size, seed=step)
        graphs, skips = compiled_graphs(), cudagraph_skips()
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        t0 = time.perf_counter()
        with counted_captures() as captures, check.clock.timing(layers):
            out = rollouts.generate(prompt_ids, params, copies, step)
            rollouts.learn()
            synchronize(dev)
        entry: dict[str, Any] = {
            "prompt_length": length,
            "seconds": time.perf_counter() - t0,
            "accept_length": out.stats.accept_length,
            "graphs": compiled_graphs() - graphs,
            "captures": captures.count if counted else None,
            "cudagraph_skips": cudagraph_skips() - skips,
        }
        if cuda:
            entry["reserved_mb"] = torch.cuda.memory_reserved(dev) / MiB
            entry["peak_reserved_mb"] = torch.cuda.max_memory_reserved(dev) / MiB
        out.hidden_states = None
        rollouts.release()
        if cuda:
            entry["reserved_after_release_mb"] = torch.cuda.memory_reserved(dev) / MiB
        entries.append(entry)
        saved()


def recording_rows(results: dict[str, Any]) -> list[list[Any]]:
    """The table rows of the training rollouts (`four_rollouts`) in the recordings section's ``results`` so far."""
    rows = []
    for name in [n for n in rollout_variants() if n in results]:
        for index, entry in enumerate(results[name]["rollouts"], 1):
            memory = [entry.get(k) for k in ("reserved_mb", "peak_reserved_mb", "reserved_after_release_mb")]
            captures = "-" if entry["captures"] is None else entry["captures"]
            rows.append(
                [name, index, entry["prompt_length"], entry["graphs"], captures, entry["cudagraph_skips"]]
                + [f"{entry['accept_length']:.2f}", f"{entry['seconds']:.2f}"]
                + ["-" if m is None else f"{m:.0f}" for m in memory]
            )
    return rows


def section_recordings(check: Check, section: Section) -> None:
    """Graphs compiled and CUDA graphs recorded over four training rollouts of the decode section's model, with the
    caches released between them as training does. After the first rollout, plain decoding must compile and record
    nothing more (its rows all end together, so every rollout meets the same row bucket and, with the caches sized
    once, the same addresses and extents); speculative rollouts are reported only, since their rows end at steps that
    depend on acceptance, and a later rollout may meet a row bucket the first did not."""
    dev = check.device
    if dev.type == "cpu" and not check.quick:
        section.skipped.append("the 7B-shaped model rolls out on a GPU: run with --quick on a CPU")
        return
    model = decode_model(check)
    section.results["reserve"] = hasattr(TrainingRollouts, "reserve")
    if dev.type == "cuda" and check.captures_counted is False:
        section.skipped.append("CUDA graph recordings: not counted (the preflight's recording was not seen)")
    title = (
        f"Four training rollouts (TrainingRollouts, {'reserved' if section.results['reserve'] else 'not reserved'}, "
        f"released between rollouts) of the decode model on {dev}: graphs compiled, CUDA graphs recorded, compiled "
        "graphs run without CUDA graphs, and reserved memory (MiB)"
    )
    columns = ["rollouts", "rollout", "prompt tokens", "graphs", "recordings", "cudagraph skips", "accept length"]
    columns += ["seconds", "reserved", "peak reserved", "after release"]
    layers = model.config.num_hidden_layers

    def saved() -> None:
        section.draft(title, columns, recording_rows(section.results))
        check.save(section)

    with private_cache(check.scratch / "recordings-cache"):
        for name, speculation in rollout_variants().items():
            if not section.in_time(check, f"{name} rollouts", graphs=RECORDING_GRAPHS[name], layers=layers):
                continue
            entries: list[dict[str, Any]] = []
            section.results[name] = {"rollouts": entries}
            four_rollouts(check, model, speculation, entries, saved)
            later_graphs = sum(e["graphs"] for e in entries[1:])
            later_captures = [e["captures"] for e in entries[1:] if e["captures"] is not None]
            if name == "plain":
                section.expect(later_graphs == 0, f"{name}: {later_graphs} graphs compiled after the first rollout")
                section.expect(
                    sum(later_captures) == 0, f"{name}: {sum(later_captures)} CUDA graphs recorded after the first"
                )
            release(dev)
    section.table(check, title, columns, recording_rows(section.results))


# ------------------------------------------------------------------------------------------------ host time per step


def host_engine(kind: str, model: PreTrainedModel, backend: str | None) -> RolloutEngine:
    """An engine of plain steps, or of `TREE` steps drafted by a random EAGLE head or the suffix drafter."""
    if kind == "plain":
        return RolloutEngine(model, [], backend=backend)
    drafter = EagleDrafter(tiny_draft(model, model.device), model, backend) if kind == "eagle" else SuffixDrafter()
    return RolloutEngine(model, [], drafter=drafter, tree=TREE, backend=backend)


@contextmanager
def device_spans(engine: RolloutEngine, sleep_seconds: float) -> Iterator[list[float]]:
    """Inside the block, each of the engine's decoding steps starts behind a GPU sleep of ``sleep_seconds``, so that
    the host queues the step's work while the device waits and the device then runs it without gaps; the seconds
    between the sleep's end and the step's read of the device (`fastgrpo.rollout.host.read_back`: its one
    synchronisation) are appended to the list, for the steps whose host reached the read before the sleep ended."""
    spans: list[float] = []
    probe_start, probe_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    probe_cycles = 10_000_000
    probe_start.record()
    torch.cuda._sleep(probe_cycles)
    probe_end.record()
    probe_end.synchronize()
    cycles = int(probe_cycles * sleep_seconds / (probe_start.elapsed_time(probe_end) / 1e3))
    step, read = engine.step, host_module.read_back
    current: dict[str, Any] = {}

    def padded_step(rows: ActiveRows, call: Generation) -> ActiveRows:
        torch.cuda._sleep(cycles)
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        current.update(start=start, read=None, ahead=False)
        out = step(rows, call)
        if current["read"] is not None and current["ahead"]:
            spans.append(start.elapsed_time(current["read"]) / 1e3)
        current.clear()
        return out

    def marked_read(*tensors: torch.Tensor) -> list[list]:
        if current and current["read"] is None:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            current.update(read=event, ahead=not current["start"].query())
        return read(*tensors)

    engine.step, host_module.read_back = padded_step, marked_read
    try:
        yield spans
    finally:
        del engine.step
        host_module.read_back = read


def host_point(engine: RolloutEngine, rows: int, quick: bool) -> dict[str, Any]:
    """One engine's steps at ``rows`` rows (prompts of 4 completions each, 2 below 16 rows; sampled, no EOS),
    compiled ones after a call that compiles and records them: the median wall time of a step
    (`GenerationStats.step_times`, after the first) and, on CUDA, the median device time of such steps
    (`device_spans`) and their difference, the host's time. Each call has prompts of its own: the suffix drafter,
    which remembers the completions of earlier calls, would otherwise draft a repeated call's completions whole."""
    dev = engine.device
    copies = 2 if rows < 16 else 4
    params = SamplingParams(max_new_tokens=6 if quick else 18, temperature=1.0)

    def run(seed: int) -> list[float]:
        lengths = [8 if quick else 64] * (rows // copies)
        prompts = random_prompts(lengths, engine.model.config.vocab_size, seed=seed)
        generator = torch.Generator(device=dev).manual_seed(seed)
        return engine.generate(prompts, params, copies, generator=generator).stats.step_times[1:]

    if engine.target.compiled:
        run(seed=rows)  # compiles and records
    walls = run(seed=rows + 1)
    entry: dict[str, Any] = {"rows": rows, "steps": len(walls), "wall": statistics.median(walls) if walls else None}
    if dev.type == "cuda" and walls:
        with device_spans(engine, sleep_seconds=min(2 * max(walls), 0.5)) as spans:
            run(seed=rows + 2)
        entry.update(device_steps=len(spans), device=statistics.median(spans) if spans else None)
        entry["host"] = None if entry["device"] is None else entry["wall"] - entry["device"]
    engine.release()
    return entry


def section_host(check: Check, section: Section) -> None:
    """The host's time in a decoding step: on CUDA the wall time of a step less the device's time in it (the GPU's
    time from the step's first kernel to its read of the device, measured with CUDA events in a second pass in which
    the host has queued the whole step before the device starts it: `device_spans`), for plain, EAGLE and suffix
    steps of the small model (compiled, as the trainer runs them on a GPU) at 16 and 64 rows; on a CPU (eager, as the
    trainer runs there) the wall time only, at a few rows."""
    dev = check.device
    model = small_model(check)
    backend = compile_backend_for(dev) if dev.type == "cuda" else None
    rows_list = (2, 4) if check.quick or dev.type == "cpu" else (16, 64)
    table, points = [], []
    section.results["steps"] = points
    layers = model.config.num_hidden_layers
    title = (
        f"Host time per decoding step of the {'tiny' if check.quick or dev.type == 'cpu' else 'SmolLM2-shaped'} model "
        f"on {dev} (ms; device: CUDA-event time of the step's device work when the host is ahead of it; host: wall "
        "less device)"
    )
    columns = ["step", "rows", "wall ms", "device ms", "host ms", "host share", "device-timed steps"]
    for kind in ("plain", "eagle", "suffix"):
        engine = host_engine(kind, model, backend)
        for rows in rows_list:
            graphs = HOST_GRAPHS[kind] if backend else 0
            if not section.in_time(check, f"{kind} steps at {rows} rows", graphs=graphs, layers=layers):
                continue
            with check.clock.timing(layers):
                entry = {"kind": kind, **host_point(engine, rows, check.quick)}
            points.append(entry)
            device, host = entry.get("device"), entry.get("host")
            share = "-" if host is None else f"{host / entry['wall']:.0%}"
            steps = f"{entry['device_steps']}/{entry['steps']}" if "device_steps" in entry else "-"
            table.append([kind, rows, ms(entry["wall"]), ms(device), ms(host), share, steps])
            section.draft(title, columns, table)
            check.save(section)
        release(dev)
    section.table(check, title, columns, table)


# ------------------------------------------------------------------------------------------------ calibration


def ratios(calibrated: list[float], steady: list[float]) -> list[float]:
    """Calibrated over steady seconds, point by point."""
    return [c / s for c, s in zip(calibrated, steady, strict=True)]


def grid_ratios(calibrated: LatencyProfile, steady: LatencyProfile) -> list[float]:
    """Calibrated over steady seconds at every (rows, tokens per row) point of the tree grid both measured."""
    both = zip(calibrated.tree_seconds, steady.tree_seconds, strict=True)
    pairs = [(c, s) for row_c, row_s in both for c, s in zip(row_c, row_s, strict=True)]
    return [c / s for c, s in pairs if c is not None and s is not None]


def ratio_rows(forward: str, tokens: tuple[int, ...], calibrated: list[float], steady: list[float]) -> list[list]:
    """Table rows of one curve: per token count, the calibrated and steady milliseconds and their ratio."""
    points = zip(tokens, calibrated, steady, ratios(calibrated, steady), strict=True)
    return [[forward, t, ms(c), ms(s), f"{r:.2f}"] for t, c, s, r in points]


def section_calibration(check: Check, section: Section) -> None:
    """The latency profile the trainer calibrates on a first run (`fastgrpo.speculative.profiler.calibrate`, with the
    EAGLE drafter's probe, compiled as ``compile: auto`` compiles: inductor on a GPU, eager on a CPU) against the same
    forwards timed in steady state (`measure` at the same token counts and context, many rounds): the ratio of each
    point's calibrated time to its steady one (above 1: the calibration saw compilation, recording or warm-up)."""
    dev = check.device
    model = small_model(check)
    backend = compile_backend("auto", dev)
    probes = cost_probes([PLUGINS["eagle"]], model, backend)
    replays = 2 if check.quick else 30
    with private_cache(check.scratch / "calibration-cache"):
        t0 = time.perf_counter()
        calibrated = calibrate(model, "gpu-check-calibration", probes, backend)
        section.results["calibration_seconds"] = time.perf_counter() - t0
        tokens, context = tuple(calibrated.tokens), calibrated.context_length
        steady = measure(model, "gpu-check-calibration", probes, tokens, context, replays, backend=backend)
    target = ratios(calibrated.target_seconds, steady.target_seconds)
    drafters = {name: ratios(s, steady.drafter_seconds[name]) for name, s in calibrated.drafter_seconds.items()}
    grid = grid_ratios(calibrated, steady)
    section.results.update(
        tokens=list(tokens),
        context=context,
        replays=replays,
        calibrated_seconds=calibrated.target_seconds,
        steady_seconds=steady.target_seconds,
        target_ratio=target,
        drafter_ratio=drafters,
        grid_ratio=grid,
        c_peak=(calibrated.c_peak, steady.c_peak),
    )
    table = ratio_rows("target", tokens, calibrated.target_seconds, steady.target_seconds)
    for name, seconds in calibrated.drafter_seconds.items():
        table += ratio_rows(name, tokens, seconds, steady.drafter_seconds[name])
    if grid:
        table.append(["tree grid", f"{len(grid)} points", "-", "-", f"{min(grid):.2f} to {max(grid):.2f}"])
    check.record.table(
        f"Calibrated latency profile against {replays} steady rounds of the same forwards, "
        f"{'compiled' if backend else 'eager'}, {context} cached tokens, on {dev} (C_peak calibrated "
        f"{calibrated.c_peak}, steady {steady.c_peak})",
        ["forward", "tokens", "calibrated ms", "steady ms", "calibrated / steady"],
        table,
    )
