"""Tests for fastgrpo.data: file loading, presets, GSM8K parsing and the arithmetic generator."""

from __future__ import annotations

import ast
import json
import operator
import sys
from pathlib import Path

import pytest

from fastgrpo.data import (
    GSM8K_INSTRUCTION,
    PRESETS,
    DataConfig,
    DatasetSourceError,
    build_prompt,
    load_dataset,
    load_gsm8k,
    make_arithmetic,
)

GSM8K_TRAIN = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "gsm8k" / "train.jsonl"


def _write_jsonl(path: Path, records: list[object]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


def _user_text(row: dict) -> str:
    return row["prompt"][-1]["content"]


@pytest.fixture(scope="module")
def gsm8k_rows() -> list[dict]:
    return load_gsm8k(GSM8K_TRAIN)


def test_gsm8k_real_file_answers(gsm8k_rows: list[dict]) -> None:
    assert len(gsm8k_rows) == 7473
    first = gsm8k_rows[0]
    assert first["answer"] == "72"
    assert first["solution"].endswith("#### 72")
    question = (
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?"
    )
    assert first["prompt"] == [{"role": "user", "content": f"{question}\n{GSM8K_INSTRUCTION}"}]
    assert [row["answer"] for row in gsm8k_rows[1:5]] == ["10", "5", "42", "624"]


def test_gsm8k_real_file_commas_and_negatives(gsm8k_rows: list[dict]) -> None:
    assert gsm8k_rows[345]["solution"].endswith("#### 1,080")
    assert gsm8k_rows[345]["answer"] == "1080"
    assert gsm8k_rows[5715]["answer"] == "-7"
    assert all(row["answer"].lstrip("-").isdigit() for row in gsm8k_rows)


def test_gsm8k_instruction_and_system_prompt(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "g.jsonl", [{"question": "Q?", "answer": "work\n#### 1,000"}])
    rows = load_gsm8k(path, instruction="", system_prompt="Be brief.")
    assert rows == [
        {
            "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q?"}],
            "answer": "1000",
            "solution": "work\n#### 1,000",
        }
    ]


def test_gsm8k_rows_without_final_answer_are_skipped(tmp_path: Path) -> None:
    path = _write_jsonl(
        tmp_path / "g.jsonl",
        [{"question": "A?", "answer": "no marker"}, {"question": "B?", "answer": "#### 3"}],
    )
    rows = load_gsm8k(path)
    assert [row["answer"] for row in rows] == ["3"]


def test_gsm8k_all_rows_without_answer_is_an_error(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "g.jsonl", [{"question": "A?", "answer": "no marker"}])
    with pytest.raises(ValueError, match=r"g\.jsonl is empty \(none of its 1 rows"):
        load_gsm8k(path)


def test_jsonl_column_mapping_keeps_other_columns(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", [{"q": "What is 2+2?", "gold": 4, "level": 1}])
    rows = load_dataset(DataConfig(name=str(path), prompt_column="q", answer_column="gold"))
    assert rows == [{"prompt": [{"role": "user", "content": "What is 2+2?"}], "answer": "4", "gold": 4, "level": 1}]


def test_answer_column_dotted_path(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "P", "reward_model": {"ground_truth": "7"}}])
    rows = load_dataset(DataConfig(name=str(path), answer_column="reward_model.ground_truth"))
    assert rows[0]["answer"] == "7"


def test_plain_file_without_answer_column_loads_prompts_only(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Tell a joke."}])
    rows = load_dataset(DataConfig(name=str(path), instruction="Keep it short."))
    assert rows == [{"prompt": [{"role": "user", "content": "Tell a joke.\nKeep it short."}]}]


def test_chat_prompts_are_kept_and_system_prompt_replaces(tmp_path: Path) -> None:
    prompt = [{"role": "system", "content": "old"}, {"role": "user", "content": "Hi"}]
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": prompt, "answer": "1"}])
    rows = load_dataset(DataConfig(name=str(path), system_prompt="new"))
    assert rows[0]["prompt"] == [{"role": "system", "content": "new"}, {"role": "user", "content": "Hi"}]
    assert prompt[0]["content"] == "old"


def test_json_list_and_data_key(tmp_path: Path) -> None:
    records = [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}]
    listed = tmp_path / "list.json"
    listed.write_text(json.dumps(records), encoding="utf-8")
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"data": records}), encoding="utf-8")
    for path in (listed, wrapped):
        rows = load_dataset(DataConfig(name=str(path)))
        assert [(_user_text(row), row["answer"]) for row in rows] == [("a", "1"), ("b", "2")]


