"""Configuration: YAML and command-line overrides, validated with errors that name the option."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
from conftest import save_tiny_llama, save_tiny_scorer
from test_bad_inputs import refused

from fastgrpo.cli import main
from fastgrpo.config import (
    COMMANDS,
    GRPOConfig,
    build_options,
    config_to_dict,
    load_config,
    option_rows,
    options_markdown,
    parse_options,
    parse_overrides,
)
from fastgrpo.config.files import build_config, read_options
from fastgrpo.config.trl_names import trl_refusal
from fastgrpo.data import DataConfig


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
            "loss_type must be one of ['grpo', 'bnpo', 'dr_grpo', 'dapo', 'cispo', 'sapo', 'luspo', 'vespo'], "
            "got 'ppo'",
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
    assert config.prompts_per_generation * config.num_generations == config.generation_batch_size == 16
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
    assert "(default: 512)" in " ".join(capsys.readouterr().out.split())


def test_profile_help_shows_the_profilers_default_token_counts() -> None:
    from fastgrpo.config.commands import PROFILE_TOKENS, ProfileOptions
    from fastgrpo.speculative import profiler

    assert ",".join(map(str, profiler.DEFAULT_TOKENS)) == PROFILE_TOKENS == ProfileOptions().tokens


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("learning_rate: 1.0e-5\nmax_steps: 3\nlearning_rate: 1e-4\n", "learning_rate appears twice, on lines 1 and 3"),
        ("speculation:\n  mode: off\n  nodes: 4\n  mode: static\n", "speculation.mode appears twice, on lines 2 and 4"),
        ("speculation:\n  mode: off\nmax_steps: 3\nspeculation:\n  mode: static\n", "speculation appears twice, on "
         "lines 1 and 4"),
        ("stop:\n  - {a: 1, a: 2}\n", "stop[0].a appears twice, on line 2"),
    ],
)  # fmt: skip
def test_a_key_given_twice_in_a_config_file_is_refused(tmp_path: Path, text: str, message: str) -> None:
    """YAML forbids a key twice in a mapping; PyYAML would keep the last value without a word."""
    path = write(tmp_path, text)
    for command in ("train", "eval", "draft train"):
        with pytest.raises(ValueError) as excinfo:
            parse_options(COMMANDS[command], path, ["--output", "d"] if command == "draft train" else [])
        assert str(excinfo.value) == f"{path}: {message}"


def test_the_same_key_in_different_mappings_is_no_duplicate(tmp_path: Path) -> None:
    text = "seed: 3\ndataset:\n  seed: 4\nbase: &b {mode: off}\n"
    assert load_config(write(tmp_path, text.replace("base: &b {mode: off}\n", "")), []).dataset.seed == 4
    assert read_options(write(tmp_path, text + "speculation:\n  <<: *b\n  mode: static\n"))["speculation"] == {
        "mode": "static"
    }


def test_tilde_is_expanded_in_every_path_option(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every option naming a file or directory, of every command, holds the expanded path (config.yaml records it),
    and so does --config."""
    monkeypatch.setenv("HOME", str(tmp_path))
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (tmp_path / "data.jsonl").write_text('{"prompt": "2 + 2?", "answer": "4"}\n')
    (tmp_path / "c.yaml").write_text("model: ~/m\noutput_dir: ~/run\ndataset: {name: ~/data.jsonl}\n")
    config = load_config("~/c.yaml", ["--speculation.draft", "~/draft"])
    assert (config.model, config.output_dir) == (str(model), str(tmp_path / "run"))
    assert (config.dataset.name, config.speculation.draft) == (str(tmp_path / "data.jsonl"), str(tmp_path / "draft"))
    assert config_to_dict(config)["output_dir"] == str(tmp_path / "run")
    preset = load_config(None, ["--dataset.name", "gsm8k", "--dataset.path", "~/data.jsonl"]).dataset
    assert preset.path == str(tmp_path / "data.jsonl")
    (generate,) = parse_options(
        COMMANDS["generate"], None, ["--model", "~/m", "--prompts_file", "~/p", "--output", "~/o"]
    )
    assert (generate.model, generate.prompts_file, generate.output) == tuple(str(tmp_path / n) for n in "mpo")
    (profile,) = parse_options(COMMANDS["profile"], None, ["--output", "~/p.json", "--draft", "~"])
    assert (profile.output, profile.draft) == (str(tmp_path / "p.json"), None)  # a bare ~ is YAML's null
    draft, _ = parse_options(COMMANDS["draft train"], None, ["--output", "~/d"])
    assert draft.output == str(tmp_path / "d")
    assert load_config(None, ["--dataset.name", "someone/data", "--model", "org/model"]).dataset.name == "someone/data"


