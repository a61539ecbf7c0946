"""The models a run trains and compares against: the LoRA-wrapped policy and the frozen reference."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedModel

from fastgrpo.config import GRPOConfig
from fastgrpo.models import load_model


def reference_model(config: GRPOConfig, device: torch.device) -> PreTrainedModel | None:
    """A frozen copy of the initial policy for the KL penalty (none with LoRA: the policy with its adapters disabled
    is the reference)."""
    if config.use_peft:
        return None
    ref = load_model(config.model, dtype=config.dtype, device=device).eval()
    ref.requires_grad_(False)
    return ref


def wrap_lora(model: PreTrainedModel, config: GRPOConfig, checkpoint: Path | None) -> PreTrainedModel:
    """``model`` with trainable LoRA adapters: those of ``checkpoint``, or fresh ones as ``lora_*`` asks."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if checkpoint is not None:
        return PeftModel.from_pretrained(model, str(checkpoint), is_trainable=True)
    lora = LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=config.lora_target_modules or "all-linear",
        task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(model, lora)
    except ValueError as e:
        raise ValueError(f"lora_target_modules {config.lora_target_modules}: {e}") from None


def disable_dropout(model: torch.nn.Module) -> None:
    """Set every dropout of ``model`` to 0 (TRL's ``disable_dropout``)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