def test_json_of_wrong_shape(tmp_path: Path) -> None:
    path = tmp_path / "d.json"
    path.write_text(json.dumps({"rows": []}), encoding="utf-8")
    with pytest.raises(ValueError, match="expected a JSON list"):
        load_dataset(DataConfig(name=str(path)))


def test_malformed_jsonl_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": oops}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 3 is not valid JSON"):
        load_dataset(DataConfig(name=str(path)))


def test_missing_prompt_column_names_file_row_and_column(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", [{"question": "a"}, {"text": "b"}])
    with pytest.raises(ValueError, match=r"d\.jsonl line 1: missing prompt column 'prompt' \(columns: question\)"):
        load_dataset(DataConfig(name=str(path)))
    with pytest.raises(ValueError, match=r"d\.jsonl line 2: missing prompt column 'question'"):
        load_dataset(DataConfig(name=str(path), prompt_column="question"))


@pytest.mark.parametrize(
    ("prompt", "problem"),
    [
        ("   ", "is an empty string"),
        (42, "got int"),
        ([], "got list"),
        ([{"role": "user"}], "without string 'content'"),
        ([{"content": "x"}], "without a string 'role'"),
        ([{"role": "assistant", "content": "x"}], "has no user message"),
    ],
)
def test_invalid_prompts_name_file_row_and_column(tmp_path: Path, prompt: object, problem: str) -> None:
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"prompt": "fine"}, {"prompt": prompt}]), encoding="utf-8")
    with pytest.raises(ValueError, match=r"d\.json row 2: prompt column 'prompt' ") as info:
        load_dataset(DataConfig(name=str(path)))
    assert problem in str(info.value)


def test_non_object_record(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", [["not", "an", "object"]])
    with pytest.raises(ValueError, match=r"d\.jsonl line 1: expected an object"):
        load_dataset(DataConfig(name=str(path)))


def test_explicit_answer_column_missing_is_an_error(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "gold": "1"}, {"prompt": "b"}])
    with pytest.raises(ValueError, match=r"d\.jsonl line 2: missing answer column 'gold'"):
        load_dataset(DataConfig(name=str(path), answer_column="gold"))


def test_empty_file_names_source(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"dataset .*empty\.jsonl is empty"):
        load_dataset(DataConfig(name=str(path)))


def test_parquet_without_pyarrow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match="pip install pyarrow"):
        load_dataset(DataConfig(name=str(path)))


def test_unsupported_suffix_and_missing_file(tmp_path: Path) -> None:
    csv = tmp_path / "d.csv"
    csv.write_text("prompt\nx\n", encoding="utf-8")
    with pytest.raises(ValueError, match="unsupported file type '.csv'"):
        load_dataset(DataConfig(name="gsm8k", path=str(csv)))
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_dataset(DataConfig(name=str(tmp_path / "nope.jsonl")))
    with pytest.raises(FileNotFoundError, match="nope.json"):
        load_dataset(DataConfig(name="math", path=str(tmp_path / "nope.json")))


def test_hub_id_without_datasets_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DatasetSourceError, match="not a local file.*pip install datasets"):
        load_dataset(DataConfig(name="someone/some-dataset"))


def test_hub_download_failure_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    class FakeDatasets:
        @staticmethod
        def load_dataset(*args: object, **kwargs: object) -> None:
            raise ConnectionError("no network")

    monkeypatch.setitem(sys.modules, "datasets", FakeDatasets)
    with pytest.raises(DatasetSourceError, match="neither a local file nor a reachable.*offline.*no network"):
        load_dataset(DataConfig(name="someone/some-dataset"))