def test_options_that_do_not_apply_are_refused_only_where_given(tmp_path: Path) -> None:
    """dataset.split for a local file, the arithmetic generator's options for another dataset: refused when the user
    sets them (on the command line or in the file), not for their defaults, nor for eval's default test split."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "2 + 2?", "answer": "4"}\n')
    with pytest.raises(ValueError, match=f"dataset.split applies to .*not to the local file {data}, whose rows"):
        parse_options(COMMANDS["eval"], None, ["--dataset.name", str(data), "--dataset.split", "test"])
    with pytest.raises(ValueError, match="dataset.num_examples applies to the arithmetic generator only, not to the "):
        load_config(write(tmp_path, "dataset:\n  num_examples: 256\n"), ["--dataset.name", str(data)])
    with pytest.raises(ValueError, match="dataset.operators applies"):
        load_config(None, ["--dataset.name", "gsm8k", "--dataset.operators", "+-"])
    assert load_config(None, ["--dataset.name", str(data)]).dataset.split == "train"
    assert load_config(None, ["--dataset.name", "gsm8k", "--dataset.split", "test"]).dataset.split == "test"
    built = build_config({"dataset": {"name": str(data)}}, defaults={"dataset": {"split": "test", "digits": 2}})
    assert built.dataset.name == str(data)
    _, config = build_options(COMMANDS["eval"], {"dataset": {"digits": 2}}, {"dataset": {"split": "test"}})
    assert (config.dataset.split, config.dataset.digits) == ("test", 2)


def test_draft_options_are_refused_where_no_draft_learns_them() -> None:
    """draft_training.* set with the suffix drafter alone or speculation off: refused (by the trainer, its dry run
    and the TRL plug-in), as no draft network learns; read where the drafters include EAGLE, and by draft train
    (which trains the EAGLE head whatever speculation.drafter names, and does not check)."""
    from fastgrpo.speculative.registry import check_draft_training

    suffix = ["--speculation.mode", "static", "--speculation.drafter", "suffix"]
    config = load_config(None, [*suffix, "--draft_training.epochs", "2", "--draft_training.unroll", "2"])
    with pytest.raises(ValueError, match=r"draft_training.epochs \(2\), draft_training.unroll \(2\): no effect with "):
        check_draft_training(config.speculation, config.draft_training)
    config = load_config(None, ["--speculation.mode", "off", "--draft_training.online", "false"])
    with pytest.raises(ValueError, match=r"draft_training.online \(False\): no effect with speculation.mode: off"):
        check_draft_training(config.speculation, config.draft_training)
    for options in (suffix, ["--speculation.drafter", "suffix+eagle", "--draft_training.epochs", "2"]):
        config = load_config(None, options)
        check_draft_training(config.speculation, config.draft_training)
    _, config = parse_options(COMMANDS["draft train"], None, [*suffix, "--draft_training.epochs", "2", "--output", "d"])
    assert config.draft_training.epochs == 2


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama of a 2048-token context, saved with its tokenizer."""
    from conftest import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", seed=0, tie_word_embeddings=True)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--temperature", "0"], "temperature: 0 samples greedily"),
        (["--max_completion_length", "2000"], "max_completion_length: prompts of up to max_prompt_length (512) tokens"),
        (["--speculation.mode", "off", "--speculation.drafter", "medusa"], "speculation.drafter must be one of ["),
    ],
)
def test_the_dry_run_refuses_what_training_refuses(
    options: list[str],
    message: str,
    tiny_model_dir: Path,
    capsys: pytest.CaptureFixture[str],
    no_model_loads: None,
) -> None:
    assert message in refused(capsys, "train", "--dry-run", "--model", str(tiny_model_dir), *options)


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--prompt", "hi", "--max_completion_length", "100000000"],
        ["generate", "--prompt", "hi", "--max_prompt_length", "2000", "--max-new-tokens", "100"],
        ["eval", "--max_completion_length", "1537"],
    ],
)
def test_generate_and_eval_refuse_sequences_beyond_the_context(
    argv: list[str], tiny_model_dir: Path, capsys: pytest.CaptureFixture[str], no_model_loads: None
) -> None:
    err = refused(capsys, *argv, "--model", str(tiny_model_dir))
    assert "max_completion_length: prompts of up to max_prompt_length" in err
    assert "exceed the model's context of 2048 tokens (max_position_embeddings)" in err


