"""Tools: resolved and refused before a model loads, shown and read in the fallback format of the embedded model's
template, run with deadlines, every fault ending as an error message in the conversation, and tool results masked
out of training."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import torch
from transformers import AutoTokenizer

from fastgrpo.config import GRPOConfig
from fastgrpo.grpo.batch import build_batch, mask_tool_results
from fastgrpo.models import resolve_model_path
from fastgrpo.tools.format import ToolFormat
from fastgrpo.tools.functions import calculator, concurrent, resolve_tools
from fastgrpo.tools.runner import ToolRunner
from fastgrpo.tools.turns import ToolTurns


def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return str(a + b)


def undocumented(a: int) -> str:
    return str(a)


def untyped(a):
    """No hints.

    Args:
        a: a value.
    """
    return a


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model_path("smollm2"))


def test_calculator() -> None:
    assert calculator("12 * (3 + 4)") == "84"
    assert calculator("7 / 2") == "3.5"
    with pytest.raises(ValueError, match="not arithmetic"):
        calculator("__import__('os')")
    with pytest.raises(ValueError, match="exponent"):
        calculator("2 ** 1000")


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        (["nowhere_module:f"], "cannot import module 'nowhere_module' for tools entry"),
        (["json:no_such_function"], "module 'json' has no callable 'no_such_function'"),
        ([undocumented], "tool 'undocumented' cannot be described to the model"),
        ([untyped], "tool 'untyped' cannot be described to the model"),
        ([add, add], "two tools are named 'add'"),
        (["abacus"], "unknown tool 'abacus'"),
    ],
)
def test_bad_tools_are_refused_naming_them(specs, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        resolve_tools(specs)


def test_bad_tools_are_refused_before_the_model_loads(tmp_path, no_model_loads) -> None:
    from fastgrpo.grpo.trainer import GRPOTrainer

    config = GRPOConfig(model="smollm2", tools=["abacus"], output_dir=str(tmp_path / "run"))
    with pytest.raises(ValueError, match="unknown tool 'abacus'"):
        GRPOTrainer(config)


def test_the_fallback_format_shows_reads_and_continues(tokenizer) -> None:
    tools = resolve_tools(["calculator", add])
    fmt = ToolFormat(tokenizer, tools)
    assert not fmt.native and "fallback" in fmt.name
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 1}}}
    example = [
        {"role": "user", "content": "What is 1 + 1?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "add", "content": "2"},
    ]
    messages, kwargs = fmt.conversation([*example, {"role": "user", "content": "What is 2 + 3?"}])
    assert kwargs == {} and messages[0]["role"] == "system" and '"name": "calculator"' in messages[0]["content"]
    written = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>'
    assert messages[2] == {"role": "assistant", "content": written}, "a worked example keeps its call"

    def parse(text: str) -> dict:
        return fmt.parse(tokenizer(text, add_special_tokens=False)["input_ids"], [], tools)

    call = parse('Sure. <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>')["tool_calls"][0]
    assert call == {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    malformed = '<tool_call>{"name": add}</tool_call>'
    assert parse(malformed) == {"role": "assistant", "content": malformed}, "a malformed call is text, as TRL reads it"
    strict = ToolFormat(tokenizer, tools, strict=True)  # strict_tool_calls: an error call the model reads
    assert (
        "error" in strict.parse(tokenizer(malformed, add_special_tokens=False)["input_ids"], [], tools)["tool_calls"][0]
    )
    assert "tool_calls" not in parse("The answer is 5.")
    suffix = fmt.suffix_ids([{"role": "tool", "name": "add", "content": "5"}])
    assert tokenizer.decode(suffix) == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture
def native():
    """SmolLM2's tokenizer with the Qwen2.5 template (ChatML, with tools) and TRL's response template."""
    chat_templates = pytest.importorskip("trl.chat_template_utils")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("smollm2"))
    tokenizer.chat_template = chat_templates.qwen2_5_chat_template
    chat_templates.add_response_schema(tokenizer)
    return tokenizer


def test_a_template_with_tool_support_shows_and_parses_its_own_format(native) -> None:
    """The Qwen2.5 template (ChatML, with tools) on SmolLM2's tokenizer, with TRL's response template: the tools go
    to the template, calls are read by transformers' parse_response (arguments cast by the schema), and the tool
    turn is the template's."""
    tools = resolve_tools([add])
    fmt = ToolFormat(native, tools)
    assert fmt.native and fmt.parses and "chat template" in fmt.name
    messages, kwargs = fmt.conversation([{"role": "user", "content": "What is 2 + 3?"}])
    assert kwargs == {"tools": [tools[0].schema]} and len(messages) == 1
    prompt = native.apply_chat_template(messages, add_generation_prompt=True, return_dict=False, **kwargs)
    call = '<tool_call>\n{"name": "add", "arguments": {"a": "2", "b": 3}}\n</tool_call><|im_end|>'
    message = fmt.parse(native(call, add_special_tokens=False)["input_ids"], list(prompt), tools)
    assert message["tool_calls"] == [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]
    malformed = native('<tool_call>\n{"name": add}\n</tool_call>')["input_ids"]
    assert "tool_calls" not in fmt.parse(malformed, list(prompt), tools), "a malformed call is text, as TRL reads it"
    broken = ToolFormat(native, tools, strict=True).parse(malformed, list(prompt), tools)
    assert broken["tool_calls"][0]["error"].startswith("error: the turn's tool calls cannot be read: json parser")
    suffix = native.decode(fmt.suffix_ids([{"role": "tool", "name": "add", "content": "5"}]))
    assert suffix == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def hangs(x: str) -> str:
    """Never returns until released.

    Args:
        x: anything.
    """
    RELEASE.wait()
    return x


