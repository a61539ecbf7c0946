"""Every case of the bad-input matrix (`bad_input_matrix.CASES`) ends as it must: refused with a message naming the
option, file, row or function (before a model loads, unless only the model can tell), warned, or run correctly;
never silent, never a traceback."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from bad_input_matrix import CASES, GOOD, REFUSED, Case, run_case
from conftest import save_tiny_llama


@pytest.fixture(scope="module")
def matrix_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("matrix") / "model", seed=0, tie_word_embeddings=True)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_a_bad_input_ends_as_it_must(case: Case, tmp_path: Path, matrix_model: Path) -> None:
    result = run_case(case, tmp_path, matrix_model)
    assert result.outcome == GOOD[case.expect], f"{result.outcome} (exit {result.code}):\n{result.output[-3000:]}"


def test_the_matrix_covers_every_command() -> None:
    assert len(CASES) >= 80 and len({case.name for case in CASES}) == len(CASES)
    commands = Counter(case.argv[0] for case in CASES if case.expect == REFUSED)
    assert set(commands) == {"train", "generate", "eval", "draft", "report", "profile"}, commands


@pytest.mark.parametrize(
    "name", ["resuming a trainer state holding a pickled call", "resuming learners' state holding a pickled call"]
)
def test_a_pickled_call_in_a_checkpoint_is_neither_run_nor_loaded(
    name: str, tmp_path: Path, matrix_model: Path
) -> None:
    """The tampered state file's ``os.system`` call would write ``pwned``: the resume is refused in one line naming
    the file, and the call never ran (the file is not unpickled past the reference it refuses)."""
    (case,) = [case for case in CASES if case.name == name]
    result = run_case(case, tmp_path, matrix_model)
    assert result.outcome == "message", result.output[-3000:]
    assert not (tmp_path / "pwned").exists()
    refusal = [line for line in result.output.splitlines() if "holds more than data" in line]
    assert len(refusal) == 1 and str(tmp_path / "run" / "checkpoint-") in refusal[0], result.output[-3000:]


def test_a_pickled_call_is_refused_by_the_loader(tmp_path: Path) -> None:
    import torch
    from bad_input_matrix import PickledCall

    from fastgrpo.state_files import UnsafeStateFile, load_data

    path = tmp_path / "state.pt"
    torch.save({"step": 1, "x": PickledCall(tmp_path / "pwned")}, path)
    with pytest.raises(UnsafeStateFile, match=r"state\.pt holds more than data \(a pickled reference to posix\.system"):
        load_data(path)
    assert not (tmp_path / "pwned").exists()
    torch.save({"step": 1, "t": torch.ones(2)}, path)
    assert load_data(path)["step"] == 1


def test_fastgrpo_cache_expands_a_tilde(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``FASTGRPO_CACHE=~/c`` is the home directory's ``c`` (not ``./~/c``); an unknown user is refused naming it."""
    from fastgrpo.models import cache_root

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("FASTGRPO_CACHE", "~/c")
    assert cache_root() == tmp_path / "c"
    monkeypatch.setenv("FASTGRPO_CACHE", "~nosuchuser_fastgrpo/c")
    with pytest.raises(ValueError, match="FASTGRPO_CACHE: ~nosuchuser_fastgrpo/c starts with ~ but the user"):
        cache_root()
