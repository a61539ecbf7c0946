"""Plots: of training runs from their ``metrics.jsonl`` (``fastgrpo report RUN_DIR [RUN_DIR ...]``), and of a latency
profile (``fastgrpo profile``).

``curves.png`` draws reward (dashed: the in-training evaluation's, ``eval/reward``), completion length, accepted
length (over all decoding steps, and dashed over tree steps only), rollout tokens/s, and the online draft's held-out
accuracy and loss against step (one line per run, so two runs, e.g. plain GRPO and FastGRPO, are overlaid);
``phases.png`` the mean time per step of each phase (rollout, draft update, policy update, rewards) per run; and for
runs with tools ``tools.png``: tool calls per completion, the share that failed, the rows waiting on a tool per
decoding step and the tool-result tokens fed per step.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from fastgrpo.paths import read_lines

if TYPE_CHECKING:
    from fastgrpo.speculative.profiler import LatencyProfile

CURVES = (  # metric, panel title, y-axis label
    ("reward", "Mean reward (dashed: eval/reward)", "reward"),
    ("completions/mean_length", "Completion length", "tokens"),
    ("spec/accept_length", "Accepted length (dashed: tree steps only)", "tokens per row per forward"),
    ("rollout/tokens_per_second", "Rollout throughput", "tokens/s"),
    ("draft/accuracy", "Draft accuracy (before training on the step)", "share of tokens"),
    ("draft/loss", "Draft loss", "loss"),
)
TOOL_CURVES = (  # drawn into tools.png by a run with tools
    ("tools/call_frequency", "Tool calls per completion", "calls"),
    ("tools/failure_frequency", "Share of tool calls that failed", "share of calls"),
    ("tools/rows_waiting", "Rows waiting on a tool, per decoding step", "rows"),
    ("tools/prefill_tokens", "Tool-result tokens fed", "tokens per step"),
)
ASYNC_CURVES = (  # drawn into async.png by a run with rollout processes
    ("async/staleness", "Staleness of the step's samples (oldest token)", "optimizer steps"),
    ("async/token_lag/mean", "Mean lag of the samples' tokens", "optimizer steps"),
    ("async/queue_depth", "Generations waiting to be trained", "generations"),
    ("async/trainer_wait_seconds", "Training process waiting for a generation", "seconds per step"),
    ("async/rollout_wait_seconds", "Rollout process waiting for weights", "seconds per generation"),
    ("async/dropped_samples", "Samples dropped past max_staleness", "samples"),
)
OPTIONAL = ((TOOL_CURVES, (2, 2), "tools.png"), (ASYNC_CURVES, (2, 3), "async.png"))
REQUIRED = ("step", "time/step")  # what every line of a run's metrics.jsonl holds (`reward`: a step that generated)
# drawn dashed in the same panel and colour
DASHED = {"spec/accept_length": "spec/tree_accept_length", "reward": "eval/reward"}
PHASES = (
    ("time/rollout", "rollout"),
    ("draft/time", "draft update"),
    ("time/train", "policy update"),
    ("time/reward", "rewards"),
)


def read_metrics(run_dir: str | Path) -> list[dict[str, float]]:
    """The per-step metrics of a run directory (written by `fastgrpo train`)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {run_dir} is not a fastgrpo run directory")
    rows = []
    for number, line in read_lines(path):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}, line {number}: not JSON ({e})") from None
        problem = _metrics_problem(row)
        if problem is not None:
            raise ValueError(f"{path}, line {number}: {problem}; is this a metrics.jsonl of fastgrpo train?")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path} has no steps yet")
    if not any("reward" in row for row in rows):  # every run's first step generates
        raise ValueError(f"{path}: no line has a 'reward'; is this a metrics.jsonl of fastgrpo train?")
    return rows


