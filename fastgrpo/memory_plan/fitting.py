"""Whether a run's memory plan fits the device: `check_fits` refuses a plan larger than the memory available, naming
the options that would fit (each re-estimated, `fitting_options`); `plan_for_trainer` is what the trainer calls, and
`dry_run` is ``fastgrpo train --dry-run``."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from transformers import PretrainedConfig

from fastgrpo.config import GRPOConfig
from fastgrpo.memory.items import GIB
from fastgrpo.memory_plan.plan import CUDA_CONTEXT_BYTES, MemoryPlan, estimate_memory
from fastgrpo.models import SUPPORTED_FAMILIES, check_model_source, resolve_model_path

CARD_80GB_BYTES = 81559 * 2**20  # what an 80 GB A100/H100 reports in all
RECIPE_SHARE = 0.95  # a recommended configuration plans at most this share of the memory (the rest: fragmentation)


def _fits(config: GRPOConfig, plan: MemoryPlan, free_bytes: int, world_size: int | None = None) -> MemoryPlan | None:
    """``config`` re-estimated like ``plan`` (same model and device); the new plan when it fits ``free_bytes``."""
    processes = plan.world_size if world_size is None else world_size
    new = estimate_memory(config, plan.shape, plan.device, processes, plan.rollout)
    return new if new.peak_bytes <= free_bytes else None


def _largest(candidates: Iterator[GRPOConfig], plan: MemoryPlan, free_bytes: int) -> tuple[GRPOConfig, MemoryPlan]:
    """The first candidate (they come largest first) that fits, and its plan; raises StopIteration when none does."""
    for candidate in candidates:
        fitted = _fits(candidate, plan, free_bytes)
        if fitted is not None:
            return candidate, fitted
    raise StopIteration


def _in_micro_batches(config: GRPOConfig, rows: int, b: int, **changes: int) -> GRPOConfig | None:
    """``config`` with generations of ``rows`` completions in micro-batches of ``b``, and as many optimizer steps per
    generation (or generations per step) as it had; None where they do not divide."""
    micro = rows // b
    if config.steps_per_generation is None:
        return dataclasses.replace(config, per_device_train_batch_size=b, gradient_accumulation_steps=micro, **changes)
    windows, generations = config.windows_per_generation, config.generations_per_step
    if micro % windows:
        return None
    accumulated = micro // windows * generations
    return dataclasses.replace(
        config, per_device_train_batch_size=b, steps_per_generation=micro, gradient_accumulation_steps=accumulated,
        **changes,
    )  # fmt: skip


def _smaller_micro_batches(config: GRPOConfig) -> Iterator[GRPOConfig]:
    """The same completions per generation in smaller micro-batches (more accumulation steps), largest first."""
    rows = config.generation_batch_size
    for b in range(config.per_device_train_batch_size - 1, 0, -1):
        if rows % b == 0 and (fitted := _in_micro_batches(config, rows, b)) is not None:
            yield fitted


def _fewer_completions(config: GRPOConfig) -> Iterator[GRPOConfig]:
    """Fewer completions per generation, largest first: whole groups of ``num_generations`` while there is more than
    one, then a single smaller group; each in the largest micro-batches (at most the current ones) that divide it."""
    g = config.num_generations
    for rows in range(config.generation_batch_size - 1, 1, -1):
        if rows >= g and rows % g:
            continue
        b = max(d for d in range(1, min(config.per_device_train_batch_size, rows) + 1) if rows % d == 0)
        fitted = _in_micro_batches(config, rows, b, num_generations=min(g, rows))
        if fitted is not None:
            yield fitted


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
    processes that fit, and no speculation. Changes that fit only together are not searched."""
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
    if not config.use_peft and not plan.rollout:  # (a rollout process holds the whole policy all the same)
        sharded = dataclasses.replace(config, fsdp=True)
        for n in range(max(2, plan.world_size), 257):
            fitted = _fits(sharded, plan, free_bytes, world_size=n)
            if fitted is not None:
                apart = f" training and {config.rollout_processes} rollout" if config.rollout_processes else ""
                nproc = n + config.rollout_processes
                found.append((f"fsdp: true on {n}{apart} processes (torchrun --nproc_per_node {nproc})", fitted))
                break
    if config.speculation.mode != "off":
        off = dataclasses.replace(config, speculation=dataclasses.replace(config.speculation, mode="off"))
        attempt(single(off))
    return found


