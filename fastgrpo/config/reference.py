"""The option reference, ``docs/options.md``, generated from the option dataclasses (``python -m fastgrpo.config``):
every command's options with their types, defaults and help, and the TRL options fastgrpo reads under other names or
refuses."""

from __future__ import annotations

import dataclasses
from typing import Any

from fastgrpo.config.files import yaml_value
from fastgrpo.config.grpo import GRPOConfig
from fastgrpo.config.training_arguments import IGNORED, READ
from fastgrpo.config.trl_names import TRL_REFUSED, VLLM_OPTIONS
from fastgrpo.config.trl_script import SCRIPT_AT_DEFAULT
from fastgrpo.rewards import TRL_SCRIPT_REWARDS


def option_rows(cls: type = GRPOConfig, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """``(name, type, default, help)`` of every option in declaration order, nested ones dotted
    (``dataset.name``); the default of a required option is ``dataclasses.MISSING``."""
    rows = []
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            rows += option_rows(type(default), f"{prefix}{f.name}.")
            continue
        help_ = f.metadata["help"]
        if "choices" in f.metadata:
            help_ += " (" + ", ".join(f"`{c}`" for c in f.metadata["choices"]) + ")"
        if "valid" in f.metadata:
            help_ += f"; valid: {f.metadata['valid']}"
        rows.append((prefix + f.name, str(f.type), default, help_))
    return rows


def command_option_rows(command: str) -> list[tuple[str, str, Any, str]]:
    """`option_rows` of every dataclass ``fastgrpo COMMAND`` reads (``draft train`` for the subcommand)."""
    from fastgrpo.config.commands import COMMANDS

    return [row for cls in COMMANDS[command] for row in option_rows(cls)]


def _table(rows: list[tuple[str, str, Any, str]]) -> list[str]:
    lines = ["| option | type | default | what it does |", "|---|---|---|---|"]
    for name, type_, default, help_ in rows:
        lines.append(f"| `{name}` | `{type_.replace(' | ', ' or ')}` | `{yaml_value(default)}` | {help_} |")
    return lines


def _trl_section() -> list[str]:
    """The page's section on TRL 1.16's ``GRPOConfig``: its names fastgrpo reads as its own, the metrics, and its
    options fastgrpo lacks (ignored at the values that change nothing, refused in one line at any other)."""
    lines = [
        "",
        "## TRL's GRPOConfig",
        "",
        "A TRL 1.16 config runs as it is where fastgrpo has its options (the table above: same names, defaults where",
        "the table does not say otherwise, same meaning). TRL's names "
        + ", ".join(f"`{a}`" for a in GRPOConfig.ALIASES)
        + " are read as "
        + ", ".join(f"`{n}`" for n in GRPOConfig.ALIASES.values())
        + " (one option, two names; TRL's default for the correction is true, fastgrpo's false, because its",
        "sampler shares the policy's weights). Reward functions are called as TRL calls them, with `trainer_state`",
        "(`global_step`, `max_steps`), `log_metric(name, value)` (averaged into the step's metrics) and",
        "`log_extra(column, values)` (printed with the sample completions); `async def` ones run concurrently.",
        "",
        "Metrics have TRL's definitions: `reward` and `reward_std` over the whole batch's scored completions (one no",
        "function scores has reward NaN, is left out of its group's mean and std and gets advantage 0),",
        "`frac_reward_zero_std` from the std that scales the advantages (with `scale_rewards: batch` the batch's: 0 or",
        "1); `clip_ratio/*` (with `low_min`, `high_max`), `cispo_clip_ratio`, `kl` and `entropy` over every completion",
        "the optimizer step trains (at sequence level empty ones included), the rows of advantage 0 that the update",
        "skips too (see `score_skipped_rows`); `sampling/*` over the generation. A generation's figures (rewards,",
        "`completions/*`, `num_tokens`, `rollout/*`, `sampling/*`) are logged by the step that made it, as TRL's; the",
        "steps that train on it after that log the update's. With `steps_per_generation` below",
        "`gradient_accumulation_steps` a step's generations are scored one by one, as TRL's, and dapo, cispo and vespo",
        "divide the step's loss by the tokens of all of them (TRL: each generation's by its own). The update's",
        "metrics are each micro-batch's (`per_device_train_batch_size` rows of the step's shuffled completions, all",
        "processes' together), averaged over the step, as TRL's (`accumulation_scope: step`: the step's at once).",
        "fastgrpo's own figures beside them: `group_reward_std` (the mean of the groups'",
        "stds) and `frac_group_zero_std` (the share of groups whose rewards do not vary, which teach nothing, whatever",
        "`scale_rewards` is).",
        "",
        "In-training evaluation reads TRL's and transformers' `eval_strategy` (`no`, `steps`), `eval_steps`,",
        "`num_generations_eval` and `per_device_eval_batch_size`; `eval_dataset` is a mapping of `dataset.*` options.",
        "Its metrics are `eval/reward`, `eval/reward_std`, `eval/frac_reward_zero_std`, `eval/rewards/<func>/mean` and",
        "`/std`, `eval/completions/*` and `eval/runtime` (TRL's `eval_*`), over all eval completions at once (TRL",
        "averages its eval batches' figures: the same with one batch); TRL's eval loss, `kl`, `entropy` and",
        "`clip_ratio/*` are not computed. Eval prompts are sampled as training samples, with noise of their own and",
        "without drafting, so that the training and the drafters' state are those of a run without evaluation.",
        "",
        "TRL's options and transformers' `TrainingArguments` fields that fastgrpo does not have: vLLM's (",
        ", ".join(f"`{k}`" for k in VLLM_OPTIONS) + ") are accepted at any value with one line saying that fastgrpo's",
        "own engine generates; " + ", ".join(f"`{k}`" for k in READ) + " set fastgrpo's options (`progress_bar`,",
        "`device`, `report_to`: `none` is `[jsonl]`, `importance_sampling_clip_max`); `generation_batch_size` (the",
        "completions of one generation over every process) sets `steps_per_generation`; "
        + ", ".join(f"`{k}`" for k in IGNORED),
        "configure machinery fastgrpo does not have and are accepted at any value; the others below are accepted",
        "at the values listed (they change nothing) and refused in one line at any other.",
        "",
        "| TRL option | accepted | why any other value is refused |",
        "|---|---|---|",
    ]
    for key, (accepted, reason) in TRL_REFUSED.items():
        ok = ", ".join(yaml_value(v) for v in accepted) if accepted else "(none)"
        lines.append(f"| `{key}` | {ok} | {reason} |")
    return lines


def _script_section() -> list[str]:
    """The page's section on configs written for TRL's ``trl grpo`` script (`fastgrpo.config.trl_script`)."""
    lines = [
        "",
        "## TRL's script configs",
        "",
        "A YAML file written for TRL's `trl grpo` script, with `ModelConfig`'s and `ScriptArguments`' keys beside",
        "`GRPOConfig`'s, runs with `fastgrpo train --config` as that script reads it: `model_name_or_path` is `model`;",
        "`dataset_name` (a local file, or a hub id where the hub is reachable), `dataset_config` and",
        "`dataset_train_split` are `dataset.name`, `dataset.config` and `dataset.split`, and `dataset_test_split` the",
        "split of `eval_dataset` where `eval_strategy` is `steps`; `reward_model_name_or_path` comes first among",
        "`reward_funcs`, whose names may be the script's (" + ", ".join(f"`{k}`" for k in TRL_SCRIPT_REWARDS) + ",",
        "from `trl.rewards`, the overlong punishment with the script's values) or dotted paths",
        "(`my_lib.rewards.custom_reward`). `dtype`, `use_peft` and `lora_*` are fastgrpo's own options. The others:",
        "",
        "| script key | accepted | why any other value is refused |",
        "|---|---|---|",
    ]
    for key, (accepted, reason) in SCRIPT_AT_DEFAULT.items():
        lines.append(f"| `{key}` | {', '.join(yaml_value(v) for v in accepted)} | {reason} |")
    return lines


def options_markdown() -> str:
    """The option reference, ``docs/options.md``: ``python -m fastgrpo.config > docs/options.md`` writes it."""
    from fastgrpo.config.commands import COMMANDS

    lines = [
        "# Options",
        "",
        "Every option of `fastgrpo train` (and of `eval` and `draft train`, which read the same config), as a YAML key",
        "(nested ones as mappings: `dataset: {name: gsm8k}`) or on the command line (`--learning_rate 1e-5`,",
        "`--dataset.name gsm8k`); the command line wins. Names follow TRL's `GRPOConfig` where TRL has the option.",
        "`generate` and `profile` take some of these options (the same default), and every command except `report`",
        "its own below, read the same way: from a YAML `--config` file and `--name value`.",
        "This page is generated from the option dataclasses by `python -m fastgrpo.config > docs/options.md`.",
        "",
        *_table(option_rows()),
        *_trl_section(),
        *_script_section(),
    ]
    train = {row[0]: row for row in option_rows()}
    for command, classes in COMMANDS.items():
        if classes == (GRPOConfig,):
            continue
        rows = command_option_rows(command)
        same = [name for name, *rest in rows if train.get(name) == (name, *rest)]
        if GRPOConfig in classes:
            intro = "Every option of `fastgrpo train`, and these of its own"
        else:
            intro = f"The options {', '.join(f'`{name}`' for name in same)} of `fastgrpo train`, and these"
        aliases = [f"`--{a}` for `--{n}`" for cls in classes for a, n in getattr(cls, "ALIASES", {}).items()]
        intro += f" ({'; '.join(aliases)} also works):" if aliases else ":"
        lines += ["", f"## fastgrpo {command}", "", intro, "", *_table([r for r in rows if r[0] not in same])]
    return "\n".join(lines) + "\n"