def test_preset_uses_hub_when_no_path(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    class FakeDatasets:
        @staticmethod
        def load_dataset(name: str, config: str | None, split: str) -> list[dict]:
            calls.append((name, config, split))
            return [{"question": "Q", "answer": "r\n#### 5"}]

    monkeypatch.setitem(sys.modules, "datasets", FakeDatasets)
    rows = load_dataset(DataConfig(name="gsm8k", split="test"))
    assert calls == [("openai/gsm8k", "main", "test")]
    assert rows[0]["answer"] == "5"


def test_preset_without_hub_needs_path() -> None:
    with pytest.raises(ValueError, match="'simplerl' has no default hub dataset"):
        load_dataset(DataConfig(name="simplerl"))


def test_math_preset_extracts_boxed_answer(tmp_path: Path) -> None:
    solution = "We get $x = \\frac{1}{2}$, so the answer is $\\boxed{\\frac{1}{2}}$."
    path = _write_jsonl(tmp_path / "m.jsonl", [{"problem": "Find x.", "solution": solution}])
    rows = load_dataset(DataConfig(name="math", path=str(path)))
    assert rows[0]["answer"] == "\\frac{1}{2}"
    assert rows[0]["solution"] == solution
    assert _user_text(rows[0]) == "Find x.\n" + PRESETS["math"].instruction


def test_dapo_preset_answer_candidates(tmp_path: Path) -> None:
    chat = [{"role": "user", "content": "Solve it."}]
    records = [
        {"prompt": chat, "reward_model": {"ground_truth": "34", "style": "rule"}},
        {"prompt": "Solve that.", "solution": "12"},
    ]
    path = _write_jsonl(tmp_path / "dapo.jsonl", records)
    rows = load_dataset(DataConfig(name="dapo-math", path=str(path)))
    assert [row["answer"] for row in rows] == ["34", "12"]
    assert rows[0]["prompt"] == chat
    assert rows[1]["prompt"] == [{"role": "user", "content": "Solve that."}]


def test_simplerl_preset_prefers_gt_answer(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "s.jsonl", [{"question": "Q", "gt_answer": "9", "answer": "long text"}])
    rows = load_dataset(DataConfig(name="simplerl", path=str(path), instruction=""))
    assert rows[0]["answer"] == "9"
    assert rows[0]["prompt"] == [{"role": "user", "content": "Q"}]


def test_preset_columns_can_be_overridden(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "g.jsonl", [{"text": "Q", "final": "#### 8"}])
    rows = load_dataset(DataConfig(name="gsm8k", path=str(path), prompt_column="text", answer_column="final"))
    assert rows[0]["answer"] == "8"
    assert "text" not in rows[0]


def test_limit(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": str(i)} for i in range(5)])
    rows = load_dataset(DataConfig(name=str(path), limit=2))
    assert [_user_text(row) for row in rows] == ["0", "1"]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"digits": 0}, "dataset.digits must be >= 1, got 0"),
        ({"operands": 1}, "dataset.operands must be >= 2, got 1"),
        ({"operators": "+/"}, "dataset.operators must be"),
        ({"operators": ""}, "dataset.operators must be"),
        ({"num_examples": 0}, "dataset.num_examples must be >= 1"),
        ({"limit": 0}, "dataset.limit must be None or >= 1"),
        ({"name": " "}, "dataset.name must not be empty"),
        ({"path": "x.jsonl"}, "dataset.path is only used with a preset name"),
        ({"answer_column": ""}, "dataset.answer_column"),
    ],
)
def test_validate(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        DataConfig(**changes).validate()


def test_validate_accepts_defaults() -> None:
    DataConfig().validate()
    DataConfig(name="gsm8k", path="x.jsonl", operators="*-+", digits=3, operands=4).validate()


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _evaluate_expression(text: str) -> int:
    """Independent evaluation of an integer +-* expression through Python's parser."""

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.BinOp):
            return _OPERATORS[type(node.op)](walk(node.left), walk(node.right))
        assert isinstance(node, ast.Constant)
        return node.value

    return walk(ast.parse(text, mode="eval").body)


def test_arithmetic_answers_are_correct() -> None:
    cfg = DataConfig(num_examples=300, digits=2, operands=3, operators="+-*", seed=3)
    rows = make_arithmetic(cfg)
    assert len(rows) == 300
    for row in rows:
        question = _user_text(row)
        assert question.startswith("What is ") and question.endswith("?")
        expression = question.removeprefix("What is ").removesuffix("?")
        numbers = [int(token) for token in expression.split() if token.isdigit()]
        assert len(numbers) == 3 and all(1 <= n <= 99 for n in numbers)
        assert row["answer"] == str(_evaluate_expression(expression))
        assert set(row) == {"prompt", "answer"}
    assert any(row["answer"].startswith("-") for row in rows)
    assert {op for row in rows for op in "+-*" if f" {op} " in _user_text(row)} == {"+", "-", "*"}


def test_arithmetic_is_deterministic_in_seed() -> None:
    cfg = DataConfig(num_examples=50, operators="+-", word_problems=True)
    assert make_arithmetic(cfg) == make_arithmetic(cfg)
    assert make_arithmetic(cfg) != make_arithmetic(DataConfig(num_examples=50, operators="+-", seed=1))


def test_arithmetic_defaults_bare_question() -> None:
    rows = load_dataset(DataConfig(num_examples=20))
    assert len(rows) == 20
    for row in rows:
        assert row["prompt"][0]["role"] == "user" and len(row["prompt"]) == 1
        a, b = (int(x) for x in _user_text(row).removeprefix("What is ").removesuffix("?").split(" + "))
        assert 1 <= a <= 9 and 1 <= b <= 9
        assert row["answer"] == str(a + b)


