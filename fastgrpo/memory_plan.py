"""How much device memory a training run will take, per process, estimated from its options and the model's config
alone (no weights are loaded), item by item, so that a run that cannot fit is refused before its first rollout with
the options that would make it fit.

A GRPO step has two phases whose peaks are separate, each in two moments:

- the rollout: *decode* (the KV caches, the hidden states captured for the draft, the logits of the widest forward),
  then the *draft update* (the draft head's online training on those states); the KV caches and captured states are
  given back before the policy update;
- the update: the *backward* of a micro-batch (every decoder layer's saved activations; with ``gradient_checkpointing``
  each layer's input instead, and during the backward one layer's activations recomputed at a time; the LM head runs
  in checkpointed chunks of ``logprob_chunk_tokens`` either way), then the *optimizer step* (AdamW's temporaries,
  float32 gradients of the master weights).

The weights, the optimizer state, the reference model, the LoRA adapters and the draft head are resident in all four
moments. The peak is the largest moment. Every prompt is taken at ``max_prompt_length`` and every completion at
``max_completion_length``: the estimate bounds a run whose rows are shorter.

`estimate_memory` makes a `MemoryPlan`; `check_fits` refuses a plan larger than the memory available, naming the
options that would fit (each re-estimated); `plan_for_trainer` is what the trainer calls on CUDA, and `dry_run` is
``fastgrpo train --dry-run``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from fastgrpo.config import GRPOConfig
from fastgrpo.models import DTYPES, SUPPORTED_FAMILIES, check_model_source, resolve_dtype, resolve_model_path

GIB = 2**30
CUDA_CONTEXT_BYTES = 2**29  # the CUDA context with torch's kernels loaded (lazily): about 0.5 GiB on recent GPUs
CUDA_WORKSPACE_BYTES = 2**29  # cuBLAS/cuDNN workspaces and the allocator's rounding
HOST_RUNTIME_BYTES = 2**30  # on CPU: Python with torch and transformers imported
CARD_80GB_BYTES = 81559 * 2**20  # what an 80 GB A100/H100 reports in all
MASTERS = "float32 master weights"
MOMENTS = ("decode", "draft update", "backward", "optimizer step")
PHASE_OF = ("rollout", "rollout", "update", "update")


# ---------------------------------------------------------------------------------------------- the model's shapes
@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer that memory depends on, read from its transformers config.

    ``qkv_bias``/``o_bias``: biases of the query/key/value and output projections (Qwen2 has the former only; Llama
    and Qwen3 follow ``attention_bias`` for all four); ``mlp_bias``: biases of the MLP (Llama's ``mlp_bias``);
    ``qk_norm``: an RMSNorm over the head dimension of queries and keys (Qwen3)."""

    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> ModelShape:
        """The shape of the model ``config`` describes (the text model's, for a multimodal config)."""
        text = config.get_text_config()
        heads = text.num_attention_heads
        family = text.model_type
        attention_bias = bool(getattr(text, "attention_bias", False))
        tied = getattr(text, "tie_word_embeddings", None)
        return cls(
            model_type=family,
            hidden_size=text.hidden_size,
            num_layers=text.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
            intermediate_size=text.intermediate_size,
            vocab_size=text.vocab_size,
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False) if tied is None else tied),
            qkv_bias=True if family == "qwen2" else attention_bias,
            o_bias=False if family == "qwen2" else attention_bias,
            mlp_bias=bool(getattr(text, "mlp_bias", False)),
            qk_norm=family == "qwen3",
        )

    @property
    def q_width(self) -> int:
        """Query (and attention output) features: heads x head dim."""
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Key (or value) features: KV heads x head dim."""
        return self.num_kv_heads * self.head_dim

    def linears(self) -> dict[str, tuple[int, int]]:
        """``(in, out)`` features of each linear layer of a decoder layer."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (h, self.q_width),
            "k_proj": (h, self.kv_width),
            "v_proj": (h, self.kv_width),
            "o_proj": (self.q_width, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def biases(self) -> dict[str, bool]:
        """Whether each linear layer of a decoder layer has a bias."""
        qkv, mlp = self.qkv_bias, self.mlp_bias
        return {
            "q_proj": qkv,
            "k_proj": qkv,
            "v_proj": qkv,
            "o_proj": self.o_bias,
            "gate_proj": mlp,
            "up_proj": mlp,
            "down_proj": mlp,
        }

    def layer_params(self) -> int:
        """Parameters of one decoder layer: its linear layers (and biases), two RMSNorms, Qwen3's query/key norms."""
        linear = sum(i * o + (o if self.biases()[name] else 0) for name, (i, o) in self.linears().items())
        return linear + 2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)

    def linear_weights(self) -> int:
        """Weight elements of every decoder layer's linear layers (no biases)."""
        return self.num_layers * sum(i * o for i, o in self.linears().values())

    @property
    def embedding_params(self) -> int:
        """Elements of the token embedding (and of an untied LM head)."""
        return self.vocab_size * self.hidden_size

    def num_parameters(self) -> int:
        """All parameters of the causal LM, a tied LM head counted once (as ``model.parameters()`` does)."""
        head = 0 if self.tied_embeddings else self.embedding_params
        return self.embedding_params + self.num_layers * self.layer_params() + self.hidden_size + head

    def draft_parameters(self) -> tuple[int, int]:
        """``(all, trainable)`` parameters of the draft head (`fastgrpo.speculative.eagle.head.DraftHead`): the ``2H -> H``
        input projection with its bias, one decoder layer, the final norm and a one-row embedding that is frozen."""
        h = self.hidden_size
        trainable = 2 * h * h + h + self.layer_params() + h
        return trainable + h, trainable


