"""What a forward with autograd saves for its backward, per decoder layer and in all, with and without gradient
checkpointing: measured against the tensors autograd saves in ``tests/test_memory_plan.py``."""

from __future__ import annotations

import math
from dataclasses import dataclass

from fastgrpo.memory.shapes import ModelShape


@dataclass(frozen=True)
class TrainingForward:
    """How a forward with autograd runs, for what it saves: ``residual`` bytes per element of the hidden states
    between layers (the weights' dtype), ``compute`` bytes of linear outputs (2 under bfloat16 autocast of float32
    weights), ``full`` whether the layers' weights train, and LoRA's adapted ``lora_modules`` (rank ``lora_rank``,
    adapters of ``lora_bytes`` per element, ``lora_dropout`` above 0); ``cuda``: on a GPU (where dropout keeps a
    one-byte mask and the attention kernel pads its mask to 16 columns), else on the CPU (a mask in the input's dtype,
    no padding)."""

    residual: int
    compute: int
    full: bool
    lora_modules: frozenset[str] = frozenset()
    lora_rank: int = 0
    lora_bytes: int = 4
    lora_dropout: bool = False
    cuda: bool = True


def _linear_inputs_saved(shape: ModelShape, run: TrainingForward) -> int:
    """Bytes per token and layer that the linear layers (and LoRA branches) save of their inputs.

    A trained linear layer saves its input (once per shared input; under autocast each layer its own low-precision
    copy); a frozen one saves nothing of it. peft's LoRA branch casts the input to the adapters' dtype, applies
    dropout (keeping its output and its mask) and saves what reaches ``lora_A``, and ``lora_B`` saves the
    rank-wide product."""
    h, i = shape.hidden_size, shape.intermediate_size
    groups = (  # (features, layers reading the input, input dtype bytes, saved elsewhere anyway)
        (h, ("q_proj", "k_proj", "v_proj"), run.residual, False),  # the RMSNorm's output
        (shape.q_width, ("o_proj",), run.compute, True),  # the attention output, saved by the attention kernel
        (h, ("gate_proj", "up_proj"), run.residual, False),
        (i, ("down_proj",), run.compute, False),
    )
    total = 0
    for width, readers, dtype, elsewhere in groups:
        if run.full:
            if dtype != run.compute:
                total += len(readers) * width * run.compute
            elif not elsewhere:
                total += width * dtype
            continue
        adapted = [name for name in readers if name in run.lora_modules]
        if not adapted:
            continue
        total += len(adapted) * run.lora_rank * run.lora_bytes
        if run.lora_dropout:
            total += len(adapted) * width * (run.lora_bytes + (1 if run.cuda else run.lora_bytes))
        elif dtype != run.lora_bytes:
            total += len(adapted) * width * run.lora_bytes
        elif not elsewhere:
            total += width * dtype
    return total


def layer_activation_bytes(shape: ModelShape, run: TrainingForward, seq_len: int) -> int:
    """Bytes one decoder layer saves for the backward, per token of a batch of rows ``seq_len`` tokens wide.

    RMSNorm keeps its float32 input and its reciprocal RMS and, when its weight trains, the normalised input before
    the weight (the output after it is a linear layer's input); attention (PyTorch SDPA on CUDA with
    the padding mask, which rules out the grouped-query kernels, so keys and values are repeated to every head)
    keeps the query, keys, values, output and float32 log-sum-exp, and the mask converted to the query's dtype
    (padded to 16 columns on CUDA); the MLP keeps the gate output, its SiLU and the up output; plus
    `_linear_inputs_saved`. Measured against the tensors autograd saves in ``tests/test_memory_plan.py``."""
    h, q, kv = shape.hidden_size, shape.q_width, shape.kv_width
    a = run.compute
    norms = 2 * (4 * h + 4 + (run.residual * h if run.full else 0))
    heads = shape.num_heads + shape.num_kv_heads
    qk_norms = (4 + (a if run.full else 0)) * (q + kv) + 4 * heads if shape.qk_norm else 0
    mask_columns = 16 * math.ceil(seq_len / 16) if run.cuda else seq_len
    attention = 4 * q * a + 4 * shape.num_heads + mask_columns * a
    mlp = 3 * shape.intermediate_size * a
    return norms + qk_norms + attention + mlp + _linear_inputs_saved(shape, run)


def _embedding_trains(run: TrainingForward) -> bool:
    """Whether the token embedding trains (full fine-tune, or LoRA on ``embed_tokens``): then it keeps the token ids,
    and a gradient flows into the first layer's input even without checkpointing."""
    return run.full or "embed_tokens" in run.lora_modules


def head_saved_bytes(shape: ModelShape, run: TrainingForward, rows: int, seq_len: int, kept: int) -> int:
    """Bytes a policy forward with autograd saves after its last decoder layer, all released by the time the
    backward reaches that layer: the final norm's (its float32 input and reciprocal RMS, and the normalised input
    when its weight trains) over ``rows`` x ``seq_len`` tokens, and for the ``kept`` positions the hidden states
    gathered for the LM head and the target ids (both inputs of the head's checkpointed chunks)."""
    h = shape.hidden_size
    final_norm = 4 * h + 4 + (run.residual * h if run.full else 0)
    return rows * seq_len * final_norm + kept * (h * run.residual + 8)


