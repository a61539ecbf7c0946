"""Memory-lean log-probs of completion tokens for the policy update: the decoder body once, then the LM head chunk by
chunk (checkpointed under autograd), so that no full-vocabulary logits of the batch are ever alive; with the entropies
of the same chunks on request (`completion_logprobs`, and `CompletionLogprobs` as one module for DDP and FSDP2)."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions counting only attended tokens: ``[B, T]`` mask -> ``[B, T]`` ids (0 on left pads)."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def _chunk_logprobs(
    head: nn.Module,
    hidden: Tensor,
    targets: Tensor,
    temperature: float,
    entropy: bool | str = False,
    fp32_head: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Log-probs of ``targets`` under ``head``: hidden ``[n, H]``, targets ``[n]`` -> ``[n]``; with ``entropy``
    also the entropy of each position's distribution (``[n]``) from the same logits, detached unless ``entropy`` is
    ``"grad"``.

    The softmax runs in at least float32 (float64 inputs stay float64); ``fp32_head``: the head's matmul too
    (TRL's ``cast_lm_head_to_fp32``).
    """
    if fp32_head and hidden.dtype != torch.float64:
        bias = None if head.bias is None else head.bias.float()
        logits = nn.functional.linear(hidden.float(), head.weight.float(), bias)
    else:
        logits = head(hidden)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    logp = logits.log_softmax(dim=-1)
    chosen = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not entropy:
        return chosen
    if entropy == "grad":  # the entropy bonus differentiates it
        return chosen, -(logp.exp() * logp).sum(dim=-1)
    with torch.no_grad():  # a metric (or a mask): no graph, and one [n, V] temporary, freed at once
        probs = logp.exp()
        return chosen, -probs.mul_(logp).sum(dim=-1)


def _head_logprobs(
    head: nn.Module,
    hidden: Tensor,
    targets: Tensor,
    temperature: float,
    chunk_tokens: int,
    entropy: bool | str = False,
    fp32_head: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Apply the LM head chunk by chunk: hidden ``[n, H]``, targets ``[n]`` -> ``[n]`` (and the entropies ``[n]``
    with ``entropy``).

    With autograd on, each chunk is checkpointed, so only one chunk's ``[chunk_tokens, V]``
    logits are alive at a time, in the forward and in the backward pass.
    """
    pieces = []
    for h, t in zip(hidden.split(chunk_tokens), targets.split(chunk_tokens), strict=True):
        if torch.is_grad_enabled():
            pieces.append(checkpoint(_chunk_logprobs, head, h, t, temperature, entropy, fp32_head, use_reentrant=False))
        else:
            pieces.append(_chunk_logprobs(head, h, t, temperature, entropy, fp32_head))
    if not entropy:
        return torch.cat(pieces)
    return torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces])


def completion_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    logits_to_keep: int,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    entropy: bool | str = False,
    fp32_head: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Per-token log-probabilities of the completion tokens, without full-vocabulary logits.

    Rows are ``[prompt (left-padded) | completion (right-padded)]``; the completion occupies
    the last ``logits_to_keep`` columns. The decoder body (``model.get_decoder()``) runs with
    position ids from the mask's cumulative sum; only the hidden states predicting completion
    tokens (columns ``T - logits_to_keep - 1 .. T - 2``) go through the LM head
    (``model.get_output_embeddings()``), ``chunk_tokens`` tokens at a time. Differentiable.

    Args:
        model: causal LM (transformers model, possibly peft-wrapped).
        input_ids: ``[B, T]`` token ids.
        attention_mask: ``[B, T]``, 0 on padding.
        logits_to_keep: completion length ``C`` (``1 <= C < T``).
        temperature: logits are divided by it before the softmax.
        chunk_tokens: most tokens sent through the LM head at once.
        entropy: also return each position's entropy (from the same chunks of logits, none kept): ``True``
            detached, ``"grad"`` differentiable (for an entropy bonus).
        fp32_head: the LM head's matmul in float32 (TRL's ``cast_lm_head_to_fp32``).

    Returns:
        ``[B, C]`` log-probs (at least float32), and with ``entropy`` the ``[B, C]`` entropies; padded completion
        slots hold garbage values and must be masked by the caller.
    """
    batch, length = input_ids.shape
    if not 1 <= logits_to_keep < length:
        raise ValueError(f"logits_to_keep must be in [1, {length - 1}], got {logits_to_keep}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    hidden = model.get_decoder()(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    ).last_hidden_state
    hidden = hidden[:, -logits_to_keep - 1 : -1, :].reshape(batch * logits_to_keep, -1)
    targets = input_ids[:, -logits_to_keep:].reshape(-1)
    head = model.get_output_embeddings()
    out = _head_logprobs(head, hidden, targets, temperature, chunk_tokens, entropy, fp32_head)
    if not entropy:
        return out.view(batch, logits_to_keep)
    return out[0].view(batch, logits_to_keep), out[1].view(batch, logits_to_keep)


class CompletionLogprobs(nn.Module):
    """`completion_logprobs` of a model as one module call, so that DistributedDataParallel (which synchronises
    the gradients of a module's forward) can wrap the training forward. Returns the log-probs and the entropies
    (``[B, C]`` each)."""

    def __init__(self, model: nn.Module, fp32_head: bool = False, entropy_grad: bool = False):
        super().__init__()
        self.model = model
        self.fp32_head = fp32_head
        self.entropy: bool | str = "grad" if entropy_grad else True

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int, temperature: float, chunk_tokens: int
    ) -> tuple[Tensor, Tensor]:
        logps, entropies = completion_logprobs(
            self.model,
            input_ids,
            attention_mask,
            logits_to_keep,
            temperature,
            chunk_tokens,
            self.entropy,
            self.fp32_head,
        )
        # FSDP2 warns of a view returned by the module it wraps: [B, C], a trifle to copy
        return logps.clone(), entropies.clone()