@dataclass(frozen=True)
class LoraShape:
    """LoRA adapters on a model: ``params`` adapter parameters, ``adapted`` base-weight elements of the modules they
    adapt (the copies kept while merged into low-precision weights), ``modules`` the adapted module names."""

    params: int
    adapted: int
    modules: frozenset[str]


def lora_shape(shape: ModelShape, config: GRPOConfig) -> LoraShape:
    """The adapters `fastgrpo.grpo.policy.wrap_lora` adds: rank ``lora_r`` on every decoder linear layer (peft's
    ``all-linear``, which leaves the LM head out) or on the modules ``lora_target_modules`` names (by their last name
    component, as peft matches them; ``lm_head`` and ``embed_tokens`` too)."""
    r = config.lora_r
    names = {t.rsplit(".", 1)[-1] for t in config.lora_target_modules} if config.lora_target_modules else None
    linears = {n: io for n, io in shape.linears().items() if names is None or n in names}
    params = shape.num_layers * sum(r * (i + o) for i, o in linears.values())
    adapted = shape.num_layers * sum(i * o for i, o in linears.values())
    extra = {"lm_head", "embed_tokens"} & (names or set())
    for _ in extra:  # an embedding's adapter is r x (V + H), as a linear layer's
        params += r * (shape.vocab_size + shape.hidden_size)
        adapted += shape.embedding_params
    return LoraShape(params, adapted, frozenset(linears) | extra)


# ---------------------------------------------------------------------------------------------- activations
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


# ---------------------------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class MemoryItem:
    """One thing a run keeps on its device: ``bytes`` at each of the four moments of `MOMENTS`."""

    name: str
    bytes: tuple[int, int, int, int]

    @property
    def peak(self) -> int:
        return max(self.bytes)


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


def _tree(config: GRPOConfig) -> tuple[int, int, int] | None:
    """``(nodes, top_k, depth)`` of the largest draft tree a rollout may verify (None: speculation off)."""
    spec = config.speculation
    if spec.mode == "off":
        return None
    if spec.mode == "static":
        return spec.nodes, spec.top_k, spec.depth
    return spec.n_max, spec.k_max, spec.l_max


class _Items:
    """Collects `MemoryItem`s, dropping those that are 0 at every moment."""

    def __init__(self) -> None:
        self.items: list[MemoryItem] = []

    def add(self, name: str, decode: float = 0, draft: float = 0, backward: float = 0, step: float = 0) -> None:
        values = tuple(int(v) for v in (decode, draft, backward, step))
        if any(values):
            self.items.append(MemoryItem(name, values))  # type: ignore[arg-type]

    def resident(self, name: str, size: float) -> None:
        """An item of the same size at every moment."""
        self.add(name, size, size, size, size)


