"""`benchmarks/gpu_check.py --device cpu --quick` runs every section to the end on a CPU, every section passes, and
its JSON record holds each section's results; the script makes every tensor on the device it uses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_device_lint import deviceless_factories

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"
SECTIONS = ("environment", "grpo", "greedy", "sampling", "sdpa", "decode")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, dict[str, Any]]:
    """One quick CPU run of the whole check (tiny shapes) and its JSON record."""
    output = tmp_path_factory.mktemp("gpu-check") / "gpu_check.json"
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--output", str(output)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert output.is_file(), f"no record written:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return run, json.loads(output.read_text())


def test_every_section_passes(quick_run) -> None:
    run, record = quick_run
    sections = record["notes"]["sections"]
    assert list(sections) == list(SECTIONS)
    failed = {name: (s["failures"], s["error"]) for name, s in sections.items() if s["status"] != "passed"}
    assert not failed, f"{failed}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    assert run.returncode == 0
    assert "all sections passed" in run.stdout
    assert record["notes"]["device"] == "cpu" and record["notes"]["quick"] is True
    assert [t["title"] for t in record["tables"]][-1] == "Sections"


def test_environment_and_sdpa(quick_run) -> None:
    sections = quick_run[1]["notes"]["sections"]
    env = sections["environment"]["results"]
    assert env["device"] == "cpu" and env["torch"] and env["transformers"] and env["python"]
    assert set(env["sdpa_enabled"]) == {"flash", "mem_efficient", "cudnn", "math"}
    steps = sections["sdpa"]["results"]
    assert len(steps) == 6  # two dtypes x (unmasked step, masked step, tree)
    for name, step in steps.items():
        assert step["backend"] != "none found", name
        assert any("scaled_dot_product" in op for op in step["aten_ops"]), name


def test_grpo_runs_every_mode_lora_and_dtype_for_two_steps(quick_run) -> None:
    results = quick_run[1]["notes"]["sections"]["grpo"]["results"]
    runs = results["runs"]
    combos = {(r["mode"], r["lora"], r["dtype"]) for r in runs}
    modes, loras, dtypes = ("off", "static", "paper", "adaptive"), (False, True), ("float32", "bfloat16")
    assert combos == {(m, lo, d) for m in modes for lo in loras for d in dtypes}
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
    assert [(p["rows"], p["context"]) for p in results["steps"]] == [(1, 48), (4, 48)]
    for point in results["steps"]:
        assert point["engine"] > 0 and point["generate"] > 0 and point["engine_bandwidth_gb_s"] > 0
    for point in results["verification"]:
        assert set(point["seconds"]) == {"1", "4", "8"}
        assert all(s > 0 for s in point["seconds"].values())


def test_the_script_names_the_device_of_every_tensor_it_makes() -> None:
    assert deviceless_factories(SCRIPT.read_text()) == []
