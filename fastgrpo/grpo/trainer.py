"""The GRPO training loop: rollout with the batched engine, rewards, group advantages, clipped policy update."""

from __future__ import annotations

import logging
import math
import random
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fastgrpo import distributed
from fastgrpo.config import GRPOConfig, config_to_dict
from fastgrpo.data import load_dataset
from fastgrpo.device_memory import peak_memory_mb, peak_reserved_mb, reset_peak_memory, synchronized
from fastgrpo.grpo.checkpoint import latest_checkpoint, prepare_output_dir, save_checkpoint
from fastgrpo.grpo.evaluation import evaluate, evaluation_rows
from fastgrpo.grpo.generation import Generation, generate, merge, prepare
from fastgrpo.grpo.pipeline import RolloutFeed
from fastgrpo.grpo.policy import disable_dropout, reference_model, wrap_lora
from fastgrpo.grpo.policy_update import NonFiniteUpdate, PolicyUpdate
from fastgrpo.grpo.prompts import StepPrompts
from fastgrpo.grpo.restore import restore_run
from fastgrpo.grpo.resume_checks import check_resumed
from fastgrpo.grpo.rollout_process import RolloutProcess
from fastgrpo.grpo.run_dir import (
    DirectoryLock,
    check_disk_space,
    check_output_dir,
    checkpoint_bytes,
    checkpoints_written,
)
from fastgrpo.grpo.run_log import RunLog, logged_record
from fastgrpo.grpo.tool_use import RunTools, ToolTurns, resolve_run_tools, rollout_prompts
from fastgrpo.grpo.trl_callbacks import TrlCallbacks
from fastgrpo.grpo.trl_form import FastgrpoArguments, TrlTrainerMethods, train_summary, trl_call
from fastgrpo.grpo.weight_sync import check_same_parameters, gathered_dtype
from fastgrpo.memory_plan.fitting import check_training_options, plan_for_trainer, read_model_config
from fastgrpo.models import (
    check_cache_dir,
    check_tokenizer_files,
    eos_token_ids,
    load_model,
    load_tokenizer,
    load_weights_into,
    resolve_model_path,
    warn_if_bf16_emulated,
)
from fastgrpo.precision import tf32_matmuls
from fastgrpo.reward_model import load_reward_models
from fastgrpo.rewards import check_columns, resolve_reward_funcs
from fastgrpo.rollout.compiled import compile_backend
from fastgrpo.rollout.sequence import GenerationOutput
from fastgrpo.speculative.registry import check_draft_training, check_speculation, check_tools
from fastgrpo.threads import ThreadGovernor
from fastgrpo.training_rollouts import TrainingRollouts

logger = logging.getLogger(__name__)


