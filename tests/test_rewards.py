"""Tests for fastgrpo.rewards: answer extraction, built-in rewards, the registry and reward aggregation."""

from __future__ import annotations

import math
import sys
import threading

import pytest
import torch

from fastgrpo.answers import completion_text, extract_boxed, extract_hash_answer, extract_last_number, normalize_number
from fastgrpo.reward_calls import reward_name
from fastgrpo.rewards import (
    REWARD_FUNCS,
    compute_rewards,
    format_reward,
    gsm8k_flexible,
    gsm8k_strict,
    math_accuracy,
    required_columns,
    resolve_reward_funcs,
)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("1,000.00", "1000"),
        ("1000", "1000"),
        ("-3", "-3"),
        ("7.0", "7"),
        ("7.", "7"),
        ("$12", "12"),
        ("0.50", "0.5"),
        (".5", "0.5"),
        ("-0", "0"),
        ("\u22124", "-4"),
        (" 12 345 ", "12345"),
        ("abc", "abc"),
    ],
)
def test_normalize_number(raw: str, expected: str) -> None:
    assert normalize_number(raw) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("#### 72", "72"),
        ("so 5 + 6\n#### $1,234.", "1234"),
        ("#### -3", "-3"),
        ("#### 1 then #### 2", "2"),
        ("#### 2.50", "2.5"),
        ("The answer is 72.", None),
        ("#### none", None),
        ("72 ####", None),
    ],
)
def test_extract_hash_answer(text: str, expected: str | None) -> None:
    assert extract_hash_answer(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is 1,234.", "1234"),
        ("#### 72", "72"),
        ("3 - 4 = -1", "-1"),
        ("It drops to -12.5 degrees.", "-12.5"),
        ("10-3 is seven, or 10-3", "3"),
        ("costs $1,000.00 in total", "1000"),
        ("values 1,2,3", "3"),
        ("x2 and nothing else", None),
        ("no digits here", None),
    ],
)
def test_extract_last_number(text: str, expected: str | None) -> None:
    assert extract_last_number(text) == expected