def forward_activation_bytes(shape: ModelShape, run: TrainingForward, rows: int, seq_len: int, kept: int) -> int:
    """Bytes a policy forward with autograd keeps until its backward: every layer's (`layer_activation_bytes`) over
    ``rows`` x ``seq_len`` tokens, `head_saved_bytes`, the rotary tables (in the hidden states' dtype) and, when the
    embedding trains, the token ids; under autocast also the low-precision copies of the decoder's weights. With
    frozen embeddings (LoRA) no gradient flows into the first layer's input, so its input norm keeps nothing and the
    dropout of its query/key/value adapters keeps no mask."""
    tokens = rows * seq_len
    h = shape.hidden_size
    per_token = shape.num_layers * layer_activation_bytes(shape, run, seq_len) + 2 * shape.head_dim * run.residual
    if _embedding_trains(run):
        per_token += 8
    else:
        per_token -= 4 * h + 4
        if run.lora_dropout:
            adapted = len({"q_proj", "k_proj", "v_proj"} & run.lora_modules)
            per_token -= adapted * h * (1 if run.cuda else run.lora_bytes)
    total = tokens * per_token + head_saved_bytes(shape, run, rows, seq_len, kept)
    if run.compute != run.residual:  # the LM head's copy is not kept: its chunks are recomputed in the backward
        total += shape.linear_weights() * run.compute
    return total


def autocast_copy_bytes(shape: ModelShape, run: TrainingForward) -> int:
    """Bytes of the low-precision copies autocast caches in a forward with autograd of wider weights (0 without
    autocast): every decoder linear layer's weight and bias and the LM head's weight, held until the autocast region
    ends (after it only the copies autograd saves stay: the decoder weights, without checkpointing)."""
    if run.compute == run.residual:
        return 0
    biases = shape.num_layers * sum(o for name, (_, o) in shape.linears().items() if shape.biases()[name])
    return (shape.linear_weights() + biases + shape.embedding_params) * run.compute


def checkpointed_activation_bytes(
    shape: ModelShape, run: TrainingForward, rows: int, seq_len: int, kept: int
) -> tuple[int, int]:
    """``(saved, recomputed)`` bytes of a policy forward with gradient checkpointing (transformers'
    ``GradientCheckpointingLayer`` around every decoder layer, non-reentrant ``torch.utils.checkpoint``), over
    ``rows`` x ``seq_len`` tokens.

    ``saved``: what the forward keeps until its backward. Each checkpointed layer keeps its positional input, the
    hidden states (in their dtype); the keyword arguments it is recomputed with are shared by all layers and kept
    once: the position ids (int64), the boolean 4-D attention mask (one byte per key) and the rotary cos and sin.
    Outside the layers the forward saves what it saves without checkpointing: `head_saved_bytes`, and the token ids
    when the embedding trains. (Under checkpointing transformers makes the embedding's output require a gradient, so
    the first layer is recomputed like the others even with LoRA.)

    ``recomputed``: what the backward adds, one layer at a time: the layer's saved tensors, recomputed when its
    backward begins (`layer_activation_bytes`; in float32 less the input norm's float32 input, which is the layer
    input already in ``saved``) and released as its backward consumes them. Under autocast of wider weights it is
    the larger of that with the layer's low-precision weight copies and the forward's cast cache
    (`autocast_copy_bytes`), which holds every weight's copy until the forward ends.

    Measured on tiny models (``tests/test_memory_plan.py``, CPU kernels): ``saved`` is exactly what the forward
    leaves alive, and the live total during the backward peaks at the start of the last layer's backward at
    ``saved + recomputed - head_saved_bytes`` (the head's and final norm's tensors are released by then), so
    ``saved + recomputed`` bounds it from above. Not counted here: the recomputation's own temporaries (the
    intermediate outputs that are not saved, a few of a layer's activations: under peft's float32 adapters over
    16-bit weights an MLP projection's float32 LoRA output and its scaled copy) and the gradients of the layer's
    backward, both alive only during that layer's recomputation or backward and left to `estimate_memory`'s backward
    temporaries (one layer's activations, or an LM head chunk's if larger)."""
    tokens = rows * seq_len
    h = shape.hidden_size
    per_token = shape.num_layers * h * run.residual + 8 + seq_len + 2 * shape.head_dim * run.residual
    if _embedding_trains(run):
        per_token += 8
    saved = tokens * per_token + head_saved_bytes(shape, run, rows, seq_len, kept)
    layer = layer_activation_bytes(shape, run, seq_len) - (4 * h if run.residual == 4 else 0)
    recomputed = tokens * layer
    if run.compute != run.residual:
        layer_copies = shape.linear_weights() // shape.num_layers * run.compute
        recomputed = max(recomputed + layer_copies, autocast_copy_bytes(shape, run))
    return saved, recomputed
