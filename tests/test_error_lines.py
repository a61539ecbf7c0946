"""Failures outside the option checks end in one line naming the variable, file, option or function: a bad
``FASTGRPO_MALLOC``, a reward function that calls ``sys.exit``, a model directory without its tokenizer, a saved
draft whose files cannot be read, a disk that cannot hold a draft; and ``--version`` answers at once."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from conftest import save_tiny_llama, tiny_model
from safetensors import SafetensorError
from test_bad_inputs import refused, write_config

from fastgrpo import malloc
from fastgrpo.cli import main
from fastgrpo.errors import RewardFunctionError
from fastgrpo.models import check_tokenizer_files
from fastgrpo.rewards import compute_rewards
from fastgrpo.speculative.eagle import head as head_module
from fastgrpo.speculative.eagle.head import DRAFT_CONFIG, DRAFT_WEIGHTS, DraftHead


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"), seed=0, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def no_tokenizer(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's weights and config, saved without its tokenizer."""
    bare = tmp_path_factory.mktemp("bare")
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(model_dir / name, bare / name)
    return bare


# -- FASTGRPO_MALLOC and --version ------------------------------------------------------------------------------------


@pytest.mark.parametrize("applied", [None, True])
def test_a_malloc_setting_it_does_not_know_is_one_line(capsys, monkeypatch, applied: bool | None) -> None:
    """Refused as an option is, also in a process that set the thresholds already."""
    monkeypatch.setattr(malloc, "_applied", applied)
    monkeypatch.setenv("FASTGRPO_MALLOC", "bogus")
    err = refused(capsys, "generate", "--prompt", "hi")
    assert err.startswith("fastgrpo generate: error: FASTGRPO_MALLOC must be 'keep' or 'system', got 'bogus'")


def test_version_answers_without_importing_torch(capsys) -> None:
    with pytest.raises(SystemExit) as excinfo:
        main(["--version"])
    assert excinfo.value.code == 0 and capsys.readouterr().out == f"fastgrpo {version('fastgrpo')}\n"
    code = (
        "import sys\nfrom fastgrpo.cli import main\ntry:\n    main(['--version'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out == f"fastgrpo {version('fastgrpo')}\n[]\n"


# -- rewards ----------------------------------------------------------------------------------------------------------


def exit_reward(completions: list, **kwargs: object) -> list[float]:
    sys.exit(3)


def quiet_exit_reward(completions: list, **kwargs: object) -> list[float]:
    sys.exit()


def interrupted_reward(completions: list, **kwargs: object) -> list[float]:
    raise KeyboardInterrupt


@pytest.mark.parametrize(("func", "called"), [(exit_reward, "sys.exit(3)"), (quiet_exit_reward, "sys.exit()")])
def test_a_reward_that_calls_sys_exit_is_a_reward_error(func, called: str) -> None:
    with pytest.raises(RewardFunctionError) as excinfo:
        compute_rewards([func], None, ["2 + 2?", "3 + 3?"], ["4", "6"], None, [{}, {}])
    message = str(excinfo.value)
    assert f"reward function {func.__name__!r} failed on row 0 (prompt: '2 + 2?'): it called {called}" in message


def test_ctrl_c_in_a_reward_function_stays_an_interrupt() -> None:
    with pytest.raises(KeyboardInterrupt):
        compute_rewards([interrupted_reward], None, ["2 + 2?"], ["4"], None, [{}])


# -- model directories without a tokenizer ----------------------------------------------------------------------------


def test_a_model_directory_without_a_tokenizer_is_refused_before_it_loads(
    capsys, no_model_loads, no_tokenizer: Path, tmp_path: Path
) -> None:
    config = write_config(tmp_path / "c.yaml", no_tokenizer)
    says = f"model: {no_tokenizer} holds no tokenizer files (tokenizer.json, tokenizer_config.json, tokenizer.model"
    for argv in (
        ("eval", "--config", str(config)),
        ("train", "--config", str(config)),
        ("draft", "train", "--config", str(config), "--output", str(tmp_path / "draft")),
        ("generate", "--model", str(no_tokenizer), "--prompt", "hi"),
    ):
        assert says in refused(capsys, *argv)


def test_directories_that_hold_a_tokenizer_pass(model_dir: Path, tmp_path: Path) -> None:
    """A model directory and a checkpoint (which holds its tokenizer) pass; so do names that are not directories
    (a hub id, the embedded model); a peft adapter saved alone has no tokenizer to load."""
    check_tokenizer_files(str(model_dir))
    check_tokenizer_files("HuggingFaceTB/SmolLM2-135M-Instruct")
    check_tokenizer_files("smollm2")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(ValueError, match="--model: .*adapter holds no tokenizer files"):
        check_tokenizer_files(str(adapter), "--model")
    (adapter / "tokenizer.json").write_text("{}")
    check_tokenizer_files(str(adapter))


# -- saved drafts -----------------------------------------------------------------------------------------------------


NO_TARGET = "expected a JSON object whose 'target' names the architecture the draft was made for"


def saved_draft(directory: Path) -> Path:
    """A draft head for the tiny models' architecture, saved in ``directory``."""
    return DraftHead(tiny_model("llama").config, "tiny").save(directory)


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ('{"target": {"model_type": "llama"', "not valid JSON (Expecting ',' delimiter: line 1, column 34)"),
        ('{"target_name": "tiny"}', f"{NO_TARGET}, got keys ['target_name']"),
        ("[1, 2]", f"{NO_TARGET}, got list"),
    ],
)
def test_a_draft_config_it_cannot_read_names_the_file(
    capsys, no_model_loads, model_dir: Path, tmp_path: Path, content: str, says: str
) -> None:
    draft = saved_draft(tmp_path / "draft")
    (draft / DRAFT_CONFIG).write_text(content)
    config = write_config(tmp_path / "c.yaml", model_dir, speculation={"mode": "adaptive", "draft": str(draft)})
    assert f"speculation.draft: {draft / DRAFT_CONFIG}: {says}" in refused(capsys, "train", "--config", str(config))
    with pytest.raises(ValueError) as excinfo:
        DraftHead.load(draft, tiny_model("llama"))  # as a checkpoint's draft/ is read on --resume
    assert str(excinfo.value).startswith(f"{draft / DRAFT_CONFIG}: {says}")