def test_arithmetic_instruction_and_system_prompt() -> None:
    cfg = DataConfig(num_examples=1, instruction="Answer with just the number.", system_prompt="S")
    (row,) = make_arithmetic(cfg)
    assert row["prompt"][0] == {"role": "system", "content": "S"}
    assert row["prompt"][1]["content"].endswith("?\nAnswer with just the number.")


_WORD_MARKERS = (("+", ("more", "afternoon")), ("-", ("left",)), ("*", ("each",)))


def _word_problem_kind(text: str) -> str:
    (kind,) = [kind for kind, markers in _WORD_MARKERS if any(m in text.lower() for m in markers)]
    return kind


def test_word_problems_match_their_operator() -> None:
    rows = make_arithmetic(DataConfig(num_examples=400, operators="+-*", word_problems=True, seed=7))
    words = [row for row in rows if not _user_text(row).startswith("What is")]
    assert len({_user_text(row).split(" ")[0] for row in words}) >= 5
    assert {_word_problem_kind(_user_text(row)) for row in words} == {"+", "-", "*"}
    apply = {"+": operator.add, "-": operator.sub, "*": operator.mul}
    for row in words:
        text = _user_text(row)
        a, b = (int(token.rstrip(".")) for token in text.split() if token.rstrip(".").isdigit())
        assert row["answer"] == str(apply[_word_problem_kind(text)](a, b)), text
        assert int(row["answer"]) >= 0


def test_word_problems_fall_back_for_many_operands() -> None:
    rows = make_arithmetic(DataConfig(num_examples=30, operands=3, word_problems=True))
    assert all(_user_text(row).startswith("What is") for row in rows)


def test_build_prompt_appends_instruction_to_last_user_message() -> None:
    messages = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "second  "},
    ]
    built = build_prompt(messages, "sys", " Think. ")
    assert built[0] == {"role": "system", "content": "sys"}
    assert built[1]["content"] == "first"
    assert built[3]["content"] == "second\nThink."
    assert messages[2]["content"] == "second  "


def questions(rows: list[dict]) -> set[str]:
    return {row["prompt"][-1]["content"] for row in rows}


@pytest.mark.parametrize("options", [{}, {"digits": 2, "operators": "+-*"}, {"operands": 3, "word_problems": True}])
def test_arithmetic_test_split_never_shares_a_question_with_train(options: dict) -> None:
    """A fifth of the questions is held out (by a hash of the question, whatever its wording): training never draws
    one, the test split draws nothing else, distinct questions, as many as it has when num_examples is more."""
    train = make_arithmetic(DataConfig(num_examples=2000, **options))
    test = make_arithmetic(DataConfig(num_examples=300, split="test", seed=5, **options))
    assert not questions(train) & questions(test)
    assert len(questions(test)) == len(test) and len(test) > 10


def test_the_one_digit_sums_split_and_a_split_that_cannot_be() -> None:
    train, test = make_arithmetic(DataConfig()), make_arithmetic(DataConfig(split="test", num_examples=200))
    assert (len(questions(train)), len(test)) == (67, 14) and not questions(train) & questions(test)
    with pytest.raises(ValueError, match=r"dataset.split of the arithmetic generator must be one of train, test"):
        make_arithmetic(DataConfig(split="validation"))


def test_a_local_file_is_named_as_such_and_a_hub_id_is_not(tmp_path: Path) -> None:
    data = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "2 + 2?", "answer": "4"}])
    assert DataConfig(name=str(data)).local_file() == data
    assert DataConfig(name=str(tmp_path / "missing.parquet")).local_file() == tmp_path / "missing.parquet"
    assert DataConfig(name="gsm8k", path=str(data)).local_file() == data
    assert DataConfig(name="gsm8k").local_file() is None
    assert DataConfig(name="someone/some-dataset").local_file() is None
    assert DataConfig().local_file() is None


