"""The memory plan (`fastgrpo.memory`): parameter counts against models built on the meta device, activations
against the tensors autograd really saves (with and without gradient checkpointing), the plan's arithmetic,
`check_fits`'s advice, the trainer's free-memory convention, and ``fastgrpo train --dry-run``. No weights are loaded
but those of tiny models."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, Qwen2Config, Qwen3Config

from fastgrpo import device_memory
from fastgrpo.cli import main
from fastgrpo.config import DraftTrainConfig, GRPOConfig
from fastgrpo.grpo import policy_update
from fastgrpo.grpo.policy_update import PolicyUpdate
from fastgrpo.memory.activations import (
    TrainingForward,
    autocast_copy_bytes,
    checkpointed_activation_bytes,
    forward_activation_bytes,
    head_saved_bytes,
)
from fastgrpo.memory.items import GIB, MOMENTS
from fastgrpo.memory.shapes import ModelShape, lora_shape
from fastgrpo.memory_plan import fitting
from fastgrpo.memory_plan.fitting import CARD_80GB_BYTES, check_fits, fitting_options, plan_for_trainer
from fastgrpo.memory_plan.plan import CUDA_CONTEXT_BYTES, estimate_memory
from fastgrpo.speculative.eagle.memory import draft_parameters

# The run docs/benchmarks.md's memory table plans (TRL's defaults but completions of 256 tokens, layers not
# checkpointed), so that what the checks recommend is a change away from it.
PLANNED = {"max_completion_length": 256, "gradient_checkpointing": False}
PLANNED_FLAGS = ["--max_completion_length", "256", "--gradient_checkpointing", "false"]

# The published shapes of the models the plan is checked on.
CONFIGS: dict[str, PretrainedConfig] = {
    "smollm2-135m": LlamaConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        tie_word_embeddings=True,
    ),
    "qwen2.5-0.5b": Qwen2Config(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen2.5-1.5b": Qwen2Config(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen2.5-7b": Qwen2Config(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
    "qwen3-0.6b": Qwen3Config(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "llama-with-biases": LlamaConfig(
        hidden_size=256,
        intermediate_size=640,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=1000,
        attention_bias=True,
        mlp_bias=True,
    ),
}
# Their published parameter counts, where there is one.
PUBLISHED = {"qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304, "qwen2.5-7b": 7_615_616_512}


def meta_model(config: PretrainedConfig) -> torch.nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def trainable(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_parameter_count_matches_the_model_built_from_the_config(name: str) -> None:
    config = CONFIGS[name]
    count = sum(p.numel() for p in meta_model(config).parameters())
    assert ModelShape.from_config(config).num_parameters() == count
    assert PUBLISHED.get(name, count) == count


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-0.5b", "qwen3-0.6b"])
def test_draft_head_count_matches_the_draft(name: str) -> None:
    from fastgrpo.speculative.eagle.head import DraftHead

    with torch.device("meta"):
        draft = DraftHead(CONFIGS[name])
    assert draft_parameters(ModelShape.from_config(CONFIGS[name])) == (
        sum(p.numel() for p in draft.parameters()),
        trainable(draft),
    )


@pytest.mark.parametrize("targets", [None, ["q_proj", "v_proj"], ["gate_proj", "up_proj", "down_proj", "lm_head"]])
def test_lora_count_matches_peft(targets: list[str] | None) -> None:
    from peft import LoraConfig, get_peft_model

    config = CONFIGS["llama-with-biases"]
    options = GRPOConfig(use_peft=True, lora_r=8, lora_target_modules=targets)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=targets or "all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(meta_model(config), lora)
    shape = ModelShape.from_config(config)
    assert lora_shape(shape, options).params == trainable(model)
    adapted = sum(m.get_base_layer().weight.numel() for m in model.modules() if hasattr(m, "lora_A") and m.lora_A)
    assert lora_shape(shape, options).adapted == adapted


# ------------------------------------------------------------------------------------------ activations
BATCH, PROMPT, COMPLETION = 4, 24, 16


def training_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask of a micro-batch, its first prompt left-padded as in a real batch."""
    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (BATCH, PROMPT + COMPLETION), device="cpu")
    mask = torch.ones(BATCH, PROMPT + COMPLETION, dtype=torch.long, device="cpu")
    mask[0, :5] = 0
    return ids, mask


def saved_bytes(model: torch.nn.Module, autocast: bool) -> int:
    """Bytes of the distinct non-parameter storages autograd saves in the update's training forward."""
    from fastgrpo.grpo.logprobs import completion_logprobs

    ids, mask = training_batch()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast),
    ):
        completion_logprobs(model, ids, mask, COMPLETION, 1.0, 1024)
    return sum(seen.values())