def test_draft_weights_it_cannot_read_name_the_file(tmp_path: Path) -> None:
    draft = saved_draft(tmp_path / "draft")
    (draft / DRAFT_WEIGHTS).write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match=f"{draft / DRAFT_WEIGHTS}: not a readable safetensors file"):
        DraftHead.load(draft, tiny_model("llama"))


def full_disk(tensors: dict, filename: str) -> None:
    """What safetensors raises when the disk fills while it writes, after writing part of the file."""
    Path(filename).write_bytes(b"part")
    raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")


def test_a_draft_the_disk_cannot_hold_is_one_error_and_leaves_nothing(monkeypatch, tmp_path: Path) -> None:
    """A new draft directory is not made; an existing one keeps its draft and its other files; no temporary stays."""
    old = saved_draft(tmp_path / "old")
    (old / "notes.txt").write_text("mine")
    before = {p.name: p.read_bytes() for p in old.iterdir()}
    monkeypatch.setattr(head_module, "save_file", full_disk)
    head = DraftHead(tiny_model("llama").config, "tiny")
    for directory in (tmp_path / "new", old):
        with pytest.raises(ValueError, match=f"could not write the draft to {directory}: .*StorageFull.* free on its"):
            head.save(directory)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]
    assert {p.name: p.read_bytes() for p in old.iterdir()} == before
    with pytest.raises(OSError, match=f"{tmp_path / 'ckpt' / DRAFT_WEIGHTS}: .*StorageFull"):
        head.write(tmp_path / "ckpt")  # a checkpoint's: `save_checkpoint` reports it and removes the checkpoint


def test_a_draft_saved_over_another_keeps_the_other_files(tmp_path: Path) -> None:
    old = saved_draft(tmp_path / "draft")
    (old / "notes.txt").write_text("mine")
    head = DraftHead(tiny_model("qwen2").config, "qwen2")
    head.save(old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft"]
    assert (old / "notes.txt").read_text() == "mine"
    assert json.loads((old / DRAFT_CONFIG).read_text())["target"]["model_type"] == "qwen2"
    DraftHead.load(old, tiny_model("qwen2"))


def test_draft_train_refuses_a_disk_without_room_before_the_fit(
    capsys, monkeypatch, no_model_loads, model_dir: Path, tmp_path: Path
) -> None:
    real_usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real_usage(path)._replace(free=1000))
    config = write_config(tmp_path / "c.yaml", model_dir)
    out = tmp_path / "d"
    err = refused(capsys, "draft", "train", "--config", str(config), "--output", str(out))
    assert f"--output: {out} needs about " in err and " KiB, more than the 1.0 KiB free on its disk" in err
