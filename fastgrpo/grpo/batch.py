"""One step's completions as training tensors, and the row subsets its micro-batches train on."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class RolloutBatch:
    """One step's completions as training tensors (``N = prompts * num_generations`` rows).

    ``input_ids`` is ``[N, P + C]``: the prompt left-padded to ``P``, the completion right-padded to ``C``;
    ``attention_mask`` likewise; ``completion_mask`` ``[N, C]`` marks the completion tokens that are trained;
    ``sampling_logps`` ``[N, C]`` (float64) the log-probs the sampler scored the completion tokens with;
    ``start_logps`` and ``start_entropies`` ``[N, C]`` the log-probs and entropies of the policy the update starts
    from, of the rows a pass without gradient scored before it (NaN in the others).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    advantages: torch.Tensor
    old_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None
    sampling_logps: torch.Tensor | None = None
    start_logps: torch.Tensor | None = None
    start_entropies: torch.Tensor | None = None


def build_batch(
    prompt_ids: list[list[int]],
    completion_ids: list[list[int]],
    pad_id: int,
    advantages: torch.Tensor,
    sampling_logps: list[list[float]] | None = None,
) -> RolloutBatch:
    """Pack prompts (one per completion) and completions into left/right padded tensors, with the sampler's log-prob
    of each completion token when given (0 on padding)."""
    n = len(completion_ids)
    p_len = max(map(len, prompt_ids))
    c_len = max(max(map(len, completion_ids)), 1)
    ids = torch.full((n, p_len + c_len), pad_id, dtype=torch.long, device="cpu")
    attn = torch.zeros(n, p_len + c_len, dtype=torch.long, device="cpu")
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids, strict=False)):
        ids[i, p_len - len(p) : p_len] = torch.tensor(p, dtype=torch.long, device="cpu")
        ids[i, p_len : p_len + len(c)] = torch.tensor(c, dtype=torch.long, device="cpu")
        attn[i, p_len - len(p) : p_len + len(c)] = 1
    batch = RolloutBatch(ids, attn, attn[:, p_len:].clone(), advantages)
    if sampling_logps is not None:
        batch.sampling_logps = torch.zeros(n, c_len, dtype=torch.float64, device="cpu")
        for i, lps in enumerate(sampling_logps):
            batch.sampling_logps[i, : len(lps)] = torch.tensor(lps, dtype=torch.float64, device="cpu")
    return batch


def mask_tool_results(batch: RolloutBatch, tool_masks: list[list[int]]) -> None:
    """Train on no token of a tool's result: ``completion_mask`` times each completion's tool mask (1 on the policy's
    tokens, 0 on the results'), TRL's ``completion_mask * tool_mask``."""
    for i, mask in enumerate(tool_masks):
        batch.completion_mask[i, : len(mask)] *= torch.tensor(mask, dtype=batch.completion_mask.dtype, device="cpu")


def select_rows(batch: RolloutBatch, rows: torch.Tensor) -> RolloutBatch:
    """Some rows of a batch (``rows``: ``[n]`` indices), trimmed to the prompt and completion columns they use."""
    attn = batch.attention_mask[rows]
    c_len = batch.completion_mask.shape[1]
    p_len = attn.shape[1] - c_len
    used = attn.any(dim=0).nonzero().squeeze(-1)
    start = min(int(used.min()), p_len - 1)
    keep = max(int(used.max()) + 1 - p_len, 1)

    def cut(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[rows, :keep]

    return RolloutBatch(
        input_ids=batch.input_ids[rows, start : p_len + keep],
        attention_mask=attn[:, start : p_len + keep],
        completion_mask=batch.completion_mask[rows, :keep],
        advantages=batch.advantages[rows],
        old_logps=cut(batch.old_logps),
        ref_logps=cut(batch.ref_logps),
        sampling_logps=cut(batch.sampling_logps),
        start_logps=cut(batch.start_logps),
        start_entropies=cut(batch.start_entropies),
    )


def concat_batches(batches: list[RolloutBatch], pad_id: int) -> RolloutBatch:
    """The rows of ``batches`` in one batch, prompts left-padded and completions right-padded to the widest (``pad_id``
    and 0 in the new columns; a field some batches lack, NaN in their rows)."""
    prompt = max(b.attention_mask.shape[1] - b.completion_mask.shape[1] for b in batches)
    completion = max(b.completion_mask.shape[1] for b in batches)

    def padded(b: RolloutBatch, t: torch.Tensor, value: float) -> torch.Tensor:
        left = prompt - (b.attention_mask.shape[1] - b.completion_mask.shape[1])
        return torch.nn.functional.pad(t, (left, completion - b.completion_mask.shape[1]), value=value)

    def completions(name: str) -> torch.Tensor | None:
        """One ``[N, C]`` field of every batch; NaN where a batch lacks it (none scored), None where all do."""
        parts = [getattr(b, name) for b in batches]
        if all(p is None for p in parts):
            return None
        dtype = next(p.dtype for p in parts if p is not None)
        parts = [
            torch.full(b.completion_mask.shape, math.nan, dtype=dtype, device="cpu") if p is None else p
            for b, p in zip(batches, parts, strict=True)
        ]
        return torch.cat([torch.nn.functional.pad(p, (0, completion - p.shape[1])) for p in parts])

    return RolloutBatch(
        input_ids=torch.cat([padded(b, b.input_ids, pad_id) for b in batches]),
        attention_mask=torch.cat([padded(b, b.attention_mask, 0) for b in batches]),
        completion_mask=completions("completion_mask"),
        advantages=torch.cat([b.advantages for b in batches]),
        old_logps=completions("old_logps"),
        ref_logps=completions("ref_logps"),
        sampling_logps=completions("sampling_logps"),
        start_logps=completions("start_logps"),
        start_entropies=completions("start_entropies"),
    )


def completion_lengths(completion_ids: list[list[int]], tool_masks: list[list[int]] | None) -> list[int]:
    """Each completion's length as TRL logs it: the tokens the model sampled (a tool's results are not counted)."""
    return [sum(mask) for mask in tool_masks] if tool_masks is not None else [len(c) for c in completion_ids]


def completion_metrics(lengths: torch.Tensor, truncated: torch.Tensor, prompt_tokens: int) -> dict[str, float]:
    """TRL's ``completions/*`` of one process's completions (``lengths`` ``[N]`` as `completion_lengths` gives them,
    ``truncated`` ``[N]`` those cut by the length limit), and ``num_tokens``, this step's prompt and completion
    tokens (``prompt_tokens``: the prompts', one per completion). The terminated completions' extremes are NaN
    where none ended: `fastgrpo.distributed.reduce_metrics` takes the job's, 0 where none of the job's ended."""
    terminated = lengths[~truncated]
    ended = bool(terminated.numel())
    return {
        "completions/mean_length": float(lengths.mean()),
        "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()),
        "completions/clipped_ratio": float(truncated.float().mean()),
        "completions/mean_terminated_length": float(terminated.mean()) if ended else 0.0,
        "completions/min_terminated_length": float(terminated.min()) if ended else math.nan,
        "completions/max_terminated_length": float(terminated.max()) if ended else math.nan,
        "num_tokens": float(prompt_tokens + lengths.sum()),
    }