def test_extract_boxed_balances_braces() -> None:
    assert extract_boxed("so \\boxed{\\frac{1}{2}} and later \\boxed{ 3 }") == "3"
    assert extract_boxed("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert extract_boxed("\\fbox{x^{2}}") == "x^{2}"
    assert extract_boxed("\\boxed{unclosed") is None
    assert extract_boxed("nothing") is None


def test_completion_text_accepts_strings_and_messages() -> None:
    assert completion_text("plain") == "plain"
    assert completion_text([{"role": "assistant", "content": "msg"}]) == "msg"
    assert completion_text({"role": "assistant", "content": "one"}) == "one"
    parts = [{"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert completion_text(parts) == "ab"
    with pytest.raises(TypeError, match="got int"):
        completion_text(3)  # type: ignore[arg-type]


def test_gsm8k_strict_vs_flexible() -> None:
    completions = ["work\n#### 72", "The answer is 72.", "#### 1,000", "#### 71", "#### 72 then 5"]
    answer = ["72", "72", "1000", "72", "72"]
    assert gsm8k_strict(completions=completions, answer=answer) == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert gsm8k_flexible(completions=completions, answer=answer) == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_gsm8k_rewards_accept_conversational_completions_and_full_gold() -> None:
    completions = [[{"role": "assistant", "content": "so #### -7"}]]
    assert gsm8k_strict(completions=completions, answer=["Step.\n#### -7"], prompts=["p"]) == [1.0]
    assert gsm8k_flexible(completions=completions, answer=["-7.0"]) == [1.0]


def test_number_rewards_return_none_without_gold() -> None:
    assert gsm8k_strict(completions=["#### 1", "#### 1"], answer=[None, ""]) == [None, None]


def test_accuracy_alias() -> None:
    assert REWARD_FUNCS["accuracy"] is gsm8k_flexible
    assert set(REWARD_FUNCS) == {"gsm8k_strict", "gsm8k_flexible", "accuracy", "math_accuracy", "format"}


def test_math_accuracy_equivalent_forms() -> None:
    completions = [
        "Thus the result is \\boxed{\\frac{1}{2}}.",
        "Thus the result is \\boxed{\\frac{1}{2}}.",
        "Thus the result is \\boxed{0.5}.",
        "Thus the result is \\boxed{\\frac{1}{3}}.",
        "I do not know.",
        "Thus \\boxed{1000}",
    ]
    answer = ["0.5", "1/2", "\\frac{1}{2}", "0.5", "0.5", "1,000"]
    assert math_accuracy(completions=completions, answer=answer) == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]


def test_math_accuracy_gold_from_solution_and_unparseable_gold() -> None:
    solution = "Hence $x=2$, and the answer is $\\boxed{2}$."
    result = math_accuracy(completions=["\\boxed{2}", "\\boxed{2}", "\\boxed{2}"], answer=[solution, "", None])
    assert result == [1.0, None, None]


def test_math_accuracy_works_outside_main_thread() -> None:
    results: list[object] = []
    thread = threading.Thread(
        target=lambda: results.append(math_accuracy(completions=["\\boxed{\\frac{1}{2}}"], answer=["0.5"]))
    )
    thread.start()
    thread.join()
    assert results == [[1.0]]


def test_format_reward() -> None:
    completions = ["#### 5", "\\boxed{x+1}", "The answer is 5.", "\\boxed{}", "#### ?"]
    assert format_reward(completions=completions) == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_resolve_reward_funcs() -> None:
    def custom(completions: list, **kwargs: object) -> list[float]:
        return [0.0] * len(completions)

    resolved = resolve_reward_funcs(["format", "accuracy", custom, "fastgrpo.rewards:gsm8k_strict"])
    assert resolved[2:] == [custom, gsm8k_strict]
    # a built-in is logged under the name it was given: accuracy is gsm8k_flexible, named accuracy
    assert [reward_name(f) for f in resolved] == ["format", "accuracy", "custom", "gsm8k_strict"]
    assert resolved[0].__wrapped__ is format_reward and resolved[1].__wrapped__ is gsm8k_flexible
    assert resolved[1](completions=["so 4"], answer=["4"]) == [1.0]
    assert required_columns(resolved[1]) == ["answer"]


def test_a_reward_module_in_the_current_directory_is_found(tmp_path, monkeypatch) -> None:
    """As ``python -m`` finds it, whatever directory the ``fastgrpo`` script lives in; sys.path is left as it was."""
    (tmp_path / "my_rewards_here.py").write_text("def short(completions, **kw):\n    return [1.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    before = list(sys.path)
    (func,) = resolve_reward_funcs(["my_rewards_here:short"])
    assert func(completions=["a", "b"]) == [1.0, 1.0] and sys.path == before


def test_unknown_reward_name_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="unknown reward function 'acuracy'; valid names: gsm8k_strict, .*format"):
        resolve_reward_funcs(["acuracy"])


def test_bad_import_paths() -> None:
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        resolve_reward_funcs(["no_such_module_xyz:f"])
    with pytest.raises(ValueError, match="has no callable 'missing'"):
        resolve_reward_funcs(["fastgrpo.rewards:missing"])


def _rows(answers: list[str | None], **extra: list[object]) -> list[dict]:
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "answer": a} for i, a in enumerate(answers)]
    for key, values in extra.items():
        for row, value in zip(rows, values, strict=True):
            row[key] = value
    return rows


def test_compute_rewards_weighted_sum_and_metrics() -> None:
    completions = ["#### 1", "it is 2", "#### 9"]
    rows = _rows(["1", "2", "3"])
    prompts = [row["prompt"] for row in rows]
    total, metrics = compute_rewards(
        [gsm8k_strict, format_reward], [2.0, 0.5], prompts, completions, [[1], [2], [3]], rows
    )
    assert total.dtype == torch.float64 and total.shape == (3,)
    assert total.tolist() == [2.5, 0.0, 0.5]
    assert metrics["rewards/gsm8k_strict/mean"] == pytest.approx(1 / 3)
    assert metrics["rewards/gsm8k_strict/std"] == pytest.approx(torch.tensor([1.0, 0.0, 0.0]).std().item())
    assert metrics["rewards/format_reward/mean"] == pytest.approx(2 / 3)
    assert set(metrics) == {
        "rewards/gsm8k_strict/mean",
        "rewards/gsm8k_strict/std",
        "rewards/format_reward/mean",
        "rewards/format_reward/std",
    }


