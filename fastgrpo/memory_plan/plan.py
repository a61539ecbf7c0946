"""How much device memory a training run will take, per process, estimated from its options and the model's config
alone (no weights are loaded), item by item, so that a run that cannot fit is refused before its first rollout with
the options that would make it fit.

A GRPO step has two phases whose peaks are separate, each in two moments:

- the rollout: *decode* (the hidden states captured for the draft, the logits of the widest forward), then the
  *draft update* (the draft head's online training on those states); the captured states are given back before the
  policy update;
- the update: the *backward* of a micro-batch (every decoder layer's saved activations; with ``gradient_checkpointing``
  each layer's input instead, and during the backward one layer's activations recomputed at a time; the LM head runs
  in checkpointed chunks of ``logprob_chunk_tokens`` either way), then the *optimizer step* (AdamW's temporaries,
  float32 gradients of the master weights).

The weights (under FSDP2 the shards and the full copy the rollouts compute with), the optimizer state, the reference
model, reward models, the LoRA adapters and the drafters' networks are resident in all four moments, and so are the
rollout's KV caches (the target's and the draft's): the first rollout allocates them for the run's largest rollout,
and they stay through every policy update, so that compiled steps meet the same addresses in every rollout. A
rollout compiled on a GPU also keeps, from its first step on, the memory pool of its CUDA graphs (`graph_pool_bytes`),
which the allocator cannot give back. A training process beside rollout processes rolls out for evaluations alone.
The peak is the largest moment. Prompts count ``max_prompt_length`` tokens, completions ``max_completion_length``.

The rollout's sizes are the engine's own (`fastgrpo.rollout.cache`: the cache's rows, slots and bytes), and each
drafter's items come from its plugin (`fastgrpo.speculative.plugin.DrafterPlugin.memory`). `estimate_memory` makes a
`MemoryPlan`; `fastgrpo.memory_plan.fitting` checks it against the memory available.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from fastgrpo.config import GRPOConfig
from fastgrpo.memory.activations import (
    TrainingForward,
    checkpointed_activation_bytes,
    forward_activation_bytes,
    layer_activation_bytes,
)
from fastgrpo.memory.items import GIB, MOMENTS, PHASE_OF, MemoryItem, MemoryItems
from fastgrpo.memory.shapes import LoraShape, ModelShape, lora_shape
from fastgrpo.models import DTYPES, autocast_bf16, resolve_dtype
from fastgrpo.precision import fused_adamw
from fastgrpo.reward_model import RewardModel
from fastgrpo.rewards import resolve_reward_funcs
from fastgrpo.rollout.cache import cache_bytes, call_length
from fastgrpo.rollout.compiled import compile_backend
from fastgrpo.rollout.target_step import step_rows
from fastgrpo.speculative.configured import tree_bound
from fastgrpo.speculative.plugin import PlannedRun
from fastgrpo.speculative.registry import plugins

CUDA_CONTEXT_BYTES = 2**29  # the CUDA context with torch's kernels loaded (lazily): about 0.5 GiB on recent GPUs
CUDA_WORKSPACE_BYTES = 2**29  # cuBLAS/cuDNN workspaces and the allocator's rounding
HOST_RUNTIME_BYTES = 2**30  # on CPU: Python with torch and transformers imported


@dataclass(frozen=True)
class MemoryPlan:
    """The itemised estimate of a run's device memory per process.

    ``items`` hold bytes at each of the four moments (`MOMENTS`: decode and draft update form the rollout phase,
    backward and optimizer step the update phase); a moment's total is the sum of its column, a phase's the larger
    of its two moments, and the peak the larger phase. The other fields say what the estimate assumed."""

    items: tuple[MemoryItem, ...]
    shape: ModelShape
    device: str
    dtype: str
    world_size: int
    shards: int
    rows: int
    kv_slots: int
    micro_batch_rows: int
    seq_len: int
    parameters: int
    trainable: int
    use_peft: bool
    gradient_checkpointing: bool = False
    rollout: bool = False  # a rollout process's (`rollout_processes`): nothing of the update

    def item(self, name: str) -> MemoryItem:
        """The item called ``name`` (KeyError when the plan has none: it would be 0 everywhere)."""
        for item in self.items:
            if item.name == name:
                return item
        raise KeyError(f"no memory item {name!r}; items: {[i.name for i in self.items]}")

    @property
    def moments(self) -> tuple[int, int, int, int]:
        """Total bytes at each of the four moments."""
        return tuple(sum(item.bytes[k] for item in self.items) for k in range(len(MOMENTS)))  # type: ignore[return-value]

    @property
    def rollout_bytes(self) -> int:
        """Peak of the rollout phase (decode, then the draft update)."""
        return max(self.moments[:2])

    @property
    def update_bytes(self) -> int:
        """Peak of the update phase (a micro-batch's backward, then the optimizer step)."""
        return max(self.moments[2:])

    @property
    def peak_bytes(self) -> int:
        return max(self.rollout_bytes, self.update_bytes)

    @property
    def peak_moment(self) -> str:
        """``phase: moment`` of the peak."""
        k = max(range(len(MOMENTS)), key=lambda j: self.moments[j])
        return f"{PHASE_OF[k]}: {MOMENTS[k]}"

    def summary(self) -> str:
        """One line: the model, precision, training mode and the sizes the estimate assumed."""
        mode = f"LoRA ({self.trainable / 1e6:.1f} M adapter parameters)" if self.use_peft else "full fine-tune"
        procs = f"{self.world_size} process{'es' if self.world_size > 1 else ''}"
        procs = f"a rollout process beside {procs} training" if self.rollout else procs
        if self.shards > 1:
            procs += f", FSDP-sharded {self.shards} ways"
        return (
            f"{self.shape.model_type}, {self.parameters / 1e9:.2f} B parameters in {self.dtype} on {self.device}, "
            f"{mode}, {procs}; rollout of {self.rows} completions x {self.kv_slots} KV slots, update in micro-batches "
            f"of {self.micro_batch_rows} x {self.seq_len} tokens"
            + (", layers checkpointed" if self.gradient_checkpointing else "")
        )

    def table(self) -> str:
        """The plan as text: one line per item in GiB at each moment, the totals, and the phases' peaks."""
        name_width = max(len("item (GiB)"), *(len(i.name) for i in self.items))
        heads = ("rollout:", "rollout:", "update:", "update:")
        lines = [
            " " * name_width + "".join(f"{h:>16}" for h in heads),
            f"{'item (GiB)':<{name_width}}" + "".join(f"{m:>16}" for m in MOMENTS),
        ]
        for item in self.items:
            lines.append(f"{item.name:<{name_width}}" + "".join(f"{b / GIB:16.2f}" for b in item.bytes))
        lines.append(f"{'total':<{name_width}}" + "".join(f"{b / GIB:16.2f}" for b in self.moments))
        lines.append(
            f"peak: rollout phase {self.rollout_bytes / GIB:.2f} GiB, update phase {self.update_bytes / GIB:.2f} GiB; "
            f"{self.peak_bytes / GIB:.2f} GiB at {self.peak_moment}"
        )
        return "\n".join(lines)


def plan_dtype(dtype: str, device: torch.device) -> str:
    """The policy's concrete dtype on ``device`` (`fastgrpo.models.resolve_dtype`); ``auto`` on a CUDA device this
    machine does not have is taken as bfloat16, as on any recent GPU."""
    if dtype == "auto" and device.type == "cuda" and not torch.cuda.is_available():
        return "bfloat16"
    return resolve_dtype(dtype, device)


def planned_run(
    config: GRPOConfig, model_config: PretrainedConfig | ModelShape, device: torch.device | str, world_size: int = 1
) -> PlannedRun:
    """The sizes a plan of ``config``'s run on ``device`` is made from: the model's shape and dtype, and the
    rollout's cache rows, call length and largest tree as the engine makes them (`fastgrpo.rollout.cache`)."""
    device = torch.device(device)
    shape = model_config if isinstance(model_config, ModelShape) else ModelShape.from_config(model_config)
    compiled = compile_backend(config.compile, device) is not None
    return PlannedRun(
        config,
        shape,
        DTYPES[plan_dtype(config.dtype, device)].itemsize,
        world_size,
        device.type == "cuda",
        rows=step_rows(config.rollout_rows, compiled),
        length=call_length(config.max_prompt_length, config.max_completion_length),
        bound=tree_bound(config.speculation),
        compiled=compiled,
    )


def estimate_memory(
    config: GRPOConfig,
    model_config: PretrainedConfig | ModelShape,
    device: torch.device | str = "cuda",
    world_size: int = 1,
    rollout: bool = False,
) -> MemoryPlan:
    """Estimate the device memory one process of ``config``'s run takes on ``device`` (a CUDA device this machine
    lacks is fine: the plan is arithmetic), with ``world_size`` training processes in the job (FSDP shards over
    them); with ``rollout``, a rollout process's (`rollout_processes`), which holds nothing of the update.

    ``model_config`` is the policy's transformers config (or its `ModelShape`). See the module docstring for the
    phases; the comment above each ``items.add`` gives the item's rule."""
    device = torch.device(device)
    run = planned_run(config, model_config, device, world_size)
    shape, w, dtype = run.shape, run.dtype_bytes, plan_dtype(config.dtype, device)
    h, params = shape.hidden_size, shape.num_parameters()
    shards = world_size if config.fsdp and world_size > 1 and not config.use_peft and not rollout else 1

    # What trains: the whole policy, or LoRA adapters that peft keeps in float32 over 16-bit weights.
    lora = lora_shape(shape, config) if config.use_peft else None
    grad_bytes = (4 if w == 2 else w) if lora else w
    trainable = lora.params if lora else params
    masters = config.master_weights and grad_bytes == 2
    moment_bytes = 4 if masters else grad_bytes
    items = MemoryItems()
    train = items if not rollout else MemoryItems()  # the update's items (a rollout process's are dropped)
    rolls_out = rollout or not config.rollout_processes or config.eval_strategy != "no"  # (see the module docstring)

    # Policy weights. Under FSDP2 each rank keeps its shard, and the rollout and the draft update compute with a
    # full copy kept for the whole run at fixed addresses (a captured graph reads them there), which each rollout
    # fills one gathered unit at a time (`distributed.gathered`); during the update one layer (and the next,
    # prefetched) is gathered besides the root's embedding and head. With master weights the shards are float32 (the
    # masters) and are gathered in the policy's dtype. With rollout processes, rank 0 keeps a full copy to send from.
    sharded_masters = masters and shards > 1
    root = shape.embedding_params * (1 if shape.tied_embeddings else 2) + h  # FSDP2's root unit
    if shards == 1:
        items.resident(f"policy weights ({dtype})", params * w)
    else:
        gathered = (root + 2 * shape.layer_params()) * w
        unit = max(root, shape.layer_params()) * w
        own = 0 if sharded_masters else params * w / shards
        what = "gathered from float32 shards" if sharded_masters else "sharded"
        items.add(f"policy weights ({dtype}, {what})", own + unit, own, own + gathered, own)
        if rolls_out:
            items.resident(f"rollout copy of the weights ({dtype})", params * w)
        if config.rollout_processes:
            items.resident(f"weights sent to the rollout processes ({dtype})", params * w)
    if lora:
        items.resident(f"LoRA adapters ({_dtype_name(grad_bytes, dtype)})", lora.params * grad_bytes)

    # Gradients live from the first backward to the optimizer step (zeroed to None after it). With master weights
    # they accumulate in float32: on the masters in one process (each taken from the module as soon as the backward
    # computes it), in FSDP2's float32 shards; DDP accumulates and reduces them in the weights' dtype, in its buckets,
    # and they become float32 on the masters for the step. Under FSDP2 the root's gradients (embedding, head) stay
    # whole in the weights' dtype until the backward ends, and each unit's are reduce-scattered from a copy in the
    # reduction's dtype (float32 with master weights).
    if shards > 1:
        reduced = 4 if sharded_masters else w
        unit = max(root, shape.layer_params()) * reduced
        backward = trainable * (4 if sharded_masters else grad_bytes) / shards + root * w + unit
    elif masters and world_size == 1:
        backward = trainable * 4 + _largest_trainable(shape, lora, config.lora_r) * grad_bytes
    else:
        backward = trainable * grad_bytes
    train.add("policy gradients", 0, 0, backward, trainable * (4 if masters else grad_bytes) / shards)
    if world_size > 1 and shards == 1:
        train.add("DDP gradient buckets", 0, 0, trainable * grad_bytes, trainable * grad_bytes)
    train.resident(f"AdamW moments ({_dtype_name(moment_bytes, dtype)}, x2)", 2 * trainable * moment_bytes / shards)
    if masters:
        train.resident(
            "float32 master weights" + (" (FSDP2's shards)" if sharded_masters else ""), trainable * 4 / shards
        )
    # AdamW's step fused (on CUDA, `fused_adamw`) updates in place; the default loop (elsewhere) makes a buffer the
    # size of one parameter's moment (the square root of the second moment) at a time.
    if not fused_adamw(device):
        largest = _largest_trainable(shape, lora, config.lora_r)
        train.add("AdamW step buffer", 0, 0, 0, largest * moment_bytes / shards)
    if config.beta > 0 and not lora:
        train.resident(f"reference model ({dtype})", params * w)
    for scorer in (f for f in resolve_reward_funcs(config.reward_funcs) if isinstance(f, RewardModel)):
        count = scorer.parameter_count()  # a hub id not downloaded yet: unknown, left out
        if count is not None:
            items.resident(f"reward model {scorer.__name__} ({dtype})", count * w)

    if rolls_out:
        _rollout_items(items, run, lora)
        if device.type == "cuda" and compile_backend(config.compile, device) == "inductor":
            items.resident("CUDA graph pool", graph_pool_bytes(run))
    for plugin in plugins(config.speculation):
        items.items += plugin.memory(run)
    _update_items(train, config, shape, w, lora, grad_bytes, run.cuda, autocast_bf16(config.bf16, device))

    if device.type == "cuda":
        items.resident("CUDA context", CUDA_CONTEXT_BYTES)
        items.resident("CUDA workspaces", CUDA_WORKSPACE_BYTES)
    else:
        items.resident("Python, torch and transformers", HOST_RUNTIME_BYTES)
    return MemoryPlan(
        items=tuple(items.items),
        shape=shape,
        device=device.type,
        dtype=dtype,
        world_size=world_size,
        shards=shards,
        rows=run.rows,
        kv_slots=run.kv_slots,
        micro_batch_rows=config.per_device_train_batch_size,
        seq_len=config.max_prompt_length + config.max_completion_length,
        parameters=params,
        trainable=trainable,
        use_peft=config.use_peft,
        gradient_checkpointing=config.gradient_checkpointing,
        rollout=rollout,
    )


def _largest_trainable(shape: ModelShape, lora: LoraShape | None, rank: int) -> int:
    """Elements of the largest trainable tensor: the embedding (or a linear weight) of the policy, or the largest
    LoRA adapter matrix."""
    if lora is None:
        return max(shape.embedding_params, *(i * o for i, o in shape.linears().values()))
    widths = [max(i, o) for name, (i, o) in shape.linears().items() if name in lora.modules]
    if lora.modules & {"lm_head", "embed_tokens"}:
        widths.append(shape.vocab_size)
    return rank * max(widths, default=shape.hidden_size)


def _dtype_name(size: int, policy_dtype: str) -> str:
    """The name of a ``size``-byte floating dtype: the policy's own when it has that size, else float32/float64."""
    return policy_dtype if DTYPES[policy_dtype].itemsize == size else f"float{8 * size}"


def _forward_temporaries(run: PlannedRun, tokens: int, score_elements: int) -> int:
    """Bytes of a rollout forward's temporaries over ``tokens`` tokens whose attention scores hold ``score_elements``
    elements (per head): one layer's at a time (inference mode), the scores of a masked SDPA in float32, and the
    logits: the verified tree's raw logits ``[rows, nodes, V]`` and float32 sampling distributions ``[rows, V]``
    (three of them) of the largest tree."""
    shape, w, rows = run.shape, run.dtype_bytes, run.rows
    h, v, q, kv = shape.hidden_size, shape.vocab_size, shape.q_width, shape.kv_width
    per_token = h * (3 * w + 4) + (q + 2 * kv) * w + 2 * q * w + 3 * shape.intermediate_size * w
    logits = rows * _tree_nodes(run) * v * w + 3 * rows * v * 4
    return tokens * per_token + 4 * shape.num_heads * score_elements + logits


def _tree_nodes(run: PlannedRun) -> int:
    """Tokens per row of the rollout's widest decoding step: the largest tree's nodes (1 without speculation)."""
    return run.bound.nodes if run.bound is not None else 1


def graph_pool_bytes(run: PlannedRun) -> int:
    """Bytes of the private memory pool of a rollout's CUDA graphs (inductor's ``reduce-overhead`` mode, on a GPU).

    Every graph a rollout records (the target's steps and the draft's tree expansions, one per row bucket, tree shape
    and extent) takes its intermediate buffers and outputs from one pool, which stays reserved for replays while the
    run lasts: ``empty_cache`` cannot give it back, so it is counted from the first rollout on and through every
    update. The graphs run one at a time (each call begins a new step of the graph trees, so the outputs of the last
    one are dead) and reuse the pool's blocks, so the pool is about the largest graph's live memory: the target's
    decoding step at the largest row bucket (the rows the plan takes) over the largest tree, reading every KV slot.
    Its live memory is bounded by the same rule as the widest eager forward's (`_forward_temporaries`: one layer's
    temporaries, the float32 attention scores and the logits; inductor's fused kernels keep fewer), which is the
    estimate."""
    tokens = run.rows * _tree_nodes(run)
    return _forward_temporaries(run, tokens, tokens * run.kv_slots)


def _rollout_items(items: MemoryItems, run: PlannedRun, lora: LoraShape | None) -> None:
    """The rollout's KV cache (kept for the whole run), captured states (decode; they stay until after the draft
    update) and forward temporaries (decode)."""
    config, shape, w = run.config, run.shape, run.dtype_bytes
    rows, p_len, c_len = run.rows, config.max_prompt_length, config.max_completion_length
    prompts = config.generation_batch_size // config.num_generations
    h = shape.hidden_size
    items.resident("KV cache", cache_bytes(shape.kv_dims, run.cache_rows, run.kv_slots, w))
    if lora and w == 2:  # `merged_lora` keeps each adapted 16-bit weight to restore it exactly
        items.add("LoRA merge copies", lora.adapted * w)
    if config.draft_training.online and any(p.captures_hidden for p in plugins(config.speculation)):
        # Per row [prompt + completion - 1, H]: while `Generation.output` concatenates them, the pieces (the
        # prefill's per-prompt states and every step's) are alive too.
        kept = rows * (p_len + c_len - 1) * h * w
        pieces = (prompts * p_len + rows * c_len) * h * w
        items.add("captured hidden states", kept + pieces, kept)
    # The widest forward: the prefill of the prompts or a tree per row (`_forward_temporaries`).
    width = _tree_nodes(run)
    tokens = max(prompts * p_len, rows * width)
    scores = max(prompts * p_len * p_len, rows * width * run.kv_slots)
    items.add("rollout forward temporaries", _forward_temporaries(run, tokens, scores))


def _update_items(
    items: MemoryItems, config: GRPOConfig, shape: ModelShape, w: int, lora: LoraShape | None, grad_bytes: int,
    cuda: bool, bf16: bool,
) -> None:  # fmt: skip
    """The policy update's saved activations for one micro-batch (with ``gradient_checkpointing``: what the
    checkpointed forward keeps, and one layer's recomputed activations) and its backward temporaries."""
    rows, seq_len = config.per_device_train_batch_size, config.max_prompt_length + config.max_completion_length
    run = TrainingForward(
        residual=w,
        compute=2 if bf16 and w == 4 else w,
        full=lora is None,
        lora_modules=lora.modules if lora else frozenset(),
        lora_rank=config.lora_r,
        lora_bytes=grad_bytes,
        lora_dropout=config.lora_dropout > 0,
        cuda=cuda,
    )
    kept = rows * config.max_completion_length
    if config.gradient_checkpointing:
        saved, recomputed = checkpointed_activation_bytes(shape, run, rows, seq_len, kept)
        items.add("update activations (micro-batch)", 0, 0, saved)
        items.add("recomputed layer activations", 0, 0, recomputed)
    else:
        items.add("update activations (micro-batch)", 0, 0, forward_activation_bytes(shape, run, rows, seq_len, kept))
    # The backward of the LM head, chunk by chunk: the chunk's logits recomputed and upcast, their log-softmax and
    # gradients, the head's low-precision copy under autocast, and the head's weight gradient before it is
    # accumulated; or one decoder layer's gradients (and with checkpointing the temporaries of its recomputation).
    chunk = min(config.logprob_chunk_tokens, kept)
    head = chunk * shape.vocab_size * (run.compute + 16)
    if run.compute != run.residual:
        head += shape.embedding_params * run.compute
    if lora is None:
        head += shape.embedding_params * w
    layer = rows * seq_len * layer_activation_bytes(shape, run, seq_len)
    items.add("backward temporaries", 0, 0, max(head, layer))