RELEASE = threading.Event()


def raises(x: str) -> str:
    """Raises.

    Args:
        x: anything.
    """
    raise RuntimeError("broken tool")


def exits(x: str) -> str:
    """Exits its thread.

    Args:
        x: anything.
    """
    raise SystemExit(3)


def number(x: str) -> str:
    """Returns a number.

    Args:
        x: anything.
    """
    return 5  # type: ignore[return-value]


def huge(x: str) -> str:
    """Returns too much.

    Args:
        x: anything.
    """
    return "y" * 10_000


async def later(x: str) -> str:
    """An async tool.

    Args:
        x: anything.
    """
    await asyncio.sleep(0)
    return x.upper()


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def turn(tokenizer, call: dict) -> list[int]:
    """A completion whose turn calls ``call`` and ends with the EOS."""
    text = f"<tool_call>{json.dumps(call)}</tool_call>"
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


# A fault's call, its result as TRL's loop words it (None: no fault there, the result's text) and with
# strict_tool_calls.
FAULTS = {
    "raises": (
        {"name": "raises", "arguments": {"x": "a"}},
        "{'error': 'broken tool'}",
        "raised RuntimeError: broken tool",
    ),
    "kills its worker": ({"name": "exits", "arguments": {"x": "a"}}, "{'error': '3'}", "raised SystemExit"),
    "times out": (
        {"name": "hangs", "arguments": {"x": "a"}},
        "{'error': \"tool 'hangs' did not return within 5 seconds\"}",
        "did not return within 5 seconds",
    ),
    "returns a non-string": ({"name": "number", "arguments": {"x": "a"}}, None, "returned int, not a string"),
    "returns a huge result": (
        {"name": "huge", "arguments": {"x": "a"}},
        "returned 10000 characters, more than 4000",
        "returned 10000 characters, more than 4000",
    ),
    "is unknown": ({"name": "abacus", "arguments": {}}, "{'error': 'Tool abacus not found.'}", "unknown tool 'abacus'"),
    "has malformed arguments": (
        {"name": "add", "arguments": {"a": 1}},
        "{'error': \"add() missing 1 required positional argument: 'b'\"}",
        "missing ['b']",
    ),
    "has wrongly typed arguments": (
        {"name": "add", "arguments": {"a": "1", "b": 2}},
        "{'error': 'can only concatenate str (not \"int\") to str'}",
        "'a' of tool 'add' must be",
    ),
    "has an unknown argument": (
        {"name": "add", "arguments": {"a": 1, "b": 2, "c": 3}},
        "{'error': \"add() got an unexpected keyword argument 'c'\"}",
        "unknown ['c']",
    ),
}