class LiveStorages(TorchDispatchMode):
    """The bytes of the storages the ops run under it create, and those `saved` is given, that are still alive.

    Storages of ``excluded`` (the parameters, the batch) are left out but where `saved` is given one (a saved
    tensor hook: the token ids, which the embedding saves when it trains). Only the forward's ops and, in the backward,
    those run with grad mode on (the checkpoints' recomputations) are tracked, not the gradients; `peak` is the most
    alive at a backward op, after a recomputation has stopped and freed its temporaries (the ``detach`` with which
    the checkpoint keeps each recomputed tensor runs inside it, so it is not a sampling point)."""

    def __init__(self, excluded: set[int], parameters: set[int]) -> None:
        super().__init__()
        self.excluded = excluded
        self.parameters = parameters
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}
        self.backward = False
        self.peak = 0

    def track(self, t: torch.Tensor, excluded: set[int] | frozenset[int] = frozenset()) -> None:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        known = self.storages.get(ptr)
        if ptr not in excluded and storage.nbytes() and (known is None or known[0].expired()):
            self.storages[ptr] = (StorageWeakRef(storage), storage.nbytes())

    def saved(self, t: torch.Tensor) -> torch.Tensor:
        self.track(t, self.parameters)
        return t

    def live(self) -> int:
        return sum(size for ref, size in self.storages.values() if not ref.expired())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        if self.backward and not torch.is_grad_enabled() and func is not torch.ops.aten.detach.default:
            self.peak = max(self.peak, self.live())
        if not self.backward or torch.is_grad_enabled():
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.track(t, self.excluded)
        return out


def live_bytes(model: torch.nn.Module, autocast: bool) -> tuple[int, int, int]:
    """``(after the forward, cast cache, peak in the backward)``: the bytes of the non-parameter storages the
    update's training forward leaves alive (saved by autograd, kept by the checkpoints); those that live until the
    autocast region ends only (autocast's cached weight copies that nothing saves); and the most of the former and
    of the checkpoints' recomputed tensors alive at once during the backward."""
    from fastgrpo.grpo.logprobs import completion_logprobs

    ids, mask = training_batch()
    parameters = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    tracker = LiveStorages(parameters | {t.untyped_storage().data_ptr() for t in (ids, mask)}, parameters)
    with (
        tracker,
        torch.autograd.graph.saved_tensors_hooks(tracker.saved, lambda t: t),
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast),
    ):
        logps = completion_logprobs(model, ids, mask, COMPLETION, 1.0, 1024)
        loss = logps.sum()
        for output in (logps, loss):
            tracker.storages.pop(output.untyped_storage().data_ptr())
        cast_cache = tracker.live()  # with autocast's copies of the weights, until the autocast region ends
    after = tracker.live()
    cast_cache -= after
    tracker.backward = True
    with tracker:
        loss.backward()
    return after, cast_cache, tracker.peak


ACTIVATION_CASES = [
    ("qwen2", torch.bfloat16, "full", False),
    ("qwen2", torch.bfloat16, "lora", False),
    ("qwen2", torch.bfloat16, "lora-no-dropout", False),
    ("qwen2", torch.float32, "full", True),
    ("qwen3", torch.bfloat16, "full", False),
    ("llama", torch.float32, "lora", False),
]


def tiny_training_model(
    family: str, dtype: torch.dtype, mode: str, autocast: bool, checkpointing: bool = False
) -> tuple[torch.nn.Module, ModelShape, TrainingForward]:
    """A tiny model of ``family`` in training mode (LoRA r=16 on all linear layers unless ``mode`` is full, with
    gradient checkpointing enabled as `fastgrpo.grpo.policy_update.PolicyUpdate` does), its shape, and the
    `TrainingForward` that describes it on the CPU kernels."""
    sizes = {"hidden_size": 128, "intermediate_size": 320, "num_hidden_layers": 3, "num_attention_heads": 4}
    sizes |= {"num_key_value_heads": 2, "vocab_size": 1000}
    config = {"qwen2": Qwen2Config(**sizes), "qwen3": Qwen3Config(head_dim=32, **sizes)}.get(family)
    config = config or LlamaConfig(head_dim=32, **sizes)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    options = GRPOConfig(use_peft=mode != "full", lora_dropout=0.0 if mode == "lora-no-dropout" else 0.05)
    shape = ModelShape.from_config(config)
    if options.use_peft:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=options.lora_dropout, target_modules="all-linear")
        model = get_peft_model(model, lora)
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    run = TrainingForward(
        residual=dtype.itemsize,
        compute=2 if autocast else dtype.itemsize,
        full=not options.use_peft,
        lora_modules=lora_shape(shape, options).modules if options.use_peft else frozenset(),
        lora_rank=16,
        lora_bytes=4,
        lora_dropout=options.lora_dropout > 0,
        cuda=False,
    )
    return model, shape, run


