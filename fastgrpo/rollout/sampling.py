"""The one logits-processing function shared by autoregressive and speculative steps."""

from __future__ import annotations

import torch

from fastgrpo.sampling_params import SamplingParams

TOP_P_HEADS = (64, 512, 4096)  # head sizes ranked by `topk` for top-p, in turn, before a full sort of the vocabulary
CDF_BLOCK = 256  # token ids per block of the two-stage CDF inversion in `sample`


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities of the sampling distribution.

    Args:
        logits: ``[..., V]`` raw logits.

    Returns:
        ``[..., V]`` log-probabilities (at least float32) after temperature, top-k, top-p and min-p, in that
        order; filtered tokens get ``-inf``. For greedy decoding the plain softmax is returned (its argmax is
        the greedy token, and it scores the emitted tokens).
    """
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if params.greedy:
        return torch.log_softmax(logits, dim=-1)
    logits = scaled(logits, params)
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        logits = logits.masked_fill(_top_p_drop(logits, params.top_p), float("-inf"))
    if params.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        floor = params.min_p * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return torch.log_softmax(logits, dim=-1)


def policy_logprobs(
    logits: torch.Tensor, logprobs: torch.Tensor, tokens: torch.Tensor, params: SamplingParams
) -> torch.Tensor:
    """``[N]`` the log-probabilities of ``tokens`` ``[N]`` under the policy's distribution at the sampling
    temperature, before top-k, top-p and min-p: what a training forward computes for them
    (`fastgrpo.grpo.logprobs.completion_logprobs`), so that the sampler's and the trainer's differ by rounding alone.
    ``logprobs`` is `process_logits` of ``logits`` (both ``[N, V]``), which is that distribution unless a filter
    applies; greedy decoding scores with the plain softmax."""
    if params.greedy or not filters(params, logits.shape[-1]):
        return logprobs.gather(1, tokens[:, None]).squeeze(1)
    tempered = scaled(logits.to(logprobs.dtype), params)
    return tempered.gather(1, tokens[:, None]).squeeze(1) - tempered.logsumexp(dim=-1)


def scaled(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``logits`` over the sampling temperature (a number, or a compiled step's tensor: `GraphSampling`), in their
    dtype, as dividing by the number computes it on their device: CUDA multiplies by the number's reciprocal."""
    temperature = params.temperature
    if isinstance(temperature, torch.Tensor):
        divisor = temperature.to(logits.dtype)
        return logits * divisor.reciprocal() if logits.is_cuda else logits / divisor
    return logits if temperature == 1.0 else logits / temperature


def filters(params: SamplingParams, vocab: int) -> bool:
    """Whether `process_logits` drops tokens (top-k, top-p or min-p) from a ``vocab``-token distribution."""
    return bool(params.top_k and params.top_k < vocab) or params.top_p < 1.0 or params.min_p > 0.0