@pytest.mark.parametrize("strict", [False, True], ids=["as TRL", "strict"])
@pytest.mark.parametrize("fault", FAULTS)
def test_every_fault_is_an_error_message_and_the_others_go_on(tokenizer, fault: str, strict: bool) -> None:
    """Row 0 meets the fault, row 1 calls a working tool in the same call: both rows go on, only row 0's call is
    counted as failed, and its result in the conversation is the error, worded as TRL's loop words it (a tool's
    non-string result is its text there, as in TRL's loop), or by fastgrpo with ``strict_tool_calls``, which checks
    a call's arguments against the tool before running it."""
    clock = FakeClock()
    tools = resolve_tools([add, raises, exits, hangs, number, huge, later])
    runner = ToolRunner(workers=2, timeout=5.0, clock=clock, strict=strict)
    turns = ToolTurns(tokenizer, ToolFormat(tokenizer, tools, strict), runner, rows=2, max_tokens=400)
    call, trl_message, strict_message = FAULTS[fault]
    assert turns.ended(0, turn(tokenizer, call))
    assert turns.ended(1, turn(tokenizer, {"name": "later", "arguments": {"x": "ok"}}))
    ready: dict[int, list[int] | None] = {}
    while len(ready) < 2:
        ready.update(turns.ready(block=False))
        if 1 in ready:  # the clock runs on once the working tool has returned: a hung call then times out
            clock.now += 1.0
        else:
            threading.Event().wait(0.001)
    assert all(tokens is not None for tokens in ready.values())
    content = turns.rows[0].messages[-1]["content"]
    if strict:
        assert strict_message in content and content.startswith("error: ")
    else:
        assert content == "5" if trl_message is None else trl_message in content
    assert turns.rows[1].messages[-1]["content"] == "OK"
    metrics = turns.metrics()
    failed = 0.0 if trl_message is None and not strict else 0.5
    assert metrics["tools/call_frequency"] == 1.0 and metrics["tools/failure_frequency"] == failed
    runner.close()


def test_a_result_that_leaves_no_room_is_rolled_back_and_iterations_are_bounded(tokenizer) -> None:
    tools = resolve_tools([add])
    runner = ToolRunner()
    completion = turn(tokenizer, {"name": "add", "arguments": {"a": 1, "b": 2}})
    short = ToolTurns(tokenizer, ToolFormat(tokenizer, tools), runner, rows=1, max_tokens=len(completion) + 5)
    assert short.ended(0, completion)
    assert short.ready(block=True) == [(0, None)]
    assert short.metrics()["tools/overlong"] == 1.0 and len(short.rows[0].messages) == 1
    bounded = ToolTurns(tokenizer, ToolFormat(tokenizer, tools), runner, rows=1, max_tokens=400, max_iterations=1)
    assert bounded.ended(0, completion)
    ((index, tokens),) = bounded.ready(block=True)
    assert tokenizer.decode(tokens) == "\n<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\n"
    assert not bounded.ended(0, completion + tokens + completion), "a second turn of calls is past the limit"
    none = ToolTurns(tokenizer, ToolFormat(tokenizer, tools), runner, rows=1, max_tokens=400, max_iterations=0)
    assert not none.ended(0, completion) and none.metrics()["tools/call_frequency"] == 0, "0: no call runs, as TRL"
    assert [m["role"] for m in bounded.rows[0].messages] == ["assistant", "tool", "assistant"]


def test_tool_results_are_masked_out_of_training() -> None:
    batch = build_batch([[1, 2], [3]], [[4, 5, 6, 7], [8, 9]], 0, torch.zeros(2), [[-1.0] * 4, [-1.0] * 2])
    mask_tool_results(batch, [[1, 0, 0, 1], [1, 1]])
    assert batch.completion_mask.tolist() == [[1, 0, 0, 1], [1, 1, 0, 0]]


def test_the_tools_example_config_shows_its_worked_calls(tokenizer, monkeypatch) -> None:
    """configs/tools.yaml (run from the repository's root, as the README says): valid, its rows load, and each prompt
    shows the four worked calls in the fallback format before its question."""
    from pathlib import Path

    from fastgrpo.config import load_config
    from fastgrpo.data import load_dataset
    from fastgrpo.grpo.tool_use import RunTools, resolve_run_tools

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)
    config = load_config(root / "configs" / "tools.yaml")
    config.validate()
    rows = load_dataset(config.dataset)
    assert len(rows) >= config.max_steps * 2
    run = RunTools(*resolve_run_tools(config, [], rows), tokenizer, config)
    messages, shown = run.render(rows[0])
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **shown)
    # the form and the example call of the system message, and the four worked calls
    assert text.count("<tool_call>{") == 6 and text.rstrip().endswith("<|im_start|>assistant")
    assert len(tokenizer(text)["input_ids"]) <= config.max_prompt_length
    run.close()


