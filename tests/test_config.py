"""Configuration: YAML and command-line overrides, validated with errors that name the option."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fastgrpo.cli import main
from fastgrpo.config import GRPOConfig, load_config, option_rows, options_markdown, parse_overrides


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def test_yaml_and_overrides_merge(tmp_path: Path) -> None:
    path = write(tmp_path, "learning_rate: 1.0e-5\ndataset:\n  name: arithmetic\n  digits: 2\n")
    config = load_config(path, ["--dataset.operands", "3", "--max_steps=7", "--reward_funcs", "format"])
    assert config.learning_rate == 1e-5
    assert (config.dataset.digits, config.dataset.operands) == (2, 3)
    assert config.max_steps == 7
    assert config.reward_funcs == ["format"]


def test_int_is_accepted_for_float_options() -> None:
    assert load_config(None, ["--learning_rate", "1"]).learning_rate == 1.0


def test_exponent_without_decimal_point_is_a_float(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "learning_rate: 1e-5\n"), ["--draft_training.learning_rate", "5e-4"])
    assert (config.learning_rate, config.draft_training.learning_rate) == (1e-5, 5e-4)


def test_parse_overrides_nests_dotted_keys() -> None:
    assert parse_overrides(["--a.b", "2", "--c=x", "--use-peft", "true"]) == {"a": {"b": 2}, "c": "x", "use_peft": True}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--learnig_rate", "1e-5"], "unknown option learnig_rate (did you mean learning_rate?)"),
        (["--dataset.digitz", "2"], "unknown option dataset.digitz (did you mean dataset.digits?)"),
        (
            ["--loss_type", "ppo"],
            "loss_type must be one of ['grpo', 'bnpo', 'dr_grpo', 'dapo', 'cispo', 'sapo'], got 'ppo'",
        ),
        (["--scale_rewards", "rank"], "scale_rewards must be one of"),
        (["--max_steps", "ten"], "max_steps must be of type int, got 'ten'"),
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--top_p", "0"], "top_p must be in (0, 1]"),
        (["--cpu_threads", "-1"], "cpu_threads must be >= 0, got -1"),
        (["--adam_beta1", "1.0"], "adam_beta1 must be in [0, 1), got 1.0"),
        (["--adam_beta2", "-0.1"], "adam_beta2 must be in [0, 1), got -0.1"),
        (["--lora_r", "0"], "lora_r must be >= 1, got 0"),
        (["--lora_dropout", "1"], "lora_dropout must be in [0, 1), got 1"),
        (["--weight_decay", "-1"], "weight_decay must be >= 0, got -1"),
        (["--seed", "-1"], "seed must be in [0, 9223372036854775808), got -1"),
        (["--seed", str(2**64)], "seed must be in [0, 9223372036854775808)"),
        (["--log_completions_steps", "0"], "log_completions_steps must be >= 1, got 0"),
        (["--num_completions_to_print", "-1"], "num_completions_to_print must be >= 0, got -1"),
        (["--output_dir", ""], "output_dir must name a directory"),
        (["--speculation.nodes", "5000"], "speculation.nodes must be in [1, 256], got 5000"),
        (["--speculation.depth", "0"], "speculation.depth must be in [1, 32], got 0"),
        (["--num_generations", "3"], "must be a multiple of num_generations (3)"),
        (["--reward_funcs", "nope"], "nope"),
        (["--reward_weights", "[1.0, 2.0]"], "reward_weights has 2 entries but reward_funcs has 1"),
        (["--dataset.digits", "0"], "dataset.digits"),
        (["--dataset", "gsm8k"], "dataset must be a mapping of options"),
        (["--speculation.mode", "fast"], "speculation.mode must be one of ['off', 'static', 'paper', 'adaptive']"),
        (["--speculation.c_peak", "many"], "speculation.c_peak must be 'auto' or an integer >= 1, got 'many'"),
        (["--speculation.c_peak", "0"], "speculation.c_peak must be 'auto' or an integer >= 1, got 0"),
        (["--speculation.l_min", "6"], "speculation.l_max must be >= speculation.l_min"),
        (["--speculation.alpha", "1.5"], "speculation.alpha must be in (0, 1]"),
        (["--draft_training.unroll", "0"], "draft_training.unroll must be > 0, got 0"),
        (["--draft_training.lr_scheduler_type", "step"], "draft_training.lr_scheduler_type must be one of"),
        (["--draft_training.warmup_ratio", "2"], "draft_training.warmup_ratio must be in [0, 1], got 2"),
    ],
)
def test_invalid_options_name_the_option(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        load_config(None, overrides)
    assert message in str(excinfo.value)


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_config(tmp_path / "absent.yaml")


def test_cli_reports_bad_option_before_loading_a_model(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as excinfo:
        main(["train", "--loss_type", "ppo"])
    assert excinfo.value.code == 2
    assert "loss_type must be one of" in capsys.readouterr().err


def test_default_config_file_is_valid() -> None:
    config = load_config(Path(__file__).parents[1] / "configs" / "default.yaml")
    assert config.model == "smollm2"
    assert config.prompts_per_step * config.num_generations == config.generation_batch_size == 16
    assert isinstance(config, GRPOConfig)


def test_speculation_defaults_to_the_adaptive_controller_and_accepts_a_fixed_c_peak() -> None:
    assert GRPOConfig().speculation.mode == "adaptive"
    assert GRPOConfig().speculation.c_peak == "auto"
    config = load_config(None, ["--speculation.mode", "paper", "--speculation.c_peak", "24"])
    assert config.speculation.c_peak == 24


def test_cli_profile_rejects_bad_token_counts_before_loading_a_model(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as excinfo:
        main(["profile", "--model", "no/such-model", "--tokens", "8,4"])
    assert excinfo.value.code == 2
    assert "tokens must be increasing positive integers" in capsys.readouterr().err


def test_every_option_is_documented_and_the_reference_is_current() -> None:
    """Each option carries help text; docs/options.md is what `python -m fastgrpo.config` writes (regenerate it when
    an option changes)."""
    rows = option_rows()
    assert len(rows) > 60 and all(help_.strip() for *_, help_ in rows)
    assert "dataset.digits" in {name for name, *_ in rows} and "speculation.mode" in {name for name, *_ in rows}
    reference = Path(__file__).resolve().parent.parent / "docs" / "options.md"
    assert reference.read_text() == options_markdown()


def test_help_imports_neither_torch_nor_transformers() -> None:
    """`fastgrpo --help` answers at once: the command line imports the libraries only in the commands that use them."""
    code = (
        "import sys\nfrom fastgrpo.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "usage: fastgrpo" in out and out.strip().endswith("[]")


def test_subcommand_help_lists_every_option_with_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "override" in text and "--batch_size V prompts generated at once" in text and "(default: 32)" in text
    for name, *_ in option_rows():
        assert f"--{name} V" in text
    assert "--learning_rate V AdamW learning rate of the policy; valid: > 0 (default: 1.0e-06)" in text
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "(default: 256)" in " ".join(capsys.readouterr().out.split())


def test_profile_help_shows_the_profilers_default_token_counts() -> None:
    from fastgrpo.config.commands import PROFILE_TOKENS, ProfileOptions
    from fastgrpo.speculative import profiler

    assert ",".join(map(str, profiler.DEFAULT_TOKENS)) == PROFILE_TOKENS == ProfileOptions().tokens
