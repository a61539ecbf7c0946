"""The training sections of `gpu_check`: two GRPO steps of `GRPOTrainer` in every speculation mode, with and without
LoRA, in float32 and bfloat16; and two steps of ``fastgrpo train`` under ``torchrun`` with FSDP2 and compilation on."""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import transformers
import yaml
from gpu_check_budget import GRPO_COMPILED_GRAPHS
from gpu_check_common import (
    TINY_LLAMA_SHAPE,
    Check,
    Section,
    build_model,
    check_tokenizer,
    private_cache,
    release,
    smollm2_config,
)
from record import REPO
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from fastgrpo.config import GRPOConfig, SpeculationConfig
from fastgrpo.data import DataConfig, load_dataset
from fastgrpo.grpo.trainer import GRPOTrainer
from fastgrpo.models import DTYPES

COMPILED_RUN = ("adaptive", False, "bfloat16")  # (mode, LoRA, dtype) of the one GRPO run compiled on a GPU
TORCHRUN_SECONDS = 300  # the most a torchrun job may take (its compilation included), within the time budget

# ------------------------------------------------------------------------------------------------ GRPO steps


def even_token_share(prompts: list[Any], completions: list[str], completion_ids: list[list[int]], **_: Any) -> list:
    """A reward that differs between the completions of a random model (the share of even token ids), so that the
    group advantages are not all zero and the policy update trains on every row (accuracy alone is 0 for all)."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def grpo_run(
    check: Check,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict[str, Any]],
    data: DataConfig,
    mode: str,
    lora: bool,
    dtype: str,
    compiled: bool,
) -> dict[str, Any]:
    """Two GRPO steps of a fresh random model in one configuration, its rollouts compiled (``compile: on``) or eager
    (``compile: off``); returns each step's metrics."""
    dev, quick = check.device, check.quick
    model = build_model(LlamaForCausalLM, smollm2_config(tokenizer, quick), DTYPES[dtype], dev)
    output_dir = check.scratch / f"grpo-{mode}-{'lora' if lora else 'full'}-{dtype}"
    config = GRPOConfig(
        model="gpu-check-smollm2-shape",  # a name for the draft and the latency profile; the model is passed in
        dtype=dtype,
        device=dev.type,
        compile="on" if compiled else "off",
        dataset=data,
        reward_funcs=["accuracy", even_token_share],
        num_generations=2 if quick else 8,
        per_device_train_batch_size=4 if quick else 16,
        gradient_accumulation_steps=1,
        max_completion_length=8 if quick else 64,
        max_steps=2,
        learning_rate=1e-5,
        speculation=SpeculationConfig(mode=mode, nodes=4 if quick else 16, top_k=2 if quick else 4, depth=3),
        use_peft=lora,
        output_dir=str(output_dir),
        save_steps=2,
        logging_steps=1,
        gradient_checkpointing=False,
        bf16=False,
        save_only_model=True,
        save_total_limit=1,
        log_completions=False,
        progress_bar=False,
        seed=0,
    )
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    try:
        history = GRPOTrainer(config, model=model, tokenizer=tokenizer, dataset=rows).train()
    finally:
        shutil.rmtree(output_dir, ignore_errors=True)
        del model
        release(dev)
    return {"steps": history}


def peft_importable() -> bool:
    """Whether peft, which the LoRA runs need, imports here (the GPU machine's packages may lack it)."""
    try:
        import peft  # noqa: F401
    except ImportError:
        return False
    return True


def grpo_row(mode: str, lora: bool, dtype: str, compiled: bool, steps: list[dict[str, float]]) -> list[Any]:
    """A table row: per step (first, second) seconds, reward, accept length; peak memory of the second step."""

    def both(key: str, fmt: str) -> str:
        return ", ".join(format(s[key], fmt) if key in s else "-" for s in steps)

    def mb(key: str) -> str:
        value = steps[-1].get(key)
        return "-" if value is None else f"{value:.0f}"

    cells = [mode, "yes" if lora else "no", dtype, "yes" if compiled else "no", both("time/step", ".2f")]
    return cells + [
        both("reward", ".3f"),
        both("spec/accept_length", ".2f"),
        mb("memory/rollout_peak_mb"),
        mb("memory/update_peak_mb"),
        mb("memory/peak_mb"),
    ]