def test_a_call_the_template_reads_with_odd_types_is_an_error_message(tokenizer) -> None:
    """A template's parser may hand back a name that is not a string or arguments that are not an object: the call's
    result is an error, the step goes on."""
    tools = resolve_tools([add])
    fmt = ToolFormat(tokenizer, tools)
    odd = [{"type": "function", "function": {"name": ["add"], "arguments": None}}]
    fmt.parse = lambda turn, prefix, tools: {"role": "assistant", "content": "", "tool_calls": odd}
    turns = ToolTurns(tokenizer, fmt, ToolRunner(), rows=1, max_tokens=400)
    assert turns.ended(0, turn(tokenizer, {"name": "add", "arguments": {}}))
    ((_, tokens),) = turns.ready(block=True)
    assert (
        tokens is not None
        and "a call needs a tool name and an object of arguments" in turns.rows[0].messages[-1]["content"]
    )
    assert turns.metrics()["tools/failure_frequency"] == 1.0


class Slow:
    """An environment whose tool waits until released."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def reset(self, **row) -> None:
        pass

    def wait(self, x: str) -> str:
        """Wait.

        Args:
            x: anything.
        """
        self.release.wait(30)
        return x


def test_an_environment_whose_call_outlived_its_deadline_is_not_handed_out_again() -> None:
    from fastgrpo.tools.environments import Environments

    clock = FakeClock()
    runner = ToolRunner(timeout=5.0, clock=clock)
    environments = Environments(Slow)
    (first,) = environments.draw([None])
    tool = environments.bind(first, None)["wait"]
    runner.submit("k", tool, {"x": "a"})
    while runner._calls and runner._calls[0].started is None:  # a worker has taken it: its deadline runs
        threading.Event().wait(0.001)
    clock.now = 10.0
    (result,) = runner.results(block=True)
    assert result.failed and "did not return within 5 seconds" in result.content
    assert runner.busy_owners() == {id(first)}
    (second,) = environments.draw([None], busy=runner.busy_owners())
    assert second is not first and first not in environments.pool[None]
    first.release.set()
    while runner.busy_owners():
        threading.Event().wait(0.001)
    assert environments.draw([None], busy=runner.busy_owners()) == [second]


def trls_tool_loop(native, tool, prompt: list[int], first_turns: list[list[int]], generate, budget: int, turns: int):
    """TRL 1.16's ``_tool_call_loop`` on a stand-in trainer: the completions' first turns (``first_turns`` after
    ``prompt``) parsed as ``_generate`` does, at most ``turns`` turns of calls of ``tool``, ``generate`` giving the
    tokens after the results; returns the loop's ``(tool_mask, completions, completion_ids, ...)``."""
    from types import SimpleNamespace

    from trl import GRPOTrainer
    from trl.chat_template_utils import parse_response

    n = len(first_turns)
    trl_self = SimpleNamespace(
        max_tool_calling_iterations=turns,
        _sync_tool_dicts=[{tool.__name__: tool}] * n,
        _async_tool_dicts=[{}] * n,
        _is_vlm=False,
        chat_template=None,
        chat_template_kwargs={},
        processing_class=native,
        _tokenizer=native,
        use_vllm=False,
        vllm_mode="server",
        model=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=8192)),
        max_completion_length=budget,
        tools=[tool],
        environment_factories=None,
        async_loop=None,
    )
    trl_self._get_tool_suffix_ids = GRPOTrainer._get_tool_suffix_ids.__get__(trl_self)
    trl_self._generate_single_turn = generate
    trl_completions = [[parse_response(native, t, prefix=prompt, tools=[tool])] for t in first_turns]
    prompts = [[{"role": "user", "content": "What is 2 + 3?"}] for _ in range(n)]
    return GRPOTrainer._tool_call_loop(
        trl_self, prompts, [prompt] * n, [list(t) for t in first_turns], trl_completions, None, None, {}
    )