def _metrics_problem(row: object) -> str | None:
    """Why ``row`` is not a step's metrics as the plots read them, or None."""
    if not isinstance(row, dict):
        return f"expected a JSON object of metrics, got {type(row).__name__}"
    for key in REQUIRED:
        if key not in row:
            return f"no {key!r}"
    for key in (*REQUIRED, *(k for k, _, _ in CURVES), *DASHED.values(), *(k for k, _ in PHASES), "spec/time_saved"):
        value = row.get(key, 0.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"{key!r} is {json.dumps(value)}, not a number"
    return None


def phase_seconds(rows: list[dict[str, float]]) -> dict[str, float]:
    """Mean seconds per step of each phase (0 for a phase the run does not have)."""
    return {label: sum(r.get(key, 0.0) for r in rows) / len(rows) for key, label in PHASES}


def speculation_saved(rows: list[dict[str, float]]) -> str:
    """What speculation saved over the run (``spec/time_saved``, negative where it cost), in seconds and as a share
    of the plain rollouts' estimated time (the rollouts' time plus what was saved); a dash for a run whose trees
    saved and cost nothing (speculation off, or no tree timed)."""
    if not any(r.get("spec/time_saved") for r in rows):
        return "-"
    saved = sum(r.get("spec/time_saved", 0.0) for r in rows)
    plain = sum(r.get("time/rollout", 0.0) for r in rows) + saved
    return f"{saved:+.1f} ({saved / plain:+.0%})" if plain > 0 else f"{saved:+.1f}"


def summary(runs: dict[str, list[dict[str, float]]], last: int = 5) -> str:
    """A markdown table: steps, reward and accepted length of the last steps, the mean time per step by phase, and
    what speculation saved over the run (`speculation_saved`); where a run evaluated during training (``eval/*``),
    its last evaluation's reward and step too."""
    evaluated = any("eval/reward" in r for rows in runs.values() for r in rows)
    lines = [
        f"| run | steps | reward (last {last}) | accepted length (last {last}) "
        "| step s | rollout s | draft s | update s | saved by speculation s |"
        + (" eval reward (step) |" if evaluated else ""),
        "|---|---|---|---|---|---|---|---|---|" + ("---|" if evaluated else ""),
    ]
    for name, rows in runs.items():
        tail = [r for r in rows if "reward" in r][-last:]
        phases = phase_seconds(rows)
        step_s = sum(r["time/step"] for r in rows) / len(rows)
        reward = sum(r["reward"] for r in tail) / len(tail) if tail else math.nan
        accept = sum(r.get("spec/accept_length", 1.0) for r in tail) / max(len(tail), 1)
        lines.append(
            f"| {name} | {len(rows)} | {reward:.3f} | {accept:.2f} | {step_s:.1f} | {phases['rollout']:.1f} | "
            f"{phases['draft update']:.2f} | {phases['policy update']:.1f} | {speculation_saved(rows)} |"
        )
        if evaluated:
            evals = [r for r in rows if "eval/reward" in r]
            lines[-1] += f" {evals[-1]['eval/reward']:.3f} ({evals[-1]['step']}) |" if evals else " - |"
    return "\n".join(lines)


def plot_runs(runs: dict[str, list[dict[str, float]]], output_dir: str | Path) -> list[Path]:
    """Write ``curves.png``, ``phases.png`` and, where a run used tools or rollout processes, ``tools.png`` or
    ``async.png`` into ``output_dir``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [_panels(runs, CURVES, (2, 3), out / "curves.png")]
    for curves, grid, name in OPTIONAL:
        if any(key in r for rows in runs.values() for r in rows for key, _, _ in curves):
            written.append(_panels(runs, curves, grid, out / name))

    names = list(runs)
    fig, ax = plt.subplots(figsize=(max(4.0, 1.6 * len(runs) + 2) + 2.2, 4), layout="constrained")
    bottom = [0.0] * len(names)
    for _, label in PHASES:
        values = [phase_seconds(runs[n])[label] for n in names]
        ax.bar(names, values, bottom=bottom, label=label, width=0.6)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_ylabel("mean seconds per step")
    ax.set_title("Time per step, by phase")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)  # beside the bars, covering none
    phases = out / "phases.png"
    fig.savefig(phases, dpi=110)
    plt.close(fig)
    return [written[0], phases, *written[1:]]


def _panels(
    runs: dict[str, list[dict[str, float]]], panels: tuple[tuple[str, str, str], ...], grid: tuple[int, int], path: Path
) -> Path:
    """One panel per ``(metric, title, y label)`` of ``panels`` against step, one line per run; written to ``path``."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(*grid, figsize=(5 * grid[1], 3.75 * grid[0]), layout="constrained")
    for ax, (key, title, ylabel) in zip(axes.flat, panels, strict=True):
        for i, (name, rows) in enumerate(runs.items()):
            points = [(r["step"], r[key]) for r in rows if key in r]
            if points:  # one colour per run in every panel, also where earlier runs have no such metric
                ax.plot(*zip(*points, strict=True), marker=".", label=name, color=f"C{i}")
            dashed = [(r["step"], r[DASHED[key]]) for r in rows if DASHED.get(key) in r]
            if dashed:
                ax.plot(*zip(*dashed, strict=True), marker=".", linestyle="--", color=f"C{i}")
        if not ax.lines:
            ax.text(0.5, 0.5, "not logged by this run", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
    if len(runs) > 1:
        fig.legend(*axes.flat[0].get_legend_handles_labels(), loc="outside upper center", ncol=len(runs))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_profile(profile: LatencyProfile, path: str | Path) -> Path:
    """Draw the target's latency curve and each profiled drafter's with the knee marked and, when the profile has the
    grid, what a forward over ``N`` tokens per row costs against one token per row, for each row count; writes a
    PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 if profile.tree_rows else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.4 * panels, 4.2), squeeze=False)
    ax = axes[0][0]
    ax.plot(profile.tokens, [1e3 * s for s in profile.target_seconds], "o-", label="target forward")
    for name, seconds in profile.drafter_seconds.items():
        ax.plot(profile.tokens, [1e3 * s for s in seconds], "s-", label=f"{name} drafter")
    ax.axvline(profile.c_peak, color="gray", linestyle="--", label=f"C_peak = {profile.c_peak} tokens")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens in the forward (rows x 1 token)")
    ax.set_ylabel("latency (ms)")
    ax.set_title(f"{profile.model} on {profile.device}, {profile.dtype}, context {profile.context_length}")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    if profile.tree_rows:
        ax = axes[0][1]
        for i, rows in enumerate(profile.tree_rows):
            points = profile.tree_points(i)
            if points:
                one = profile.target_time(rows)
                ax.plot([1] + [n for n, _ in points], [1.0] + [s / one for _, s in points], "o-", label=f"{rows} rows")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per row (draft tree nodes N)")
        ax.set_ylabel("forward latency / latency at one token per row")
        ax.set_title("verification cost by rows and tree size")
        ax.legend(fontsize="small", ncol=2)
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
