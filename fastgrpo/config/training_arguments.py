"""transformers' ``TrainingArguments`` fields that a TRL GRPO script sets and fastgrpo has no option of its own for:
`IGNORED`, those that configure machinery fastgrpo does not have (a ``DataLoader``, the Hub, a tracker, DDP's
buckets) and change nothing whatever their value; `READ`, those read into fastgrpo's own options; `AT_DEFAULT`,
those accepted at values that change nothing and refused otherwise, one line each saying what fastgrpo does instead.
`fastgrpo.config.trl_names` applies them with TRL's own options (YAML, the command line and the constructor)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# Accepted at any value: nothing in a fastgrpo run reads them.
IGNORED = (
    *(
        f"dataloader_{name}"
        for name in (
            "drop_last",
            "num_workers",
            "pin_memory",
            "persistent_workers",
            "prefetch_factor",
            "multiprocessing_context",
            "in_order",
        )
    ),
    "remove_unused_columns",  # every column reaches the reward functions, as TRL's GRPO keeps them
    "label_names",
    "length_column_name",
    "train_sampling_strategy",
    "log_on_each_node",
    "logging_nan_inf_filter",
    "log_level",
    "log_level_replica",
    "include_num_input_tokens_seen",
    "prediction_loss_only",
    "eval_do_concat_batches",
    "eval_use_gather_object",
    "eval_accumulation_steps",
    "include_for_metrics",
    "batch_eval_metrics",
    "skip_memory_metrics",
    "do_train",
    "do_eval",
    "do_predict",
    "local_rank",
    "ddp_find_unused_parameters",
    "ddp_bucket_cap_mb",
    "ddp_broadcast_buffers",
    "ddp_static_graph",
    "average_tokens_across_devices",  # fastgrpo's losses are over the whole job's tokens
    "run_name",
    "project",
    "trackio_space_id",
    "trackio_bucket_id",
    "trackio_static_space_id",
    "hub_token",
    "hub_private_repo",
    "hub_model_id",
    "hub_strategy",
    "hub_always_push",
    "hub_revision",
    "save_on_each_node",
    "ignore_data_skip",
    "restore_callback_states_from_checkpoint",
    "use_cache",
    "torch_empty_cache_steps",
)


def _report_to(value: Any) -> dict[str, Any]:
    """TRL's ``report_to``: ``none`` (no tracker; fastgrpo's own metrics.jsonl is always written), one name or a
    list."""
    if value is None or value == "none" or value == ["none"]:
        return {"report_to": ["jsonl"]}
    return {"report_to": [value] if isinstance(value, str) else value}


# Read into fastgrpo's options: the key -> the options it sets.
READ: dict[str, Callable[[Any], dict[str, Any]]] = {
    "disable_tqdm": lambda value: {} if value is None else {"progress_bar": not value},
    "use_cpu": lambda value: {"device": "cpu"} if value else {},
    "report_to": _report_to,
    # TRL's deprecated name of the correction's highest ratio, which sets it (TRL 1.16's __post_init__)
    "vllm_importance_sampling_cap": lambda value: {} if value is None else {"importance_sampling_clip_max": value},
}

_OPTIMIZER = "fastgrpo's optimizer is torch's AdamW (adam_beta1, adam_beta2, adam_epsilon, weight_decay)"
_PRECISION = "fastgrpo trains in float32, or bfloat16 with bf16 or dtype"
_COMPILE = "the update runs eagerly; rollouts compile their decoding steps with `compile`"
_EVAL = "fastgrpo evaluates every eval_steps (eval_strategy steps) and keeps every checkpoint's metrics"
_RUN = "the run is set by fastgrpo's options (device, fsdp, seed); no accelerate, DeepSpeed or FSDP1 config"

# Accepted at these values (which change nothing), refused otherwise with what fastgrpo does instead.
AT_DEFAULT: dict[str, tuple[tuple[Any, ...], str]] = {
    "lr_scheduler_kwargs": ((None, {}), "the schedule is lr_scheduler_type's with its defaults"),
    "optim": (("adamw_torch", "adamw_torch_fused"), _OPTIMIZER),
    "optim_args": ((None, ""), _OPTIMIZER),
    "optim_target_modules": ((None,), _OPTIMIZER),
    "label_smoothing_factor": ((0, 0.0), "GRPO's loss has no labels to smooth"),
    "fp16": ((False,), _PRECISION),
    "bf16_full_eval": ((False,), _PRECISION),
    "fp16_full_eval": ((False,), _PRECISION),
    "tf32": ((None, True), "fastgrpo's update uses TF32 matmuls on GPUs that have them"),
    "activation_checkpointing": ((False,), "gradient_checkpointing is fastgrpo's activation checkpointing"),
    "activation_checkpointing_kwargs": ((None, {}), "gradient_checkpointing is fastgrpo's activation checkpointing"),
    "gradient_checkpointing_kwargs": (
        (None, {}, {"use_reentrant": False}),
        "gradient_checkpointing runs torch's non-reentrant checkpointing",
    ),
    "torch_compile": ((False,), _COMPILE),
    "torch_compile_backend": ((None,), _COMPILE),
    "torch_compile_mode": ((None,), _COMPILE),
    "use_liger_kernel": ((False,), "Liger kernels are not used: the update's LM head runs in chunks of its own"),
    "liger_kernel_config": ((None,), "Liger kernels are not used"),
    "neftune_noise_alpha": ((None,), "NEFTune's embedding noise is not implemented"),
    "auto_find_batch_size": ((False,), "the memory plan checks the batch before the run starts (check_memory)"),
    "logging_strategy": (("steps",), "fastgrpo logs every logging_steps steps"),
    "logging_first_step": ((False,), "fastgrpo logs every logging_steps steps"),
    "eval_delay": ((0, 0.0), _EVAL),
    "eval_on_start": ((False,), _EVAL),
    "save_strategy": (("steps",), "checkpoints are written every save_steps steps and after the last one"),
    "push_to_hub": ((False,), "fastgrpo writes checkpoints to output_dir; push them with huggingface_hub"),
    "load_best_model_at_end": ((False,), _EVAL),
    "metric_for_best_model": ((None,), _EVAL),
    "greater_is_better": ((None,), _EVAL),
    "full_determinism": ((False,), "fastgrpo seeds its own generators from seed"),
    "data_seed": ((None,), "fastgrpo shuffles its prompts with seed"),
    "accelerator_config": ((None, {}), _RUN),
    "parallelism_config": ((None,), _RUN),
    "fsdp_config": ((None, {}), _RUN),
    "deepspeed": ((None,), _RUN),
    "debug": (("", [], None), _RUN),
    "resume_from_checkpoint": (
        (None,),
        "resume with trainer.train(resume_from_checkpoint=True), GRPOTrainer(..., resume=True) or --resume",
    ),
    "enable_jit_checkpoint": ((False,), "checkpoints are written every save_steps steps; a run resumes from the last"),
    "ddp_backend": ((None,), "fastgrpo's process group is nccl's on GPUs and gloo's on CPUs"),
}
