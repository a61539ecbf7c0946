"""`GRPOConfig`: every option of a training run, with TRL's names wherever TRL has the option (TRL's other names of
them and its options fastgrpo lacks: `fastgrpo.config.trl_names`). Everything is validated before any model loads
(`fastgrpo.config.grpo_checks`); an error names the option and what it accepts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from fastgrpo.config.grpo_checks import GRPOChecks
from fastgrpo.config.speculation import LR_SCHEDULERS, DraftTrainConfig, SpeculationConfig
from fastgrpo.config.step_counts import StepCounts
from fastgrpo.config.trl_names import TRL_ALIASES, accept_trl_names
from fastgrpo.data import DataConfig
from fastgrpo.distributed import DEVICES
from fastgrpo.fields import Range, option
from fastgrpo.models import DTYPE_CHOICES
from fastgrpo.sampling_params import SamplingParams

COMPILE_CHOICES = ("auto", "on", "off")  # see `fastgrpo.rollout.compiled.compile_backend`

SCALE_REWARDS = ("group", "batch", "none")
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
EVAL_STRATEGIES = ("no", "steps")


@dataclass
class GRPOConfig(StepCounts, GRPOChecks):
    """All options of a training run. Names follow TRL's ``GRPOConfig`` wherever TRL has the same option.

    Each generation samples ``per_device_train_batch_size * steps_per_generation`` completions on each process,
    ``num_generations`` per prompt; each optimizer step trains on ``gradient_accumulation_steps`` micro-batches of
    them (`fastgrpo.config.step_counts`).
    """

    ALIASES: ClassVar[dict[str, str]] = TRL_ALIASES  # TRL's names of options fastgrpo names otherwise

    # model
    model: str = option(
        "smollm2", help="a local Hugging Face directory, a hub id, or `smollm2` (the embedded default)", path=True
    )
    dtype: str = option(
        "auto",
        help="the policy's weights, which rollouts and the update compute with; `auto`: bfloat16 on a GPU, float32 "
        "on CPU",
        choices=DTYPE_CHOICES,
    )
    master_weights: bool = option(
        True,
        help="with bfloat16 or float16 weights, AdamW updates float32 master weights (optimizer state; with fsdp, "
        "FSDP2's float32 shards) and the module computes with them rounded; gradients accumulate and reduce in "
        "float32 (under DDP in the weights' dtype); float16 gets no loss scaling; false: AdamW updates the "
        "low-precision weights directly",
    )
    device: str = option("auto", help="`auto`: each process's GPU if there is one, else the CPU", choices=DEVICES)
    compile: str = option(
        "auto",
        help="run the rollout's decoding step compiled by torch.compile (captured as CUDA graphs on a GPU); `auto`: "
        "on a GPU only",
        choices=COMPILE_CHOICES,
    )
    ddp_timeout: int = option(1800, help="seconds a collective waits for the other processes", valid=Range(1))
    fsdp: bool = option(False, help="several processes: shard the policy with FSDP2 instead of replicating it (DDP)")
    cpu_threads: int = option(
        0,
        help="torch's CPU threads during training; 0: start from torch's count and run one fewer while another "
        "process competes for the cores, N: exactly N",
        valid=Range(0),
    )
    disable_dropout: bool = option(False, help="set every dropout probability of the policy to 0, as TRL")
    cast_lm_head_to_fp32: bool = option(
        False, help="the policy update's LM head computes in float32 (ScaleRL), as TRL (rollouts are not changed)"
    )
    check_memory: bool = option(
        True,
        help="on a GPU, refuse to start when the estimated peak memory exceeds the free memory, naming the options "
        "that would fit (`fastgrpo train --dry-run` prints the estimate); false: start anyway",
    )
    # data and rewards
    dataset: DataConfig = option(default_factory=DataConfig, help="where the prompts come from (`dataset.*`)")
    reward_funcs: list[str] = option(
        default_factory=lambda: ["accuracy"],
        help="built-in names (`accuracy`, `gsm8k_strict`, `math_accuracy`, `format`), `module:function`, or a reward "
        "model: the directory (or hub id) of a sequence-classification model, scored on the policy's device as TRL "
        "scores one",
    )
    reward_weights: list[float] | None = option(None, help="one weight per reward function (None: all 1)")
    shuffle_dataset: bool = option(
        True, help="draw the prompts in a seeded random order, epoch by epoch (false: in the dataset's order)"
    )
    chat_template_kwargs: dict[str, Any] | None = option(
        None,
        help="keyword arguments of the tokenizer's apply_chat_template for chat prompts, as TRL "
        "(`{enable_thinking: false}` for Qwen3-style templates)",
    )
    # in-training evaluation
    eval_dataset: DataConfig | None = option(
        None,
        help="the prompts evaluated during training, a mapping of the `dataset.*` options (`{name: gsm8k, split: "
        "test}`; arithmetic questions training never draws: `{split: test}`); None: no evaluation",
    )
    eval_strategy: str = option(
        "no",
        help="`steps`: every eval_steps optimizer steps (and after the last) generate on eval_dataset and log the "
        "rewards and lengths under `eval/`, as TRL; `no`: never",
        choices=EVAL_STRATEGIES,
    )
    eval_steps: float | None = option(
        None,
        help="optimizer steps between evaluations (None: logging_steps; below 1: that share of max_steps, rounded up)",
        valid=Range(0, low_open=True),
    )
    num_generations_eval: int | None = option(
        None, help="completions sampled per eval prompt (None: num_generations)", valid=Range(1)
    )
    per_device_eval_batch_size: int = option(
        8,
        help="eval completions generated together on each process (whole groups: at least num_generations_eval)",
        valid=Range(1),
    )
    # generation
    num_generations: int = option(8, help="completions sampled per prompt (the group)", valid=Range(2))
    max_prompt_length: int = option(512, help="longer prompts keep their last tokens", valid=Range(1))
    max_completion_length: int = option(512, help="new tokens per completion at most", valid=Range(1))
    temperature: float = option(1.0, help="sampling temperature (0: greedy)", valid=Range(0))
    top_p: float = option(1.0, help="nucleus sampling mass", valid=Range(0, 1, low_open=True))
    top_k: int = option(0, help="sample among the k most likely tokens (0: all)", valid=Range(0))
    min_p: float = option(
        0.0, help="drop tokens below this share of the most likely one's probability", valid=Range(0, 1, high_open=True)
    )
    stop: list[str] = option(default_factory=list, help="strings that end a completion")
    # tools (agents)
    tools: list[str] = option(
        default_factory=list,
        help="tools completions may call: built-in names (`calculator`) or `module:function` (a typed, documented "
        "function, plain or async); a turn that calls one waits for its result, which the completion goes on from",
    )
    max_tool_calling_iterations: int | None = option(
        None, help="turns of tool calls per completion at most, as TRL (0: none; None: no limit)", valid=Range(0)
    )
    strict_tool_calls: bool = option(
        False,
        help="tool calls stricter than TRL's loop: a malformed call and a tool's non-string result are errors the "
        "model reads, arguments are checked against the tool first, and errors are worded by fastgrpo",
    )
    tool_timeout: float = option(
        30.0,
        help="seconds a tool call may run (a later result is an error message), and an environment's reset (past it "
        "the run stops naming it)",
        valid=Range(0, low_open=True),
    )
    tool_workers: int = option(4, help="tool calls running at once", valid=Range(1))
    reward_timeout: float | None = option(
        600.0,
        help="seconds an async reward function (an environment's async get_reward too) may take on a step's "
        "completions before the run stops naming it; None: no deadline",
        valid=Range(0, low_open=True),
    )
    environment_factory: str | dict[str, str] | None = option(
        None,
        help="`module:Class` (or a mapping of names to them, chosen by each row's `environment` column) making "
        "environments as TRL: each completion gets an instance, reset(**row) before its rollout (a returned string "
        "is appended to the prompt), whose public methods are its tools and whose get_reward(), when defined, is a "
        "reward logged under the class's name",
    )
    speculation: SpeculationConfig = option(
        default_factory=SpeculationConfig, help="speculative rollouts (`speculation.*`)"
    )
    draft_training: DraftTrainConfig = option(
        default_factory=DraftTrainConfig, help="online and offline draft learning (`draft_training.*`)"
    )
    # optimisation
    learning_rate: float = option(1e-6, help="AdamW learning rate of the policy", valid=Range(0, low_open=True))
    per_device_train_batch_size: int = option(8, help="completions per micro-batch on each process", valid=Range(1))
    gradient_accumulation_steps: int = option(1, help="micro-batches per optimizer step", valid=Range(1))
    steps_per_generation: int | None = option(
        None,
        help="micro-batches of completions one generation samples, as TRL (None: gradient_accumulation_steps): a "
        "multiple of gradient_accumulation_steps trains it in that many optimizer steps, a divisor trains several "
        "generations in one",
        valid=Range(1),
    )
    max_steps: int = option(-1, help="optimizer steps of the run (-1: num_train_epochs epochs of the dataset)")
    num_train_epochs: float = option(3.0, help="passes over the dataset when max_steps is -1")
    lr_scheduler_type: str = option("linear", help="transformers' learning-rate schedule", choices=LR_SCHEDULERS)
    warmup_ratio: float = option(0.0, help="share of the steps spent warming the learning rate up", valid=Range(0, 1))
    warmup_steps: float = option(0, help="warmup steps, or below 1 their share (not with warmup_ratio)", valid=Range(0))
    weight_decay: float = option(0.0, help="AdamW weight decay", valid=Range(0))
    adam_beta1: float = option(0.9, help="AdamW beta1", valid=Range(0, 1, high_open=True))
    adam_beta2: float = option(0.999, help="AdamW beta2", valid=Range(0, 1, high_open=True))
    adam_epsilon: float = option(1e-8, help="AdamW epsilon", valid=Range(0, low_open=True))
    max_grad_norm: float = option(1.0, help="gradient clipping", valid=Range(0, low_open=True))
    bf16: bool | None = option(
        None,
        help="bfloat16 autocast for the policy update (fast on GPUs, and on CPUs with AMX or avx512_bf16 only); None "
        "(the default, as TRL's, which turns it on everywhere): on a GPU with bfloat16 units, off on a CPU",
    )
    gradient_checkpointing: bool = option(
        True,
        help="recompute each decoder layer's activations in the backward pass instead of keeping them: a fraction "
        "of the update's activation memory for about a third more of its compute",
    )
    logprob_chunk_tokens: int = option(
        1024, help="completion tokens per chunk of the LM head in the policy update", valid=Range(1)
    )
    # asynchronous GRPO (as TRL's AsyncGRPOConfig)
    rollout_processes: int = option(
        0,
        help="under torchrun, the last this many processes only generate, on the newest weights they hold, taken "
        "between decoding steps, and the others train (asynchronous GRPO); 0: every process generates, then trains",
        valid=Range(0),
    )
    max_staleness: int = option(
        4,
        help="optimizer steps a sample's oldest token may lag behind the weights it trains; the rollout processes "
        "wait rather than sample further ahead, and a sample past it is dropped (counted)",
        valid=Range(0),
    )
    weight_sync_steps: int = option(1, help="optimizer steps between weights sent to rollout processes", valid=Range(1))
    queue_maxsize: int = option(1024, help="completions generated ahead, untrained, per trainer", valid=Range(1))
    heartbeat_stale_after_s: float = option(
        300.0,
        help="seconds a process waits for a rollout process that sends nothing before the run stops, naming it",
        valid=Range(0, low_open=True),
    )
    max_inflight_tasks: int = option(
        -1, help="completions a process decodes at once at most, refilling finished rows (-1: all)", valid=Range(-1)
    )
    # GRPO
    loss_type: str = option(
        "dapo",
        help="the policy loss and how its token losses are averaged, as in TRL: the clipped grpo, bnpo, dr_grpo, dapo, "
        "luspo (each completion's token losses summed); cispo (the ratio capped at epsilon_high as a weight; ScaleRL "
        "suggests epsilon_high 5.0); sapo (a soft gate); vespo (a gamma weight of the sequence ratio, vespo_*)",
        choices=LOSS_TYPES,
    )
    importance_sampling_level: str = option(
        "token",
        help="the importance ratio per token, or per sequence (GSPO: exp of the mean of its tokens' log-ratios; "
        "best with loss_type grpo)",
        choices=IMPORTANCE_SAMPLING_LEVELS,
    )
    scale_rewards: str = option(
        "group", help="divide advantages by the group's or the batch's reward std, or not", choices=SCALE_REWARDS
    )
    beta: float = option(0.0, help="KL coefficient (k3 estimator); > 0 loads a reference model", valid=Range(0))
    epsilon: float = option(0.2, help="lower clipping range of the ratio", valid=Range(0, low_open=True))
    epsilon_high: float | None = option(
        None, help="upper clipping range (None: epsilon); cispo's cap of the ratio", valid=Range(0, low_open=True)
    )
    delta: float | None = option(
        None,
        help="two-sided clipping: the ratio capped at delta also where the advantage is negative (None: off; "
        "above 1 + epsilon_high; refused with cispo and sapo, which do not clip)",
        valid=Range(1, low_open=True),
    )
    importance_sampling_correction: bool = option(
        False,
        help="weigh each completion's loss by how the policy the update starts from scores its tokens against how "
        "the sampler scored them (TRL's vllm_importance_sampling_correction; off: the two share the weights and "
        "differ by rounding, logged as sampling/*, and the weights would make the update depend on which trees "
        "verified each token)",
    )
    importance_sampling_mode: str = option(
        "sequence_mask",
        help="the correction's ratio per token or per completion (its tokens' product), clamped into the clip range "
        "(truncate) or zeroed outside it (mask); set with the correction off, refused",
        choices=IMPORTANCE_SAMPLING_MODES,
    )
    importance_sampling_clip_min: float | None = option(
        None, help="the correction's lowest ratio (None: none; refused with the correction off)", valid=Range(0)
    )
    importance_sampling_clip_max: float | None = option(
        3.0,
        help="the correction's highest ratio (None: none; refused with the correction off)",
        valid=Range(0, low_open=True),
    )
    sapo_temperature_pos: float = option(
        1.0,
        help="sapo's gate temperature for positive advantages (refused with another loss)",
        valid=Range(0, low_open=True),
    )
    sapo_temperature_neg: float = option(
        1.05,
        help="sapo's gate temperature for other advantages (refused with another loss)",
        valid=Range(0, low_open=True),
    )
    vespo_k_pos: float = option(2.0, help="vespo's gamma shape k for advantages >= 0", valid=Range(0))
    vespo_lambda_pos: float = option(3.0, help="vespo's gamma rate lambda for advantages >= 0", valid=Range(0))
    vespo_k_neg: float = option(3.0, help="vespo's gamma shape k for negative advantages", valid=Range(0))
    vespo_lambda_neg: float = option(2.0, help="vespo's gamma rate lambda for negative advantages", valid=Range(0))
    num_iterations: int = option(1, help="passes of optimizer steps over each generation", valid=Range(1))
    mask_truncated_completions: bool = option(False, help="train on no token of a completion cut by the length limit")
    multi_objective_aggregation: str = option(
        "sum_then_normalize",
        help="how several reward functions make one advantage, as TRL: the weighted sum, then the group baseline and "
        "scale_rewards; or each function normalised within its group, then the weighted sum normalised over the batch "
        "(GDPO)",
        choices=AGGREGATIONS,
    )
    use_bias_correction_kl: bool = option(
        True,
        help="weigh the KL term by the (differentiable) importance ratio, so that its gradient is the unbiased "
        "reverse-KL gradient (DeepSeek-V3.2), as TRL; with beta > 0 it changes the gradient, on-policy too",
    )
    top_entropy_quantile: float = option(
        1.0,
        help="keep in the policy loss only this top share of the completion tokens by entropy (Beyond the 80/20 Rule "
        "suggests 0.2; 1: all), ranked per accumulation_scope over every process, by the entropies of the policy the "
        "step starts from (a pass without gradient before the update)",
        valid=Range(0, 1),
    )
    entropy_coef: float = option(
        0.0,
        help="an entropy bonus: the loss less this times the mean entropy of the trained tokens (per "
        "accumulation_scope; the same "
        "meaning for every loss_type); > 0 also trains the rows of advantage 0; with use_adaptive_entropy the first "
        "coefficient",
        valid=Range(0),
    )
    use_adaptive_entropy: bool = option(
        False,
        help="Skywork-OR1's adaptive entropy control, as TRL: after each optimizer step entropy_coef rises by "
        "entropy_coef_delta while the step's mean entropy is at most entropy_target and falls otherwise, and the "
        "bonus applies only after a step at or below the target (also trains the rows of advantage 0)",
    )
    entropy_coef_min: float = option(0.0, help="adaptive entropy control's lowest coefficient", valid=Range(0))
    entropy_coef_max: float = option(1.0, help="adaptive entropy control's highest coefficient", valid=Range(0))
    entropy_coef_delta: float = option(0.005, help="adaptive entropy control's step of the coefficient", valid=Range(0))
    entropy_target: float = option(
        0.2, help="adaptive entropy control's target entropy (nats per token)", valid=Range(0)
    )
    accumulation_scope: str = option(
        "micro_batch",
        help="what top_entropy_quantile ranks, the entropy bonus averages and the update's metrics cover: each "
        "micro-batch of per_device_train_batch_size rows of the step's shuffled completions, averaged over the step, "
        "as TRL (`micro_batch`); or the whole step, every process's rows together (`step`)",
        choices=("micro_batch", "step"),
    )
    off_policy_mask_threshold: float | None = option(
        None,
        help="DeepSeek-V3.2's off-policy sequence masking: a completion of negative advantage whose mean over its "
        "tokens of the sampler's log-prob less the policy's is above this leaves the loss (None: off)",
        valid=Range(0),
    )
    score_skipped_rows: bool = option(
        True,
        help="the rows of advantage 0, which the update skips (their loss and gradient are 0), go through the policy "
        "without gradient, so that entropy and sampling/* cover every completion as TRL's do; false: those metrics "
        "cover the rows trained, and the update runs no extra forward",
    )
    # LoRA through peft
    use_peft: bool = option(False, help="train LoRA adapters instead of the whole policy")
    lora_r: int = option(16, help="LoRA rank", valid=Range(1))
    lora_alpha: int = option(32, help="LoRA scale numerator", valid=Range(0, low_open=True))
    lora_dropout: float = option(0.05, help="LoRA dropout", valid=Range(0, 1, high_open=True))
    lora_target_modules: list[str] | None = option(None, help="modules to adapt (None: all linear layers)")
    # outputs
    output_dir: str = option("trainer_output", help="config, metrics and checkpoints of the run", path=True)
    overwrite_output_dir: bool = option(
        False,
        help="start a new run in an output_dir that holds another one, deleting that run's metrics and checkpoints",
    )
    seed: int = option(42, help="seeds data order, sampling and initialisation", valid=Range(0, 2**63, high_open=True))
    logging_steps: int = option(10, help="write metrics every this many steps", valid=Range(1))
    save_steps: int = option(500, help="write a checkpoint every this many steps (and at the last)", valid=Range(1))
    save_total_limit: int | None = option(
        None, help="keep this many checkpoints, removing the oldest (None: all)", valid=Range(1)
    )
    save_only_model: bool = option(
        False,
        help="checkpoints hold the policy (and draft) only, not the optimizer state: a third of the disk, "
        "but --resume cannot continue from them",
    )
    report_to: list[str] = option(
        default_factory=lambda: ["jsonl"], help="`jsonl` (metrics.jsonl) and/or `tensorboard`"
    )
    log_completions: bool = option(False, help="print a few sample completions every log_completions_steps")
    num_completions_to_print: int | None = option(
        None, help="sample completions printed each time (None: all)", valid=Range(0)
    )
    log_completions_steps: int = option(5, help="steps between printed samples", valid=Range(1))
    progress_bar: bool = option(True, help="show a progress bar")

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=self.max_completion_length,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            stop=tuple(self.stop),
        )


accept_trl_names(GRPOConfig)