def section_grpo(check: Check, section: Section) -> None:
    """Two GRPO steps in each of 16 configurations (``--quick``: each speculation mode in float32, LoRA and bfloat16
    with the default mode: 7). Only one run compiles its rollouts, on a GPU and when the
    preflight found what compiling needs: `COMPILED_RUN`, the configuration a GPU run uses by default, whose compiled
    steps are what its seconds measure (the compiled step's own speed is the decode section's); the others run
    eagerly (``compile: off``), as every run does on a CPU, so that the section pays for one compilation, not 16."""
    transformers.utils.logging.disable_progress_bar()  # one bar per checkpoint write otherwise
    tokenizer, source = check_tokenizer(check.tokenizer)
    section.results["tokenizer"] = source
    data = DataConfig(name="arithmetic", num_examples=16 if check.quick else 64, seed=0)
    rows = load_dataset(data)
    runs, table = [], []
    section.results["runs"] = runs
    where = "peak allocated CUDA memory" if check.device.type == "cuda" else "max RSS of the process so far"
    title = (
        f"Two GRPO steps of a random {'tiny Llama' if check.quick else 'SmolLM2-135M-shaped model'} on {check.device} "
        f"(seconds, reward and accept length of step 1, step 2; memory: {where}, MB, step 2)"
    )
    columns = ["speculation", "LoRA", "dtype", "compiled", "s/step", "reward", "accept length"]
    columns += ["rollout peak MB", "update peak MB", "peak MB"]
    layers = smollm2_config(tokenizer, check.quick).num_hidden_layers
    loras = (False, True) if peft_importable() else (False,)
    if len(loras) == 1:
        section.skipped.append("the LoRA runs: peft does not import here")
    with private_cache(check.scratch / "grpo-cache"):
        for dtype in ("float32", "bfloat16"):
            for lora in loras:
                for mode in ("off", "static", "paper", "adaptive"):
                    if check.quick and (dtype, lora) != ("float32", False) and mode != "adaptive":
                        continue  # quick: every mode once, LoRA and bfloat16 with the default mode
                    label = f"grpo {mode} lora={lora} {dtype}"
                    compiled = (mode, lora, dtype) == COMPILED_RUN and check.device.type == "cuda"
                    if not section.in_time(check, label, graphs=GRPO_COMPILED_GRAPHS if compiled else 0, layers=layers):
                        continue
                    if compiled and check.compile_ok is False:
                        section.skipped.append(f"{label}, compiled: the preflight failed")
                        continue
                    run: dict[str, Any] = {"mode": mode, "lora": lora, "dtype": dtype, "compiled": compiled}
                    try:
                        run.update(grpo_run(check, tokenizer, rows, data, mode, lora, dtype, compiled))
                    except Exception as e:
                        run["error"] = traceback.format_exc()
                        section.failures.append(f"{label}: {type(e).__name__}: {e}")
                        cells = [mode, "yes" if lora else "no", dtype, "yes" if compiled else "no"]
                        table.append(cells + [f"failed: {type(e).__name__}"] + [""] * 5)
                    else:
                        steps = run["steps"]
                        section.expect(len(steps) == 2, f"{label}: {len(steps)} steps")
                        finite = all(math.isfinite(s.get("loss", 0.0)) for s in steps)
                        section.expect(finite, f"{label}: non-finite loss")
                        table.append(grpo_row(mode, lora, dtype, compiled, steps))
                    runs.append(run)
                    section.draft(title, columns, table)
                    check.save(section)
    section.table(check, title, columns, table)