def test_compute_rewards_default_weights_and_columns() -> None:
    seen: dict[str, object] = {}

    def spy(prompts: list, completions: list, completion_ids: list, **columns: object) -> list[float]:
        seen.update(columns, prompts=prompts, completion_ids=completion_ids)
        return [float(len(c)) for c in completions]

    rows = _rows(["1", "2"], level=[3, 4])
    total, _ = compute_rewards([spy, spy], None, ["p0", "p1"], ["a", "bbb"], [[7], [8, 9]], rows)
    assert total.tolist() == [2.0, 6.0]
    assert seen == {
        "answer": ["1", "2"],
        "level": [3, 4],
        "prompts": ["p0", "p1"],
        "completion_ids": [[7], [8, 9]],
    }


def test_compute_rewards_none_handling() -> None:
    def partial(completions: list, **kwargs: object) -> list[float | None]:
        return [1.0, None, 0.0, None]

    def never(completions: list, **kwargs: object) -> list[float | None]:
        return [None] * len(completions)

    rows = _rows(["1", "1", "1", "1"])
    completions = ["#### 1", "#### 1", "x", "x"]
    total, metrics = compute_rewards([partial, format_reward, never], [1.0, 1.0, 3.0], None, completions, None, rows)
    assert total.tolist() == [2.0, 1.0, 0.0, 0.0]
    assert metrics["rewards/partial/mean"] == pytest.approx(0.5)
    assert metrics["rewards/partial/std"] == pytest.approx(math.sqrt(0.5))
    assert math.isnan(metrics["rewards/never/mean"]) and math.isnan(metrics["rewards/never/std"])


def test_compute_rewards_checks_lengths() -> None:
    rows = _rows(["1", "2"])
    with pytest.raises(ValueError, match="got 1 reward weights for 2 reward functions"):
        compute_rewards([gsm8k_strict, format_reward], [1.0], None, ["a", "b"], None, rows)
    with pytest.raises(ValueError, match="got 1 rows for 2 completions"):
        compute_rewards([gsm8k_strict], None, None, ["a", "b"], None, rows[:1])
    with pytest.raises(ValueError, match="at least one reward function"):
        compute_rewards([], None, None, ["a", "b"], None, rows)

    def short(completions: list, **kwargs: object) -> list[float]:
        return [1.0]

    with pytest.raises(ValueError, match="'short' must return a list of 2 floats or None, got length 1"):
        compute_rewards([short], None, None, ["a", "b"], None, rows)

    def not_numbers(completions: list, **kwargs: object) -> list[object]:
        return ["high", "low"]

    with pytest.raises(ValueError, match="'not_numbers' returned the text 'high' for row 0; rewards are numbers"):
        compute_rewards([not_numbers], None, None, ["a", "b"], None, rows)


def test_raising_reward_names_function_and_row() -> None:
    def fragile(completions: list, answer: list, **kwargs: object) -> list[float]:
        return [1.0 / int(a) for a in answer]

    rows = _rows(["1", "2", "0", "0"])
    prompts = [row["prompt"] for row in rows]
    with pytest.raises(RuntimeError, match=r"'fragile' failed on row 2 \(prompt: 'q2'\): ZeroDivisionError") as info:
        compute_rewards([fragile], None, prompts, ["a"] * 4, None, rows)
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_raising_reward_on_whole_batch_only() -> None:
    def batch_only(completions: list, **kwargs: object) -> list[float]:
        if len(completions) > 1:
            raise ValueError("batch too large")
        return [0.0]

    with pytest.raises(RuntimeError, match="'batch_only' failed on a batch of 2 completions") as info:
        compute_rewards([batch_only], None, None, ["a", "b"], None, _rows(["1", "2"]))
    assert isinstance(info.value.__cause__, ValueError)


