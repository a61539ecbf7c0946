"""The command line on the embedded SmolLM2-135M-Instruct: train two short steps (adaptive speculation and online
draft learning, the defaults), report them, eval, generate, and profile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fastgrpo.cli import main

ROOT = Path(__file__).parents[1]
GSM8K_TEST = ROOT.parent / "shared" / "data" / "gsm8k" / "test.jsonl"


def test_train_eval_generate_on_smollm2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    main(
        ["train", "--config", str(ROOT / "configs" / "default.yaml"), "--output_dir", str(out), "--max_steps", "2"]
        + ["--max_completion_length", "16", "--num_generations", "4", "--per_device_train_batch_size", "4"]
        + ["--gradient_accumulation_steps", "1", "--save_steps", "2", "--progress_bar", "false"]
    )
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2
    assert all(0.0 <= m["reward"] <= 1.0 and m["completions/max_length"] <= 16 for m in metrics)
    checkpoint = out / "checkpoint-2"
    assert (checkpoint / "config.json").is_file() and (checkpoint / "trainer_state.pt").is_file()
    assert (checkpoint / "draft" / "draft.safetensors").is_file()
    assert all(m["draft/loss"] > 0 and m["spec/concurrency_mean"] > 0 for m in metrics)
    main(["report", str(out)])
    assert (out / "report" / "curves.png").is_file() and (out / "report" / "phases.png").is_file()
    capsys.readouterr()

    main(
        ["eval", "--model", str(checkpoint), "--dataset.name", "gsm8k", "--dataset.path", str(GSM8K_TEST)]
        + ["--dataset.limit", "3", "--max_completion_length", "8", "--temperature", "0"]
    )
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["examples"] == 3 and 0.0 <= result["reward"] <= 1.0

    main(["generate", "--model", str(checkpoint), "--prompt", "What is 2 + 2?", "--max-new-tokens", "8"])
    printed = capsys.readouterr().out
    assert "--- What is 2 + 2?" in printed and len(printed.splitlines()) >= 2


def test_profile_on_smollm2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "profile.json"
    main(["profile", "--tokens", "1,2,4", "--repeats", "1", "--context-length", "16", "--output", str(path)])
    profile = json.loads(path.read_text())
    assert profile["tokens"] == [1, 2, 4] and profile["c_peak"] in (1, 2, 4)
    assert profile["tree_rows"] == [1, 2, 4]  # one row of 2 and 4 tokens, two rows of 2: up to 4 tokens in all
    assert [n is not None for n in profile["tree_seconds"][0][:3]] == [True, True, False]
    assert path.with_suffix(".png").is_file()
    printed = capsys.readouterr().out
    assert "C_peak = " in printed and "| rows | one token ms | N=2 |" in printed
    assert list(profile["drafter_seconds"]) == ["eagle"] and "| eagle drafter ms |" in printed
    suffix = tmp_path / "suffix.json"
    main(["profile", "--tokens", "1,2", "--repeats", "1", "--speculation.drafter", "suffix", "--output", str(suffix)])
    assert json.loads(suffix.read_text())["drafter_seconds"] == {}, "a suffix-only profile times no draft head"


def test_draft_train_on_smollm2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fastgrpo.models import load_model
    from fastgrpo.speculative.eagle.head import DraftHead

    out = tmp_path / "draft"
    main(
        ["draft", "train", "--output", str(out), "--dataset.name", "gsm8k", "--dataset.path", str(GSM8K_TEST)]
        + ["--dataset.limit", "4", "--greedy-fraction", "0.5", "--max_completion_length", "8"]
        + ["--draft-vocab-size", "64", "--batch-size", "4"]
    )
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["sequences"] == 4 and 0 < report["completion_tokens"] <= 32
    draft = DraftHead.load(out, load_model("smollm2"))
    assert draft.draft_vocab is not None and draft.draft_vocab.numel() <= 64
    with pytest.raises(SystemExit) as excinfo:
        main(["draft", "train", "--output", str(out), "--dataset.limit", "2", "--greedy-fraction", "1.5"])
    assert excinfo.value.code == 2
    assert "greedy_fraction must be in [0, 1], got 1.5" in capsys.readouterr().err
