"""fastgrpo against TRL 1.16's own code on identical float64 tensors: the rewards and advantages of
``GRPOTrainer._generate_and_score_completions`` and the loss of ``GRPOTrainer._compute_loss``, each run on a stand-in
trainer (an instance made without ``__init__``, its attributes set here), beside fastgrpo's reward code and its
policy update (`PolicyUpdate.fixed_logps` and `optimize`, with its own micro-batches, which skip the rows of
advantage 0) on a stand-in policy whose log-probs and entropies are parameters. TRL accumulates 4 micro-batches of 3
consecutive rows into one optimizer step (ranking entropies, averaging the bonus and logging metrics per micro-batch,
adaptive entropy control moving at the step's end). Loss, gradient and every metric both log agree to 1e-10 relative
(TRL's float32 shares to float32's rounding), with a completion no reward function scores, an empty completion and a
group whose advantages are all 0 in every batch."""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")

from fastgrpo.config import GRPOConfig  # noqa: E402
from fastgrpo.grpo.advantages import compute_advantages  # noqa: E402
from fastgrpo.grpo.batch import build_batch, mask_tool_results  # noqa: E402
from fastgrpo.grpo.policy_update import PolicyUpdate  # noqa: E402
from fastgrpo.rewards import function_metrics, reward_matrix  # noqa: E402

F64 = torch.float64
G = 4
# Three groups of four: group 0 has a completion no function scores (row 2), group 1 rewards alike (advantage 0:
# fastgrpo's update skips its rows), group 2 an empty completion (row 9). Rewards are dyadic, exact in TRL's float32.
LENGTHS = [5, 3, 6, 2, 4, 6, 1, 3, 5, 0, 6, 2]
CORRECT = [1.0, None, None, 0.5, 1.0, 1.0, 1.0, 1.0, 0.25, 1.0, None, 0.0]
FORMAT = [0.5, 0.0, None, 0.5, 0.5, 0.5, 0.5, 0.5, 0.0, 0.5, 0.25, None]
N, C = len(LENGTHS), max(LENGTHS)
# A tool's result tokens (0) inside completions, as multi-turn rollouts with tools give them.
TOOL_MASK = {
    0: [1, 1, 0, 0, 1],
    2: [1, 0, 0, 1, 1, 1],
    5: [1, 1, 1, 0, 1, 1],
    8: [1, 0, 0, 0, 1],
    10: [1, 0, 1, 0, 1, 1],
}
BASE = 100  # a prompt's last token is BASE + its row: the stand-in policy reads which row it scores from it


def correct(completions: list, **kwargs: Any) -> list[float | None]:
    return [CORRECT[int(c)] for c in completions]


def formatted(completions: list, **kwargs: Any) -> list[float | None]:
    return [FORMAT[int(c)] for c in completions]


def tables() -> dict[str, torch.Tensor]:
    """``[N, C]`` log-probs of the current policy (``theta``), of the old one, of the sampler and of the reference,
    and the entropies (``phi``), 0 beyond each completion."""
    gen = torch.Generator().manual_seed(7)
    real = torch.tensor([[j < n for j in range(C)] for n in LENGTHS], dtype=F64)
    old = -0.2 - 2.0 * torch.rand(N, C, generator=gen, dtype=F64)
    out = {
        "old": old,
        "theta": old + 0.35 * torch.randn(N, C, generator=gen, dtype=F64),
        "sampling": old + 0.15 * torch.randn(N, C, generator=gen, dtype=F64),
        "ref": old + 0.3 * torch.randn(N, C, generator=gen, dtype=F64),
        "phi": 4.0 * torch.rand(N, C, generator=gen, dtype=F64),
    }
    return {name: value * real for name, value in out.items()}


# -- TRL's side ---------------------------------------------------------------------------------------------------