@pytest.mark.parametrize(("family", "dtype", "mode", "autocast"), ACTIVATION_CASES)
def test_activation_estimate_matches_what_autograd_saves(
    family: str, dtype: torch.dtype, mode: str, autocast: bool
) -> None:
    """On the CPU kernels (`TrainingForward.cuda` false): within 0.1 % of the bytes the forward really keeps."""
    model, shape, run = tiny_training_model(family, dtype, mode, autocast)
    measured = saved_bytes(model, autocast)
    estimated = forward_activation_bytes(shape, run, BATCH, PROMPT + COMPLETION, BATCH * COMPLETION)
    assert estimated == pytest.approx(measured, rel=1e-3)
    # the live storages say the same: everything the forward leaves alive is saved
    after, cast_cache, _ = live_bytes(model, autocast)
    assert after == pytest.approx(measured, rel=1e-3)
    # autocast's copies of the LM head and the biases, which nothing saves, are given back as the forward ends
    assert cast_cache == autocast_copy_bytes(shape, run) - (shape.linear_weights() * 2 if autocast else 0)


@pytest.mark.parametrize(("family", "dtype", "mode", "autocast"), ACTIVATION_CASES)
def test_checkpointed_activation_estimate_matches_what_the_forward_keeps_and_the_backward_recomputes(
    family: str, dtype: torch.dtype, mode: str, autocast: bool
) -> None:
    """With gradient checkpointing, on the CPU kernels: ``saved`` within 0.1 % of what the forward leaves alive
    (the saved tensors outside the layers, the layers' inputs and their shared keyword arguments), and the peak of
    those and the recomputed tensors alive during the backward within 0.1 % of ``saved + recomputed`` less
    `head_saved_bytes` (released before the last layer's backward); a fraction of the forward's without it."""
    model, shape, run = tiny_training_model(family, dtype, mode, autocast, checkpointing=True)
    after, cast_cache, peak = live_bytes(model, autocast)
    seq_len, kept = PROMPT + COMPLETION, BATCH * COMPLETION
    saved, recomputed = checkpointed_activation_bytes(shape, run, BATCH, seq_len, kept)
    assert saved == pytest.approx(after, rel=1e-3)
    assert cast_cache == autocast_copy_bytes(shape, run) <= recomputed
    assert saved + recomputed - head_saved_bytes(shape, run, BATCH, seq_len, kept) == pytest.approx(peak, rel=1e-3)
    assert saved + recomputed < forward_activation_bytes(shape, run, BATCH, seq_len, kept) / 2


# ------------------------------------------------------------------------------------------ the plan
def test_items_add_up_to_the_moments_and_phases() -> None:
    plan = estimate_memory(GRPOConfig(beta=0.04), CONFIGS["qwen2.5-1.5b"], "cuda")
    for k in range(len(MOMENTS)):
        assert plan.moments[k] == sum(item.bytes[k] for item in plan.items)
    assert plan.rollout_bytes == max(plan.moments[:2])
    assert plan.update_bytes == max(plan.moments[2:])
    assert plan.peak_bytes == max(plan.moments) == max(plan.rollout_bytes, plan.update_bytes)
    # resident in every moment (the KV cache and the graph pool too); the captured states in the rollout only;
    # activations in the backward
    resident = ("policy weights (bfloat16)", "float32 master weights", "reference model (bfloat16)", "draft head")
    for name in (*resident, "KV cache", "draft KV cache", "CUDA graph pool"):
        assert len(set(plan.item(name).bytes)) == 1 and plan.item(name).bytes[0] > 0
    assert plan.item("captured hidden states").bytes[2:] == (0, 0) and plan.item("captured hidden states").bytes[0] > 0
    assert plan.item("update activations (micro-batch)").bytes[:2] == (0, 0)
    table = plan.table()
    assert all(item.name in table for item in plan.items) and "total" in table
    assert f"{plan.peak_bytes / GIB:.2f} GiB" in table