def recipe(config: GRPOConfig, plan: MemoryPlan, free_bytes: int) -> tuple[str, MemoryPlan] | None:
    """The configuration nearest ``config`` that fits `RECIPE_SHARE` of ``free_bytes`` on each of
    ``plan.world_size`` processes, with the same completions per step and float32 master weights kept: a full
    fine-tune sharded with FSDP2 over several processes, then in this order of preference no reference model
    (``beta: 0``) before LoRA (replicated), and within each the largest micro-batches, gradient checkpointing before
    smaller ones (under FSDP2 every micro-batch gathers every layer again). Returns the changed options and the
    plan, or None when none fits (fewer or shorter completions, or more processes, remain)."""
    for lora in dict.fromkeys((config.use_peft, True)):
        for beta in dict.fromkeys((config.beta, 0.0)):
            sharded = (config.fsdp or plan.world_size > 1) and not lora
            base = dataclasses.replace(config, use_peft=lora, beta=beta, fsdp=sharded)
            for sized in (base, *_smaller_micro_batches(base)):
                for checkpointing in dict.fromkeys((config.gradient_checkpointing, True)):
                    candidate = dataclasses.replace(sized, gradient_checkpointing=checkpointing)
                    fitted = _fits(candidate, plan, int(RECIPE_SHARE * free_bytes))
                    if fitted is not None:
                        return _changed(config, candidate), fitted
    return None


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


def world_size() -> int:
    """Processes in the job: torch.distributed's world when it is up, else torchrun's ``WORLD_SIZE`` (1 alone)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    from fastgrpo.distributed import env_int

    return env_int("WORLD_SIZE", 1)


def training_processes(config: GRPOConfig, processes: int) -> int:
    """The processes of a job of ``processes`` that train: those past its ``rollout_processes``."""
    return max(processes - config.rollout_processes, 1)


def available_bytes(device: torch.device | str) -> int:
    """The device memory a process's run may use in all, on CUDA device ``device``: what is free now
    (``torch.cuda.mem_get_info``), plus what this process's caching allocator holds already
    (``torch.cuda.memory_reserved``: tensors it has loaded, such as the policy, and cached blocks), plus the CUDA
    context allowance of the plan (the context exists once ``mem_get_info`` has run, so its memory is already
    outside the free figure, while the plan counts it)."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) + CUDA_CONTEXT_BYTES


def plan_for_trainer(
    config: GRPOConfig, model_config: PretrainedConfig, device: torch.device, rollout: bool = False
) -> MemoryPlan:
    """The run's memory plan on ``device``, refused (``ValueError`` from `check_fits`) on CUDA when it does not fit.

    Free-memory convention: the plan estimates everything the process will hold on the device, including what it
    has already allocated, and is checked against `available_bytes(device)` = ``torch.cuda.mem_get_info(device)``'s
    free bytes + ``torch.cuda.memory_reserved(device)`` + `CUDA_CONTEXT_BYTES`. So call it on each process with its
    own device, at any point after ``distributed.init`` and before the first rollout, before or after loading the
    policy, the reference model, the LoRA wrapping, the draft head and the optimizer's master weights: what they
    hold is in ``memory_reserved`` (with the allocator's cached free blocks, which the run can reuse too), and the
    plan counts it. The condition is that every live device tensor of the process is one the plan counts (not a
    second copy of the model, say). Other processes' memory on the same GPU is not free and is not counted.
    ``model_config`` is the policy's transformers config (``model.config``, also for a peft model). The training
    processes are torch.distributed's world (or ``WORLD_SIZE``) less the ``rollout_processes``; with ``rollout``
    the plan is a rollout process's. On a device other than CUDA the plan is returned unchecked."""
    device = torch.device(device)
    plan = estimate_memory(config, model_config, device, training_processes(config, world_size()), rollout)
    if device.type == "cuda":
        check_fits(plan, available_bytes(device), config)
    return plan


def _config_source(name: str) -> str:
    """Where the transformers config of model ``name`` is: the base model's for a directory holding a peft adapter
    alone (as a LoRA run's checkpoint does), else the model's own."""
    directory = Path(name).expanduser()
    adapter = directory / "adapter_config.json"
    if not adapter.is_file() or (directory / "config.json").is_file():
        return resolve_model_path(name)
    try:
        base = json.loads(adapter.read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"model: cannot read {adapter}: {e}") from None
    if not isinstance(base, str) or not base:
        raise ValueError(f"model: {adapter} names no base model (base_model_name_or_path)")
    return resolve_model_path(base)


def read_model_config(name: str) -> PretrainedConfig:
    """The transformers config of ``config.model`` (a directory, a hub id, or ``smollm2``; for a peft adapter's
    directory its base model's), without its weights or tokenizer; ``ValueError`` when it is not the config of a
    causal language model."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    check_model_source(name)
    try:
        model_config = AutoConfig.from_pretrained(_config_source(name))
    except (OSError, ValueError) as e:
        raise ValueError(f"model: cannot read the config of {name}: {e}") from None
    if model_config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not getattr(model_config, "auto_map", None):
        raise ValueError(
            f"model: cannot load {name} as a causal language model: its config is a {type(model_config).__name__}, "
            "of a model that transformers' AutoModelForCausalLM does not build"
        )
    return model_config


def check_sequence_length(model_config: PretrainedConfig, max_prompt_length: int, max_completion_length: int) -> None:
    """Raise ``ValueError`` naming max_completion_length when prompts of ``max_prompt_length`` tokens and completions
    of ``max_completion_length`` exceed the model's context (``max_position_embeddings``, where its config has one)."""
    context = getattr(model_config.get_text_config(), "max_position_embeddings", None)
    if context is not None and max_prompt_length + max_completion_length > context:
        raise ValueError(
            f"max_completion_length: prompts of up to max_prompt_length ({max_prompt_length}) tokens and "
            f"completions of up to {max_completion_length} exceed the model's context of {context} tokens "
            "(max_position_embeddings); shorten either"
        )


