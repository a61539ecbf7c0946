"""`benchmarks/gpu_check.py --device cpu --quick` runs every section to the end on a CPU, in order, and every one
passes, on a PATH without git; its JSON record holds each section's results and graphs compiled; a run killed inside
its decode section keeps the sections it finished and the decode points it measured on disk; a spent time budget skips
sections with a line each, and a point whose compiles do not fit the time left is skipped with a line; the speed
targets are judged as the GPU run will judge them; and the scripts make every tensor on the device they use."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import gpu_check
import pytest
import torch
import yaml
from gpu_check import skip_reason
from gpu_check_budget import (
    CALIBRATION_GRAPHS,
    MIN_GRAPH_SECONDS,
    PUBLIC_7B_GRAPH_SECONDS,
    TORCHRUN_GRAPHS,
    CompileClock,
    Estimate,
    section_estimate,
)
from gpu_check_common import Check, Section, counted_captures
from gpu_check_decode import TARGETS, decode_sweep, target_values, verdict
from gpu_check_training import JOB, save_model_dir, torchrun_command, torchrun_config
from record import commit
from test_device_lint import deviceless_factories

from fastgrpo.cli import build_parser
from fastgrpo.config import load_config
from fastgrpo.models import load_model, load_tokenizer

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"
SECTIONS = (
    "preflight",
    "environment",
    "greedy",
    "sampling",
    "sdpa",
    "parked",
    "torchrun",
    "decode",
    "settle",
    "recordings",
    "targets",
    "host",
    "calibration",
    "grpo",
)
# ``--first``: the decisive sections first (correctness, parked rows, settling, compiled steps, host time).
FIRST = ("preflight", "environment", "greedy", "sampling", "parked", "settle", "decode", "host")
REST = tuple(name for name in SECTIONS if name not in FIRST)


def quick_command(output: Path, *args: str) -> list[str]:
    return [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--output", str(output), *args]


# One torch thread per process, as the torchrun tests run theirs: the tiny shapes gain nothing from a second one, which
# on a machine whose cores are busy with other work spends its time waiting for a core.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def without_git(directory: Path) -> dict[str, str]:
    """`ENV` with a PATH of one directory that holds only this interpreter, as ``python``: no git, no C compiler."""
    directory.mkdir()
    (directory / "python").symlink_to(sys.executable)
    return {**ENV, "PATH": str(directory)}


@pytest.fixture(scope="module")
def quick_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[subprocess.CompletedProcess, dict, Path]]:
    """Two quick CPU runs of the check (tiny shapes) on a PATH without git, which together run every section once:
    ``first`` (``--first``) and ``rest`` (the other sections); each one's process, JSON record and record path."""
    root = tmp_path_factory.mktemp("gpu-check")
    env = without_git(root / "bin")
    assert shutil.which("git", path=env["PATH"]) is None
    runs = {}
    for name, args in (("first", ["--first"]), ("rest", ["--sections", ",".join(REST)])):
        output = root / name / "gpu_check.json"
        run = subprocess.run(quick_command(output, *args), capture_output=True, text=True, timeout=900, env=env)
        assert output.is_file(), f"{name}: no record written:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
        runs[name] = (run, json.loads(output.read_text()), output)
    return runs


@pytest.fixture(scope="module")
def quick_run(quick_runs) -> tuple[subprocess.CompletedProcess, dict[str, Any], Path]:
    """The ``first`` run, its record holding the sections of both runs."""
    run, record, output = quick_runs["first"]
    sections = {**record["notes"]["sections"], **quick_runs["rest"][1]["notes"]["sections"]}
    return run, {**record, "notes": {**record["notes"], "sections": sections}}, output


