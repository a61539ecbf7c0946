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
