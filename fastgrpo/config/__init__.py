"""Training configuration: TRL's GRPOConfig option names, loaded from YAML and command-line overrides.

`GRPOConfig` (`fastgrpo.config.grpo`) holds every option of a run, `SpeculationConfig` and `DraftTrainConfig`
(`fastgrpo.config.speculation`) its nested sections; `fastgrpo.config.files` reads and writes them.
"""

from fastgrpo.config.files import (
    config_to_dict,
    load_config,
    option_rows,
    options_markdown,
    parse_overrides,
    yaml_value,
)
from fastgrpo.config.grpo import LOSS_TYPES, SCALE_REWARDS, GRPOConfig
from fastgrpo.config.speculation import (
    DRAFT_CONFIG,
    LR_SCHEDULERS,
    ControllerLimits,
    DraftTrainConfig,
    SpeculationConfig,
)

__all__ = [
    "DRAFT_CONFIG",
    "LOSS_TYPES",
    "LR_SCHEDULERS",
    "SCALE_REWARDS",
    "ControllerLimits",
    "DraftTrainConfig",
    "GRPOConfig",
    "SpeculationConfig",
    "config_to_dict",
    "load_config",
    "option_rows",
    "options_markdown",
    "parse_overrides",
    "yaml_value",
]