@pytest.mark.parametrize(("name", "planned"), [("first", FIRST), ("rest", REST)])
def test_every_section_runs_in_order_and_passes(quick_runs, name: str, planned: tuple[str, ...]) -> None:
    run, record, output = quick_runs[name]
    sections = record["notes"]["sections"]
    assert list(sections) == list(planned) == record["notes"]["planned"]
    failed = {name: (s["failures"], s["error"]) for name, s in sections.items() if s["status"] == "failed"}
    assert not failed, f"{failed}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    assert run.returncode == 0
    assert "all sections passed" in run.stdout and "skipped:" not in run.stdout.splitlines()[-1]
    assert all(s["status"] == "passed" for s in sections.values())
    assert record["notes"]["device"] == "cpu" and record["notes"]["quick"] is True
    assert record["notes"]["first"] is (name == "first")
    assert record["notes"]["budget"] == (480.0 if name == "first" else None)  # --first: 8 minutes unless given
    titles = [t["title"] for t in record["tables"]]
    assert titles[-1] == "Sections" and titles[0].startswith("Preflight") == (name == "first")
    markdown = output.with_suffix(".md").read_text()
    assert all(f"**{title}**" in markdown for title in titles)


def test_parked_rows_keep_their_keys_and_values_under_compiled_steps(quick_run) -> None:
    results = quick_run[1]["notes"]["sections"]["parked"]["results"]
    for name in ("greedy", "sampled"):
        entry = results[name]
        assert entry["changed"] == [] and entry["resumed"] >= 4 and entry["most_waiting"] >= 2, name
        assert entry["equal"] == entry["rows"] == 12, name  # float64 on a CPU: every completion as eager's
    assert results["eager_calls"] == {"plain_step": 0, "tree_step": 0, "eagle_proposal": 0}


def test_settling_compiles_in_the_first_call_only(quick_run) -> None:
    calls = quick_run[1]["notes"]["sections"]["settle"]["results"]["calls"]
    assert [c["rows"] for c in calls] == [4, 8]
    assert calls[0]["graphs"] >= 1 and calls[0]["shapes"] >= calls[0]["graphs"] and calls[0]["compile_seconds"] > 0
    assert (calls[1]["graphs"], calls[1]["shapes"], calls[1]["compile_seconds"]) == (0, 0, 0.0)
    assert all(c["eager_calls"] == 0 and c["recordings"] is None for c in calls)  # CUDA graphs: on a GPU only


