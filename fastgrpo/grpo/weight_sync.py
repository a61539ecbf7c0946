"""What rank 0 sends of the policy to the rollout processes (`fastgrpo.grpo.pipeline`), and the check,
before the first generation, that every rollout process would receive into the same parameters: the weights travel
as bare tensors in order, so a parameter trained on one side and frozen on the other (a callback that freezes layers
on the training processes alone) would otherwise land in the wrong tensor, or leave a receive waiting until the process
group's timeout.

Under FSDP2 each training process holds a shard of every parameter (float32 ones where they are the master weights):
at each weight sync every training process gathers them (`SentWeights.gather`) and rank 0 sends them whole, in the
policy's dtype, from buffers it keeps for the run (a full copy of the trained parameters)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fastgrpo import distributed

if TYPE_CHECKING:
    from fastgrpo.grpo.policy_update import PolicyUpdate

Signature = list[tuple[str, tuple[int, ...], str]]


def _trained(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters the update trains, named, in the model's order: every one, or the LoRA adapters (the frozen
    base weights being the same everywhere)."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def gathered_dtype(update: PolicyUpdate | None) -> torch.dtype | None:
    """The dtype the update's float32 master shards travel in (FSDP2 gathers them in the policy's for every forward
    too); None where each parameter travels in its own."""
    return update.compute_dtype if update is not None and update.float32_shards else None


def _sent_dtype(param: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype ``param`` travels in: a sharded one's (FSDP2's `DTensor`) is ``dtype`` where given (`gathered_dtype`),
    any other's its own."""
    return dtype if dtype is not None and isinstance(param, DTensor) else param.dtype


def synced_parameters(model: torch.nn.Module) -> list[torch.Tensor]:
    """What a rollout process receives into of ``model`` (`_trained`), in the order rank 0 sends it."""
    return [p.data for _, p in _trained(model)]


class SentWeights:
    """What a training process sends of the policy (``sender``: rank 0) or gathers for it at each weight sync: the
    trained parameters as the update holds them, taken once (FSDP2's sharded parameters, which AdamW updates, stay the
    same objects for the run, while its root unit registers gathered copies in their place from a forward to the
    next backward), and rank 0's tensors to send (`tensors`): the parameters' own, or, for sharded ones, buffers of
    their full shapes in ``dtype`` (`gathered_dtype`) that `gather` fills."""

    def __init__(self, policy: torch.nn.Module, model: torch.nn.Module, dtype: torch.dtype | None, sender: bool):
        if distributed.is_sharded(policy):
            policy.reshard()  # (registers every sharded parameter again: the root unit may hold gathered copies)
        self.params = [p for _, p in _trained(model)]
        self.copies = bool(self.params) and all(isinstance(p, DTensor) for p in self.params)  # (none the update's)
        self.tensors = [
            torch.empty(p.shape, dtype=_sent_dtype(p, dtype), device=p.device) if isinstance(p, DTensor) else p.data
            for p in (self.params if sender else [])
        ]

    def gather(self) -> None:
        """Gather every sharded parameter whole (a collective of the training processes, each calling this at the
        same step, in the same order) into its buffer on rank 0; the others drop what they gather. A no-op without
        FSDP2."""
        with torch.no_grad():
            for i, p in enumerate(self.params):
                if isinstance(p, DTensor):
                    full = p.full_tensor()
                    if self.tensors:
                        self.tensors[i].copy_(full)


def signature(model: torch.nn.Module, dtype: torch.dtype | None = None) -> Signature:
    """``(name, shape, dtype)`` of each of `synced_parameters` (``dtype``: the policy's, that of sharded ones)."""
    return [(name, tuple(p.shape), str(_sent_dtype(p, dtype)).removeprefix("torch.")) for name, p in _trained(model)]


def check_same_parameters(model: torch.nn.Module, group: dist.ProcessGroup, dtype: torch.dtype | None = None) -> None:
    """Raise ``ValueError`` on every process of ``group`` (every process of the job; a collective) unless each one's
    `signature` is rank 0's (which sends the weights), naming the first rank and parameter that differ; ``dtype``
    is the policy's, in which sharded parameters travel."""
    mine = signature(model, dtype)
    every: list[Signature] = [[] for _ in range(dist.get_world_size(group))]
    dist.all_gather_object(every, mine, group=group)
    sent = every[0]
    for rank, received in enumerate(every[1:], start=1):
        if received != sent:
            raise ValueError(f"rollout_processes: {difference(sent, received, rank)}")


def difference(sent: Signature, received: Signature, rank: int) -> str:
    """The first difference between the parameters rank 0 trains (and sends) and those rank ``rank`` trains."""
    ours, theirs = {s[0]: s for s in sent}, {s[0]: s for s in received}
    for name, shape, dtype in sent:
        if name not in theirs:
            return (
                f"rank 0 trains {name}, which rank {rank} does not (frozen there, or no "
                "such parameter); every process must train the same parameters, frozen before training starts"
            )
        if theirs[name][1:] != (shape, dtype):
            _, other_shape, other_dtype = theirs[name]
            return (
                f"{name} is {list(shape)} {dtype} on rank 0 but {list(other_shape)} {other_dtype} on rank {rank}; "
                "every process must load the same model in the same dtype"
            )
    extra = next((s[0] for s in received if s[0] not in ours), None)
    if extra is not None:
        return (
            f"rank {rank} trains {extra}, which rank 0 does not (frozen there, or no such "
            "parameter); every process must train the same parameters, frozen before training starts"
        )
    return f"rank {rank} holds the trained parameters in another order than rank 0"