class Identity:
    """The accelerator of one process."""

    device = torch.device("cpu")
    num_processes = 1
    process_index = 0
    sync_gradients = True
    is_main_process = True

    def gather(self, x: Any) -> Any:
        return x

    def reduce(self, x: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return x

    def pad_across_processes(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return x


VESPO = {"vespo_k_pos": 2.0, "vespo_lambda_pos": 3.0, "vespo_k_neg": 3.0, "vespo_lambda_neg": 2.0}  # TRL's defaults
ADAPTIVE = {"entropy_coef_min": 0.0, "entropy_coef_max": 1.0, "entropy_coef_delta": 0.005, "entropy_target": 0.2}


def trl_trainer(options: dict[str, Any], t: dict[str, torch.Tensor], leaves: dict[str, torch.Tensor]) -> Any:
    """A `trl.GRPOTrainer` made without ``__init__``, with the attributes its two methods read for these options."""
    trainer = object.__new__(trl_grpo.GRPOTrainer)
    correction = options.get("importance_sampling_correction", False)
    policy, ref = SimpleNamespace(training=True, is_gradient_checkpointing=False), object()

    def logps_and_entropies(model: Any, input_ids: Any, attention_mask: Any, logits_to_keep: int, **kw: Any):
        rows = input_ids[:, -logits_to_keep - 1] - BASE
        if model is ref:
            return t["ref"][rows, :logits_to_keep], None, None
        if kw.get("compute_entropy"):  # the loss's forward: the current policy, differentiable
            return leaves["theta"][rows, :logits_to_keep], leaves["phi"][rows, :logits_to_keep], None
        return t["old"][rows, :logits_to_keep], None, None

    def generate(prompts: list) -> tuple:
        rows = [int(p) for p in prompts]
        completion_ids = [[5] * LENGTHS[i] for i in rows]
        sampling = [t["sampling"][i, : LENGTHS[i]].tolist() for i in rows]
        prompt_ids = [[1] * (1 + i % 3) + [BASE + i] for i in rows]
        tool_mask = [TOOL_MASK.get(i, [1] * LENGTHS[i]) for i in rows] if options.get("tool_mask") else None
        return prompt_ids, completion_ids, tool_mask, [str(i) for i in rows], sampling, {}, None, None

    beta = options.get("beta", 0.0)
    args = SimpleNamespace(
        per_device_train_batch_size=N,
        steps_per_generation=1,
        gradient_accumulation_steps=1,
        gradient_checkpointing_kwargs=None,
        report_to=[],
        **{key: options.get(key, default) for key, default in ADAPTIVE.items()},
        use_bias_correction_kl=options.get("use_bias_correction_kl", True),
        delta=options.get("delta"),
        sapo_temperature_pos=1.0,
        sapo_temperature_neg=1.05,
        **{key: options.get(key, default) for key, default in VESPO.items()},
    )
    trainer.__dict__.update(
        args=args,
        accelerator=Identity(),
        model=policy,
        ref_model=ref,
        environment_factories=None,
        environments=None,
        tools=None,
        _generate=generate,
        _get_per_token_logps_and_entropies=logps_and_entropies,
        _tokenizer=SimpleNamespace(pad_token_id=0),
        pad_to_multiple_of=None,
        mask_truncated_completions=False,
        num_iterations=2,  # old log-probs are computed (generation does not fall on the step), as fastgrpo's are
        use_vllm=correction,
        vllm_importance_sampling_correction=correction,
        vllm_importance_sampling_mode=options.get("importance_sampling_mode", "sequence_mask"),
        vllm_importance_sampling_clip_min=options.get("importance_sampling_clip_min"),
        vllm_importance_sampling_clip_max=options.get("importance_sampling_clip_max", 3.0),
        beta=beta,
        reward_funcs=[correct, formatted],
        reward_func_names=["correct", "formatted"],
        reward_processing_classes=[None, None],
        reward_weights=torch.tensor(options.get("reward_weights", [1.0, 1.0]), dtype=torch.float32),
        num_generations=G,
        scale_rewards=options.get("scale_rewards", "group"),
        multi_objective_aggregation=options.get("multi_objective_aggregation", "sum_then_normalize"),
        state=SimpleNamespace(global_step=0),
        _metrics={"train": defaultdict(list)},
        _logs={
            "prompt": [],
            "completion": [],
            "rewards": defaultdict(list),
            "advantages": [],
            "extra": defaultdict(list),
            "images": [],
        },
        _pending_extra_logs=defaultdict(list),
        _pending_metrics=defaultdict(list),
        log_multimodal=False,
        eos_token_ids=[2],
        top_entropy_quantile=options.get("top_entropy_quantile", 1.0),
        off_policy_mask_threshold=options.get("off_policy_mask_threshold"),
        importance_sampling_level=options.get("importance_sampling_level", "token"),
        loss_type=options.get("loss_type", "dapo"),
        epsilon_low=options.get("epsilon", 0.2),
        epsilon_high=options.get("epsilon_high") or options.get("epsilon", 0.2),
        max_completion_length=C,
        current_gradient_accumulation_steps=1,
        _entropy_bonus_enabled=options.get("entropy_coef", 0.0) > 0 or options.get("use_adaptive_entropy", False),
        entropy_coef=options.get("entropy_coef", 0.0),
        use_adaptive_entropy=options.get("use_adaptive_entropy", False),
        _last_world_entropy=math.inf,
        _entropy_window_stats=None,
        aux_loss_enabled=False,
    )
    return trainer


def run_trl(options: dict[str, Any], t: dict[str, torch.Tensor]) -> tuple[dict, float, dict, dict]:
    """TRL's advantages and reward metrics, then its loss, gradient and metrics over micro-batches of
    ``per_device_train_batch_size`` consecutive rows, accumulated into one optimizer step as TRL accumulates them,
    the metrics the mean of each micro-batch's as TRL logs them."""
    from accelerate import PartialState

    PartialState(cpu=True)  # TRL's warnings go through accelerate's logging, which needs its state
    leaves = {name: t[name].clone().requires_grad_() for name in ("theta", "phi")}
    trainer = trl_trainer(options, t, leaves)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(F64)  # TRL's reward tensors, statistics and constants (sapo's temperatures) in float64
    try:
        return _run_trl(options, t, trainer, leaves)
    finally:
        torch.set_default_dtype(previous)


def _run_trl(options: dict[str, Any], t: dict[str, torch.Tensor], trainer: Any, leaves: dict) -> tuple:
    inputs = trl_grpo.GRPOTrainer._generate_and_score_completions(trainer, [{"prompt": str(i)} for i in range(N)])
    rewards = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    trainer._metrics["train"].clear()
    mb = options["per_device_train_batch_size"]
    steps = N // mb  # micro-batches of consecutive rows, accumulated into one optimizer step of one generation
    trainer.current_gradient_accumulation_steps = steps
    trainer.args.gradient_accumulation_steps = trainer.args.steps_per_generation = steps
    loss = 0.0
    for start in range(0, N, mb):
        trainer.accelerator.sync_gradients = start + mb >= N  # the optimizer step's boundary: its last micro-batch
        part = {k: v[start : start + mb] if torch.is_tensor(v) and v.dim() else v for k, v in inputs.items()}
        step = trl_grpo.GRPOTrainer._compute_loss(trainer, trainer.model, part)
        step.backward()
        loss += float(step)
    grads = {name: leaf.grad for name, leaf in leaves.items()}
    metrics = {k: sum(v) / len(v) for k, v in trainer._metrics["train"].items()}  # TRL's log: the values' mean
    return inputs, loss, grads, {**rewards, **metrics}


# -- fastgrpo's side ----------------------------------------------------------------------------------------------


class TablePolicy(nn.Module):
    """A stand-in for the training forward: the log-probs and entropies of the rows it is given are rows of its
    parameters ``theta`` and ``phi``."""

    def __init__(self, t: dict[str, torch.Tensor]):
        super().__init__()
        self.theta = nn.Parameter(t["theta"].clone())
        self.phi = nn.Parameter(t["phi"].clone())

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, *args: Any):
        rows = input_ids[:, -logits_to_keep - 1] - BASE
        return self.theta[rows, :logits_to_keep], self.phi[rows, :logits_to_keep]


def run_fastgrpo(options: dict[str, Any], t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, float, dict, dict]:
    """fastgrpo's rewards, advantages, and policy update in its own micro-batches; the gradient is read before the
    optimizer step."""
    options = dict(options)
    tool_mask = options.pop("tool_mask", False)
    config = GRPOConfig(
        num_generations=G,
        max_completion_length=C,
        max_grad_norm=1e12,
        gradient_checkpointing=False,  # the table policy has no layers
        **{"per_device_train_batch_size": 3, "gradient_accumulation_steps": N // 3, **options},
    )
    completions = [str(i) for i in range(N)]
    per_func, _ = reward_matrix([correct, formatted], None, completions, None, [{} for _ in range(N)])
    weights = torch.tensor(config.reward_weights or [1.0, 1.0], dtype=F64)
    result = compute_advantages(per_func, weights, G, config.scale_rewards, config.multi_objective_aggregation)
    metrics = {**result.metrics, **function_metrics(per_func, ["correct", "formatted"])}
    prompts = [[1] * (1 + i % 3) + [BASE + i] for i in range(N)]
    sampling = [t["sampling"][i, : LENGTHS[i]].tolist() for i in range(N)]
    batch = build_batch(prompts, [[5] * n for n in LENGTHS], 0, result.advantages, sampling)
    if tool_mask:
        mask_tool_results(batch, [TOOL_MASK.get(i, [1] * n) for i, n in enumerate(LENGTHS)])
    batch.old_logps = t["old"].clone()
    if config.beta > 0:
        batch.ref_logps = t["ref"].clone()
    policy = TablePolicy(t)
    update = PolicyUpdate(policy, None, config, world_size=1)
    update.policy = policy
    grads: dict[str, torch.Tensor] = {}

    def record(*args: Any) -> None:
        grads.update(theta=policy.theta.grad.clone(), phi=policy.phi.grad.clone())

    update.optimizer.register_step_pre_hook(record)
    update.fixed_logps(batch)
    out = update.optimize(batch)
    return result.advantages, out["loss"], grads, {**metrics, **out}


SHARED = (
    "policy_loss",
    "entropy_coef",
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "rewards/correct/mean",
    "rewards/correct/std",
    "rewards/formatted/mean",
    "rewards/formatted/std",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
    "cispo_clip_ratio",
    "vespo/phi_seq_mean",
    "kl",
    "entropy",
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
)

CASES = {
    "dapo": {},
    "adaptive entropy luspo top entropy": {  # the entropies (near 2) below the target: the coefficient rises
        "loss_type": "luspo",
        "use_adaptive_entropy": True,
        "entropy_coef": 0.02,
        "entropy_target": 5.0,
        "entropy_coef_delta": 0.01,
        "top_entropy_quantile": 0.5,
    },
    "adaptive entropy vespo": {"loss_type": "vespo", "use_adaptive_entropy": True, "entropy_coef": 0.02},
    "dapo token_truncate correction": {
        "importance_sampling_correction": True,
        "importance_sampling_mode": "token_truncate",
        "importance_sampling_clip_min": 0.5,
        "importance_sampling_clip_max": 1.5,
    },
    "grpo gspo beta bias-corrected": {
        "loss_type": "grpo",
        "importance_sampling_level": "sequence",
        "epsilon": 0.05,
        "beta": 0.04,
        "importance_sampling_correction": True,
        "importance_sampling_clip_max": 8.0,
    },
    "bnpo beta uncorrected kl": {"loss_type": "bnpo", "beta": 0.1, "use_bias_correction_kl": False},
    "dr_grpo delta off-policy mask": {
        "loss_type": "dr_grpo",
        "epsilon_high": 0.28,
        "delta": 1.5,
        "off_policy_mask_threshold": 0.05,
    },
    "cispo top entropy": {"loss_type": "cispo", "epsilon_high": 1.3, "top_entropy_quantile": 0.4},
    "sapo entropy bonus token_mask": {
        "loss_type": "sapo",
        "entropy_coef": 0.01,
        "importance_sampling_correction": True,
        "importance_sampling_mode": "token_mask",
        "importance_sampling_clip_min": 0.7,
        "importance_sampling_clip_max": 1.4,
    },
    "dapo quantile bonus beta": {"top_entropy_quantile": 0.2, "entropy_coef": 0.05, "beta": 0.1},
    "batch scaling weights": {"scale_rewards": "batch", "reward_weights": [2.0, 0.5]},
    "no scaling": {"scale_rewards": "none"},
    "normalize_then_sum": {"multi_objective_aggregation": "normalize_then_sum", "reward_weights": [1.0, 3.0]},
    "tool mask dapo beta token_truncate": {
        "tool_mask": True,
        "beta": 0.04,
        "importance_sampling_correction": True,
        "importance_sampling_mode": "token_truncate",
        "importance_sampling_clip_max": 1.5,
        "top_entropy_quantile": 0.5,
    },
    "tool mask grpo sequence level": {"tool_mask": True, "loss_type": "grpo", "importance_sampling_level": "sequence"},
    "tool mask dr_grpo": {"tool_mask": True, "loss_type": "dr_grpo", "epsilon_high": 0.28},
    "luspo sequence level": {"loss_type": "luspo", "importance_sampling_level": "sequence", "epsilon": 0.05},
    "luspo beta delta": {"loss_type": "luspo", "beta": 0.04, "delta": 1.5},
    "vespo": {"loss_type": "vespo"},
    "vespo token_truncate correction beta": {
        "loss_type": "vespo",
        "beta": 0.04,
        "importance_sampling_correction": True,
        "importance_sampling_mode": "token_truncate",
        "importance_sampling_clip_min": 0.5,
        "importance_sampling_clip_max": 1.5,
        "vespo_k_pos": 1.5,
        "vespo_lambda_neg": 4.0,
    },
    "tool mask vespo token_mask top entropy": {
        "tool_mask": True,
        "loss_type": "vespo",
        "importance_sampling_correction": True,
        "importance_sampling_mode": "token_mask",
        "importance_sampling_clip_min": 0.7,
        "importance_sampling_clip_max": 1.4,
        "top_entropy_quantile": 0.5,
    },
}


# What TRL computes from 0/1 flags turned float32 (``.float()``): counts, exact, divided in float32 at token level
# (in float64 at sequence level, where the count is a tensor of the default dtype). fastgrpo's (float64) value is
# TRL's to 1e-10, or within float32's rounding of TRL's (each micro-batch's share rounded, then averaged).
FLOAT32_SHARES = {
    "frac_reward_zero_std",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
    "cispo_clip_ratio",
}


def agrees(name: str, actual: float, expected: float) -> bool:
    if name in FLOAT32_SHARES and abs(actual - expected) <= 2**-23 * max(abs(expected), abs(actual)):
        return True
    return close(actual, expected)


def close(actual: float, expected: float) -> bool:
    if math.isnan(expected):
        return math.isnan(actual)
    return abs(actual - expected) <= 1e-10 * max(abs(expected), 1e-300) or actual == expected


@pytest.mark.parametrize("case", list(CASES))
def test_loss_gradient_and_metrics_equal_trls(case: str) -> None:
    options = CASES[case]
    t = tables()
    advantages, loss, grads, metrics = run_fastgrpo(options, t)
    fastgrpo_options = {"per_device_train_batch_size": 3, **options}
    inputs, trl_loss, trl_grads, trl_metrics = run_trl(fastgrpo_options, t)
    # the batch has what the test is for: an unscored completion (advantage 0), an empty one, a group of advantage 0
    assert advantages[2] == 0 and LENGTHS[9] == 0
    if options.get("multi_objective_aggregation") != "normalize_then_sum":  # GDPO centres the batch after the groups
        assert (advantages[4:8] == 0).all()
    torch.testing.assert_close(advantages, inputs["advantages"], rtol=1e-10, atol=0)
    assert close(loss, trl_loss), (loss, trl_loss)
    for name in ("theta", "phi"):
        expected = trl_grads[name] if trl_grads[name] is not None else torch.zeros_like(grads[name])
        torch.testing.assert_close(grads[name], expected, rtol=1e-10, atol=1e-15)
    shared = [name for name in SHARED if name in trl_metrics]
    assert {"reward", "clip_ratio/low_mean", "entropy"} & set(shared)
    if options.get("loss_type") == "vespo":
        assert "vespo/phi_seq_mean" in shared
    if options.get("use_adaptive_entropy") or options.get("entropy_coef"):
        assert {"policy_loss", "entropy_coef"} <= set(shared)
    missing = [name for name in shared if name not in metrics]
    assert not missing, missing
    loss_keys = [n for n in SHARED if n.startswith(("clip_ratio", "cispo", "vespo")) or n == "kl"]
    extra = [name for name in loss_keys if name in metrics and name not in trl_metrics]
    assert not extra, f"logged where TRL logs nothing: {extra}"
    pairs = {name: (metrics[name], trl_metrics[name]) for name in shared}
    differ = {name: pair for name, pair in pairs.items() if not agrees(name, *pair)}
    assert not differ, differ


def test_the_skipped_rows_need_their_pass_for_trls_entropy() -> None:
    """Without the pass over the rows the update skips (``score_skipped_rows: false``) the entropy covers the rows
    trained only, and differs from TRL's; the loss and gradient do not change."""
    t = tables()
    _, loss, grads, metrics = run_fastgrpo({"score_skipped_rows": False}, t)
    _, trl_loss, trl_grads, trl_metrics = run_trl({"per_device_train_batch_size": 3}, t)
    assert close(loss, trl_loss)
    torch.testing.assert_close(grads["theta"], trl_grads["theta"], rtol=1e-10, atol=1e-15)
    assert not close(metrics["entropy"], trl_metrics["entropy"])
