"""TRL's ``callbacks`` on fastgrpo's trainer: transformers' `TrainerCallback` events that a GRPO loop has (init end,
train begin and end, step begin and end, log, evaluate, save), called through transformers' own `CallbackHandler`
with its `TrainerState` and `TrainerControl`. fastgrpo's loop logs, evaluates and saves on its own schedule
(``logging_steps``, ``eval_steps``, ``save_steps``), the part transformers' ``DefaultFlowCallback`` plays; a callback
that sets ``should_save``, ``should_evaluate`` or ``should_training_stop`` at a step's end gets a checkpoint, an
evaluation or the run's end (after a checkpoint) there."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import CallbackHandler, TrainerControl, TrainerState

from fastgrpo.config import GRPOConfig, config_to_dict
from fastgrpo.config.training_arguments import AT_DEFAULT


class LoopCallbacks(CallbackHandler):
    """transformers' `CallbackHandler` for a loop that plays ``DefaultFlowCallback``'s part itself (which
    transformers' constructor warns about when it is missing)."""

    def __init__(self, callbacks: Iterable[TrainerCallback | type]):
        self.callbacks: list[TrainerCallback] = []
        for callback in callbacks:
            self.add_callback(callback)
        self.train_dataloader = self.eval_dataloader = None


class CallbackArgs:
    """``args`` as a callback reads them: the run's `GRPOConfig`, and the ``TrainingArguments`` fields fastgrpo has no
    option for at the values it runs with (`fastgrpo.config.training_arguments.AT_DEFAULT`'s first)."""

    def __init__(self, config: GRPOConfig):
        self._config = config

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # not set yet (a copy being made): no option is private
            raise AttributeError(name)
        if name in AT_DEFAULT and not hasattr(self._config, name):
            return AT_DEFAULT[name][0][0]
        return getattr(self._config, name)

    def to_dict(self) -> dict[str, Any]:
        """The options as plain data, as ``TrainingArguments.to_dict`` gives a tracker's callback."""
        return config_to_dict(self._config)

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)


class TrlCallbacks:
    """The events of ``trainer``'s run (a `fastgrpo.grpo.trainer.GRPOTrainer`) for ``callbacks``: `begin` and `end`
    of a ``train()`` call, `step_begin` and `step_end` of each step (`step_end` says what the callbacks asked for),
    `logged`, `evaluated` and `saved`."""

    def __init__(self, callbacks: Iterable[TrainerCallback | type]):
        self.handler = LoopCallbacks(callbacks)
        self.args: CallbackArgs | None = None  # set by the first `bind`

    def bind(self, trainer: Any) -> TrlCallbacks:
        """Hand the callbacks ``trainer``'s model, tokenizer, optimizer and scheduler; the first time, its options and
        state, and ``on_init_end`` (a trainer built again to resume keeps its callbacks, which saw it once)."""
        self.handler.model, self.handler.processing_class = trainer.model, trainer.tokenizer
        self.handler.optimizer, self.handler.lr_scheduler = trainer.update.optimizer, trainer.update.scheduler
        if self.args is None:
            cfg = trainer.config
            self.args = CallbackArgs(cfg)
            self.state = TrainerState(
                max_steps=cfg.max_steps,
                logging_steps=cfg.logging_steps,
                eval_steps=cfg.eval_interval,
                save_steps=cfg.save_steps,
                train_batch_size=cfg.per_device_train_batch_size,
                is_local_process_zero=trainer.dist.is_main,
                is_world_process_zero=trainer.dist.is_main,
            )
            self.control = self.handler.on_init_end(self.args, self.state, TrainerControl())
        return self

    def unbind(self) -> None:
        """Let go of the trainer's model, tokenizer, optimizer and scheduler (before it is built again)."""
        self.handler.model = self.handler.processing_class = None
        self.handler.optimizer = self.handler.lr_scheduler = None

    def begin(self, step: int) -> None:
        self.state.global_step = step
        self.control = self.handler.on_train_begin(self.args, self.state, self.control)

    def step_begin(self) -> None:
        self.control = self.handler.on_step_begin(self.args, self.state, self.control)

    def step_end(self, metrics: dict[str, Any]) -> TrainerControl:
        """The step that logged ``metrics`` ended: the callbacks' ``control`` (its ``should_*`` flags) after
        ``on_step_end``."""
        self.state.global_step, self.state.epoch = int(metrics["step"]), metrics["epoch"]
        if "num_tokens" in metrics:  # logged by a step that generated
            self.state.num_input_tokens_seen = int(metrics["num_tokens"])
        self.control = self.handler.on_step_end(self.args, self.state, self.control)
        return self.control

    def logged(self, logs: dict[str, Any]) -> None:
        self.state.log_history.append(logs)
        self.control = self.handler.on_log(self.args, self.state, self.control, logs=logs)
        self.control.should_log = False

    def evaluated(self, metrics: dict[str, Any]) -> None:
        self.control = self.handler.on_evaluate(self.args, self.state, self.control, metrics=metrics)
        self.control.should_evaluate = False

    def saved(self) -> None:
        self.control = self.handler.on_save(self.args, self.state, self.control)
        self.control.should_save = False

    def end(self) -> None:
        self.control = self.handler.on_train_end(self.args, self.state, self.control)