def test_async_reward_functions_run_concurrently_and_get_trls_keywords() -> None:
    """Two async functions each wait for the other (run one after the other, the first would time out); every
    function gets TRL's trainer_state, log_metric and log_extra, and what it logs is kept."""
    import asyncio

    from fastgrpo.reward_calls import RewardLog, TrainerState
    from fastgrpo.rewards import reward_matrix

    started: dict[str, asyncio.Event] = {}

    async def waiting(name: str, other: str, completions: list) -> list[float]:
        started.setdefault(name, asyncio.Event()).set()
        await asyncio.wait_for(started.setdefault(other, asyncio.Event()).wait(), timeout=5)
        return [1.0] * len(completions)

    async def first(completions: list, **kwargs: object) -> list[float]:
        return await waiting("first", "second", completions)

    async def second(completions: list, **kwargs: object) -> list[float]:
        return await waiting("second", "first", completions)

    def shaped(completions: list, trainer_state: TrainerState, log_metric, log_extra, **kwargs) -> list[float | None]:
        log_metric("shaped/progress", trainer_state.global_step / trainer_state.max_steps)
        log_extra("why", ["short", "long"])
        return [None, 0.5]

    log = RewardLog()
    extra = log.keywords(TrainerState(global_step=3, max_steps=12))
    per_func, metrics = reward_matrix([first, second, shaped], ["p", "q"], ["a", "b"], None, [{}, {}], extra)
    assert per_func[:, :2].tolist() == [[1.0, 1.0], [1.0, 1.0]] and math.isnan(per_func[0, 2])
    assert metrics["rewards/shaped/mean"] == 0.5 and math.isnan(metrics["rewards/shaped/std"])  # TRL's nanstd of one
    assert log.metrics() == {"shaped/progress": 0.25} and log.columns == {"why": ["short", "long"]}


def test_a_completion_no_function_scores_is_nan_and_warned_about_by_name(caplog: pytest.LogCaptureFixture) -> None:
    def never(completions: list, **kwargs: object) -> list[float | None]:
        return [None] * len(completions)

    def partial(completions: list, **kwargs: object) -> list[float | None]:
        return [1.0, None]

    with caplog.at_level("WARNING", logger="fastgrpo.rewards"):
        total, _ = compute_rewards([never, partial], [1.0, 2.0], ["p0", "p1"], ["a", "b"], None, [{}, {}])
    assert total[0] == 2.0 and math.isnan(total[1])
    assert "1 of 2 completions got no reward from any reward function ('never', 'partial'" in caplog.text
    assert "the first is row 1 (prompt: 'p1')" in caplog.text


def test_an_async_reward_past_reward_timeout_is_named_and_its_own_timeout_error_is_its_failure() -> None:
    """``reward_timeout`` stops a function that never returns, naming the option; a function that itself raises
    TimeoutError (its HTTP client's) fails as any raising function does, named with its row."""
    import asyncio

    from fastgrpo.errors import RewardFunctionError
    from fastgrpo.reward_calls import call_reward_funcs

    async def never(completions: list, **kwargs: object) -> list[float]:
        await asyncio.Event().wait()
        return [1.0] * len(completions)

    async def client_timeout(completions: list, **kwargs: object) -> list[float]:
        raise TimeoutError("the judge did not answer")

    batch = {"prompts": ["p", "q"], "completions": ["a", "b"]}
    with pytest.raises(RewardFunctionError, match=r"'never' did not return within reward_timeout \(0.05 s\)"):
        call_reward_funcs([never], batch, 2, timeout=0.05)
    with pytest.raises(RewardFunctionError, match="'client_timeout' failed on row 0.*TimeoutError: the judge"):
        call_reward_funcs([client_timeout], batch, 2, timeout=30)
