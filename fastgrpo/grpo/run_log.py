"""What a run writes as it goes: ``config.yaml``, ``metrics.jsonl`` (one line per logged step), TensorBoard scalars
and a few sample completions printed beside the progress bar."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import yaml
from tqdm.auto import tqdm

from fastgrpo.answers import content_text
from fastgrpo.config import GRPOConfig, config_to_dict
from fastgrpo.paths import read_text, write_atomically

logger = logging.getLogger(__name__)


def logged_lines(path: Path, warn: bool = True) -> list[str]:
    """The lines of a run's ``metrics.jsonl``, each a JSON object with its ``step``. A last line cut short (what a
    run killed while writing it leaves) is dropped, with a warning (``warn``); any other unreadable line is a
    ``ValueError`` naming the file and line."""
    lines = read_text(path).splitlines()
    for number, line in enumerate(lines, start=1):
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise ValueError("not an object with an integer step")
        except ValueError as e:
            if number == len(lines):
                if warn:
                    logger.warning("%s, line %d: dropped, cut short when its run stopped (%s)", path, number, e)
                return lines[:-1]
            raise ValueError(f"{path}, line {number}: not a line of metrics ({e}); remove or repair it") from None
    return lines


def completion_shown(completion: Any) -> str:
    """A completion as printed: its text, or with tools its turns, one per line, a tool's result marked as such (a
    call the turn's text does not show is written out)."""
    if isinstance(completion, str):
        return completion.strip()
    lines = []
    for message in completion:
        text = content_text(message.get("content")).strip()
        if message.get("role") == "tool":
            lines.append(f"[{message.get('name', 'tool')} returned] {text}")
        elif text or message.get("tool_calls"):
            calls = [json.dumps(c["function"]) for c in message.get("tool_calls") or [] if "function" in c]
            lines.append(text or " ".join(f"[calls {call}]" for call in calls))
    return "\n    ".join(lines)


# A logged record's counters, rate and gradient norm are its last step's, as transformers logs them.
LAST_STEPS = ("step", "epoch", "learning_rate", "grad_norm", "num_tokens")


def logged_record(steps: list[dict[str, float]]) -> dict[str, float]:
    """The record transformers logs for the optimizer steps since its last log (``steps``, each one's metrics, oldest
    first; ``logging_steps`` of them): the last step's `LAST_STEPS`, the largest memory peaks, the compilations
    summed, and every other figure's mean over the steps that have it, as TRL averages the values it gathered since
    (a generation's figures over the generations made)."""
    record: dict[str, float] = {}
    for key in dict.fromkeys(k for step in steps for k in step):
        values = [step[key] for step in steps if key in step]
        if key in LAST_STEPS:
            record[key] = values[-1]
        elif key.startswith("memory/"):
            record[key] = max(values)
        elif key.startswith("compile/"):
            record[key] = sum(values)
        else:
            record[key] = sum(values) / len(values)
    return record


class RunLog:
    """The log of the run in ``output_dir`` (written by the main process only), continuing after ``start_step``."""

    def __init__(self, config: GRPOConfig, start_step: int):
        self.config = config
        out = Path(config.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        write_atomically(out / "config.yaml", yaml.safe_dump(config_to_dict(config), sort_keys=False))
        metrics_path = out / "metrics.jsonl"
        if metrics_path.exists():
            # Steps logged after the checkpoint being resumed from are run again: drop their old lines.
            kept = [line for line in logged_lines(metrics_path, warn=False) if json.loads(line)["step"] <= start_step]
            write_atomically(metrics_path, "".join(line + "\n" for line in kept))
        self.tensorboard = self._tensorboard(out) if "tensorboard" in config.report_to else None
        self.file = metrics_path.open("a")

    @staticmethod
    def _tensorboard(out: Path) -> Any:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError("report_to: tensorboard needs `pip install tensorboard`") from e
        return SummaryWriter(str(out / "tensorboard"))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        """The record logged after optimizer step ``step`` (1-based): a line of ``metrics.jsonl`` and TensorBoard's
        scalars."""
        self.file.write(json.dumps(metrics) + "\n")
        self.file.flush()
        if self.tensorboard is not None:
            for k, v in metrics.items():
                self.tensorboard.add_scalar(k, v, step)

    def samples(self, step: int, samples: list[tuple[Any, str, float, dict[str, Any]]]) -> bool:
        """A few ``(prompt, completion, reward, extra columns)`` of the latest generation, printed after step
        ``step`` when it is one of every ``log_completions_steps`` (the columns reward functions gave TRL's
        ``log_extra``; ``num_completions_to_print`` None: all); whether they were."""
        cfg = self.config
        if not cfg.log_completions or step % cfg.log_completions_steps:
            return False
        shown = samples if cfg.num_completions_to_print is None else samples[: cfg.num_completions_to_print]
        for prompt, completion, reward, extra in shown:
            text = prompt[-1]["content"] if isinstance(prompt, list) else prompt
            columns = "".join(f"\n  {column}: {value}" for column, value in extra.items())
            written = completion_shown(completion)
            tqdm.write(f"[step {step}] reward={reward:.2f}\n  prompt: {text}\n  completion: {written}{columns}")
        return True

    def close(self) -> None:
        self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
