"""Each class of fault planted once, end to end: a run writes only what it owns and refuses before it deletes, never
saves a non-finite weight, resumes by its identity (a moved directory, a lost config.yaml, a torn metrics line, a
damaged learner state), and sizes its disk check by the checkpoints it writes. Each checks that nothing is lost and
that the one-line message names the cause."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from conftest import save_tiny_llama
from safetensors.torch import load_file
from test_bad_inputs import refused, run_cli, write_config

from fastgrpo import paths
from fastgrpo.grpo.run_dir import check_disk_space, checkpoints_written


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"), seed=0, tie_word_embeddings=True)


def test_a_foreign_config_and_a_refused_overwrite_lose_nothing(capsys, model_dir: Path, tmp_path: Path) -> None:
    """The user's config.yaml in output_dir is refused by name with --overwrite_output_dir, and kept; an earlier run
    overwritten by a run then refused for its options (temperature 0, before the model loads; LoRA layers the model
    lacks, after) is still whole; a lock file that is a link
    leaves its target as it was."""
    config = write_config(tmp_path / "c.yaml", model_dir)
    out = tmp_path / "c-run"
    out.mkdir()
    (out / "config.yaml").write_text("mine: true\n")
    err = refused(capsys, "train", "--config", str(config), "--overwrite_output_dir", "true")
    assert "holds config.yaml, which no fastgrpo run wrote" in err
    assert (out / "config.yaml").read_text() == "mine: true\n" and sorted(p.name for p in out.iterdir()) == [
        ".fastgrpo.lock",
        "config.yaml",
    ]
    shutil.rmtree(out)
    assert run_cli(capsys, "train", "--config", str(config))[0] == 0
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    err = refused(capsys, "train", "--config", str(config), "--overwrite_output_dir", "true", "--temperature", "0")
    assert "temperature: 0 samples greedily" in err
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before
    lora = ("--use_peft", "true", "--lora_target_modules", "[no_such_layer]")  # refused once the model has loaded
    err = refused(capsys, "train", "--config", str(config), "--overwrite_output_dir", "true", *lora)
    assert "lora_target_modules ['no_such_layer']" in err
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before
    (out / ".fastgrpo.lock").unlink()
    (tmp_path / "precious.txt").write_text("keep me\n")
    (out / ".fastgrpo.lock").symlink_to(tmp_path / "precious.txt")
    err = refused(capsys, "train", "--config", str(config), "--resume", "--max_steps", "2")
    assert ".fastgrpo.lock is a symbolic link" in err
    assert (tmp_path / "precious.txt").read_text() == "keep me\n"


def test_an_update_that_yields_nan_stops_the_run_and_every_checkpoint_is_finite(
    capsys, model_dir: Path, tmp_path: Path
) -> None:
    """A learning rate of 1000 makes the gradient norm NaN within a few steps: the run stops with exit 2 and one line
    naming the step and the cause; every checkpoint it saved is finite, and the latest resumes."""
    config = write_config(tmp_path / "c.yaml", model_dir, learning_rate=1000.0, max_steps=6, save_total_limit=None)
    code, err = run_cli(capsys, "train", "--config", str(config))
    assert code == 2 and "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert "the gradient norm is nan" in line and "the run stops before saving anything of it" in line, line
    stopped = int(line.split("step ")[1].split(":")[0])
    out = tmp_path / "c-run"
    saved = sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    assert [p.name for p in saved] == [f"checkpoint-{s}" for s in range(1, stopped)]
    assert f"the latest checkpoint is {saved[-1]}" in line if saved else "none yet" in line
    for checkpoint in saved:
        assert all(torch.isfinite(t).all() for t in load_file(checkpoint / "model.safetensors").values())
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, stopped))


def test_a_moved_run_without_its_config_resumes_and_gets_its_config_back(
    capsys, caplog, model_dir: Path, tmp_path: Path
) -> None:
    """A run moved to another directory, its config.yaml deleted and its metrics' last line torn, resumes: from its
    own checkpoint (found by the run file, not by the path it was started in), with the options the checkpoint was
    saved with (a changed learning rate is refused by name), its config.yaml written again and the torn line
    dropped with a warning (the one line lost is the one that was never whole)."""
    config = write_config(tmp_path / "c.yaml", model_dir, max_steps=2, save_total_limit=None)
    assert run_cli(capsys, "train", "--config", str(config))[0] == 0
    moved = tmp_path / "elsewhere" / "run"
    moved.parent.mkdir()
    (tmp_path / "c-run").rename(moved)
    saved = yaml.safe_load((moved / "config.yaml").read_text())
    (moved / "config.yaml").unlink()
    metrics = moved / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text(lines[0] + "\n" + lines[1][:15])
    err = refused(capsys, "train", "--config", str(config), "--output_dir", str(moved), "--resume", "--max_steps",
                  "3", "--learning_rate", "0.5")  # fmt: skip
    assert "learning_rate: 0.001 when started, 0.5 now" in err
    with caplog.at_level("WARNING"):
        code, err = run_cli(
            capsys, "train", "--config", str(config), "--output_dir", str(moved), "--resume", "--max_steps", "3"
        )
    assert code == 0, err
    assert "config.yaml is missing: it is written again" in caplog.text
    assert "metrics.jsonl, line 2: dropped, cut short" in caplog.text
    rewritten = yaml.safe_load((moved / "config.yaml").read_text())
    assert {k: v for k, v in rewritten.items() if k not in ("max_steps", "output_dir")} == {
        k: v for k, v in saved.items() if k not in ("max_steps", "output_dir")
    }
    # step 2's line was torn (its metrics were never whole), step 3's is the resumed run's
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 3]


def test_a_damaged_learner_state_is_passed_over_as_damaged_weights_are(
    capsys, caplog, model_dir: Path, tmp_path: Path
) -> None:
    """The newest checkpoint's draft/learners.pt truncated: --resume passes over it to the one before, naming the
    file, before the model loads."""
    config = write_config(tmp_path / "c.yaml", model_dir, max_steps=2, speculation={"mode": "adaptive"})
    assert run_cli(capsys, "train", "--config", str(config))[0] == 0
    learners = tmp_path / "c-run" / "checkpoint-2" / "draft" / "learners.pt"
    learners.write_bytes(learners.read_bytes()[:100])
    with caplog.at_level("INFO"):
        code, err = run_cli(capsys, "train", "--config", str(config), "--resume", "--max_steps", "3")
    assert code == 0, err
    assert "passing over checkpoint-2: draft/learners.pt is unreadable" in caplog.text
    assert "resumed from" in caplog.text and "checkpoint-1 at step 1" in caplog.text


def test_the_disk_check_counts_the_checkpoints_the_run_writes(monkeypatch, tmp_path: Path) -> None:
    """A 1-step run writes one checkpoint whatever save_total_limit allows: room for one is enough, as is room for
    the limit plus the one being written of a long run; less is refused naming both counts."""
    assert checkpoints_written(0, 1, 500, 100) == 1
    assert checkpoints_written(0, 20, 10, None) == 2
    assert checkpoints_written(0, 100, 10, 2) == 3
    assert checkpoints_written(10, 20, 10, 2) == 1  # resumed at step 10
    assert checkpoints_written(0, 25, 10, None) == 3  # steps 10, 20 and the last
    assert checkpoints_written(10, 40, 10, 2, existing=2) == 1  # resumed beside its 2: only the one being written
    assert checkpoints_written(10, 40, 10, None, existing=1) == 3

    class Usage:
        free = 10 * 2**30

    monkeypatch.setattr(paths.shutil, "disk_usage", lambda path: Usage)
    check_disk_space(tmp_path / "not" / "yet", 9 * 2**30, checkpoints_written(0, 1, 500, 100))
    with pytest.raises(ValueError, match=r"need about 18.0 GiB \(2 more of 9.0 GiB on disk at once\)"):
        check_disk_space(tmp_path, 9 * 2**30, checkpoints_written(0, 20, 10, 100))
    assert math.isclose(Usage.free / 2**30, 10.0)