@pytest.mark.parametrize(
    ("changes", "given", "message"),
    [
        ({"name": "{file}"}, {"split": "test"}, "dataset.split applies to hub datasets and the arithmetic generator"),
        ({"name": "gsm8k", "path": "{file}"}, {"split": "train"}, "not to the local file {file}, whose rows are all"),
        ({"name": "{file}"}, {"num_examples": 5}, "dataset.num_examples applies to the arithmetic generator only"),
        ({"name": "gsm8k"}, {"digits": 2}, "dataset.digits applies to the arithmetic generator only, not to the "),
        ({"name": "math"}, {"seed": 1}, "dataset.seed applies"),
        ({"name": "someone/some-dataset"}, {"word_problems": True}, "dataset.word_problems applies"),
    ],
)
def test_an_option_given_that_does_not_apply_is_refused(
    tmp_path: Path, changes: dict, given: dict, message: str
) -> None:
    file = str(_write_jsonl(tmp_path / "d.jsonl", [{"prompt": "2 + 2?", "answer": "4"}]))
    cfg = DataConfig(**{k: v.replace("{file}", file) for k, v in changes.items()})
    with pytest.raises(ValueError, match=message.replace("{file}", file).replace(".", r"\.")):
        cfg.check_given(given)


def test_options_that_apply_or_are_not_given_are_accepted(tmp_path: Path) -> None:
    file = str(_write_jsonl(tmp_path / "d.jsonl", [{"prompt": "2 + 2?", "answer": "4"}]))
    DataConfig(name=file, split="test", digits=3).check_given({"name": file, "limit": 1})  # values, not given
    DataConfig(name="gsm8k").check_given({"name": "gsm8k", "split": "test"})  # the hub's split
    DataConfig(split="test", digits=2).check_given({"split": "test", "digits": 2, "num_examples": 5})


def test_arithmetic_rows_beyond_a_quarter_of_the_memory_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from fastgrpo.data import config

    with pytest.raises(
        ValueError, match=r"dataset\.num_examples: 1000000000 arithmetic rows \(operands: 2, digits: 1\)"
    ):
        DataConfig(num_examples=10**9).validate()
    with pytest.raises(ValueError, match="rows, operands or digits"):  # each question holds every operand
        DataConfig(num_examples=100, operands=10**8).validate()
    monkeypatch.setattr(config, "physical_memory_bytes", lambda: 4 * 2**20)
    DataConfig(num_examples=1000).validate()  # 0.6 MB of a quarter of 4 MiB
    with pytest.raises(ValueError, match=r"\(610 bytes each\), more than 25% of this machine's 0\.0 GiB"):
        DataConfig(num_examples=2000).validate()
    with pytest.raises(ValueError, match="1610 bytes each"):  # each row holds its copy of the instruction
        DataConfig(num_examples=1000, instruction="x" * 1000).validate()
    DataConfig(name="gsm8k", num_examples=10**9).validate()  # the generator's option only bounds the generator


@pytest.mark.parametrize(("changes", "longest"), [({"digits": 4300}, 4301), ({"digits": 1500, "operands": 3}, 4500)])
def test_arithmetic_answers_longer_than_python_writes_are_refused(changes: dict, longest: int) -> None:
    """Python converts integers of at most 4300 digits to text (``sys.get_int_max_str_digits``)."""
    cfg = DataConfig(operators="+" if longest == 4301 else "+*", **changes)
    with pytest.raises(ValueError, match=f"dataset.digits: answers of .* have up to {longest} digits, more than the"):
        cfg.validate()


def test_the_estimate_of_a_row_is_at_least_what_a_row_takes() -> None:
    import tracemalloc

    from fastgrpo.data.arithmetic import rows_bytes

    for cfg in (DataConfig(num_examples=2000), DataConfig(num_examples=2000, word_problems=True, system_prompt="S")):
        tracemalloc.start()
        rows = make_arithmetic(cfg)
        held = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        assert len(rows) == 2000 and held <= rows_bytes(cfg) <= 2 * held


def test_more_training_rows_than_distinct_questions_say_that_they_repeat(caplog: pytest.LogCaptureFixture) -> None:
    from fastgrpo.data.arithmetic import split_size

    assert (split_size(DataConfig()), split_size(DataConfig(split="test"))) == (67, 14)  # 81 one-digit sums
    with caplog.at_level("INFO", logger="fastgrpo.data.arithmetic"):
        rows = make_arithmetic(DataConfig(num_examples=100))
    assert len(rows) == 100 and len({_user_text(r) for r in rows}) <= 67
    assert "the arithmetic train split has 67 distinct questions, fewer than num_examples (100): they repeat" in (
        caplog.text
    )
    caplog.clear()
    with caplog.at_level("INFO", logger="fastgrpo.data.arithmetic"):
        assert len(make_arithmetic(DataConfig(num_examples=100, split="test"))) == 14
        make_arithmetic(DataConfig(num_examples=60))
    assert "test split has 14 distinct questions, fewer than num_examples (100): all of them" in caplog.text
    assert "train split" not in caplog.text
