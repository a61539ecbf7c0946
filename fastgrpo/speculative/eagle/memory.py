"""The EAGLE drafter's device memory in a run (`EaglePlugin.memory`): the draft head in the policy's dtype, its
training state and temporaries, its KV cache (sized as `EagleDrafter.cache_slots` sizes it) and what drafting a tree
adds to the rollout's widest forward; and what it adds to a checkpoint."""

from __future__ import annotations

from transformers import PretrainedConfig

from fastgrpo.memory.activations import TrainingForward, layer_activation_bytes
from fastgrpo.memory.items import MemoryItem, MemoryItems
from fastgrpo.memory.shapes import ModelShape
from fastgrpo.rollout.cache import cache_bytes
from fastgrpo.speculative.eagle.drafter import EagleDrafter
from fastgrpo.speculative.plugin import PlannedRun


def draft_parameters(shape: ModelShape) -> tuple[int, int]:
    """``(all, trainable)`` parameters of the draft head (`fastgrpo.speculative.eagle.head.DraftHead`) of a target of
    ``shape``: the ``2H -> H`` input projection with its bias, one decoder layer, the final norm and a one-row
    embedding that is frozen."""
    h = shape.hidden_size
    trainable = 2 * h * h + h + shape.layer_params() + h
    return trainable + h, trainable


def draft_file_bytes(target_config: PretrainedConfig, dtype_bytes: int, draft_vocab_size: int | None) -> int:
    """About what `DraftHead.save` writes for the target of ``target_config`` whose weights take ``dtype_bytes``
    each: the head's parameters and a reduced vocabulary's int64 token ids."""
    total, _ = draft_parameters(ModelShape.from_config(target_config))
    return total * dtype_bytes + 8 * (draft_vocab_size or 0)


def eagle_memory(run: PlannedRun) -> list[MemoryItem]:
    """The draft head (in the policy's dtype), its AdamW moments and gradients (which stay allocated between its
    updates; a bfloat16 or float16 draft also keeps float32 master weights, and its moments and the gradients the
    optimizer reads are float32), its training temporaries, its cache and its tree's forward temporaries."""
    config, shape, w = run.config, run.shape, run.dtype_bytes
    items = MemoryItems()
    total, trainable = draft_parameters(shape)
    items.resident("draft head", total * w)
    _, kv_heads, head_dim = shape.kv_dims
    slots = EagleDrafter.cache_slots(run.length, run.bound)
    items.resident("draft KV cache", cache_bytes((1, kv_heads, head_dim), run.cache_rows, slots, w))  # kept for the run
    # Per tree level the draft's logits over the top-k frontier (raw and float32), and the pending pairs it reads.
    h, v = shape.hidden_size, shape.vocab_size
    pending = 2 * run.rows * (config.max_prompt_length + 1) * h * w
    items.add("draft forward temporaries", run.rows * run.bound.top_k * v * (w + 4) + pending)
    if config.draft_training.online:
        _training_items(items, run, total, trainable)
    return items.items


def _training_items(items: MemoryItems, run: PlannedRun, total: int, trainable: int) -> None:
    config, shape, w = run.config, run.shape, run.dtype_bytes
    ddp = 2 if run.world_size > 1 else 1
    if w < 4:  # `DraftTrainer` keeps float32 masters: their gradients and moments are float32
        items.resident("draft float32 master weights", total * 4)
        items.resident("draft gradients and AdamW moments", trainable * (w * ddp + 4 + 8))
    else:
        items.resident("draft gradients and AdamW moments", trainable * w * (2 + ddp))
    dt = config.draft_training
    p_len, c_len, rows = config.max_prompt_length, config.max_completion_length, config.generation_batch_size
    # A batch packs rows up to token_budget tokens (a longer row alone); its completion positions are trained, each
    # through the LM head twice (the target's distribution and the draft's), over the draft vocabulary.
    tokens = min(max(dt.token_budget, p_len + c_len), rows * (p_len + c_len))
    positions = min(tokens, rows * c_len) * dt.unroll
    vocab = config.speculation.draft_vocab_size or shape.vocab_size
    logits = positions * vocab * (2 * w + 16) + (vocab * shape.hidden_size * w if vocab < shape.vocab_size else 0)
    forward = TrainingForward(residual=w, compute=2 if dt.bf16 and w == 4 else w, full=True, cuda=run.cuda)
    h = shape.hidden_size
    per_token = layer_activation_bytes(shape, forward, min(tokens, p_len + c_len)) + 4 * h * w + (4 + w) * h
    # AdamW's, as the policy's (over float32 masters for a low-precision draft)
    step_buffer = (trainable if run.cuda else max(2 * h * h, h * shape.intermediate_size)) * max(w, 4)
    items.add("draft training temporaries", 0, tokens * dt.unroll * per_token + logits + step_buffer)


def eagle_checkpoint_bytes(run: PlannedRun) -> int:
    """The draft head's weights and, unless ``save_only_model``, its AdamW state (two moments in its dtype, or
    float32 moments and master weights for a low-precision draft)."""
    total, _ = draft_parameters(run.shape)
    w = run.dtype_bytes
    adam_state = 2 * w if w >= 4 else 12
    return total * w + (0 if run.config.save_only_model else total * adam_state)