def test_a_turn_cut_by_the_budget_reaches_the_rewards_as_trls_loop_hands_it(native) -> None:
    """Three completions on the native Qwen2.5 template, the same tokens on both sides: one cut in its first turn,
    one cut after a tool's result, one that ends. fastgrpo's messages for the reward functions equal what TRL 1.16's
    ``_tool_call_loop`` hands them (run here with its generation replaced by the same tokens)."""
    tools = resolve_tools([add])
    fmt = ToolFormat(native, tools)
    messages, kwargs = fmt.conversation([{"role": "user", "content": "What is 2 + 3?"}])
    prompt = list(native.apply_chat_template(messages, add_generation_prompt=True, return_dict=False, **kwargs))

    def ids(text: str) -> list[int]:
        return native(text, add_special_tokens=False)["input_ids"]

    call = ids('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>')
    after_tool = {0: ids("The sum is"), 2: ids("The sum is 5.<|im_end|>")}
    first_turns = [call, ids("Let me think about"), call]
    budget = 64

    # fastgrpo: the engine's side of the turns, played by hand
    turns = ToolTurns(native, fmt, ToolRunner(), rows=3, max_tokens=budget)
    turns.prompt_ids = [prompt] * 3
    completions = [list(t) for t in first_turns]
    for row in (0, 2):
        assert turns.ended(row, completions[row])
    for row, tokens in turns.ready(block=True) + turns.ready(block=True):
        completions[row] += tokens + after_tool[row]
    assert not turns.ended(2, completions[2])
    ours = turns.messages(completions)

    # TRL 1.16: its first turns parsed as `_generate` does, then its tool loop, whose generation after the tools'
    # results gives the same tokens
    generated: list[list[list[int]]] = []

    def generate_single_turn(prompt_ids, images, fields, num_generations, has_tool_images=False):
        generated.append(prompt_ids)
        return [after_tool[0], after_tool[2]], None

    out = trls_tool_loop(native, add, prompt, first_turns, generate_single_turn, budget, turns=5)
    theirs, trl_ids = out[1], out[2]
    assert len(generated) == 1 and trl_ids == completions, "both sides hold the same tokens"
    assert ours == theirs
    assert [m["role"] for m in ours[0]] == ["assistant", "tool", "assistant"] and ours[0][-1]["content"] == "The sum is"
    assert ours[1] == [{"role": "assistant", "content": "Let me think about"}]


def half(a: int) -> float:
    """Half a number, as a float (transformers' own tool example returns a float).

    Args:
        a: the number.
    """
    return a / 2


def divide(a: int, b: int) -> float:
    """Divide two numbers.

    Args:
        a: the dividend.
        b: the divisor.
    """
    return a / b


def both_loops(native, tool, first_turns: list[list[int]], after_tool: list[list[int]], budget: int) -> tuple:
    """The same completions through fastgrpo's tool turns (the engine's side played by hand: each tool turn's
    tokens, then the row's ``after_tool`` tokens, all cut to ``budget``) and through TRL 1.16's ``_tool_call_loop``
    (its generation after the results replaced by the same tokens); each side's messages for the reward functions,
    completion ids and tool masks."""
    n = len(first_turns)
    fmt = ToolFormat(native, resolve_tools([tool]))
    messages, kwargs = fmt.conversation([{"role": "user", "content": "What is 2 + 3?"}])
    prompt = list(native.apply_chat_template(messages, add_generation_prompt=True, return_dict=False, **kwargs))
    turns = ToolTurns(native, fmt, ToolRunner(), rows=n, max_tokens=budget)
    turns.prompt_ids = [prompt] * n
    completions, masks = [list(t) for t in first_turns], [[1] * len(t) for t in first_turns]
    called = [row for row in range(n) if turns.ended(row, completions[row])]
    resumed = []
    while any(turns.rows[row].waiting for row in called):
        for row, tokens in turns.ready(block=True):
            if tokens is not None:
                resumed.append(row)
                more = after_tool[row][: max(0, budget - len(completions[row]) - len(tokens))]
                completions[row] += tokens + more
                masks[row] += [0] * len(tokens) + [1] * len(more)
    for row in resumed:  # a turn after the results, ended by its EOS, is read as the engine reads it
        if len(completions[row]) > turns.rows[row].turn_start and len(completions[row]) < budget:
            turns.ended(row, completions[row])
    ours = turns.messages(completions)

    def generate_single_turn(prompt_ids, images, fields, num_generations, has_tool_images=False):
        return [after_tool[row] for row in sorted(resumed)], None

    out = trls_tool_loop(native, tool, prompt, first_turns, generate_single_turn, budget, turns=1)
    return (ours, completions, masks), (out[1], out[2], out[0])