def test_the_context_of_a_lora_checkpoint_is_its_base_models(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A LoRA run's checkpoint holds the adapter alone; its context is the base model's."""
    from fastgrpo.memory_plan.fitting import read_model_config

    (tmp_path / "adapter_config.json").write_text(f'{{"base_model_name_or_path": "{tiny_model_dir}"}}')
    assert read_model_config(str(tmp_path)).max_position_embeddings == 2048
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(ValueError, match="adapter_config.json names no base model"):
        read_model_config(str(tmp_path))


# -- TRL's GRPOConfig -------------------------------------------------------------------------------------------------

TRL_EXAMPLE = Path(__file__).resolve().parent.parent / "configs" / "trl_example.yaml"


def test_trls_names_are_fastgrpos_options_from_yaml_the_command_line_and_the_constructor() -> None:
    config = load_config(TRL_EXAMPLE, ["--vllm_importance_sampling_clip_max", "2.5"])
    assert config.importance_sampling_correction and config.importance_sampling_mode == "sequence_mask"
    assert config.importance_sampling_clip_max == 2.5 == config.vllm_importance_sampling_clip_max
    assert config.top_entropy_quantile == 0.2 and config.use_bias_correction_kl
    assert config.chat_template_kwargs == {"enable_thinking": False} and config.disable_dropout
    made = GRPOConfig(vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_min=0.5)
    assert made.importance_sampling_mode == "token_mask" and made.importance_sampling_clip_min == 0.5
    with pytest.raises(ValueError, match="--vllm_importance_sampling_mode and --importance_sampling_mode are one"):
        load_config(None, ["--vllm_importance_sampling_mode", "token_mask", "--importance_sampling_mode", "token_mask"])


def test_trl_options_fastgrpo_lacks_are_refused_one_line_each(capsys: pytest.CaptureFixture[str]) -> None:
    """At TRL's values that change nothing they are accepted (the example holds some); at any other, each is named in
    a line of its own saying what fastgrpo does instead, before any model loads."""
    argv = ["train", "--config", str(TRL_EXAMPLE), "--optim", "sgd", "--repetition_penalty", "1.1"]
    lines = refused(capsys, *argv, "--sync_ref_model", "true", "--vllm_mode", "server").strip().splitlines()
    assert len(lines) == 3, lines
    for key, why in [
        ("optim", "torch's AdamW"),
        ("repetition_penalty", "refused rather than made lossy"),
        ("sync_ref_model", "the reference model stays the initial policy"),
    ]:
        assert any(key in line and why in line for line in lines), (key, lines)
    assert "push them with huggingface_hub" in refused(capsys, *argv[:3], "--push_to_hub", "true")
    hub_model = "OpenAssistant/reward-model-deberta-v3-large-v2"  # a reward model, loaded with the policy
    assert load_config(None, ["--reward_funcs", f"[accuracy, {hub_model}]"]).reward_funcs[1] == hub_model


def test_a_trl_scripts_training_arguments_are_read_as_trl_reads_them(caplog: pytest.LogCaptureFixture) -> None:
    """TRL's and transformers' options fastgrpo has no option of its own for: vLLM's accepted with one line (fastgrpo's
    engine generates), those nothing reads dropped, those fastgrpo reads under its own names read, the others
    accepted at values that change nothing and refused otherwise; from the constructor and the command line alike.
    Every ``TrainingArguments`` field is one of these or an option of fastgrpo's."""
    import dataclasses

    from transformers import TrainingArguments

    from fastgrpo.config.training_arguments import IGNORED, READ
    from fastgrpo.config.trl_names import TRL_ALIASES, TRL_REFUSED, VLLM_OPTIONS

    script = dict(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3, report_to="none")
    script |= dict(disable_tqdm=True, dataloader_num_workers=4, remove_unused_columns=False, num_train_epochs=1)
    script |= dict(max_steps=8, optim="adamw_torch_fused", adam_epsilon=1e-6, warmup_steps=0.25, push_to_hub=False)
    script |= dict(vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="token_truncate")
    script |= dict(vllm_importance_sampling_cap=2.0, logging_strategy="steps", gradient_checkpointing_kwargs=None)
    with caplog.at_level("WARNING"):
        made = GRPOConfig(**script)
    assert "use_vllm, vllm_mode, vllm_gpu_memory_utilization: fastgrpo samples with its own" in caplog.text
    cli = load_config(None, [f"--{k}={'null' if v is None else v}" for k, v in script.items()])
    for config in (made, cli):
        assert config.report_to == ["jsonl"] and not config.progress_bar and config.adam_epsilon == 1e-6
        assert config.importance_sampling_clip_max == 2.0 and config.warmup_optimizer_steps == 2
    for values, message in [
        ({"num_train_epochs": 0}, "num_train_epochs must be above 0 with max_steps -1"),
        ({"max_steps": 0}, "max_steps must be a positive number of optimizer steps, or -1"),
        ({"steps_per_generation": 3, "gradient_accumulation_steps": 2}, "must be a multiple or a divisor of gradient"),
        (
            {"steps_per_generation": 1, "gradient_accumulation_steps": 2, "num_iterations": 2},
            "num_iterations (2) with steps_per_generation (1) below gradient_accumulation_steps (2)",
        ),
        ({"generation_batch_size": 12}, "generation_batch_size (12) must be a multiple of per_device_train_batch_size"),
        ({"generation_batch_size": 16, "steps_per_generation": 2}, "generation_batch_size and steps_per_generation"),
        ({"save_strategy": "no", "fp16": True}, "save_strategy: checkpoints are written every save_steps"),
        ({"warmup_steps": 3, "warmup_ratio": 0.1}, "warmup_steps and warmup_ratio both set the warmup"),
        ({"disable_tqdm": True, "progress_bar": True}, "disable_tqdm and progress_bar set one option"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            GRPOConfig(**values).validate()
    known = {f.name for f in dataclasses.fields(GRPOConfig)} | set(TRL_ALIASES) | set(TRL_REFUSED)
    known |= set(IGNORED) | set(READ) | set(VLLM_OPTIONS)
    assert not [f.name for f in dataclasses.fields(TrainingArguments) if f.name not in known]


def test_the_trl_example_config_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """configs/trl_example.yaml trains as it is (only sized down to a tiny model and step here), its second reward
    function a reward model as a TRL user names one (a model's directory), and the step's metrics hold TRL's
    figures. The command frees its trainer before it destroys the process group (`distributed.shutdown`)."""
    from fastgrpo import distributed
    from fastgrpo.grpo.trainer import GRPOTrainer

    trainers, alive_at_shutdown = [], []
    init, shutdown = GRPOTrainer.__init__, distributed.shutdown
    monkeypatch.setattr(
        GRPOTrainer, "__init__", lambda self, *a, **k: trainers.append(weakref.ref(self)) or init(self, *a, **k)
    )
    monkeypatch.setattr(
        distributed, "shutdown", lambda: alive_at_shutdown.extend(t for t in trainers if t()) or shutdown()
    )
    model_dir = save_tiny_llama(tmp_path / "tiny", seed=0, tie_word_embeddings=True)
    scorer = save_tiny_scorer(tmp_path / "scorer")
    out = tmp_path / "run"
    sizes = {"model": str(model_dir), "max_steps": 1, "save_steps": 1, "output_dir": str(out), "progress_bar": False}
    sizes |= {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 1, "steps_per_generation": 1}
    sizes |= {"num_generations": 4, "max_completion_length": 8, "log_completions": False}
    sizes["mask_truncated_completions"] = False  # a random tiny model's 8 tokens are all cut: none would be trained
    sizes["reward_funcs"] = f"[accuracy, {scorer}]"
    main(["train", "--config", str(TRL_EXAMPLE), *[f"--{k}={v}" for k, v in sizes.items()]])
    metrics = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    for name in ("reward_std", "frac_group_zero_std", "clip_ratio/low_min", "clip_ratio/high_max", "entropy"):
        assert math.isfinite(metrics[name]), name
    assert "sampling/importance_sampling_ratio/mean" in metrics
    assert math.isfinite(metrics["rewards/scorer/mean"]) and metrics["rewards/scorer/std"] > 0
    assert len(trainers) == 1 and not alive_at_shutdown, "the trainer was freed before the group was destroyed"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"eval_strategy": "steps"}, "eval_strategy: steps evaluates on eval_dataset, which is not set"),
        ({"eval_dataset": {"split": "test"}}, "eval_dataset is set but eval_strategy is no"),
        ({"eval_strategy": "epoch"}, "eval_strategy: epoch is not supported"),
        ({"eval_strategy": "steps", "eval_dataset": {"limit": 0}}, "eval_dataset.limit must be None or >= 1"),
        ({"eval_strategy": "steps", "eval_dataset": {"name": "x.jsonl", "digits": 2}}, "eval_dataset.digits applies"),
        ({"eval_strategy": "steps", "eval_dataset": {"split": "test"}, "eval_steps": 2.5}, "must be an integer"),
        ({"num_generations_eval": 0}, "num_generations_eval must be >= 1"),
        ({"eval_dataset": 3}, "eval_dataset must be a mapping of options"),
    ],
)
def test_bad_evaluation_options_are_refused_naming_them(values: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        build_config(values)


def test_evaluation_options_read_as_transformers_reads_them() -> None:
    (config,) = parse_options(
        (GRPOConfig,), None, ["--eval_strategy", "steps", "--eval_dataset.split", "test", "--max_steps", "10"]
    )
    assert config.eval_dataset == DataConfig(split="test") and config.eval_interval == config.logging_steps
    config.eval_steps = 0.25  # a share of max_steps, rounded up
    assert config.eval_interval == 3
    assert [s for s in range(1, 11) if config.evaluates_at(s)] == [3, 6, 9, 10]  # and after the last step
    assert trl_refusal("num_generations_eval", 4) is None
