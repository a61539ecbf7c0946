"""Every command's options come from dataclasses, read by one parser: an option two commands share has one default
and one help text, and YAML files, ``--name value``, validation and ``--help`` work the same for every command."""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from pathlib import Path

import pytest
from conftest import save_tiny_llama

from fastgrpo.cli import main
from fastgrpo.config import COMMANDS, GenerateOptions, GRPOConfig, ProfileOptions, option_rows, parse_options


def help_defaults(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *argv: str) -> dict[str, str]:
    """``{option: default}`` of every ``--option V ... (default: X)`` row of ``fastgrpo ARGV --help``."""
    monkeypatch.setenv("COLUMNS", "400")
    with pytest.raises(SystemExit) as excinfo:
        main([*argv, "--help"])
    assert excinfo.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    pieces = re.split(r" --([\w.]+) V ", text)  # [preamble, name, help, name, help, ...]
    defaults = {}
    for name, help_ in zip(pieces[1::2], pieces[2::2], strict=True):
        start = help_.rindex("(default: ") + len("(default: ")
        defaults[name] = help_[start : help_.rindex(")")]
    return defaults


def test_generate_and_train_help_show_the_same_default_for_every_shared_option(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    train = help_defaults(capsys, monkeypatch, "train")
    generate = help_defaults(capsys, monkeypatch, "generate")
    profile = help_defaults(capsys, monkeypatch, "profile")
    assert set(train) == {name for name, *_ in option_rows()}
    for command in (generate, profile):
        shared = set(command) & set(train)
        assert {"model", "dtype", "device"} <= shared
        assert {name: command[name] for name in shared} == {name: train[name] for name in shared}
    assert {"temperature", "top_p", "top_k", "min_p", "max_prompt_length", "max_completion_length"} <= set(generate)
    assert {"num_generations", "seed"} <= set(generate) and {"compile", "speculation.draft"} <= set(profile)
    assert (generate["temperature"], generate["max_prompt_length"]) == ("1.0", "512")
    assert set(generate) - set(train) == {"prompt", "prompts_file", "output"}
    assert set(profile) - set(train) == {"tokens", "context_length", "repeats", "output"}
    for argv, own in ((("eval",), {"batch_size"}), (("draft", "train"), {"output", "batch_size", "greedy_fraction"})):
        options = help_defaults(capsys, monkeypatch, *argv)
        assert set(options) - set(train) == own and {k: options[k] for k in train} == train
    assert help_defaults(capsys, monkeypatch, "draft", "train")["output"] == "required"


def leaf_fields(cls: type, prefix: str = "") -> dict[str, dataclasses.Field]:
    """Every option field of ``cls``, nested ones dotted (``speculation.draft``)."""
    hints = typing.get_type_hints(cls)
    fields = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            fields |= leaf_fields(hints[f.name], f"{prefix}{f.name}.")
        else:
            fields[prefix + f.name] = f
    return fields


def test_a_shared_option_is_the_training_configs_field() -> None:
    """Same type, default and help; only generate's num_generations may be 1 (one completion is no group there)."""
    train = leaf_fields(GRPOConfig)
    for classes in COMMANDS.values():
        for cls in (cls for cls in classes if cls is not GRPOConfig):
            for name, f in leaf_fields(cls).items():
                if name in train:
                    source = train[name]
                    assert (f.type, f.default, f.metadata["help"]) == (
                        source.type,
                        source.default,
                        source.metadata["help"],
                    ), f"{cls.__name__}.{name}"
                    assert f.metadata == source.metadata or name == "num_generations", f"{cls.__name__}.{name}"
    assert GenerateOptions().num_generations == GRPOConfig().num_generations
    assert ProfileOptions().draft is None and ProfileOptions().compile == GRPOConfig().compile


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "--prompt", "hi", "--temperature", "-1"], "temperature must be >= 0, got -1"),
        (["generate", "--prompt", "hi", "--top_p", "0"], "top_p must be in (0, 1], got 0"),
        (["generate", "--prompt", "hi", "--dtype", "int8"], "dtype must be one of"),
        (["generate", "--prompt", "hi", "--max_prompt_length", "0"], "max_prompt_length must be >= 1, got 0"),
        (["generate", "--prompt", "hi", "--num_generations", "two"], "num_generations must be of type int, got 'two'"),
        (["generate", "--prompt", "hi", "--temprature", "1"], "unknown option temprature (did you mean temperature?)"),
        (["generate", "--prompt", "hi", "--learning_rate", "1"], "unknown option learning_rate"),
        (["profile", "--context_length", "1"], "context_length must be >= 2, got 1"),
        (["profile", "--repeats", "0"], "repeats must be >= 1, got 0"),
        (["profile", "--compile", "maybe"], "compile must be one of ['auto', 'on', 'off'], got 'maybe'"),
        (["profile", "--device", "tpu"], "device must be one of"),
        (["profile", "--tokens", "4,2"], "tokens must be increasing positive integers, got '4,2'"),
        (["profile", "--speculation.mode", "off"], "unknown option speculation.mode"),
        (["draft", "train", "--batch_size", "1"], "output is required"),
    ],
)
def test_generate_and_profile_refuse_a_bad_value_naming_the_option(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as excinfo:
        main(argv)
    assert excinfo.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_generate_reads_a_yaml_config_and_the_command_line_overrides_it(tmp_path: Path) -> None:
    config = tmp_path / "generate.yaml"
    config.write_text("prompt: ['What is 2 + 2?', 'Name: a colour']\ntemperature: 0\nnum_generations: 1\nseed: 7\n")
    (options,) = parse_options(COMMANDS["generate"], config, ["--seed", "3", "--max-new-tokens", "5"])
    assert options.prompt == ["What is 2 + 2?", "Name: a colour"]
    assert (options.temperature, options.num_generations, options.seed, options.max_completion_length) == (0, 1, 3, 5)
    assert options.max_prompt_length == GRPOConfig().max_prompt_length
    (options,) = parse_options(COMMANDS["generate"], config, ["--prompt", "Say: hi # now", "--prompt", "null"])
    assert options.prompt == ["Say: hi # now", "null"]  # text as typed, repeated --prompt kept in order
    config.write_text("temperature: hot\n")
    with pytest.raises(ValueError, match="temperature must be of type float, got 'hot'"):
        parse_options(COMMANDS["generate"], config, ["--prompt", "hi"])
    config.write_text("top_q: 0.5\n")
    with pytest.raises(ValueError, match=r"unknown option top_q \(did you mean top_p\?\)"):
        parse_options(COMMANDS["generate"], config, [])


def test_generate_runs_from_a_config_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    model = save_tiny_llama(tmp_path / "model", seed=0, tie_word_embeddings=True)
    config = tmp_path / "generate.yaml"
    config.write_text(f"model: {model}\nprompt: [hi, 'Question: 2 + 2?']\nmax_completion_length: 2\ndevice: cpu\n")
    out = tmp_path / "out.jsonl"
    main(["generate", "--config", str(config), "--num_generations", "2", "--output", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["prompt"][-1]["content"] for row in rows] == ["hi", "hi", "Question: 2 + 2?", "Question: 2 + 2?"]
    assert "8 tokens in" in capsys.readouterr().err


def test_profile_and_draft_train_keep_their_short_names() -> None:
    (options,) = parse_options(COMMANDS["profile"], None, ["--draft", ".", "--context-length", "16"])
    assert (options.speculation.draft, options.draft, options.context_length) == (".", ".", 16)
    extra, config = parse_options(COMMANDS["draft train"], None, ["--output", "d", "--draft-vocab-size", "64"])
    assert (extra.output, config.speculation.draft_vocab_size) == ("d", 64)
    extra, config = parse_options(COMMANDS["eval"], None, ["--batch-size", "4", "--temperature", "0"])
    assert (extra.batch_size, config.temperature) == (4, 0.0)
