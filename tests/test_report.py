"""`fastgrpo report`: plots and a summary of one run or several overlaid, clear errors for what is not a run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fastgrpo.cli import main
from fastgrpo.report import phase_seconds, read_metrics

PNG = b"\x89PNG\r\n\x1a\n"


def write_run(path: Path, steps: int, accept: float, draft: bool) -> Path:
    path.mkdir(parents=True)
    lines = []
    for step in range(1, steps + 1):
        row = {
            "step": step,
            "reward": 0.1 * step,
            "completions/mean_length": 50.0 + step,
            "spec/accept_length": accept + 0.1 * step,
            "rollout/tokens_per_second": 20.0 * accept,
            "time/rollout": 4.0 / accept,
            "time/train": 2.0,
            "time/reward": 0.01,
            "time/step": 4.0 / accept + 2.01 + (0.2 if draft else 0.0),
        }
        row["spec/time_saved"] = 0.0  # logged by every run, speculation off included
        if draft:
            row.update({"draft/time": 0.2, "draft/loss": 1.0 / step, "draft/accuracy": 0.05 * step})
            row["spec/time_saved"] = 0.5 if step > 1 else -0.5  # the first step's trees lost
        lines.append(json.dumps(row))
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return path


def test_report_overlays_runs_and_summarises_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plain = write_run(tmp_path / "plain", 6, 1.0, draft=False)
    fast = write_run(tmp_path / "fast", 6, 2.0, draft=True)
    main(["report", str(plain), str(fast), "--output", str(tmp_path / "out")])
    for name in ("curves.png", "phases.png"):
        assert (tmp_path / "out" / name).read_bytes()[:8] == PNG
    assert not (tmp_path / "out" / "tools.png").exists(), "no tool plots for runs without tools"
    table = capsys.readouterr().out
    assert "| plain | 6 | 0.400 | 1.40 |" in table
    assert "| fast | 6 | 0.400 | 2.40 |" in table
    # speculation saved 5 x 0.5 - 0.5 = 2 s of an estimated 6 x 2 + 2 = 14 s of plain rollouts; plain saved none
    assert table.split("| fast |")[1].split("\n")[0].endswith(" | +2.0 (+14%) |")
    assert table.split("| plain |")[1].split("\n")[0].endswith(" | - |")
    assert phase_seconds(read_metrics(fast)) == pytest.approx(
        {"rollout": 2.0, "draft update": 0.2, "policy update": 2.0, "rewards": 0.01}
    )


def test_report_shows_the_in_training_evaluation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """eval/reward (logged every eval_steps) is drawn dashed in the reward panel and its last value is summarised;
    a run without evaluation beside it shows a dash."""
    run = write_run(tmp_path / "evaluated", 4, 1.0, draft=False)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for row in rows[1::2]:
        row |= {"eval/reward": 0.5 * row["step"], "eval/completions/mean_length": 40.0}
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    plain = write_run(tmp_path / "plain", 4, 1.0, draft=False)
    main(["report", str(run), str(plain), "--output", str(tmp_path / "out")])
    table = capsys.readouterr().out
    assert "eval reward (step) |" in table
    assert "| evaluated | 4 | 0.250 | 1.25 |" in table and table.split("| evaluated |")[1].split("\n")[0].endswith(
        " 2.000 (4) |"
    )
    assert table.split("| plain |")[1].split("\n")[0].endswith(" - |")
    assert (tmp_path / "out" / "curves.png").read_bytes()[:8] == PNG


def test_report_plots_the_tools_of_a_run_with_tools(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = write_run(tmp_path / "agent", 3, 1.5, draft=False)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        row |= {"tools/call_frequency": 0.1 * row["step"], "tools/failure_frequency": 0.5, "tools/rows_waiting": 1.0}
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    main(["report", str(run), "--output", str(tmp_path / "out")])
    assert (tmp_path / "out" / "tools.png").read_bytes()[:8] == PNG
    assert "tools.png" in capsys.readouterr().out


def test_report_plots_the_pipeline_of_an_asynchronous_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = write_run(tmp_path / "async", 3, 1.5, draft=False)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        row |= {"async/staleness": 1.0, "async/token_lag/mean": 0.5, "async/trainer_wait_seconds": 0.2}
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    main(["report", str(run), "--output", str(tmp_path / "out")])
    assert (tmp_path / "out" / "async.png").read_bytes()[:8] == PNG
    assert "async.png" in capsys.readouterr().out
    assert not (tmp_path / "out" / "tools.png").exists()


def test_report_of_a_single_run_writes_into_it(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", 3, 1.5, draft=True)
    main(["report", str(run)])
    assert (run / "report" / "curves.png").read_bytes()[:8] == PNG


def test_report_names_what_is_not_a_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as excinfo:
        main(["report", str(tmp_path / "missing")])
    assert excinfo.value.code == 2
    assert "missing/metrics.jsonl not found" in capsys.readouterr().err
    bad = tmp_path / "bad"
    bad.mkdir()
    step = '{"step": 1, "reward": 0.5, "time/step": 2.0}\n'
    for text, message in (
        (step + "not json\n", "metrics.jsonl, line 2: not JSON"),
        (step + "[1, 2]\n", "metrics.jsonl, line 2: expected a JSON object of metrics, got list"),
        (step + '{"step": 2, "reward": 0.5}\n', "metrics.jsonl, line 2: no 'time/step'"),
        ('{"step": 1, "time/step": 2.0}\n', "metrics.jsonl: no line has a 'reward'"),
        (step + '{"step": 2, "reward": "high", "time/step": 2.0}\n', "line 2: 'reward' is \"high\", not a number"),
    ):
        (bad / "metrics.jsonl").write_text(text)
        with pytest.raises(SystemExit):
            main(["report", str(bad)])
        assert message in capsys.readouterr().err
    (bad / "metrics.jsonl").write_bytes(step.encode() + b"\xff\n")
    with pytest.raises(SystemExit):
        main(["report", str(bad)])
    assert "metrics.jsonl, line 2, column 1: not UTF-8 text (byte 0xff)" in capsys.readouterr().err