def estimate_memory(
    config: GRPOConfig,
    model_config: PretrainedConfig | ModelShape,
    device: torch.device | str = "cuda",
    world_size: int = 1,
) -> MemoryPlan:
    """Estimate the device memory one process of ``config``'s run takes on ``device`` (a CUDA device this machine
    lacks is fine: the plan is arithmetic), with ``world_size`` processes in the job (FSDP shards over them).

    ``model_config`` is the policy's transformers config (or its `ModelShape`). See the module docstring for the
    phases; the comment above each ``items.add`` gives the item's rule."""
    shape = model_config if isinstance(model_config, ModelShape) else ModelShape.from_config(model_config)
    device = torch.device(device)
    dtype = plan_dtype(config.dtype, device)
    w = DTYPES[dtype].itemsize
    h = shape.hidden_size
    params = shape.num_parameters()
    shards = world_size if config.fsdp and world_size > 1 and not config.use_peft else 1

    # What trains: the whole policy, or LoRA adapters that peft keeps in float32 over 16-bit weights.
    lora = lora_shape(shape, config) if config.use_peft else None
    grad_bytes = (4 if w == 2 else w) if lora else w
    trainable = lora.params if lora else params
    masters = config.master_weights and grad_bytes == 2
    moment_bytes = 4 if masters else grad_bytes
    items = _Items()

    # Policy weights. FSDP2 gathers them in full for the rollout and the draft update (each rank keeps its shard
    # too); during the update one layer (and the next, prefetched) is gathered besides the root's embedding and head.
    if shards == 1:
        items.resident(f"policy weights ({dtype})", params * w)
    else:
        root = shape.embedding_params * (1 if shape.tied_embeddings else 2) + h
        gathered = (root + 2 * shape.layer_params()) * w
        full = params * w + params * w / shards
        items.add(f"policy weights ({dtype}, sharded)", full, full, params * w / shards + gathered, params * w / shards)
    if lora:
        items.resident(f"LoRA adapters ({_dtype_name(grad_bytes, dtype)})", lora.params * grad_bytes)

    # Gradients live from the first backward to the optimizer step (zeroed to None after it); with master weights
    # they become float32 on the masters for the step. DDP keeps a bucketed copy for its all-reduce.
    step_grads = trainable * (4 if masters else grad_bytes) / shards
    items.add("policy gradients", 0, 0, trainable * grad_bytes / shards, step_grads)
    if world_size > 1 and shards == 1:
        items.add("DDP gradient buckets", 0, 0, trainable * grad_bytes, trainable * grad_bytes)
    items.resident(f"AdamW moments ({_dtype_name(moment_bytes, dtype)}, x2)", 2 * trainable * moment_bytes / shards)
    if masters:
        items.resident(MASTERS, trainable * 4 / shards)
    # AdamW's step on CUDA (foreach) makes one moment-sized buffer (the square root of the second moment) for all
    # parameters at once; on the CPU (a loop) for one parameter at a time.
    largest = trainable if device.type == "cuda" else _largest_trainable(shape, lora, config.lora_r)
    items.add("AdamW step buffer", 0, 0, 0, largest * moment_bytes / shards)
    if config.beta > 0 and not lora:
        items.resident(f"reference model ({dtype})", params * w)

    cuda = device.type == "cuda"
    _rollout_items(items, config, shape, w, lora, cuda)
    _draft_items(items, config, shape, w, world_size, cuda)
    _update_items(items, config, shape, w, lora, grad_bytes, cuda)

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
        rows=config.generation_batch_size,
        kv_slots=kv_cache_slots(config),
        micro_batch_rows=config.per_device_train_batch_size,
        seq_len=config.max_prompt_length + config.max_completion_length,
        parameters=params,
        trainable=trainable,
        use_peft=config.use_peft,
        gradient_checkpointing=config.gradient_checkpointing,
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


def kv_cache_slots(config: GRPOConfig) -> int:
    """Slots per row of the rollout's KV cache, as `fastgrpo.rollout.engine.RolloutEngine` sizes it: the longest
    prompt, the completion, one more, and the largest tree a step may verify (1 without speculation)."""
    tree = _tree(config)
    return config.max_prompt_length + config.max_completion_length + 1 + (tree[0] if tree else 1)