def check_training_options(config: GRPOConfig, model_config: PretrainedConfig) -> None:
    """Refuse, before any weight is read, settings that are valid options but cannot train: greedy sampling (every
    completion of a group the same) and sequences longer than the model's context; and a draft vocabulary where the
    run makes no EAGLE draft (`fastgrpo draft train` makes one whatever the speculation options)."""
    spec = config.speculation
    if spec.draft_vocab_size is not None and (spec.mode == "off" or "eagle" not in spec.drafter.split("+")):
        why = "speculation.mode: off" if spec.mode == "off" else f"speculation.drafter: {spec.drafter}"
        raise ValueError(
            f"speculation.draft_vocab_size has no effect with {why} (it sizes the EAGLE draft's vocabulary): remove it"
        )
    if config.temperature == 0:
        raise ValueError(
            "temperature: 0 samples greedily, so every completion of a group is the same, every advantage is 0 and "
            "nothing is learnt; GRPO needs temperature > 0 (1.0 is TRL's default)"
        )
    check_sequence_length(model_config, config.max_prompt_length, config.max_completion_length)


def check_before_training(config: GRPOConfig) -> PretrainedConfig:
    """What `GRPOTrainer` refuses before it loads a model, besides the dataset and the output directory, checked the
    same way (the trainer's own functions): the drafters and a saved draft, draft options no drafter reads, the reward
    functions, the cache directory, and the model's config against the options (`check_training_options`: greedy
    sampling, sequences beyond the context). Not the model's weights or tokenizer files: a dry run plans from a
    model's config.json alone. Returns the model's config."""
    from fastgrpo.models import check_cache_dir
    from fastgrpo.rewards import resolve_reward_funcs
    from fastgrpo.speculative.registry import check_draft_training, check_speculation

    check_speculation(config.speculation)
    check_draft_training(config.speculation, config.draft_training)
    resolve_reward_funcs(config.reward_funcs)
    check_cache_dir()
    model_config = read_model_config(config.model)
    check_training_options(config, model_config)
    return model_config


def dry_run(config: GRPOConfig, processes: int | None = None) -> str:
    """``fastgrpo train --dry-run``: the options checked as training checks them before it loads a model
    (`check_before_training`), then the memory plan of ``config`` (validated already) on the device the run would
    use, for ``processes`` processes (None: this job's, `world_size`), from the model's config alone, and on a GPU
    whether it fits the memory available there (`available_bytes`), with the nearest configuration that does
    (`recipe`) when it does not. ``device: cuda`` on a machine without a GPU plans for one (bfloat16 for ``dtype:
    auto``), checked against an 80 GB card. Nothing is written."""
    from fastgrpo.distributed import env_int, resolve_device

    model_config = check_before_training(config)
    planned_only = config.device == "cuda" and not torch.cuda.is_available()
    if planned_only:  # planning a GPU run on a machine without one: the plan is arithmetic
        device = torch.device("cuda", env_int("LOCAL_RANK", 0))
    else:
        device = resolve_device(config.device, env_int("LOCAL_RANK", 0))
    plan = estimate_memory(config, model_config, device, training_processes(config, processes or world_size()))
    lines = [f"memory plan of {config.model}: {plan.summary()}", "", plan.table(), ""]
    if plan.shape.model_type not in SUPPORTED_FAMILIES:
        lines.append(f"note: {plan.shape.model_type} is outside the families the estimate models exactly")
    if planned_only:
        lines.append("no GPU here: the plan is for a CUDA device, checked against an 80 GB card's memory")
        lines += _fits_lines(plan, CARD_80GB_BYTES, config, "an 80 GB card")
    elif device.type == "cuda":
        lines += _fits_lines(plan, available_bytes(device), config, str(device))
    else:
        lines.append(
            f"no GPU: the plan is for the CPU (dtype {plan.dtype}), whose memory is the host's; add --device cuda to "
            "plan a GPU run"
        )
    return "\n".join(lines)


def _fits_lines(plan: MemoryPlan, available: int, config: GRPOConfig, where: str) -> list[str]:
    """``fits: yes`` with the memory available on ``where``; or ``fits: no`` with `check_fits`'s advice and the
    `recipe` that fits on the plan's processes."""
    try:
        check_fits(plan, available, config)
    except ValueError as e:
        n = plan.world_size
        on = f"on {n} process{'es' if n > 1 else ''} of {available / GIB:.1f} GiB"
        found = recipe(config, plan, available)
        if found is None:
            advice = f"recommended {on}: none of fsdp, smaller micro-batches, checkpointing, beta 0 or LoRA fits"
        else:
            advice = f"recommended {on}: {found[0]} (peak {found[1].peak_bytes / GIB:.1f} GiB)"
        return [f"fits: no: {e}", advice]
    return [f"fits: yes, {available / GIB:.1f} GiB available on {where}"]