def test_first_and_sections_exclude_each_other(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--first", "--sections", "greedy"])
    assert "give --sections or --first, not both" in capsys.readouterr().err
    assert gpu_check.parse_args(["--first", "--budget", "300"]).budget == 300.0
    assert tuple(gpu_check.parse_args(["--first"]).sections) == FIRST
    sweep = decode_sweep(quick=False, first=True)  # 16 and 64 rows of 512 tokens, each eager and compiled
    assert (sweep.rows, sweep.contexts, sweep.nodes) == ([16, 64], [512], [8])
    assert sweep.step_rows == sweep.verify_rows == (16, 64)


def test_the_run_needs_no_git(quick_run) -> None:
    record = quick_run[1]
    assert record["commit"] == "unknown"  # the run's PATH holds no git
    assert commit(Path(quick_run[2]).parent) == "unknown"  # a directory outside any repository


def test_every_section_records_its_compiled_graphs(quick_run) -> None:
    sections = quick_run[1]["notes"]["sections"]
    graphs = {name: s["graphs"] for name, s in sections.items()}
    assert all(graphs[name] >= 1 for name in ("preflight", "parked", "decode", "settle"))  # compiled on a CPU too
    assert all(graphs[name] == 0 for name in ("environment", "greedy", "sampling", "sdpa", "host", "targets"))
    assert quick_run[1]["notes"]["compile_cache"] == str(quick_run[2].parent / "inductor-cache")


def test_preflight_and_environment(quick_run) -> None:
    sections = quick_run[1]["notes"]["sections"]
    items = sections["preflight"]["results"]["items"]
    assert set(items) == {"C compiler", "Python headers", "compiled smoke test"}  # Triton: on a GPU only
    assert items["compiled smoke test"] == {**items["compiled smoke test"], "ok": True, "required": True}
    assert not items["C compiler"]["required"] and not items["Python headers"]["required"]  # aot_eager on a CPU
    smoke = sections["preflight"]["results"]["smoke"]
    assert smoke["equal"] is True and smoke["graphs"] >= 1 and smoke["recordings"] is None
    env = sections["environment"]["results"]
    assert env["device"] == "cpu" and env["torch"] and env["transformers"] and env["python"]
    assert set(env["sdpa_enabled"]) == {"flash", "mem_efficient", "cudnn", "math"}


def test_sdpa_kernels_and_attention_points(quick_run) -> None:
    results = quick_run[1]["notes"]["sections"]["sdpa"]["results"]
    forwards = results["forwards"]
    assert len(forwards) == 6  # two dtypes x (unmasked step, masked step, tree)
    for name, step in forwards.items():
        assert step["backend"] != "none found", name
        assert any("scaled_dot_product" in op for op in step["aten_ops"]), name
    points = results["attention"]
    assert {(p["rows"], p["context"], p["masked"]) for p in points} == {
        (rows, context, masked) for rows in (2, 4) for context in (64, 256) for masked in (False, True)
    }
    for p in points:
        assert p["backend"] != "none found" and p["seconds"] > 0 and p["kv_gb_s"] > 0, p


def test_grpo_runs_every_mode_lora_and_dtype_for_two_steps_eagerly_on_a_cpu(quick_run) -> None:
    """``--quick``: each mode in float32, and LoRA and bfloat16 each way with the default mode."""
    results = quick_run[1]["notes"]["sections"]["grpo"]["results"]
    runs = results["runs"]
    combos = {(r["mode"], r["lora"], r["dtype"]) for r in runs}
    modes, loras, dtypes = ("off", "static", "paper", "adaptive"), (False, True), ("float32", "bfloat16")
    every = {(m, False, "float32") for m in modes} | {("adaptive", lo, d) for lo in loras for d in dtypes}
    assert combos == every and len(runs) == 7
    assert not any(r["compiled"] for r in runs)  # the one compiled run compiles on a GPU only
    for run in runs:
        assert "error" not in run, run.get("error")
        steps = run["steps"]
        assert [s["step"] for s in steps] == [1, 2]
        for s in steps:
            assert s["time/step"] > 0 and s["memory/peak_mb"] > 0
            assert 0.0 <= s["reward"] <= 2.0 and s["spec/accept_length"] >= 1.0
            assert s["train/rows_trained"] > 0, "the update must train on rows (non-zero advantages)"


def test_greedy_equals_generate_everywhere(quick_run) -> None:
    families = quick_run[1]["notes"]["sections"]["greedy"]["results"]["families"]
    assert len(families) == 6  # llama, qwen2, qwen3 x plain, speculative
    for name, result in families.items():
        assert result["equal"] is True and result["finish_reasons_equal"] is True, name
        assert result["max_logprob_diff"] < 1e-8, name
        assert 0 < result["rows_stopped_by_eos"] < 6, name


def test_sampling_distribution_and_same_uniforms(quick_run) -> None:
    results = quick_run[1]["notes"]["sections"]["sampling"]["results"]
    assert len(results["chi_square"]) == 4
    for name, test in results["chi_square"].items():
        assert test["p_value"] > 1e-3 and test["dof"] >= 2 and test["draws"] > 1000, name
    speculative = [t for name, t in results["chi_square"].items() if "speculative" in name]
    assert len(speculative) == 1 and speculative[0]["accept_length"] > 1.2
    same = results["same_uniforms"]
    assert len(same) == 8  # four models x (uniforms, generator)
    for name, result in same.items():
        assert result["same_tokens"] is True and result["max_logprob_diff"] < 1e-8, name
    low = results["same_uniforms_low_precision"]  # reported, not checked: rounding may change a token
    assert set(low) == {"float32", "bfloat16"}
    assert all(0 <= r["same_completions"] <= r["completions"] == 8 for r in low.values())


def test_decode_measures_every_point(quick_run) -> None:
    results = quick_run[1]["notes"]["sections"]["decode"]["results"]
    assert results["copy_bandwidth_gb_s"] > 0 and results["weight_bytes_read"] > 0
    assert results["weight_read_seconds"] > 0
    assert [(p["rows"], p["context"]) for p in results["steps"]] == [(1, 48)]
    for point in results["steps"]:
        assert point["engine"] > 0 and point["compiled"] > 0 and point["generate"] > 0
        assert point["engine_bandwidth_gb_s"] > 0
    for point in results["verification"]:
        assert set(point["seconds"]) == {"1", "4", "8"} and set(point["compiled"]) == {"1", "8"}
        assert all(s > 0 for s in [*point["seconds"].values(), *point["compiled"].values()])


def test_recordings_compile_nothing_after_the_first_plain_rollout(quick_run) -> None:
    results = quick_run[1]["notes"]["sections"]["recordings"]["results"]
    for name in ("plain", "speculative"):
        rollouts = results[name]["rollouts"]
        assert [r["prompt_length"] for r in rollouts] == [6, 12, 3, 9], name
        assert rollouts[0]["graphs"] >= 1, name  # compiled (the ``eager`` backend on a CPU)
        assert all(r["captures"] is None and "reserved_mb" not in r for r in rollouts), name  # CUDA only
    assert [r["graphs"] for r in results["plain"]["rollouts"][1:]] == [0, 0, 0]


def test_host_calibration_targets_and_torchrun_on_a_cpu(quick_run) -> None:
    sections = quick_run[1]["notes"]["sections"]
    steps = sections["host"]["results"]["steps"]
    assert {(s["kind"], s["rows"]) for s in steps} == {(k, r) for k in ("plain", "eagle", "suffix") for r in (2, 4)}
    assert all(s["wall"] > 0 and "device" not in s for s in steps)  # wall time only on a CPU
    calibration = sections["calibration"]["results"]
    assert len(calibration["target_ratio"]) == len(calibration["tokens"]) == len(calibration["drafter_ratio"]["eagle"])
    assert all(r > 0 for r in calibration["target_ratio"] + calibration["grid_ratio"])
    targets = sections["targets"]["results"]["targets"]
    assert [t["target"] for t in targets] == list(TARGETS)
    assert all(t["verdict"] == "n/a (cpu)" for t in targets)
    torchrun = sections["torchrun"]  # compile: on is a GPU's; the CPU runs the same job with compile: off
    assert len(torchrun["skipped"]) == 1 and torchrun["results"]["compile"] == "off"
    assert torchrun["results"]["passed"] is True and [s["step"] for s in torchrun["results"]["steps"]] == [1, 2]
    assert torchrun["results"]["recordings"] == [0, 0] and len(torchrun["results"]["parameters_in_place"]) == 1
    assert torchrun["results"]["sharded"] is True  # one process under torchrun still shards with FSDP2


def read_record(path: Path) -> dict[str, Any] | None:
    """The JSON record at ``path``, None while there is none (it is replaced whole, never written in place)."""
    return json.loads(path.read_text()) if path.exists() else None


def decode_points(record: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The decoding points of a decode section still running in ``record`` (empty: none yet, or it ended)."""
    decode = (record or {}).get("notes", {}).get("sections", {}).get("decode", {})
    return decode.get("results", {}).get("steps", []) if decode.get("status") == "running" else []


def test_a_run_killed_inside_decode_keeps_the_sections_and_points_it_finished(tmp_path: Path) -> None:
    output = tmp_path / "gpu_check.json"
    planned = ["preflight", "decode", "greedy"]
    cmd = quick_command(output, "--sections", ",".join(planned))
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    try:
        deadline = time.monotonic() + 300
        while not decode_points(read_record(output)):
            assert process.poll() is None, "the run left decode before a point of it was in the record"
            assert time.monotonic() < deadline, "no decode point in the record within 300 s"
            time.sleep(0.02)
        process.kill()
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL
    record = json.loads(output.read_text())
    sections = record["notes"]["sections"]
    assert record["notes"]["planned"] == planned and list(sections) == ["preflight", "decode"]
    assert sections["preflight"]["status"] == "passed"
    assert sections["preflight"]["results"]["items"]["compiled smoke test"]["ok"] is True
    decode = sections["decode"]
    assert decode["status"] == "running" and decode["results"]["compiled_rows"] == [1]
    assert [(p["rows"], p["context"]) for p in decode["results"]["steps"]] == [(1, 48)]
    assert all(decode["results"]["steps"][0][key] > 0 for key in ("engine", "compiled", "generate"))
    titles = [t["title"] for t in record["tables"]]
    assert titles[0].startswith("Preflight") and titles[-1] == "Sections"
    assert any(t.startswith("Plain decoding step") for t in titles)  # the decode table so far
    assert record["tables"][-1]["rows"][-1][:2] == ["decode", "running"]
    markdown = output.with_suffix(".md").read_text()
    assert all(f"**{title}**" in markdown for title in titles)


def test_a_spent_budget_skips_every_section_with_a_line_each(tmp_path: Path) -> None:
    output = tmp_path / "gpu_check.json"
    planned = ["preflight", "environment", "decode", "grpo"]
    run = subprocess.run(
        quick_command(output, "--budget", "0", "--sections", ",".join(planned)),
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("skipped: ")]
    assert lines == ["skipped: the time budget of 0 s is spent"] * len(planned)
    sections = json.loads(output.read_text())["notes"]["sections"]
    assert list(sections) == planned
    assert all(s["status"] == "skipped" and len(s["skipped"]) == 1 and not s["results"] for s in sections.values())


def test_skip_reasons() -> None:
    nothing, big = Estimate(0, 0.0, "nothing compiled"), Estimate(5, 350.0, "70 s per graph, assumed")
    assert skip_reason("greedy", math.inf, None, None, nothing) is None
    assert skip_reason("decode", math.inf, True, None, big) is None
    assert skip_reason("greedy", 10.0, False, 30.0, nothing) is None  # does not compile
    assert "preflight failed" in skip_reason("decode", 10.0, False, 30.0, nothing)
    assert skip_reason("greedy", 0.0, True, 30.0, nothing) == "the time budget of 30 s is spent"
    assert skip_reason("decode", 300.0, True, 480.0, big) == (
        "compiling its 5 graphs needs ~350 s (70 s per graph, assumed), 300 s left"
    )


def test_a_compiled_function_that_falls_back_to_eager_fails_its_section(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A section in which a compiled step of fastgrpo's ran eagerly (here: a graph break) fails with the reason; the
    next section does not inherit it."""
    from fastgrpo.rollout.compiled import Compiled

    def broken(x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return 2 * x

    def compiles(check: Check, section: Section) -> None:
        fn = Compiled(broken, "aot_eager", "broken")
        assert torch.equal(fn(torch.device("cpu"), torch.ones(2)), torch.full((2,), 2.0))

    monkeypatch.setitem(gpu_check.SECTIONS, "compiles", compiles)
    monkeypatch.setitem(gpu_check.SECTIONS, "eager", lambda check, section: None)
    check = Check(torch.device("cpu"), True, None, None, tmp_path, CompileClock(cuda=False))
    failed, passed = gpu_check.run_section(check, "compiles"), gpu_check.run_section(check, "eager")
    assert failed["status"] == "failed" and failed["failures"][0].startswith("ran eagerly though compiled: broken")
    assert passed["status"] == "passed" and not passed["failures"]


def test_compile_estimates_assume_until_they_measure(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = CompileClock(cuda=True)
    assert gpu.graph_seconds(28) == PUBLIC_7B_GRAPH_SECONDS and gpu.graph_seconds(2) == MIN_GRAPH_SECONDS
    calibration = section_estimate("calibration", gpu, quick=False)  # a 30-layer model
    assert calibration.graphs == CALIBRATION_GRAPHS and calibration.seconds == CALIBRATION_GRAPHS * 75.0
    assert section_estimate("torchrun", gpu, quick=False).seconds == TORCHRUN_GRAPHS * MIN_GRAPH_SECONDS
    assert section_estimate("greedy", gpu, quick=False) == (0, 0.0, "nothing compiled")
    assert section_estimate("host", CompileClock(cuda=False), quick=True).graphs == 0  # eager on a CPU
    graphs = iter([10, 10, 10, 13])  # the compiled-graph counter before and after each of two blocks
    monkeypatch.setattr("gpu_check_budget.compiled_graphs", lambda: next(graphs))
    with gpu.timing(28):  # compiles nothing: not a compile's time
        pass
    assert gpu.source(28) == "assumed"
    with gpu.timing(28):
        time.sleep(0.03)
    assert gpu.source(28) == "measured" and 0.01 < gpu.graph_seconds(28) < PUBLIC_7B_GRAPH_SECONDS


def test_a_sweep_point_that_cannot_compile_in_the_time_left_is_skipped_with_a_line(tmp_path: Path) -> None:
    check = Check(torch.device("cpu"), True, None, None, tmp_path, CompileClock(cuda=True))
    section = Section("decode")
    assert section.in_time(check, "no budget", graphs=100, layers=28)
    check.deadline = time.perf_counter() + 100.0
    assert section.in_time(check, "eager point") and section.in_time(check, "one tiny graph", graphs=1, layers=2)
    assert not section.in_time(check, "compiled point", graphs=2, layers=28)
    check.deadline = time.perf_counter() - 1.0
    assert not section.in_time(check, "eager point")
    assert len(section.skipped) == 2
    assert section.skipped[0].startswith("compiled point: compiling 2 graph(s) needs ~140 s (assumed), ")
    assert section.skipped[1] == "eager point: the time budget is spent"


def test_speed_targets_are_judged_from_the_decode_and_recordings_results() -> None:
    """In the JSON shape of the two sections' results: every target met, then each one missed in turn."""

    def step(rows: int, context: int, compiled: float, generate: float) -> dict[str, Any]:
        return {"rows": rows, "context": context, "engine": 2 * compiled, "compiled": compiled, "generate": generate}

    def verification(rows: int, ratio: float) -> dict[str, Any]:
        return {"rows": rows, "context": 512, "seconds": {}, "compiled": {"1": 0.01, "8": 0.01 * ratio}}

    def rollouts(captures: list[int | None]) -> dict[str, Any]:
        return {"plain": {"rollouts": [{"captures": c} for c in captures]}}

    decode = {
        "weight_read_seconds": 0.005,
        "steps": [step(1, 512, 0.006, 0.03), step(16, 512, 0.0064, 0.05), step(64, 512, 0.02, 0.1)]
        + [step(1, 4096, 0.007, 0.03)],
        "verification": [verification(1, 1.1), verification(8, 1.2), verification(64, 3.0)],
    }
    values = target_values(decode, rollouts([5, 0, 0, 0]))
    assert [name for name, _, _ in values] == list(TARGETS)
    assert [round(v, 3) for _, v, _ in values] == [1.28, 1.2, round(0.03 / 0.007, 3), 0.0]  # 64 rows: outside
    assert [met for _, _, met in values] == [True, True, True, True]
    decode["steps"][1] = step(16, 512, 0.007, 0.05)
    decode["verification"][1] = verification(8, 1.4)
    decode["steps"][3] = step(1, 4096, 0.011, 0.03)
    values = target_values(decode, rollouts([5, 0, 1, 0]))
    assert [met for _, _, met in values] == [False, False, False, False]
    values = target_values({}, rollouts([5, None, None, None]))
    assert [met for _, _, met in values] == [None, None, None, None]
    gpu = torch.device("cuda")
    assert [verdict(m, gpu, False) for m in (True, False, None)] == ["met", "not met", "not measured"]
    assert verdict(True, gpu, True) == "n/a (quick: tiny model)" and verdict(True, torch.device("cpu"), False) == (
        "n/a (cpu)"
    )


def test_capture_counting_wraps_and_restores_the_cuda_graph_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    began = []
    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", lambda graph, *a, **k: began.append(graph))
    stand_in = torch.cuda.CUDAGraph.capture_begin
    with counted_captures() as captures:
        torch.cuda.CUDAGraph.capture_begin("graph 1")
        torch.cuda.CUDAGraph.capture_begin("graph 2", pool=None)
    assert captures.count == 2 and began == ["graph 1", "graph 2"]
    assert torch.cuda.CUDAGraph.capture_begin is stand_in


def test_the_torchrun_job_is_a_valid_fastgrpo_train_command(tmp_path: Path) -> None:
    model_dir = save_model_dir(tmp_path / "model", load_tokenizer("smollm2"))
    assert load_model(str(model_dir)).config.num_hidden_layers == 2
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(torchrun_config(model_dir, tmp_path / "run", "cpu", "on")))
    config = load_config(config_path, [])
    assert config.fsdp is True and config.compile == "on" and config.max_steps == 2
    cmd = torchrun_command(config_path, tmp_path / "job.json")
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--nproc_per_node", "1"]
    assert cmd[7:9] == [str(JOB), str(tmp_path / "job.json")]
    args = build_parser().parse_args(["train", *cmd[9:]])
    assert args.command == "train" and args.config == str(config_path)


def test_the_scripts_name_the_device_of_every_tensor_they_make() -> None:
    scripts = sorted(SCRIPT.parent.glob("gpu_check*.py"))
    assert len(scripts) >= 6
    for script in scripts:
        assert deviceless_factories(script.read_text()) == [], script.name