def _top_p_drop(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """``[..., V]`` bool: tokens outside the nucleus. A token is dropped when the tokens ranked above it already hold
    ``top_p`` of the mass (the first always stays).

    Two rankings give the same nucleus: where a read of the device costs nothing (`host_reads_are_free`) the cheaper
    one that ranks only as much of each row as its nucleus needs, elsewhere one sort of every row, whose shapes and ops
    do not depend on the values, so that nothing is read back and the step stays one static graph."""
    if host_reads_are_free(logits):
        return _top_p_drop_by_heads(logits, top_p)
    probs = torch.softmax(logits, dim=-1)
    ranked, order = probs.sort(dim=-1, descending=True)
    drop = (ranked.cumsum(dim=-1) - ranked) >= top_p
    return torch.zeros_like(drop).scatter_(-1, order, drop)


def host_reads_are_free(t: torch.Tensor) -> bool:
    """On a CPU, outside a compiled graph, reading a value back stalls nothing (the host is the device)."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


def _top_p_drop_by_heads(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """`_top_p_drop` ranking only the head of each distribution: each row's best ``TOP_P_HEADS[0]`` tokens are ranked
    (by `topk`); the rows whose head holds less than ``top_p`` go on to the next head size, and the rows that no head
    covers sort the whole vocabulary. A row's result depends only on the row. A `topk` of a few hundred tokens costs a
    small fraction of a full sort of a large vocabulary, and most nuclei of sampled answers hold few tokens; which
    rows go on is read back at each size."""
    probs = torch.softmax(logits, dim=-1).reshape(-1, logits.shape[-1])
    vocab = probs.shape[-1]
    keep = torch.zeros_like(probs, dtype=torch.bool)
    rows, pending = torch.arange(probs.shape[0], device=probs.device), probs
    for size in (*TOP_P_HEADS, vocab):
        size = min(size, vocab)
        ranked, order = pending.topk(size, dim=-1)  # sorted, descending
        done = ranked.sum(dim=-1) >= top_p if size < vocab else torch.ones_like(rows, dtype=torch.bool)
        kept = (ranked[done].cumsum(dim=-1) - ranked[done]) < top_p
        keep[rows[done][:, None], order[done]] = kept  # writes only the ranked head of each finished row
        rows, pending = rows[~done], pending[~done]
        if rows.numel() == 0:
            break
    return ~keep.reshape(logits.shape)


def sample(logprobs: torch.Tensor, params: SamplingParams, uniform: torch.Tensor | None = None) -> torch.Tensor:
    """Draw one token per row from ``[N, V]`` log-probabilities by inverting their CDF at ``uniform`` ``[N]`` (values
    in ``[0, 1)``); argmax when greedy (or, in a compiled step, where `GraphSampling.argmax` holds). Returns ``[N]``
    ids.

    The engine draws one uniform per (completion, position) before decoding, so a token depends only on its
    distribution and its position's uniform, never on how many draws came before it: speculative and autoregressive
    decoding with the same seed emit the same tokens, whatever trees were drafted.

    The CDF is inverted in two stages, first over blocks of `CDF_BLOCK` token ids, then inside the chosen block, so
    that only one block per row is summed sequentially. Probabilities are taken in the log-probabilities' precision
    (at least float32) with a softmax (``exp`` is slow on the ``-inf`` of filtered tokens), and summed in float64:
    cheaper than a float64 softmax and one cumulative sum over the whole vocabulary, and on real distributions the
    two pick the same tokens."""
    if params.greedy:
        return logprobs.argmax(dim=-1)
    if uniform is None or uniform.shape != logprobs.shape[:1]:
        raise ValueError("sampling needs one uniform per row")
    probs = torch.softmax(logprobs, dim=-1, dtype=torch.promote_types(logprobs.dtype, torch.float32))  # not exp
    n, vocab = probs.shape
    full = vocab // CDF_BLOCK * CDF_BLOCK
    block_mass = probs[:, :full].view(n, -1, CDF_BLOCK).sum(dim=-1, dtype=torch.float64)
    if full < vocab:  # a last, partial block
        block_mass = torch.cat([block_mass, probs[:, full:].sum(dim=-1, keepdim=True, dtype=torch.float64)], dim=1)
    block_cdf = block_mass.cumsum(dim=-1)  # [N, blocks]
    point = uniform.to(block_cdf)[:, None] * block_cdf[:, -1:]  # [N, 1], in float64
    block = torch.searchsorted(block_cdf, point, right=True).clamp(max=_last_positive(block_cdf))
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    ids = block * CDF_BLOCK + torch.arange(CDF_BLOCK, device=probs.device)  # [N, CDF_BLOCK]
    inner_cdf = torch.where(ids < vocab, probs.gather(1, ids.clamp(max=vocab - 1)).double(), 0.0).cumsum(dim=-1)
    inner = torch.searchsorted(inner_cdf, point - before, right=True).clamp(max=_last_positive(inner_cdf))
    drawn = (block * CDF_BLOCK + inner).squeeze(1)
    return drawn if params.argmax is None else torch.where(params.argmax, logprobs.argmax(dim=-1), drawn)


def _last_positive(cdf: torch.Tensor) -> torch.Tensor:
    """``[N, 1]`` the last index of each row of a ``[N, M]`` CDF where it still rises (a token of positive
    probability): where a draw lands when rounding puts its point at or past the row's total."""
    return (cdf < cdf[:, -1:]).sum(dim=-1, keepdim=True)