@pytest.mark.parametrize("mode", ["off", "static", "adaptive"])
def test_kv_cache_item_is_the_row_cache_tensor(mode: str) -> None:
    """layers x 2 x rows x KV heads x slots x head dim x bytes, with the engine's slots (prompt + completion + 1 +
    the largest tree, 1 without speculation) and rows (a compiled step's, on a GPU, padded to a power of two, and its
    scratch row)."""
    config = GRPOConfig(
        speculation=dataclasses.replace(GRPOConfig().speculation, mode=mode),
        max_prompt_length=300,
        max_completion_length=200,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=6,
        num_generations=8,
    )
    tree = {"off": 1, "static": config.speculation.nodes, "adaptive": config.speculation.n_max}[mode]
    slots = -(-(300 + 200 + 1 + tree) // 8) * 8 + 8  # aligned to 8, and 8 more (`fastgrpo.rollout.cache.cache_slots`)
    for name in ("qwen2.5-7b", "qwen3-0.6b"):
        shape = ModelShape.from_config(CONFIGS[name])
        plan = estimate_memory(config, CONFIGS[name], "cuda")
        row_bytes = shape.num_layers * 2 * shape.num_kv_heads * slots * shape.head_dim * 2
        assert plan.kv_slots == slots and plan.rows == 32  # 24 rows -> 32
        assert plan.item("KV cache").bytes == (33 * row_bytes,) * 4  # kept through the update; the scratch row
    cpu = estimate_memory(config, CONFIGS["qwen3-0.6b"], "cpu")  # eager, float32
    assert cpu.rows == 24 and set(cpu.item("KV cache").bytes) == {2 * 24 * row_bytes}


def test_a_gpu_rollout_compiled_keeps_the_pool_of_its_cuda_graphs_through_the_update() -> None:
    """Compiled by inductor on a GPU (``compile`` auto or on) the plan holds the CUDA graphs' pool in every moment:
    the decoding step's temporaries at the largest row bucket and tree, the widest forward's when short prompts make
    the tree step wider than the prefill, less when the prefill is wider. Eager on a GPU, or on the CPU (compiled or
    not: no graphs there), no pool."""
    spec = dataclasses.replace(GRPOConfig().speculation, mode="static", nodes=32)
    config = GRPOConfig(
        speculation=spec,
        max_prompt_length=16,
        max_completion_length=200,
        num_generations=8,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=6,
    )
    for choice in ("auto", "on"):
        plan = estimate_memory(dataclasses.replace(config, compile=choice), CONFIGS["qwen2.5-1.5b"], "cuda")
        pool = plan.item("CUDA graph pool").bytes
        assert plan.rows == 32 and pool == (plan.item("rollout forward temporaries").bytes[0],) * 4
    long_prompts = estimate_memory(dataclasses.replace(config, max_prompt_length=2000), CONFIGS["qwen2.5-1.5b"])
    pool = long_prompts.item("CUDA graph pool").bytes[0]
    assert 0 < pool < long_prompts.item("rollout forward temporaries").bytes[0]
    bigger_trees = dataclasses.replace(config, speculation=dataclasses.replace(spec, nodes=64))
    assert estimate_memory(bigger_trees, CONFIGS["qwen2.5-1.5b"]).item("CUDA graph pool").bytes[0] > pool
    for choice, device in (("off", "cuda"), ("auto", "cpu"), ("on", "cpu")):
        plan = estimate_memory(dataclasses.replace(config, compile=choice), CONFIGS["qwen2.5-1.5b"], device)
        assert "CUDA graph pool" not in {item.name for item in plan.items}


def test_adamw_is_fused_on_cuda_where_the_plan_counts_no_step_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The policy's AdamW is fused on CUDA (updating in place, without foreach's temporary of every moment), so a GPU
    plan has no step buffer; on the CPU it loops over the parameters and the plan counts one parameter's buffer (the
    largest: the embedding)."""
    from conftest import tiny_model

    assert policy_update.fused_adamw(torch.device("cuda", 0)) and not policy_update.fused_adamw(torch.device("cpu"))
    model, config = tiny_model("llama"), GRPOConfig()
    assert PolicyUpdate(model, None, config, 1).optimizer.defaults["fused"] is False
    monkeypatch.setattr(policy_update, "fused_adamw", lambda device: device.type == "cpu")  # the CPU taken for CUDA
    assert PolicyUpdate(model, None, config, 1).optimizer.defaults["fused"] is True
    gpu = estimate_memory(config, CONFIGS["qwen2.5-1.5b"], "cuda")
    assert "AdamW step buffer" not in {item.name for item in gpu.items}
    cpu = estimate_memory(config, CONFIGS["qwen2.5-1.5b"], "cpu")
    embedding = ModelShape.from_config(CONFIGS["qwen2.5-1.5b"]).embedding_params
    assert cpu.item("AdamW step buffer").bytes == (0, 0, 0, embedding * 4)


@pytest.mark.parametrize("mode", ["off", "static", "adaptive"])
def test_the_plan_sizes_the_caches_as_the_engine_and_the_eagle_drafter_allocate_them(mode: str) -> None:
    """The plan asks the engine's sizing rule: a tiny engine generating with the options' longest prompt and
    completion allocates the rows and slots the plan counts, and the EAGLE drafter's cache as many slots as its
    item says, in the bytes their buffers hold."""
    from conftest import tiny_model

    from fastgrpo.config import SpeculationConfig
    from fastgrpo.rollout.cache import RowCache, call_length
    from fastgrpo.sampling_params import SamplingParams
    from fastgrpo.speculative.configured import tree_bound
    from fastgrpo.speculative.eagle.drafter import EagleDrafter
    from fastgrpo.training_rollouts import TrainingRollouts

    spec = SpeculationConfig(mode=mode, nodes=4, top_k=2, depth=3, n_max=8, k_max=4, l_max=3, c_peak=8)
    config = GRPOConfig(
        speculation=spec,
        max_prompt_length=9,
        max_completion_length=6,
        num_generations=2,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=3,
        dtype="float64",
    )
    model = tiny_model("llama")
    rollouts = TrainingRollouts(model, None, [], spec, DraftTrainConfig(online=False), "tiny")
    rollouts.engine.generate([[5] * 9, [6] * 9, [7] * 2], SamplingParams(max_new_tokens=6, temperature=0), 2)
    plan = estimate_memory(config, model.config, "cpu")
    cache = rollouts.engine.cache
    assert (cache.max_rows, cache.max_len) == (plan.rows, plan.kv_slots)

    def allocated(cache: RowCache) -> int:
        return sum(buf.numel() * buf.element_size() for layer in cache.layers for buf in (layer.keys, layer.values))

    assert plan.item("KV cache").bytes[0] == allocated(cache)
    eagle = rollouts.drafter("eagle")
    if eagle is None:
        assert mode == "off" and not [i for i in plan.items if "draft" in i.name]
        return
    assert eagle.cache.max_len == EagleDrafter.cache_slots(call_length(9, 6), tree_bound(spec))
    assert plan.item("draft KV cache").bytes[0] == allocated(eagle.cache)


def test_a_suffix_only_plan_holds_no_draft_head() -> None:
    """The drafters' items come from their plugins: the suffix drafter has none, so a run that drafts with it alone
    is planned (and refused or not) without a draft head, its cache, its training or its captured states."""
    base = GRPOConfig()
    suffix = dataclasses.replace(base, speculation=dataclasses.replace(base.speculation, drafter="suffix"))
    for name in ("qwen2.5-0.5b", "qwen2.5-7b"):
        both, alone = estimate_memory(base, CONFIGS[name], "cuda"), estimate_memory(suffix, CONFIGS[name], "cuda")
        drafted = {i.name for i in both.items if "draft" in i.name or i.name == "captured hidden states"}
        assert {"draft head", "draft KV cache", "draft training temporaries", "captured hidden states"} <= drafted
        assert not drafted & {i.name for i in alone.items}
        assert alone.peak_bytes < both.peak_bytes


def test_lora_and_fewer_generations_lower_the_peak() -> None:
    """Both lower the peak, which the backward sets in these full fine-tunes (fewer completions shrink the rollout
    and the backward)."""
    base = GRPOConfig(**PLANNED)
    fewer = dataclasses.replace(base, num_generations=4, per_device_train_batch_size=4)
    for name in ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b"):
        full = estimate_memory(base, CONFIGS[name], "cuda")
        lora = estimate_memory(dataclasses.replace(base, use_peft=True), CONFIGS[name], "cuda")
        assert lora.peak_bytes < full.peak_bytes and lora.trainable < full.trainable / 50
        smaller = estimate_memory(fewer, CONFIGS[name], "cuda")
        assert smaller.moments[0] < full.moments[0] and smaller.moments[2] < full.moments[2]
        assert full.peak_moment == "update: backward" and smaller.peak_bytes < full.peak_bytes
        row = full.item("KV cache").bytes[0] // (full.rows + 1)  # a compiled step's cache: the scratch row
        assert smaller.item("KV cache").bytes[0] == (full.rows // 2 + 1) * row


def test_check_fits_accepts_a_large_device_and_names_what_fits_a_small_one() -> None:
    config = GRPOConfig(beta=0.04, **PLANNED)
    plan = estimate_memory(config, CONFIGS["qwen2.5-1.5b"], "cuda")
    check_fits(plan, plan.peak_bytes, config)  # exactly enough
    free = plan.peak_bytes - GIB
    with pytest.raises(ValueError, match="more than the") as refusal:
        check_fits(plan, free, config)
    message = str(refusal.value)
    for option in ("use_peft: true", "beta: 0.0", "gradient_checkpointing: true", "per_device_train_batch_size"):
        assert option in message
    assert "max_completion_length" in message and "fsdp" in message
    options = fitting_options(plan, free, config)
    assert options and all(fitted.peak_bytes <= free for _, fitted in options)


def test_check_fits_says_how_many_fsdp_processes_and_when_nothing_alone_fits() -> None:
    config = GRPOConfig(**PLANNED)
    plan = estimate_memory(config, CONFIGS["qwen2.5-7b"], "cuda")
    assert plan.peak_bytes > CARD_80GB_BYTES
    with pytest.raises(ValueError) as refusal:
        check_fits(plan, CARD_80GB_BYTES, config)
    assert "fsdp: true on 16 processes (torchrun --nproc_per_node 16)" in str(refusal.value)
    # checkpointing alone is not enough (its optimizer step then sets the peak), nor asked for; with it, 3 processes do
    assert "gradient_checkpointing" not in str(refusal.value)
    checkpointed = dataclasses.replace(config, gradient_checkpointing=True)
    with pytest.raises(ValueError, match="on 3 processes") as refusal:
        check_fits(estimate_memory(checkpointed, CONFIGS["qwen2.5-7b"], "cuda"), CARD_80GB_BYTES, checkpointed)
    assert "gradient_checkpointing" not in str(refusal.value)
    with pytest.raises(ValueError, match="no single change"):
        check_fits(plan, 4 * GIB, config)


def test_gradient_checkpointing_keeps_the_layer_inputs_and_recomputes_one_layer() -> None:
    """The update's activations become the layers' inputs, their shared arguments and what is saved outside them,
    plus one layer recomputed in the backward; Qwen2.5-7B with LoRA then fits an 80 GB card, which check_fits
    suggests."""
    config = GRPOConfig(use_peft=True, **PLANNED)
    plain = estimate_memory(config, CONFIGS["qwen2.5-7b"], "cuda")
    checkpointed = estimate_memory(dataclasses.replace(config, gradient_checkpointing=True), CONFIGS["qwen2.5-7b"])
    rows, seq_len, kept = 8, 512 + 256, 8 * 256
    h, layers, head_dim = 3584, 28, 128
    # bfloat16 layer inputs, int64 position ids, the boolean mask, rotary cos and sin; the final norm's float32 input
    # and reciprocal RMS, the LM head's hidden states and target ids (LoRA: the embedding saves no token ids)
    saved = rows * seq_len * (layers * h * 2 + 8 + seq_len + 2 * head_dim * 2 + 4 * h + 4) + kept * (2 * h + 8)
    assert checkpointed.item("update activations (micro-batch)").bytes == (0, 0, saved, 0)
    layer = plain.item("update activations (micro-batch)").bytes[2] // layers
    recomputed = checkpointed.item("recomputed layer activations").bytes
    assert recomputed[:2] == (0, 0) and recomputed[3] == 0 and layer * 0.9 < recomputed[2] < layer * 1.1
    assert checkpointed.item("backward temporaries") == plain.item("backward temporaries")
    assert checkpointed.moments[:2] == plain.moments[:2] and checkpointed.moments[3] == plain.moments[3]
    assert checkpointed.moments[2] < plain.moments[2] / 3 and "layers checkpointed" in checkpointed.summary()
    assert plain.peak_bytes > CARD_80GB_BYTES >= checkpointed.peak_bytes
    with pytest.raises(ValueError) as refusal:
        check_fits(plain, CARD_80GB_BYTES, config)
    assert f"gradient_checkpointing: true (peak {checkpointed.peak_bytes / GIB:.1f} GiB)" in str(refusal.value)


def test_plan_for_trainer_counts_free_reserved_and_the_context(monkeypatch: pytest.MonkeyPatch) -> None:
    """The convention: available = mem_get_info's free + memory_reserved + the CUDA context allowance."""
    config = GRPOConfig(use_peft=True)
    peak = estimate_memory(config, CONFIGS["qwen2.5-0.5b"], "cuda").peak_bytes
    reserved = 3 * GIB  # the policy, loaded already
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
    monkeypatch.setattr(fitting, "world_size", lambda: 1)
    device = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (peak - reserved - CUDA_CONTEXT_BYTES, 0))
    assert plan_for_trainer(config, CONFIGS["qwen2.5-0.5b"], device).peak_bytes == peak
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (peak - reserved - CUDA_CONTEXT_BYTES - 1, 0))
    with pytest.raises(ValueError, match="available on cuda"):
        plan_for_trainer(config, CONFIGS["qwen2.5-0.5b"], device)
    cpu = plan_for_trainer(config, CONFIGS["qwen2.5-0.5b"], torch.device("cpu"))  # not checked off CUDA
    assert cpu.device == "cpu" and cpu.dtype == "float32"


