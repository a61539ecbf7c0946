"""Mixed precision as GPU training does it: float32 master weights behind low-precision module weights, and TF32
products for float32 weights on CUDA.

The transformers module holds the one copy of the weights that rollouts and the update compute with. When that copy
is bfloat16 (or float16), an AdamW step of a few 1e-6 relative size rounds away in it, so `MasterWeights` keeps a
float32 copy of each trainable parameter as optimizer state: AdamW updates the float32 copies from the module's
gradients, and the result is written back into the module rounded to its dtype.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)


class MasterWeights:
    """Float32 copies of ``params`` (trainable parameters of a low-precision module) for the optimizer to update.

    Use: build the optimizer on `copies`; after each backward pass call `take_grads` (the module's gradients are
    added to the masters', in float32), or once `take_grads_in_backward` and `take_grads` before each step; step the
    optimizer, then `write_back`.
    """

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        self.copies = [p.detach().to(dtype=torch.float32, copy=True) for p in params]

    @staticmethod
    def needed(params: list[torch.nn.Parameter]) -> bool:
        """Whether any of ``params`` is low precision (bfloat16 or float16)."""
        return any(p.dtype in LOW_PRECISION for p in params)

    @torch.no_grad()
    def take_grads(self, zero_missing: bool = True) -> None:
        """Add each parameter's gradient to its master's, in float32, and drop the parameter's: called after every
        backward, the gradients accumulate in float32. A master that has no gradient then gets zeros
        (``zero_missing``: Adam's moments still move) or stays without (the optimizer skips it)."""
        for p, m in zip(self.params, self.copies, strict=True):
            if p.grad is not None:
                grad = p.grad.to(torch.float32)
                m.grad = grad if m.grad is None else m.grad.add_(grad)
                p.grad = None
            elif m.grad is None and zero_missing:
                m.grad = torch.zeros_like(m)

    def take_grads_in_backward(self) -> None:
        """Until `close`, every backward pass adds each parameter's gradient to its master's (in float32) as soon as
        it is computed, and drops the parameter's: the low-precision gradients never all exist at once."""
        self.close()
        self._hooks = [
            p.register_post_accumulate_grad_hook(partial(_take_grad, m))
            for p, m in zip(self.params, self.copies, strict=True)
        ]

    def close(self) -> None:
        """Remove the hooks of `take_grads_in_backward` (the module's gradients stay its own again)."""
        for hook in getattr(self, "_hooks", []):
            hook.remove()
        self._hooks = []

    @torch.no_grad()
    def write_back(self) -> None:
        """Copy the masters into the module's parameters (rounded to their dtype)."""
        for p, m in zip(self.params, self.copies, strict=True):
            p.copy_(m)

    def state_dict(self) -> dict[str, Any]:
        """The masters, on the CPU, in parameter order."""
        return {"masters": [m.detach().cpu() for m in self.copies]}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` saved (and write the masters back into the module)."""
        saved = state["masters"]
        shapes = [tuple(m.shape) for m in self.copies]
        if [tuple(s.shape) for s in saved] != shapes:
            raise ValueError("master weights saved for other trainable parameters than this run's")
        for m, s in zip(self.copies, saved, strict=True):
            m.copy_(s)
        self.write_back()


@torch.no_grad()
def _take_grad(master: torch.Tensor, param: torch.Tensor) -> None:
    grad = param.grad.to(torch.float32)
    master.grad = grad if master.grad is None else master.grad.add_(grad)
    param.grad = None


@contextmanager
def tf32_matmuls(device: torch.device) -> Iterator[None]:
    """Inside the block, float32 matrix products on CUDA may run on TF32 tensor cores (as PyTorch's GPU trainers
    allow); torch's setting is restored afterwards. Nothing changes on other devices."""
    if device.type != "cuda":
        yield
        return
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # TF32 for float32 products on CUDA
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def fused_adamw(device: torch.device) -> bool:
    """Whether the policy's AdamW runs fused on ``device``: on CUDA, where one kernel updates every parameter in place
    with no temporary (the default there, foreach, makes a temporary of a moment's size for all parameters at once);
    elsewhere AdamW's default, a loop over the parameters whose temporary is one parameter's (on the CPU the fused
    kernel would round bfloat16 results differently). The memory plan counts the temporary accordingly."""
    return device.type == "cuda"