# ------------------------------------------------------------------------------------------------ torchrun


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def save_model_dir(path: Path, tokenizer: PreTrainedTokenizerBase) -> Path:
    """A random tiny Llama (`TINY_LLAMA_SHAPE`, the vocabulary widened to the tokenizer's) with ``tokenizer``, saved
    as a Hugging Face model directory."""
    shape = dict(TINY_LLAMA_SHAPE, vocab_size=max(TINY_LLAMA_SHAPE["vocab_size"], len(tokenizer)))
    config = LlamaConfig(**shape, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    build_model(LlamaForCausalLM, config, torch.float32, torch.device("cpu")).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def torchrun_config(model_dir: Path, output_dir: Path, device: str, compile: str) -> dict[str, Any]:
    """The options of two GRPO steps of ``model_dir`` with FSDP2 and the rollouts' ``compile`` option, a checkpoint at
    the second step: on a GPU in bfloat16 behind FSDP2's float32 master shards, as a 7B run trains. Plain decoding
    (``speculation.mode: off``): what is checked here (FSDP2 over NCCL, the gathered parameters' addresses, the CUDA
    graphs each rollout records) needs no trees, and the job, early in the run, compiles two graphs, not the
    calibration's and the trees' too (counted with ``aot_eager``: docs/benchmarks.md)."""
    return dict(
        model=str(model_dir),
        device=device,
        dtype="bfloat16" if device == "cuda" else "float32",
        fsdp=True,
        compile=compile,
        dataset={"name": "arithmetic", "num_examples": 16},
        reward_funcs=["accuracy"],
        speculation={"mode": "off"},
        num_generations=4,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=1,
        max_completion_length=16,
        learning_rate=1e-5,
        max_steps=2,
        save_steps=2,
        logging_steps=1,
        gradient_checkpointing=False,
        bf16=False,
        output_dir=str(output_dir),
        progress_bar=False,
        log_completions=False,
    )


JOB = Path(__file__).with_name("gpu_check_fsdp_job.py")


def torchrun_command(config: Path, record: Path) -> list[str]:
    """``torchrun --nproc_per_node 1 gpu_check_fsdp_job.py RECORD --config CONFIG`` as this interpreter runs it:
    ``fastgrpo train --config CONFIG``, each rollout's CUDA graph recordings and parameter addresses written to
    ``record``."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port"]
    return [*launcher, str(free_port()), str(JOB), str(record), "--config", str(config)]


def section_torchrun(check: Check, section: Section) -> None:
    """Two steps of ``fastgrpo train`` in one process under ``torchrun`` with ``fsdp: true`` and ``compile: on``, of
    a tiny random Llama saved to a scratch directory: whether it ends cleanly with two logged steps (else the last
    line of its error output), the CUDA graphs recorded in each rollout, and whether the second rollout's gathered
    parameters have the first's addresses (on a GPU both are expected: none recorded again, in place). ``compile:
    on`` is a GPU's: on a CPU it means inductor's C++ code generation, which the CPU runs of this check leave out,
    so there the job runs with ``compile: off`` (FSDP2 over gloo), and says so."""
    cuda = check.device.type == "cuda"
    if not cuda:
        section.skipped.append("compile: on under torchrun is checked on a GPU (on a CPU inductor generates C++)")
    elif check.compile_ok is False:
        section.skipped.append("torchrun with compile on: the preflight failed")
        return
    compile = "on" if cuda else "off"
    transformers.utils.logging.disable_progress_bar()  # saving the model directory would draw one
    tokenizer, _ = check_tokenizer(check.tokenizer)
    root = check.scratch / "torchrun"
    model_dir = save_model_dir(root / "model", tokenizer)
    config = root / "config.yaml"
    config.write_text(yaml.safe_dump(torchrun_config(model_dir, root / "run", check.device.type, compile)))
    env = {**os.environ, "FASTGRPO_CACHE": str(root / "cache"), "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    record = root / "job.json"
    cmd = torchrun_command(config, record)
    t0 = time.perf_counter()
    limit = min(TORCHRUN_SECONDS, max(check.seconds_left(), 60.0))
    try:
        run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=limit)
        code, stderr = run.returncode, run.stderr
    except subprocess.TimeoutExpired as e:
        partial = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
        code, stderr = None, f"{partial}\ntimed out after {limit:.0f} s"
    metrics = root / "run" / "metrics.jsonl"
    steps = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    rollouts = json.loads(record.read_text())["rollouts"] if record.is_file() else []
    sharded = bool(rollouts) and all(r["sharded"] for r in rollouts)  # FSDP2 wrapped the policy
    passed = code == 0 and len(steps) == 2 and sharded
    recordings = [r["recordings"] for r in rollouts]
    # FSDP2 gathers the parameters anew for every rollout: CUDA graphs follow them without recording again only
    # where they land at the addresses of the rollout before.
    in_place = [a["addresses"] == b["addresses"] for a, b in zip(rollouts, rollouts[1:], strict=False)]
    section.results.update(
        command=" ".join(cmd[1:]),
        compile=compile,
        returncode=code,
        seconds=time.perf_counter() - t0,
        steps=steps,
        passed=passed,
        sharded=sharded,
        recordings=recordings,
        parameters_in_place=in_place,
        last_error_line=None if passed or not lines else lines[-1],
    )
    error = lines[-1] if lines else ""
    section.expect(
        passed, f"torchrun fsdp, compile {compile}: exit {code}, {len(steps)} steps, sharded {sharded}: {error}"
    )
    if cuda and passed:
        section.expect(
            all(in_place) and not any(recordings[1:]),
            f"torchrun fsdp: CUDA graph recordings per rollout {recordings}, gathered parameters at the previous "
            f"rollout's addresses {in_place}",
        )
    check.record.table(
        f"fastgrpo train under torchrun, one process, fsdp: true, compile: {compile}, tiny Llama, {check.device}",
        [
            "result",
            "exit code",
            "steps",
            "seconds",
            "recordings per rollout",
            "parameters in place",
            "last line of stderr",
        ],
        [
            [
                "passed" if passed else "FAILED",
                code,
                len(steps),
                f"{section.results['seconds']:.0f}",
                " / ".join("-" if r is None else str(r) for r in recordings),
                " / ".join("yes" if same else "no" for same in in_place),
                "-" if passed else error[:150].replace("|", "/"),
            ]
        ],
    )