UPDATE_ITEMS = ("policy gradients", "DDP", "AdamW", "float32 master", "reference model", "update activations")


def test_an_asynchronous_job_plans_one_training_process_and_rollout_processes_without_the_update(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With ``rollout_processes: 1`` in a job of 2, the training process is planned alone (no DDP buckets: it has no
    peer to reduce with) and rolls out for evaluations alone, and the rollout process holds nothing of the update,
    each of its other items one of the training process's."""
    config, shape, cpu = GRPOConfig(rollout_processes=1, beta=0.04), CONFIGS["qwen2.5-0.5b"], torch.device("cpu")
    monkeypatch.setattr(fitting, "world_size", lambda: 2)
    training = plan_for_trainer(config, shape, cpu)
    assert training.world_size == 1 and training.items == estimate_memory(config, shape, cpu, 1).items
    assert estimate_memory(config, shape, cpu, 2).item("DDP gradient buckets")  # what a second trainer would add
    rollout = plan_for_trainer(config, shape, cpu, rollout=True)
    assert not [item.name for item in rollout.items if item.name.startswith(UPDATE_ITEMS)]
    rolling = {"KV cache", "captured hidden states", "rollout forward temporaries"}
    assert {item for item in rollout.items if item.name not in rolling} < set(training.items)
    assert rollout.item("KV cache") and not [item for item in training.items if item.name in rolling]
    evaluating = estimate_memory(dataclasses.replace(config, eval_strategy="steps"), shape, cpu, 1)
    assert evaluating.item("KV cache") == rollout.item("KV cache")
    assert rollout.peak_bytes == rollout.rollout_bytes < training.peak_bytes
    assert "a rollout process beside 1 process training" in rollout.summary()
    # what fits 1 byte less: LoRA, or FSDP2 over training processes (torchrun starts the rollout process besides);
    # a rollout process holds the whole policy, sharded over the training processes or not
    advice = [what for what, _ in fitting_options(training, training.peak_bytes - 1, config)]
    assert [what for what in advice if "use_peft" in what]
    sharded = next(what for what in advice if "fsdp" in what)
    n = int(sharded.split()[3])
    assert sharded == f"fsdp: true on {n} training and 1 rollout processes (torchrun --nproc_per_node {n + 1})"
    assert not [what for what, _ in fitting_options(rollout, rollout.peak_bytes - 1, config) if "fsdp" in what]
    fsdp = dataclasses.replace(config, fsdp=True)
    whole = estimate_memory(config, shape, cpu, 2, rollout=True)
    assert estimate_memory(fsdp, shape, cpu, 2, rollout=True).items == whole.items
    sending = estimate_memory(fsdp, shape, cpu, 2)
    assert sending.item("weights sent to the rollout processes (float32)")
    evaluating = estimate_memory(dataclasses.replace(fsdp, eval_strategy="steps"), shape, cpu, 2)
    assert evaluating.item("rollout copy of the weights (float32)") and not [
        item for item in sending.items if item.name.startswith("rollout copy")
    ]


def test_a_gpu_phase_reports_its_allocated_and_its_reserved_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the allocated peak and the reserved one (which also holds the allocator's cached blocks and the CUDA
    graphs' pools the plan counts) are read apart, in MiB; on the CPU both are the process's largest resident set."""
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 5 * 2**30)
    cuda = torch.device("cuda", 0)
    assert (device_memory.peak_memory_mb(cuda), device_memory.peak_reserved_mb(cuda)) == (3 * 1024, 5 * 1024)
    cpu = torch.device("cpu")
    assert device_memory.peak_reserved_mb(cpu) == device_memory.peak_memory_mb(cpu) > 0


# ------------------------------------------------------------------------------------------ --dry-run
def test_dry_run_prints_the_plan_of_a_config_only_model_without_touching_output_dir(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    model = tmp_path / "qwen2.5-7b"
    CONFIGS["qwen2.5-7b"].save_pretrained(model)  # config.json only: no weights, no tokenizer
    out = tmp_path / "run"
    printed = {}
    checkpointed_lora = ["--device", "cuda", "--gradient_checkpointing", "true", "--use_peft", "true"]
    for extra in ([], ["--use_peft", "true"], ["--device", "cuda"], checkpointed_lora):
        main(["train", "--dry-run", "--model", str(model), "--output_dir", str(out), *PLANNED_FLAGS, *extra])
        printed[" ".join(extra)] = capsys.readouterr().out
    assert not out.exists()
    full, lora = printed[""], printed["--use_peft true"]
    for text in (full, lora):
        assert "7.62 B parameters" in text and "KV cache" in text and "update activations (micro-batch)" in text
        assert "total" in text and "peak: rollout phase" in text
    assert "full fine-tune" in full and "LoRA (40.4 M adapter parameters)" in lora and "LoRA adapters" in lora
    if not torch.cuda.is_available():  # planned for a GPU this machine lacks, in bfloat16
        planned = printed["--device cuda"]
        assert "bfloat16 on cuda" in planned and "80 GB card" in planned
        assert "fits: no: the run needs about 177.3 GiB" in planned and "fsdp: true on 16 processes" in planned
        assert "recommended on 1 process of 79.6 GiB: gradient_checkpointing: true, use_peft: true" in planned
        planned = printed[" ".join(checkpointed_lora)]
        assert "layers checkpointed" in planned and "recomputed layer activations" in planned
        assert "fits: yes, 79.6 GiB available on an 80 GB card" in planned


@pytest.mark.parametrize(
    ("processes", "recommended"),
    [
        (1, "gradient_checkpointing: true, use_peft: true"),
        (2, "gradient_checkpointing: true, use_peft: true"),
        (4, "fsdp: true, gradient_checkpointing: true"),
        (8, "fsdp: true, gradient_checkpointing: true"),
    ],
)
def test_dry_run_recommends_per_card_count_a_7b_run_that_fits_and_keeps_float32_masters(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, processes: int, recommended: str
) -> None:
    """Qwen2.5-7B (config only) with the default options (but `PLANNED`) on 1, 2, 4 and 8 cards of 80 GB: the dry
    run recommends the nearest configuration that fits within 95 % of the card, float32 master weights kept (LoRA
    on one or two cards, whose adapters train in float32; FSDP2's float32 shards on more: each card also keeps the
    full bfloat16 copy of the weights that rollouts compute with), and that configuration's own plan agrees."""
    if torch.cuda.is_available():
        pytest.skip("on a GPU the dry run checks against that card's free memory, not an 80 GB card's")
    model = tmp_path / "qwen2.5-7b"
    CONFIGS["qwen2.5-7b"].save_pretrained(model)
    args = ["--model", str(model), "--output_dir", str(tmp_path / "run"), "--device", "cuda", *PLANNED_FLAGS]
    main(["train", "--dry-run", "--processes", str(processes), *args])
    text = capsys.readouterr().out
    assert f"{processes} process" in text and "fits: no" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("recommended"))
    assert line.startswith(f"recommended on {processes} process") and line.split(": ", 1)[1].startswith(recommended)
    flags = [f"--{part.replace(': ', ' ')}" for part in recommended.split(", ")]
    main(["train", "--dry-run", "--processes", str(processes), *args, *[a for f in flags for a in f.split()]])
    fitted = capsys.readouterr().out
    assert "fits: yes" in fitted
    masters = "float32 master weights (FSDP2's shards)" if "fsdp" in recommended else "LoRA adapters (float32)"
    assert masters in fitted
    peak = float(fitted.split("GiB at ")[0].rsplit("; ", 1)[1])
    recommended_peak = float(line.rsplit("(peak ", 1)[1].split(" GiB")[0])
    assert peak <= 0.95 * 79.6 and abs(peak - recommended_peak) < 0.06


def test_processes_is_refused_without_a_dry_run(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """torchrun sets a run's processes: ``--processes`` plans only, and is refused before anything else."""
    for extra in (["--processes", "2"], ["--dry-run", "--processes", "0"]):
        with pytest.raises(SystemExit) as ended:
            main(["train", *extra, "--output_dir", str(tmp_path / "run")])
        assert ended.value.code == 2 and "--processes:" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_dry_run_of_the_embedded_model(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    main(["train", "--dry-run", "--output_dir", str(tmp_path / "run")])
    text = capsys.readouterr().out
    assert "memory plan of smollm2: llama, 0.13 B parameters" in text and "total" in text
    assert not (tmp_path / "run").exists()


def test_smaller_micro_batches_keep_the_generation_and_its_optimizer_steps() -> None:
    """A suggestion in smaller micro-batches keeps a generation's completions and how many optimizer steps train it
    (or how many generations one step trains), whatever ``steps_per_generation`` says."""
    from fastgrpo.memory_plan.fitting import _smaller_micro_batches

    for given in (
        dict(per_device_train_batch_size=8, gradient_accumulation_steps=2, steps_per_generation=4),
        dict(per_device_train_batch_size=8, gradient_accumulation_steps=4, steps_per_generation=2),
        dict(per_device_train_batch_size=8, gradient_accumulation_steps=2),
    ):
        config = GRPOConfig(num_generations=4, **given)
        suggested = list(_smaller_micro_batches(config))
        assert suggested and all(c.generation_batch_size == config.generation_batch_size for c in suggested)
        for c in suggested:
            c.validate()
            assert (c.windows_per_generation, c.generations_per_step) == (
                config.windows_per_generation,
                config.generations_per_step,
            )