class GRPOTrainer(TrlTrainerMethods):
    """Trains ``config.model`` (a validated `GRPOConfig`) with GRPO on ``config.dataset``; ``model``, ``tokenizer``:
    already loaded (else loaded from ``config.model``); ``dataset``, ``eval_dataset``: rows (else read from the config).
    Or TRL's form, ``GRPOTrainer(model, reward_funcs, args=GRPOConfig(...), train_dataset=...)`` (`trl_form`)."""

    def __init__(
        self,
        config: GRPOConfig | str | PreTrainedModel | None = None,
        model: PreTrainedModel | Any = None,
        tokenizer: PreTrainedTokenizerBase | Any = None,
        dataset: list[dict[str, Any]] | Any = None,
        resume: bool = False,
        eval_dataset: Any = None,
        **trl: Any,
    ):
        self.trl_form = not isinstance(config, GRPOConfig)
        if self.trl_form:  # TRL's form: the model (or nothing) where the config goes
            given = trl_call(config, model, tokenizer, dataset, resume, eval_dataset, trl)
        elif trl:
            raise TypeError(f"GRPOTrainer(config, ...) takes no {', '.join(trl)}: TRL's arguments go with TRL's form")
        else:
            given = FastgrpoArguments(config, model, tokenizer, dataset, eval_dataset, [])
        self._build(given, resume, TrlCallbacks(given.callbacks))

    def _build(
        self, given: FastgrpoArguments, resume: bool, events: TrlCallbacks, lock: DirectoryLock | None = None
    ) -> None:
        """The trainer of ``given`` (kept as `given`, to build it again to resume): everything that can refuse the
        run does so before the model loads; ``lock``: the output directory's, already held (a trainer built again)."""
        config, model, tokenizer, dataset, eval_dataset, _ = self.given = given
        config.validate()
        check_speculation(config.speculation)  # the drafters registered (`register_drafter`) included
        check_tools(config.speculation, bool(config.tools or config.environment_factory))
        check_draft_training(config.speculation, config.draft_training)
        if tokenizer is None and not resume:  # a resumed run reads its checkpoint's tokenizer
            check_tokenizer_files(config.model)
        self.dist = distributed.init(config.device, config.ddp_timeout, config.rollout_processes)
        self.output_dir = Path(config.output_dir)
        self.reward_funcs = resolve_reward_funcs(config.reward_funcs)
        self.dataset = dataset if dataset is not None else load_dataset(config.dataset)
        tools, environments = resolve_run_tools(config, self.reward_funcs, self.dataset)
        check_columns(self.reward_funcs, self.dataset)
        self.eval_rows = evaluation_rows(
            config, self.reward_funcs, bool(tools), environments, eval_dataset, self.dist.trainers
        )
        global_prompts = config.prompts_per_generation * self.dist.trainers
        if len(self.dataset) < global_prompts:
            raise ValueError(
                f"the dataset has {len(self.dataset)} rows, fewer than the {global_prompts} prompts per generation "
                f"({config.prompts_per_generation} on each of {self.dist.trainers} processes)"
            )
        self.start_step, self.num_tokens, self.resumed_from, self.generations_dropped = 0, 0.0, None, 0
        self.generation: Generation | None = None  # the one the next optimizer steps train on
        self.samples: list[tuple[Any, str, float, dict[str, Any]]] | None = None  # the latest generation's, unshown
        self.generations_per_epoch = max(len(self.dataset) // global_prompts, 1)  # TRL's `epoch` counts them
        self.config = config = config.with_total_steps(self.generations_per_epoch)  # max_steps -1: epochs
        random.seed(config.seed)
        torch.manual_seed(config.seed)
        # What can refuse the run does before anything is loaded; an overwritten run's files are deleted only once
        # the whole set-up has worked (the end of this constructor).
        check_cache_dir()
        with distributed.main_first(self.dist):  # the embedded model is converted once, by rank 0
            resolve_model_path(config.model)
        model_config = model.config if model is not None else read_model_config(config.model)
        check_training_options(config, model_config)
        disk = checkpoint_bytes(config, model_config, self.dist.device) if self.dist.is_main else 0
        if config.check_memory and self.dist.device.type == "cuda":  # before any weight is read
            plan_for_trainer(config.for_shares(self.dist.shares), model_config, self.dist.device, self.dist.rollout)
        # rank 0 holds the output directory's lock until `train` ends (or this trainer is gone)
        self.lock = lock or (DirectoryLock(self.output_dir) if self.dist.is_main else None)
        checkpoint, resume_state = None, None
        self.held_run: str | None = None  # a run in output_dir that `train(resume_from_checkpoint=...)` may continue
        if resume:  # nothing is deleted: the run is claimed now, its checkpoint read
            with distributed.main_first(self.dist):
                checkpoint, resume_state, self.run_id = prepare_output_dir(
                    self.output_dir, resume, config.overwrite_output_dir, self.dist.is_main
                )
            check_resumed(config, self.output_dir, self.run_id, self.dist.is_main, checkpoint, resume_state, disk)
        elif self.trl_form and not config.overwrite_output_dir and latest_checkpoint(self.output_dir):  # as TRL's
            self.held_run = (
                f"output_dir {self.output_dir} holds a run that saved checkpoints: continue it with "
                "trainer.train(resume_from_checkpoint=True), choose another output_dir, or start a new run there with "
                "overwrite_output_dir=True (which deletes the earlier run's files and keeps everything else)"
            )
        elif self.dist.is_main:  # what the claim would refuse, now; the claim (and its deletions) after the set-up
            freed = check_output_dir(self.output_dir, resume, config.overwrite_output_dir)
            saves = checkpoints_written(0, config.max_steps, config.save_steps, config.save_total_limit)
            check_disk_space(self.output_dir, disk, saves, freed)
        self.config = config = config.for_shares(self.dist.shares)  # a rollout process makes every trainer's share
        source = str(checkpoint) if checkpoint else config.model
        self.tokenizer = tokenizer or load_tokenizer(source)
        self.tools = RunTools(tools, environments, self.tokenizer, config) if tools or environments else None
        # A LoRA checkpoint holds the adapter only: the base model comes from `model` and the adapter is loaded on it.
        self.model = model or load_model(config.model if config.use_peft else source, config.dtype, self.dist.device)
        if model is not None and checkpoint is not None and not config.use_peft:
            load_weights_into(model, checkpoint)  # a model given in memory goes on from the checkpoint's weights
        self.device = next(self.model.parameters()).device
        load_reward_models(self.reward_funcs, self.device, config.dtype, config.chat_template_kwargs)
        if config.disable_dropout:
            disable_dropout(self.model)
        if config.bf16:  # None turns autocast on only where the device has bfloat16 units
            warn_if_bf16_emulated("bf16", self.device)
        self.ref_model = reference_model(config, self.device) if config.beta > 0 and not self.dist.rollout else None
        if config.use_peft:
            self.model = wrap_lora(self.model, config, checkpoint)
        self.eos = eos_token_ids(self.model, self.tokenizer)
        self.rollouts = TrainingRollouts(
            self.model,
            self.tokenizer,
            self.eos,
            config.speculation,
            config.draft_training,
            config.model,
            config.seed,
            compile_backend(config.compile, self.device),
            config.speculation.draft,
        )
        self.rollouts.reserve(config.rollout_rows, config.max_prompt_length, config.max_completion_length)
        # a rollout process trains nothing; the training processes take its generations (`fastgrpo.grpo.pipeline`)
        self.update = (
            None if self.dist.rollout else PolicyUpdate(self.model, self.ref_model, config, self.dist.world_size)
        )
        self.feed: RolloutFeed | None = None
        # torch's CPU threads while `train` runs: fixed, or following the cores no other process is using.
        self.threads = None
        if self.device.type == "cpu":
            self.threads = ThreadGovernor(config.cpu_threads or None, adapt=config.cpu_threads == 0)
            self.rollouts.engine.threads = self.threads
            if self.update is not None:
                self.update.threads = self.threads
        if checkpoint is not None:
            restore_run(self, checkpoint, resume_state)
        self.sampling = config.sampling_params()
        self.prompts = StepPrompts(
            self.dataset,
            self.tokenizer,
            config.prompts_per_generation,
            self.dist.rank,
            self.dist.world_size,
            config.seed,
            config.max_prompt_length,
            config.shuffle_dataset,
            config.chat_template_kwargs,
            self.tools.render if self.tools is not None else None,
        )
        self.events = events if self.dist.rollout else events.bind(self)  # TRL's callbacks, where it trains
        if config.rollout_processes:  # a callback's freezes on the training process included
            check_same_parameters(self.model, distributed.message_group(), gathered_dtype(self.update))
        if not resume and self.held_run is None:  # all that can refuse the run has: an overwrite deletes only now
            with distributed.main_first(self.dist):
                _, _, self.run_id = prepare_output_dir(
                    self.output_dir, resume, config.overwrite_output_dir, self.dist.is_main
                )

    # -- set-up -------------------------------------------------------------------------------------------
    # -- one step -----------------------------------------------------------------------------------------
    def rollout(
        self, step: int, rows: list[dict[str, Any]]
    ) -> tuple[list[list[int]], GenerationOutput, ToolTurns | None]:
        """Sample ``num_generations`` completions per prompt (`TrainingRollouts.generate`: the same whatever the number
        of processes); with tools their calls run, and the prompt ids may be each completion's own (environments)."""
        generations = self.config.num_generations  # with environments the prompts may be each completion's own
        prompt_ids, generations, turns = rollout_prompts(self.tools, rows, generations, self.prompts)
        at_once, rank, world = self.config.rows_at_once, self.dist.rank, self.dist.world_size
        out = self.rollouts.generate(prompt_ids, self.sampling, generations, step, rank, world, turns, at_once)
        return prompt_ids, out, turns

    def train_step(self, step: int) -> dict[str, float]:
        """Optimizer step ``step`` (0-based): a new generation where the last one has trained all its steps (or none
        is held, as after a resume, which samples that generation's prompts anew, as TRL), then the update on this
        step's window of it; returns the step's metrics, with the generation's where it was made at this step."""
        cfg = self.config
        passes = cfg.steps_per_generation_pass
        t0 = time.perf_counter()
        reset_peak_memory(self.device)  # not the evaluation's or the checkpoint's of the step before
        metrics: dict[str, float] = {"step": step + 1, "epoch": cfg.epoch(step + 1, self.generations_per_epoch)}
        if self.generation is None or step % passes == 0:
            first, count = cfg.first_generation(step), cfg.generations_per_step
            made = [
                generate(self, first + i, step) if self.feed is None else prepare(self, self.feed.take())
                for i in range(count)
            ]
            pad, rank = self.tokenizer.pad_token_id, self.dist.rank
            self.generation = made[0] if count == 1 else merge(made, pad, cfg.seed, first, rank)
            metrics |= self.generation.metrics
            self.samples = self.generation.samples
        t_update = time.perf_counter()
        window = self.generation.window(step % passes % cfg.windows_per_generation)
        if self.feed is not None:
            self.feed.before_update()
        metrics |= self.update.optimize(window, self.generation.num_items_in_batch)
        t3 = synchronized(self.device)  # the optimizer step's kernels count in time/train
        if self.feed is not None:  # sent after the timing's wait for the step's kernels
            self.feed.after_step(step + 1)
        memory = {k: v for k, v in metrics.items() if k == "memory/rollout_peak_mb"}
        if self.device.type == "cuda":
            memory["memory/update_peak_mb"] = peak_memory_mb(self.device)
            metrics["memory/update_peak_reserved_mb"] = peak_reserved_mb(self.device)
        metrics |= {
            **{"time/update": t3 - t_update, "time/train": t3 - t_update + metrics.get("time/logprobs", 0.0)},
            **{"time/step": t3 - t0, "step_time": t3 - t0},
            "memory/peak_mb": max(memory.values()) if memory else peak_memory_mb(self.device),
            **memory,
            **(self.threads.metrics() if self.threads is not None else {}),
        }
        metrics = distributed.reduce_metrics(metrics)
        if "num_tokens" in metrics:  # TRL's: the run's so far, logged with each generation
            self.num_tokens = metrics["num_tokens"] = self.num_tokens + metrics["num_tokens"]
            for key in ("completions/min_terminated_length", "completions/max_terminated_length"):
                metrics[key] = 0.0 if math.isnan(metrics[key]) else metrics[key]  # no completion of the job ended
        return metrics

    def close(self) -> None:
        """Give the output directory's lock back (`train` does when it ends); another run may then use it."""
        if self.lock is not None:
            self.lock.release()
        if self.tools is not None:
            self.tools.close()

    # -- the loop -----------------------------------------------------------------------------------------
    def save(self, step: int) -> Path:
        """Write ``checkpoint-{step}`` (rank 0 writes it; every rank waits until it is complete)."""
        path = self.output_dir / f"checkpoint-{step}"
        weights, optimizer_state, masters = self.update.full_state()  # all ranks take part
        if self.dist.is_main:

            def write_model(path: Path) -> None:
                self.write_policy(path, weights)
                if self.feed is None or self.feed.closing:
                    self.rollouts.save(path, learners=not self.config.save_only_model)
                else:  # the drafters that learn are the rollout processes'
                    self.feed.save_drafts(path, learners=not self.config.save_only_model)

            state: dict[str, Any] = {"config": config_to_dict(self.config), "num_tokens": self.num_tokens}
            state |= self.feed.state() if self.feed is not None else {}
            if not self.config.save_only_model:
                state |= {"optimizer": optimizer_state, "scheduler": self.update.scheduler.state_dict()}
                if self.config.use_adaptive_entropy:  # the coefficient it has moved to, as TRL's checkpoints
                    state["entropy_control"] = self.update.entropy.state_dict()
                if masters is not None:
                    state["master_weights"] = masters
            path = save_checkpoint(self.output_dir, step, write_model, state, self.run_id, self.config.save_total_limit)
        distributed.barrier()
        return path

    def write_policy(self, path: Path, weights: dict[str, torch.Tensor] | None) -> None:
        """The policy (``weights``: its full weights gathered under FSDP2; None: the module's own) and the tokenizer,
        in transformers' format (rank 0)."""
        self.model.save_pretrained(path, **({} if weights is None else {"state_dict": weights}))
        self.tokenizer.save_pretrained(path)

    def train(self, resume_from_checkpoint: bool | str | Path | None = None) -> list[dict[str, float]]:
        """Run until ``max_steps``; returns the metrics of the steps run by this call (the same on every rank).
        ``resume_from_checkpoint`` (TRL's): True, or the path of the newest checkpoint of the run in ``output_dir``,
        continues that run first (`resume_checkpoint`)."""
        if resume_from_checkpoint not in (None, False):
            latest = self.resume_checkpoint(resume_from_checkpoint)
            if self.resumed_from is None or self.resumed_from.resolve() != latest:
                self._rebuild_resumed(latest)
        elif self.held_run is not None:
            raise ValueError(self.held_run)
        if self.dist.rollout:  # it generates until rank 0 stops the run
            try:
                with self.threads or nullcontext(), tf32_matmuls(self.device):
                    RolloutProcess(self).run()
            finally:
                self.close()
            return []
        cfg = self.config
        main = self.dist.is_main
        history = []
        bar = tqdm(
            range(self.start_step, cfg.max_steps),
            initial=self.start_step,
            total=cfg.max_steps,
            desc="GRPO",
            disable=not (cfg.progress_bar and main),
        )
        log, events = RunLog(cfg, self.start_step) if main else None, self.events
        unlogged: list[dict[str, float]] = []  # the steps since the last logged record
        start = time.perf_counter()
        try:
            self.feed = RolloutFeed(self) if cfg.rollout_processes else None
            with self.threads or nullcontext(), tf32_matmuls(self.device):
                events.begin(self.start_step)
                for step in bar:
                    events.step_begin()
                    try:
                        metrics = self.train_step(step)
                    except NonFiniteUpdate as e:
                        latest = latest_checkpoint(self.output_dir)
                        raise ValueError(
                            f"step {step + 1}: {e}; the run stops before saving anything of it (the latest "
                            f"checkpoint is {latest or 'none yet'})"
                        ) from None
                    asked = events.step_end(metrics)  # what TRL's callbacks ask of this step
                    if cfg.evaluates_at(step + 1) or (asked.should_evaluate and cfg.evaluates):
                        evaluated = evaluate(self, step + 1)
                        metrics |= evaluated
                        events.evaluated(evaluated)
                    history.append(metrics)
                    unlogged.append(metrics)
                    if log is not None and self.samples is not None and log.samples(step + 1, self.samples):
                        self.samples = None  # the latest generation's, shown once at a log_completions_steps step
                    has_eval = any(k.startswith("eval/") for k in metrics)
                    if (step + 1) % cfg.logging_steps == 0 or has_eval or asked.should_log:
                        record = logged_record(unlogged)
                        unlogged.clear()
                        if log is not None:
                            log.write(step + 1, record)
                        events.logged(record)
                    if "reward" in metrics:  # a step that generated
                        bar.set_postfix(
                            reward=f"{metrics['reward']:.3f}", tok_s=f"{metrics['rollout/tokens_per_second']:.0f}"
                        )
                    asked = events.control  # a callback's on_log or on_evaluate may have returned another one
                    stop = asked.should_training_stop
                    if (step + 1) % cfg.save_steps == 0 or step + 1 == cfg.max_steps or asked.should_save or stop:
                        self.save(step + 1)
                        events.saved()
                    if stop:
                        break
                events.end()
            self.summary = train_summary(
                history,
                time.perf_counter() - start,
                cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * self.dist.world_size,
            )
        finally:
            if self.feed is not None:
                self.feed.close()
            if log is not None:
                log.close()
            self.close()
        return history
