"""The sections only `gpu_check`'s compiled engine can answer, which ``--first`` runs among its first: whether rows
parked on tools keep their keys and values under compiled steps (``parked``), and what settling a compiled engine with
trees costs before a rollout's first step (``settle``)."""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Any

import torch
from gpu_check_budget import SETTLE_GRAPHS
from gpu_check_common import (
    Check,
    Section,
    compile_backend_for,
    counted_captures,
    decode_model,
    random_prompts,
    tiny_draft,
    tiny_model,
)
from parked_rows import LateTools, frequent_token, watch_parked

from fastgrpo.rollout.engine import RolloutEngine
from fastgrpo.rollout.tree import TreeShape
from fastgrpo.sampling_params import SamplingParams
from fastgrpo.speculative.eagle.drafter import EagleDrafter
from fastgrpo.speculative.suffix.drafter import SuffixDrafter

PARKED_PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19], [4]]
PARKED_COPIES = 3  # 12 rows: padded to 16, so that padded rows exist while rows wait
PARKED_NEW = 40
MERGED_TREE = TreeShape(8, 3, 4, drafter="eagle+suffix")
# Settling: rows of each call and (prompt, new) tokens, in the full run and with ``--quick``.
SETTLE_ROWS = ((16, 64), (4, 8))
SETTLE_TOKENS = ((512, 64), (16, 8))


def merged_engine(model: Any, eos: list[int], backend: str) -> RolloutEngine:
    """A compiled engine verifying merged EAGLE (an untrained head) and suffix trees of `MERGED_TREE`."""
    engine = RolloutEngine(model, eos, backend=backend)
    draft = tiny_draft(model, model.device)
    engine.speculate([EagleDrafter(draft, model, backend), SuffixDrafter()], tree=MERGED_TREE)
    return engine


def section_parked(check: Check, section: Section) -> None:
    """Tools answering four decoding steps late, on a tiny Llama whose steps and EAGLE proposals run compiled
    (inductor on a GPU; on a CPU Dynamo's capture, which pads rows as any compiled step does) with merged 8-node
    trees, greedy and sampled: every resumed row's keys and values as it left them, and the completions against an
    eager engine's under the same uniforms (equal required in float64 on a CPU; on a GPU, in float32, where a compiled
    graph may round otherwise, the share of equal completions is reported)."""
    dev = check.device
    dtype = torch.float64 if dev.type == "cpu" else torch.float32
    model = tiny_model("llama", dev).to(dtype)
    eos = frequent_token(model, PARKED_PROMPTS)
    engine = merged_engine(model, [eos], compile_backend_for(dev, aot=False))
    rows, table = len(PARKED_PROMPTS) * PARKED_COPIES, []
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_new_tokens=PARKED_NEW, temperature=temperature)
        args = (PARKED_PROMPTS, params, PARKED_COPIES)
        generator = torch.Generator(device=dev).manual_seed(5)
        uniforms = torch.rand(rows, PARKED_NEW, generator=generator, dtype=torch.float64, device=dev)
        eager = RolloutEngine(model, [eos]).generate(*args, uniforms=uniforms, turns=LateTools())
        with check.clock.timing(model.config.num_hidden_layers), watch_parked(engine) as parked:
            out = engine.generate(*args, uniforms=uniforms, turns=LateTools())
        equal = sum(a == b for a, b in zip(out.completion_ids, eager.completion_ids, strict=True))
        name = "greedy" if temperature == 0 else "sampled"
        entry = {"resumed": parked.resumed, "changed": parked.changed, "equal": equal, "rows": rows}
        entry["most_waiting"] = max(out.stats.waiting, default=0)
        section.results[name] = entry
        section.expect(not parked.changed, f"{name}: parked rows' keys and values written over {parked.changed}")
        section.expect(parked.resumed >= 4 and entry["most_waiting"] >= 2, f"{name}: too few rows waited on tools")
        if dtype == torch.float64:
            section.expect(equal == rows, f"{name}: {rows - equal} of {rows} completions differ from eager's")
        table.append([name, parked.resumed, len(parked.changed), entry["most_waiting"], f"{equal}/{rows}"])
        check.save(section)
    section.results["eager_calls"] = eager_calls = engine.compiled_so_far().eager_calls
    section.expect(not any(eager_calls.values()), f"compiled steps ran eagerly: {eager_calls}")
    columns = ["decoding", "rows resumed", "resumed rows written over", "most rows waiting", "completions = eager"]
    section.table(
        check, f"Parked rows under compiled steps (tiny Llama, {str(dtype).removeprefix('torch.')})", columns, table
    )


def section_settle(check: Check, section: Section) -> None:
    """The decode model (Qwen2.5-7B-shaped in bfloat16; tiny with ``--quick``) compiled as a GRPO run compiles it
    (inductor and CUDA graphs on a GPU; Dynamo's capture on a CPU) with merged EAGLE and suffix trees of 8 nodes,
    sampled, its caches reserved for the largest call: per call the seconds, graphs compiled, shapes met (CUDA graphs
    on a GPU), CUDA graphs recorded and steps that ran eagerly. Settling happens in the first call, before its first
    step; the next call, at more rows, must compile nothing."""
    dev, quick = check.device, int(check.quick)
    model = decode_model(check)
    backend = compile_backend_for(dev, aot=False)
    engine = merged_engine(model, [], backend)
    rows_list, (prompt, new) = SETTLE_ROWS[quick], SETTLE_TOKENS[quick]
    engine.reserve(max(rows_list), prompt + new + 1)
    layers = model.config.num_hidden_layers
    if not section.in_time(check, "settling the merged-tree engine", graphs=SETTLE_GRAPHS, layers=layers):
        return
    params, table = SamplingParams(max_new_tokens=new, temperature=1.0), []
    section.results["calls"] = calls = []
    for i, rows in enumerate(rows_list):
        before, t0 = engine.compiled_so_far(), time.perf_counter()
        with check.clock.timing(layers) if i == 0 else nullcontext(), counted_captures() as captures:
            engine.generate(random_prompts([prompt], model.config.vocab_size, seed=i), params, rows)
        after = engine.compiled_so_far()
        entry = {
            "rows": rows,
            "seconds": time.perf_counter() - t0,
            "compile_seconds": after.seconds - before.seconds,
            "graphs": after.graphs - before.graphs,
            "shapes": after.shapes - before.shapes,
            "recordings": captures.count if dev.type == "cuda" else None,
            "eager_calls": sum(after.eager_calls.values()) - sum(before.eager_calls.values()),
        }
        calls.append(entry)
        recorded = "-" if entry["recordings"] is None else entry["recordings"]
        cells = [f"{entry['seconds']:.1f}", f"{entry['compile_seconds']:.1f}", entry["graphs"], entry["shapes"]]
        table.append([i + 1, rows, *cells, recorded, entry["eager_calls"]])
        check.save(section)
    later = calls[1:]
    quiet = all(c["graphs"] == 0 and c["shapes"] == 0 and not c["recordings"] for c in later)
    section.expect(quiet, "a later call compiled, met a shape or recorded a CUDA graph")
    section.expect(all(c["eager_calls"] == 0 for c in calls), "a compiled step ran eagerly")
    name = "tiny Qwen2" if check.quick else "Qwen2.5-7B-shaped"
    title = f"Settling a compiled engine with merged 8-node trees ({name}, bfloat16, {prompt} + {new} tokens, {dev})"
    columns = ["call", "rows", "seconds", "compile s", "graphs", "shapes", "CUDA graphs recorded", "eager steps"]
    section.table(check, title, columns, table)
