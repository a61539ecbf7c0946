"""Training configuration: TRL's GRPOConfig option names, loaded from YAML and command-line overrides.

`GRPOConfig` (`fastgrpo.config.grpo`) holds every option of a run, `SpeculationConfig` and `DraftTrainConfig`
(`fastgrpo.config.speculation`) its nested sections; `fastgrpo.config.commands` the options of the other commands (the
ones they share with training are `GRPOConfig`'s fields); `fastgrpo.config.files` reads and writes them,
`fastgrpo.config.reference` documents them.
"""

from fastgrpo.config.commands import COMMANDS, DraftTrainOptions, EvalOptions, GenerateOptions, ProfileOptions
from fastgrpo.config.files import (
    build_options,
    config_to_dict,
    load_config,
    parse_options,
    parse_overrides,
    yaml_value,
)
from fastgrpo.config.grpo import (
    AGGREGATIONS,
    IMPORTANCE_SAMPLING_LEVELS,
    IMPORTANCE_SAMPLING_MODES,
    LOSS_TYPES,
    SCALE_REWARDS,
    GRPOConfig,
)
from fastgrpo.config.reference import option_rows, options_markdown
from fastgrpo.config.speculation import (
    LR_SCHEDULERS,
    ControllerLimits,
    DraftTrainConfig,
    SpeculationConfig,
)

__all__ = [
    "AGGREGATIONS",
    "COMMANDS",
    "IMPORTANCE_SAMPLING_LEVELS",
    "IMPORTANCE_SAMPLING_MODES",
    "LOSS_TYPES",
    "LR_SCHEDULERS",
    "SCALE_REWARDS",
    "ControllerLimits",
    "DraftTrainConfig",
    "DraftTrainOptions",
    "EvalOptions",
    "GRPOConfig",
    "GenerateOptions",
    "ProfileOptions",
    "SpeculationConfig",
    "build_options",
    "config_to_dict",
    "load_config",
    "option_rows",
    "options_markdown",
    "parse_options",
    "parse_overrides",
    "yaml_value",
]
