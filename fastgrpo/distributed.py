"""Data-parallel runs on torch.distributed: the process group, the few collectives the trainer needs, and the device of
each process.

``torchrun --nproc_per_node N -m fastgrpo train ...`` starts one process per device and sets ``RANK``, ``WORLD_SIZE``
and ``LOCAL_RANK``; the processes join a group, also when N is 1 (DDP or FSDP2 over one process). Without them a run
is a single process and every collective here returns its input. The backend is NCCL when the processes use GPUs and
gloo on CPU; every collective gives up after the configured timeout, so that a dead rank holds no other for ever."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class DistInfo:
    """This process: ``rank`` of ``world_size`` trainers (a rollout process: 0 of 1, their joint batch), ``device``."""

    rank: int
    world_size: int
    device: torch.device
    rollout: bool = False  # a rollout process (`rollout_processes`): it generates for every training process
    shares: int = 1  # a rollout process: the training processes each of its generations is cut into shares for

    @property
    def is_main(self) -> bool:
        return self.rank == 0 and not self.rollout

    @property
    def trainers(self) -> int:  # the job's training processes (a generation's prompts are cut into a share for each)
        return self.world_size * self.shares


_TRAINING: Any = None  # with rollout processes, the group of the training processes, which the collectives below use
_MESSAGES: Any = None  # with rollout processes, a gloo group of every process for their messages (on the host)
_ROLLOUT = False  # this process is a rollout process: it takes part in no collective of the training processes


def env_int(name: str, default: int) -> int:
    """The whole number the environment variable ``name`` holds (``default`` when unset); ``ValueError`` naming the
    variable when it holds something else (torchrun sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` to numbers)."""
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(
            f"the environment variable {name} must be a whole number (torchrun sets it), got {text!r}"
        ) from None
    if value < 0:
        raise ValueError(f"the environment variable {name} must be a whole number >= 0, got {text!r}")
    return value


def resolve_device(option: str, local_rank: int = 0) -> torch.device:
    """``auto`` is the process's GPU when there is one and the CPU otherwise; ``cuda`` is ``cuda:LOCAL_RANK``."""
    if option not in DEVICES:
        raise ValueError(f"device must be one of {list(DEVICES)}, got {option!r}")
    if option == "cuda" or (option == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("device: cuda was asked for but torch sees no GPU")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init(device_option: str = "auto", timeout_seconds: float = 1800.0, rollout_processes: int = 0) -> DistInfo:
    """Join the job torchrun started (once per process; later calls return the same answer); with
    ``rollout_processes``, the last ranks only generate and the others train (the group the collectives here use)."""
    global _TRAINING, _MESSAGES, _ROLLOUT
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ  # by torchrun: a group even of one process
    local_rank = env_int("LOCAL_RANK", 0)
    for name in ("RANK", "WORLD_SIZE"):
        env_int(name, 0)  # named here, before torch.distributed reads it
    device = resolve_device(device_option, local_rank)
    if launched and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            timeout=timedelta(seconds=timeout_seconds),
            device_id=device if device.type == "cuda" else None,
        )
    world = dist.get_world_size() if dist.is_initialized() else 1
    if rollout_processes and world <= rollout_processes:
        raise ValueError(
            f"rollout_processes: {rollout_processes} rollout processes need a training process besides: start at "
            f"least {rollout_processes + 1} processes with torchrun (--nproc_per_node), not {world}"
        )
    if not dist.is_initialized():
        return DistInfo(0, 1, device)
    training = world - rollout_processes
    if rollout_processes and _TRAINING is None:  # made by every process, once, in the same order
        _TRAINING = dist.new_group(list(range(training)))
        _MESSAGES = dist.new_group(backend="gloo")
    _ROLLOUT = dist.get_rank() >= training  # a rollout process: one process of the training processes' joint batch
    return DistInfo(0, 1, device, True, training) if _ROLLOUT else DistInfo(dist.get_rank(), training, device)


def shutdown() -> None:
    """Destroy the process group; free the modules under DDP first: on gloo a DDP reducer freed later holds the group's
    last reference, whose destructor, run with the GIL held, waits for a thread that waits for the GIL (a hang)."""
    global _TRAINING, _MESSAGES, _ROLLOUT
    if dist.is_initialized():
        dist.destroy_process_group()
    _TRAINING, _MESSAGES, _ROLLOUT = None, None, False


def gather(value: Any) -> list[Any]:
    """Every rank's ``value`` (any picklable object), in rank order; ``[value]`` in a single process."""
    if not dist.is_initialized() or _ROLLOUT:
        return [value]  # a rollout process scores whole generations alone
    out: list[Any] = [None] * dist.get_world_size(_TRAINING)
    dist.all_gather_object(out, value, group=_TRAINING)
    return out


def message_group() -> Any:
    """The group rollout and training processes exchange their messages in (`fastgrpo.grpo.pipeline`)."""
    return _MESSAGES


def max_over_ranks(value: int) -> int:
    return max(gather(value))


def sum_over_ranks(value: float) -> float:
    return sum(gather(value))


def barrier(job: bool = False) -> None:
    """Wait for the training processes (``job``: for every process, rollout processes included)."""
    if dist.is_initialized():
        dist.barrier(group=None if job else _TRAINING)


@contextlib.contextmanager
def main_first(info: DistInfo) -> Iterator[None]:
    """Run the body on rank 0 before every other process (for work that fills a shared cache once)."""
    if not info.is_main:
        barrier(job=True)
    yield
    if info.is_main:
        barrier(job=True)


def is_sharded(module: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def wrap_policy(policy: torch.nn.Module, fsdp: bool, float32_shards: bool = False) -> torch.nn.Module:
    """The training forward of several processes: replicated under DDP, or sharded over the training processes with
    FSDP2 (``fsdp``: a unit per decoder layer, the root holding the embedding, final norm and LM head). ``policy``
    holds the model as ``policy.model``; in a single process it is returned as it is.

    With ``float32_shards`` (a bfloat16 or float16 policy whose run keeps float32 master weights), the shards are
    float32: they are the master weights AdamW updates, FSDP2 gathers them in the policy's dtype for every forward
    and reduces gradients in float32 (its `MixedPrecisionPolicy`). Each unit is converted as it is sharded, so a
    process never holds more than one unit's parameters in float32 unsharded."""
    if not dist.is_initialized():
        return policy
    if not fsdp:
        return wrap_ddp(policy)
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device = next(policy.parameters()).device
    mesh = None if _TRAINING is None else DeviceMesh.from_group(_TRAINING, device.type)
    precision = MixedPrecisionPolicy()
    if float32_shards:
        compute = next(policy.parameters()).dtype
        precision = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)

    def shard(module: torch.nn.Module) -> None:
        if float32_shards:
            with torch.no_grad():
                for param in module.parameters():  # a unit sharded before is float32 already
                    if param.dtype != torch.float32:
                        param.data = param.data.to(torch.float32)  # in place: tied weights stay tied
        fully_shard(module, mesh=mesh, mp_policy=precision)

    for layer in policy.model.get_decoder().layers:
        shard(layer)
    shard(policy)
    # FSDP sets itself up on the first forward through the root; rollouts call the decoder directly, so one
    # two-token forward (on every rank at once) runs through the root first.
    with torch.no_grad():
        policy(torch.zeros(1, 2, dtype=torch.long, device=device), torch.ones(1, 2, device=device), 1, 1.0, 1)
    policy.reshard()  # the root keeps its parameters gathered after a forward: register the sharded ones again
    return policy


ROLLOUT_WEIGHTS = "rollout_weights"  # the policy's attribute holding the gathered copies, by parameter name


@contextlib.contextmanager
def gathered(policy: torch.nn.Module) -> Iterator[None]:
    """Full parameters on every rank inside the block (rollouts and draft updates, whose forwards differ in number
    between ranks, must not run collectives); sharded again after it. A no-op without FSDP2.

    FSDP2 frees a unit's gathered parameters when it reshards and gathers them anew at new addresses, where a captured
    CUDA graph, which reads its parameters at fixed addresses, would be recorded again in every rollout. Instead each
    unit is gathered once on entry, copied into parameters the policy keeps for the whole run (`ROLLOUT_WEIGHTS`,
    allocated at the first gather: one full copy of the weights in the policy's dtype on every rank, besides the
    shards) and sharded again at once, so that one unit at a time is gathered in FSDP2's own memory; the modules
    compute with the kept copies inside the block and get FSDP2's sharded parameters back after it.

    Inside the block the sharded modules also run without FSDP2's forward hooks, which would gather the parameters
    again (a collective): a compiled decoding step then traces the plain modules (FSDP2 keeps its hooks out of
    ``torch.compile``'s graphs, which ``fullgraph`` refuses), and ``torch.compile`` takes the kept copies, being
    parameters of the modules, as static inputs."""
    if not is_sharded(policy):
        yield
        return
    from torch.distributed.fsdp import FSDPModule

    kept: dict[str, torch.nn.Parameter] = getattr(policy, ROLLOUT_WEIGHTS, None) or {}
    setattr(policy, ROLLOUT_WEIGHTS, kept)
    units = [(name, m) for name, m in policy.named_modules() if isinstance(m, FSDPModule)]
    swapped: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []  # (module, name, FSDP2's parameter)
    set_aside: list[tuple[dict, list]] = []  # each hook dict touched, with its entries as they were
    try:
        for prefix, unit in units:
            swapped += _gather_into(unit, prefix, kept)
        _set_hooks_aside([unit for _, unit in units], set_aside)
        yield
    finally:
        for hooks, entries in set_aside:  # in their order, after them any hook added meanwhile
            added = [(k, v) for k, v in hooks.items() if k not in dict(entries)]
            hooks.clear()
            hooks.update(entries + added)
        for module, name, param in reversed(swapped):
            setattr(module, name, param)


def _unit_slots(unit: torch.nn.Module, prefix: str) -> list[tuple[str, torch.nn.Module, str]]:
    """``(qualified name, module, parameter name)`` of each parameter FSDP2 shards in ``unit`` (those of the units
    nested in it excluded), a tied parameter once per module holding it; names are prefixed with ``prefix``."""
    from torch.distributed.fsdp import FSDPModule

    slots = []

    def visit(module: torch.nn.Module, path: str) -> None:
        slots.extend((f"{path}{name}", module, name) for name, p in module._parameters.items() if p is not None)
        for name, child in module._modules.items():
            if child is not None and not isinstance(child, FSDPModule):
                visit(child, f"{path}{name}.")

    visit(unit, f"{prefix}." if prefix else "")
    return slots


@torch.no_grad()
def _gather_into(
    unit: torch.nn.Module, prefix: str, kept: dict[str, torch.nn.Parameter]
) -> list[tuple[torch.nn.Module, str, torch.nn.Parameter]]:
    """Gather ``unit`` (FSDP2), copy each of its full parameters (``[*shape]`` each, the policy's dtype) into
    ``kept[name]`` (allocated at the first call: a tied parameter under its first name), shard the unit again and
    put the kept copies in its modules. Returns ``(module, parameter name, FSDP2's sharded parameter)`` of each."""
    slots = _unit_slots(unit, prefix)
    unit.unshard()
    try:
        copies: dict[int, torch.nn.Parameter] = {}  # FSDP2's gathered parameter (by identity) -> its kept copy
        for name, module, attr in slots:
            full = getattr(module, attr)
            if id(full) not in copies:
                if name not in kept:
                    kept[name] = torch.nn.Parameter(torch.empty_like(full), requires_grad=full.requires_grad)
                copies[id(full)] = kept[name]
                kept[name].copy_(full)
        placed = [copies[id(getattr(module, attr))] for _, module, attr in slots]
    finally:
        unit.reshard()
    swapped = []
    for (_, module, attr), copy in zip(slots, placed, strict=True):
        swapped.append((module, attr, getattr(module, attr)))
        setattr(module, attr, copy)
    return swapped


def _set_hooks_aside(units: list[torch.nn.Module], set_aside: list[tuple[dict, list]]) -> None:
    """Remove FSDP2's forward hooks (methods of each unit's FSDP state) from ``units``, appending each hook dict
    touched with its entries as they were to ``set_aside``."""
    from torch.distributed.fsdp import fully_shard

    for unit in units:
        state = fully_shard.state(unit)
        for hooks in (unit._forward_pre_hooks, unit._forward_hooks):
            entries = list(hooks.items())
            for key, hook in entries:
                if getattr(hook, "__self__", None) is state:
                    del hooks[key]
            set_aside.append((hooks, entries))


@contextlib.contextmanager
def gradient_sync(policy: torch.nn.Module, sync: bool) -> Iterator[None]:
    """Backward passes inside the block synchronise gradients across ranks only if ``sync`` (off for all but the
    last micro-batch of an accumulation: DDP's ``no_sync``). FSDP2 synchronises every micro-batch: it reduce-scatters
    each one's gradients into the sharded ones (float32 with float32 shards), where skipping it would keep the
    full gradients of every parameter on every rank until the last."""
    if sync or not dist.is_initialized() or is_sharded(policy):
        yield
    else:
        with policy.no_sync():
            yield


def full_state(policy: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict | None, dict]:
    """``(model weights, optimizer state)`` to checkpoint: with FSDP2, both gathered in full on the CPU (every rank
    must call this); otherwise ``(None, optimizer.state_dict())`` and the model saves its own weights."""
    if not is_sharded(policy):
        return None, optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights, optim = get_state_dict(policy, optimizer, options=options)
    return {k.removeprefix("model."): v for k, v in weights.items()}, optim


def load_full_weights(policy: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Set the sharded parameters of ``policy`` (FSDP2) from full ``weights`` (the model's parameter names), each
    rank keeping its shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full = {f"model.{name}": tensor for name, tensor in weights.items()}
    set_model_state_dict(policy, full, options=StateDictOptions(full_state_dict=True, strict=False))


def load_optimizer_state(policy: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Restore what `full_state` saved (sharding it again under FSDP2)."""
    if not is_sharded(policy):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(policy, optimizer, state, options=StateDictOptions(full_state_dict=True))


def wrap_ddp(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` under DistributedDataParallel when a process group is up (it broadcasts rank 0's parameters,
    so every rank starts identical); ``module`` itself otherwise (a rollout process's drafts learn alone)."""
    if not dist.is_initialized() or _ROLLOUT:
        return module
    param = next(p for p in module.parameters() if p.requires_grad)
    device_ids = [param.device.index] if param.device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(module, device_ids=device_ids, process_group=_TRAINING)


# How each step metric is combined across ranks (the rest are averaged: every rank holds the same number of rows).
_COMBINE = {
    "step": max,
    "completions/min_length": min,
    "completions/max_length": max,
    "memory/peak_mb": max,
    "memory/rollout_peak_mb": max,
    "memory/update_peak_mb": max,
    "memory/rollout_peak_reserved_mb": max,
    "memory/update_peak_reserved_mb": max,
    "rollout/tokens_per_second": sum,
    "train/rows_trained": sum,
    "num_tokens": sum,
    "async/dropped_samples": sum,  # each training process counts its share's
    # NaN on a process none of whose completions ended
    "completions/min_terminated_length": lambda values: min((v for v in values if v == v), default=math.nan),
    "completions/max_terminated_length": lambda values: max((v for v in values if v == v), default=math.nan),
}


def reduce_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """One metrics dict for the job: times are the slowest rank's (the step waits for it), throughput is summed,
    extremes (``*/max``, ``*/min`` among them) are extremes, everything else is the mean over the ranks that
    measured it (not NaN, and present: a drafter that ran on one rank only has its ``spec/drafter/*`` figures
    there)."""
    parts = gather(metrics)
    if len(parts) == 1:
        return metrics
    out = {}
    for key in dict.fromkeys(k for p in parts for k in p):
        values = [p[key] for p in parts if key in p]
        combine = _COMBINE.get(key, max if key.startswith("time/") or key.endswith("/max") else None)
        combine = min if combine is None and key.endswith("/min") else combine
        if combine is None:
            measured = [v for v in values if not math.isnan(v)]
            out[key] = sum(measured) / len(measured) if measured else float("nan")
        else:
            out[key] = combine(values)
    return out