@pytest.mark.parametrize("case", ["float result", "malformed call", "raising tool", "results filling the budget"])
def test_tool_turns_give_what_trls_loop_gives(native, case: str) -> None:
    """A tool that returns a float (its text is the result), a malformed call (the turn is text: nothing runs), a
    tool that raises (``{'error': message}``), and results that exactly fill the completion's budget (kept, the
    completion ends with them): fastgrpo's messages, completion ids and tool masks equal TRL 1.16's loop's on the
    same tokens."""

    def ids(text: str) -> list[int]:
        return native(text, add_special_tokens=False)["input_ids"]

    tool, budget = half, 64
    call = ids('<tool_call>\n{"name": "half", "arguments": {"a": 5}}\n</tool_call><|im_end|>')
    after = [ids("The half is 2.5.<|im_end|>")]
    if case == "malformed call":
        call = ids('<tool_call>\n{"name": "half", "arguments": {"a": }\n</tool_call><|im_end|>')
    elif case == "raising tool":
        tool, call = (
            divide,
            ids('<tool_call>\n{"name": "divide", "arguments": {"a": 1, "b": 0}}\n</tool_call><|im_end|>'),
        )
    elif case == "results filling the budget":
        budget = len(call) + len(
            ToolFormat(native, resolve_tools([tool])).suffix_ids([{"role": "tool", "name": "half", "content": "2.5"}])
        )
    (ours, our_ids, our_masks), (theirs, trl_ids, trl_masks) = both_loops(native, tool, [call], after, budget)
    assert ours == theirs and our_ids == trl_ids and our_masks == trl_masks, (ours, theirs)
    if case == "float result":
        assert ours[0][1] == {"role": "tool", "name": "half", "content": "2.5"}
    elif case == "malformed call":
        assert ours[0] == [{"role": "assistant", "content": native.decode(call, skip_special_tokens=True)}]
    elif case == "raising tool":
        assert ours[0][1]["content"] == "{'error': 'division by zero'}"
    else:
        assert len(our_ids[0]) == budget and our_masks[0][-1] == 0 and ours[0][-1]["role"] == "tool"


_COUNTER = [0]


def bump() -> str:
    """Count one more call: the count so far, read, then written back a moment later (a race if two run at once)."""
    seen = _COUNTER[0]
    time.sleep(0.005)
    _COUNTER[0] = seen + 1
    return str(seen + 1)


_MEETING = threading.Barrier(2, timeout=10)


@concurrent
def meet() -> str:
    """Wait until a second call of this tool runs at the same time."""
    _MEETING.wait()
    return "met"


def calls_of(runner: ToolRunner, tool, count: int) -> list:
    """The results of ``count`` calls of ``tool`` (no arguments) submitted at once to ``runner``."""
    for key in range(count):
        runner.submit(key, tool, {})
    results = []
    while len(results) < count:
        results += runner.results(block=True)
    return results


def test_a_plain_tool_runs_one_call_at_a_time_unless_declared_concurrent() -> None:
    """Eight rows call a tool that keeps a count: each sees the calls before it (1 to 8, as TRL's loop gives), not
    the same count on every worker; a tool declared concurrent runs two calls at once."""
    runner = ToolRunner(workers=4, timeout=30.0)
    (counting,) = resolve_tools([bump])
    assert sorted(int(r.content) for r in calls_of(runner, counting, 8)) == list(range(1, 9))
    (meeting,) = resolve_tools([meet])
    assert [r.content for r in calls_of(runner, meeting, 2)] == ["met", "met"]
    runner.close()


_HELD = threading.Event()


def held() -> str:
    """Wait until the test lets it return."""
    _HELD.wait(30)
    return "done"


def test_a_call_waiting_behind_a_hung_call_of_its_tool_ends_at_its_deadline() -> None:
    """A plain tool whose first call hangs: that call times out, and the next one, waiting for it, ends with an
    error at its own deadline instead of waiting on; neither holds up the runner."""
    runner = ToolRunner(workers=4, timeout=0.2)
    (tool,) = resolve_tools([held])
    results = calls_of(runner, tool, 2)
    _HELD.set()
    assert all(r.failed for r in results)
    hung, waited = sorted(results, key=lambda r: "runs one call at a time" in r.content)  # either order
    late = "tool 'held' did not return within 0.2 seconds"
    assert hung.content == str({"error": late})
    assert waited.content == str({"error": f"{late}: it runs one call at a time, and an earlier call still ran"})
    runner.close()