def kv_cache_bytes(shape: ModelShape, rows: int, slots: int, dtype_bytes: int, layers: int | None = None) -> int:
    """A `fastgrpo.rollout.cache.RowCache`: ``[layers, 2, rows, kv_heads, slots, head_dim]`` elements."""
    layers = shape.num_layers if layers is None else layers
    return layers * 2 * rows * shape.num_kv_heads * slots * shape.head_dim * dtype_bytes


def _rollout_items(
    items: _Items, config: GRPOConfig, shape: ModelShape, w: int, lora: LoraShape | None, cuda: bool
) -> None:
    """The rollout's caches, captured states and forward temporaries (decode; the caches and captured states stay
    until after the draft update, and on the CPU the caches stay for the next rollout)."""
    rows, p_len, c_len = config.generation_batch_size, config.max_prompt_length, config.max_completion_length
    prompts = rows // config.num_generations
    h, v, q, kv = shape.hidden_size, shape.vocab_size, shape.q_width, shape.kv_width
    tree = _tree(config)
    slots = kv_cache_slots(config)
    cache = kv_cache_bytes(shape, rows, slots, w)
    held = 2 if cuda else 4  # moments the caches are held: the trainer gives them back before the update on CUDA
    items.add("KV cache", *[cache] * held)
    if tree is not None:
        _, top_k, depth = tree
        draft_slots = 2 * (p_len + c_len + 1) + depth * top_k  # `EagleDrafter.begin`
        draft_cache = kv_cache_bytes(shape, rows, draft_slots, w, layers=1)
        items.add("draft KV cache", *[draft_cache] * held)
    if lora and w == 2:  # `merged_lora` keeps each adapted 16-bit weight to restore it exactly
        items.add("LoRA merge copies", lora.adapted * w)
    if _captures(config):
        # Per row [prompt + completion - 1, H]: while `Generation.output` concatenates them, the pieces (the
        # prefill's per-prompt states and every step's) are alive too.
        kept = rows * (p_len + c_len - 1) * h * w
        pieces = (prompts * p_len + rows * c_len) * h * w
        items.add("captured hidden states", kept + pieces, kept)
    # The widest forward: the prefill of the prompts or a tree per row; one layer's temporaries at a time (inference
    # mode), the attention scores of a masked SDPA in float32, and the logits: the verified tree's raw logits and
    # float32 sampling distributions per row, and the draft's per tree level.
    width = tree[0] if tree else 1
    tokens = max(prompts * p_len, rows * width)
    per_token = h * (3 * w + 4) + (q + 2 * kv) * w + 2 * q * w + 3 * shape.intermediate_size * w
    scores = 4 * shape.num_heads * max(prompts * p_len * p_len, rows * width * slots)
    logits = rows * width * v * w + 3 * rows * v * 4
    if tree is not None:
        logits += rows * tree[1] * v * (w + 4) + 2 * rows * (p_len + 1) * h * w  # and the drafter's pending pairs
    items.add("rollout forward temporaries", tokens * per_token + scores + logits)


def _captures(config: GRPOConfig) -> bool:
    """Whether rollouts capture hidden states: speculation on with online draft learning."""
    return config.speculation.mode != "off" and config.draft_training.online


def _draft_items(items: _Items, config: GRPOConfig, shape: ModelShape, w: int, world_size: int, cuda: bool) -> None:
    """The draft head (in the policy's dtype), its AdamW moments and gradients (which stay allocated between its
    updates; a bfloat16 or float16 draft also keeps float32 master weights, and its moments and the gradients the
    optimizer reads are float32), and its training temporaries."""
    if config.speculation.mode == "off":
        return
    total, trainable = shape.draft_parameters()
    items.resident("draft head", total * w)
    if not config.draft_training.online:
        return
    ddp = 2 if world_size > 1 else 1
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
    run = TrainingForward(residual=w, compute=2 if dt.bf16 and w == 4 else w, full=True, cuda=cuda)
    h = shape.hidden_size
    per_token = layer_activation_bytes(shape, run, min(tokens, p_len + c_len)) + 4 * h * w + (4 + w) * h
    # AdamW's, as the policy's (over float32 masters for a low-precision draft)
    step_buffer = (trainable if cuda else max(2 * h * h, h * shape.intermediate_size)) * max(w, 4)
    items.add("draft training temporaries", 0, tokens * dt.unroll * per_token + logits + step_buffer)


def _update_items(
    items: _Items, config: GRPOConfig, shape: ModelShape, w: int, lora: LoraShape | None, grad_bytes: int, cuda: bool
) -> None:
    """The policy update's saved activations for one micro-batch (with ``gradient_checkpointing``: what the
    checkpointed forward keeps, and one layer's recomputed activations) and its backward temporaries."""
    rows, seq_len = config.per_device_train_batch_size, config.max_prompt_length + config.max_completion_length
    run = TrainingForward(
        residual=w,
        compute=2 if config.bf16 and w == 4 else w,
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


# ---------------------------------------------------------------------------------------------- fitting
def _fits(config: GRPOConfig, plan: MemoryPlan, free_bytes: int, world_size: int | None = None) -> MemoryPlan | None:
    """``config`` re-estimated like ``plan`` (same model and device); the new plan when it fits ``free_bytes``."""
    new = estimate_memory(config, plan.shape, plan.device, plan.world_size if world_size is None else world_size)
    return new if new.peak_bytes <= free_bytes else None


def _largest(candidates: Iterator[GRPOConfig], plan: MemoryPlan, free_bytes: int) -> tuple[GRPOConfig, MemoryPlan]:
    """The first candidate (they come largest first) that fits, and its plan; raises StopIteration when none does."""
    for candidate in candidates:
        fitted = _fits(candidate, plan, free_bytes)
        if fitted is not None:
            return candidate, fitted
    raise StopIteration


def _smaller_micro_batches(config: GRPOConfig) -> Iterator[GRPOConfig]:
    """The same completions per step in smaller micro-batches (more accumulation steps), largest first."""
    rows = config.generation_batch_size
    for b in range(config.per_device_train_batch_size - 1, 0, -1):
        if rows % b == 0:
            yield dataclasses.replace(config, per_device_train_batch_size=b, gradient_accumulation_steps=rows // b)


def _fewer_completions(config: GRPOConfig) -> Iterator[GRPOConfig]:
    """Fewer completions per step, largest first: whole groups of ``num_generations`` while there is more than one,
    then a single smaller group; each in the largest micro-batches (at most the current ones) that divide it."""
    g = config.num_generations
    for rows in range(config.generation_batch_size - 1, 1, -1):
        if rows >= g and rows % g:
            continue
        b = max(d for d in range(1, min(config.per_device_train_batch_size, rows) + 1) if rows % d == 0)
        yield dataclasses.replace(
            config, num_generations=min(g, rows), per_device_train_batch_size=b, gradient_accumulation_steps=rows // b
        )


def _shorter_completions(config: GRPOConfig, plan: MemoryPlan, free_bytes: int) -> tuple[GRPOConfig, MemoryPlan]:
    """The longest ``max_completion_length`` below the current one that fits (memory grows with it: bisection)."""
    low, high, best = 1, config.max_completion_length - 1, None
    while low <= high:
        mid = (low + high) // 2
        candidate = dataclasses.replace(config, max_completion_length=mid)
        fitted = _fits(candidate, plan, free_bytes)
        if fitted is None:
            high = mid - 1
        else:
            best, low = (candidate, fitted), mid + 1
    if best is None:
        raise StopIteration
    return best


def _changed(old: GRPOConfig, new: GRPOConfig) -> str:
    """``name: value`` of each option that differs, comma-separated (nested ones dotted)."""
    parts = []
    for f in dataclasses.fields(old):
        a, b = getattr(old, f.name), getattr(new, f.name)
        if dataclasses.is_dataclass(a):
            parts += [
                f"{f.name}.{g.name}: {getattr(b, g.name)}"
                for g in dataclasses.fields(a)
                if getattr(a, g.name) != getattr(b, g.name)
            ]
        elif a != b:
            parts.append(f"{f.name}: {str(b).lower() if isinstance(b, bool) else b}")
    return ", ".join(parts)


def fitting_options(plan: MemoryPlan, free_bytes: int, config: GRPOConfig) -> list[tuple[str, MemoryPlan]]:
    """The single changes of ``config`` whose re-estimated peak fits ``free_bytes``, each as ``(options, plan)``:
    LoRA, the reference model dropped (``beta: 0``), gradient checkpointing, the same completions in smaller
    micro-batches, fewer completions per step (smaller groups if need be), shorter completions, FSDP over the fewest
    processes that fit (without master weights, which FSDP runs do not keep), and no speculation. Changes that fit
    only together are not searched."""
    found: list[tuple[str, MemoryPlan]] = []

    def attempt(make: Callable[[], tuple[GRPOConfig, MemoryPlan]]) -> None:
        try:
            candidate, fitted = make()
        except StopIteration:
            return
        found.append((_changed(config, candidate), fitted))

    def single(candidate: GRPOConfig) -> Callable[[], tuple[GRPOConfig, MemoryPlan]]:
        return lambda: _largest(iter([candidate]), plan, free_bytes)

    if not config.use_peft:
        attempt(single(dataclasses.replace(config, use_peft=True, fsdp=False)))
        if config.beta > 0:
            attempt(single(dataclasses.replace(config, beta=0.0)))
    if not config.gradient_checkpointing:
        attempt(single(dataclasses.replace(config, gradient_checkpointing=True)))
    attempt(lambda: _largest(_smaller_micro_batches(config), plan, free_bytes))
    attempt(lambda: _largest(_fewer_completions(config), plan, free_bytes))
    if config.max_completion_length > 1:
        attempt(lambda: _shorter_completions(config, plan, free_bytes))
    if not config.use_peft:
        sharded = dataclasses.replace(config, fsdp=True, master_weights=False)
        masters = any(item.name == MASTERS for item in plan.items)
        what = "fsdp: true" + (", master_weights: false" if masters else "")
        for n in range(max(2, plan.world_size), 257):
            fitted = _fits(sharded, plan, free_bytes, world_size=n)
            if fitted is not None:
                found.append((f"{what} on {n} processes (torchrun --nproc_per_node {n})", fitted))
                break
    if config.speculation.mode != "off":
        off = dataclasses.replace(config, speculation=dataclasses.replace(config.speculation, mode="off"))
        attempt(single(off))
    return found


def check_fits(plan: MemoryPlan, free_bytes: int, config: GRPOConfig) -> None:
    """Raise ``ValueError`` when ``plan`` (made from ``config``) peaks above ``free_bytes``, the memory the whole
    process may use on its device (`available_bytes` measures it). The message gives the estimate, and every single
    change of options that `fitting_options` finds to fit, each with its re-estimated peak."""
    if plan.peak_bytes <= free_bytes:
        return
    options = fitting_options(plan, free_bytes, config)
    if options:
        advice = "each of these changes alone fits: " + "; ".join(
            f"{what} (peak {fitted.peak_bytes / GIB:.1f} GiB)" for what, fitted in options
        )
    else:
        advice = (
            "no single change of use_peft, beta, gradient_checkpointing, per_device_train_batch_size, "
            "gradient_accumulation_steps, num_generations, max_completion_length, fsdp or speculation.mode fits: "
            "combine them, or use a larger device"
        )
    raise ValueError(
        f"the run needs about {plan.peak_bytes / GIB:.1f} GiB of device memory per process (peak at "
        f"{plan.peak_moment}), more than the {free_bytes / GIB:.1f} GiB available on {plan.device}; {advice}. "
        "`fastgrpo train --dry-run` itemises the estimate"
    )


# ---------------------------------------------------------------------------------------------- callers
def world_size() -> int:
    """Processes in the job: torch.distributed's world when it is up, else torchrun's ``WORLD_SIZE`` (1 alone)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def available_bytes(device: torch.device | str) -> int:
    """The device memory a process's run may use in all, on CUDA device ``device``: what is free now
    (``torch.cuda.mem_get_info``), plus what this process's caching allocator holds already
    (``torch.cuda.memory_reserved``: tensors it has loaded, such as the policy, and cached blocks), plus the CUDA
    context allowance of the plan (the context exists once ``mem_get_info`` has run, so its memory is already
    outside the free figure, while the plan counts it)."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) + CUDA_CONTEXT_BYTES


def plan_for_trainer(config: GRPOConfig, model_config: PretrainedConfig, device: torch.device) -> MemoryPlan:
    """The run's memory plan on ``device``, refused (``ValueError`` from `check_fits`) on CUDA when it does not fit.

    Free-memory convention: the plan estimates everything the process will hold on the device, including what it
    has already allocated, and is checked against `available_bytes(device)` = ``torch.cuda.mem_get_info(device)``'s
    free bytes + ``torch.cuda.memory_reserved(device)`` + `CUDA_CONTEXT_BYTES`. So call it on each process with its
    own device, at any point after ``distributed.init`` and before the first rollout, before or after loading the
    policy, the reference model, the LoRA wrapping, the draft head and the optimizer's master weights: what they
    hold is in ``memory_reserved`` (with the allocator's cached free blocks, which the run can reuse too), and the
    plan counts it. The condition is that every live device tensor of the process is one the plan counts (not a
    second copy of the model, say). Other processes' memory on the same GPU is not free and is not counted.
    ``model_config`` is the policy's transformers config (``model.config``, also for a peft model). The world size
    is torch.distributed's (or ``WORLD_SIZE``). On a device other than CUDA the plan is returned unchecked."""
    device = torch.device(device)
    plan = estimate_memory(config, model_config, device, world_size())
    if device.type == "cuda":
        check_fits(plan, available_bytes(device), config)
    return plan


def read_model_config(name: str) -> PretrainedConfig:
    """The transformers config of ``config.model`` (a directory, a hub id, or ``smollm2``), without its weights or
    tokenizer; ``ValueError`` when it is not the config of a causal language model."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    check_model_source(name)
    try:
        model_config = AutoConfig.from_pretrained(resolve_model_path(name))
    except (OSError, ValueError) as e:
        raise ValueError(f"model: cannot read the config of {name}: {e}") from None
    if model_config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not getattr(model_config, "auto_map", None):
        raise ValueError(
            f"model: cannot load {name} as a causal language model: its config is a {type(model_config).__name__}, "
            "of a model that transformers' AutoModelForCausalLM does not build"
        )
    return model_config


def dry_run(config: GRPOConfig) -> str:
    """``fastgrpo train --dry-run``: the memory plan of ``config`` (validated already) on the device the run would
    use, from the model's config alone, and on a GPU whether it fits the memory available there (`available_bytes`).
    ``device: cuda`` on a machine without a GPU plans for one (bfloat16 for ``dtype: auto``) without that check.
    Nothing is written."""
    from fastgrpo.distributed import resolve_device

    model_config = read_model_config(config.model)
    planned_only = config.device == "cuda" and not torch.cuda.is_available()
    if planned_only:  # planning a GPU run on a machine without one: the plan is arithmetic
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    else:
        device = resolve_device(config.device, int(os.environ.get("LOCAL_RANK", "0")))
    plan = estimate_memory(config, model_config, device, world_size())
    lines = [f"memory plan of {config.model}: {plan.summary()}", "", plan.table(), ""]
    if plan.shape.model_type not in SUPPORTED_FAMILIES:
        lines.append(f"note: {plan.shape.model_type} is outside the families the estimate models exactly")
    if planned_only:
        lines.append("no GPU here: the plan is for a CUDA device, checked against an 80 GB card's memory")
        lines.append(_fits_line(plan, CARD_80GB_BYTES, config, "an 80 GB card"))
    elif device.type == "cuda":
        lines.append(_fits_line(plan, available_bytes(device), config, str(device)))
    else:
        lines.append(
            f"no GPU: the plan is for the CPU (dtype {plan.dtype}), whose memory is the host's; add --device cuda to "
            "plan a GPU run"
        )
    return "\n".join(lines)


def _fits_line(plan: MemoryPlan, available: int, config: GRPOConfig, where: str) -> str:
    """``fits: yes`` with the memory available on ``where``, or ``fits: no`` with `check_fits`'s advice."""
    try:
        check_fits(plan, available, config)
    except ValueError as e:
        return f"fits: no: {e}"
    return f"fits: yes, {available / GIB:.1f} GiB available on {where}"
