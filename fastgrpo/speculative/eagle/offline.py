"""Offline draft training: generate responses with the target, capturing its hidden states on the way, then fit
the draft on them (``fastgrpo draft train``)."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fastgrpo import distributed
from fastgrpo.config import DraftTrainConfig
from fastgrpo.models import encode_prompts
from fastgrpo.rollout.engine import RolloutEngine
from fastgrpo.sampling_params import SamplingParams
from fastgrpo.speculative.eagle.head import DraftHead
from fastgrpo.speculative.eagle.training import DraftFit, DraftSample, DraftTrainer


def collect_samples(
    engine: RolloutEngine,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict[str, Any]],
    params: SamplingParams,
    batch_size: int,
    max_prompt_length: int,
    seed: int = 0,
) -> list[DraftSample]:
    """Generate one response per row and keep (tokens, target hidden states) for draft training."""
    generator = torch.Generator(device=engine.device).manual_seed(seed)
    samples = []
    for start in tqdm(range(0, len(rows), batch_size), desc="generate"):
        prompts = encode_prompts(tokenizer, [r["prompt"] for r in rows[start : start + batch_size]], max_prompt_length)
        out = engine.generate(prompts, params, generator=generator, capture_hidden=True)
        for p, c, h in zip(prompts, out.completion_ids, out.hidden_states, strict=True):
            samples.append(DraftSample(torch.tensor(p + c, device="cpu"), h.float().cpu(), len(p)))
    return samples


def frequent_tokens(completions: list[list[int]], size: int, always: list[int]) -> torch.Tensor:
    """The ``size`` most frequent tokens of ``completions`` (plus ``always``, e.g. EOS), sorted: a reduced draft
    vocabulary (``[V_d]`` target ids, at most ``size`` plus ``always``)."""
    counts = Counter()
    for completion in completions:
        counts.update(completion)
    chosen = set(always)
    for token, _ in counts.most_common():
        if len(chosen) >= size:
            break
        chosen.add(token)
    return torch.tensor(sorted(chosen), dtype=torch.long, device="cpu")


def frequent_tokens_on_all_ranks(completions: list[list[int]], size: int, always: list[int]) -> torch.Tensor:
    """`frequent_tokens` of the completions of every rank (or process), so that all of them build the same reduced
    draft vocabulary."""
    return frequent_tokens([c for rank in distributed.gather(completions) for c in rank], size, always)


def collect_mixed(
    engine: RolloutEngine,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict[str, Any]],
    params: SamplingParams,
    greedy_fraction: float,
    batch_size: int,
    max_prompt_length: int,
    seed: int = 0,
) -> list[DraftSample]:
    """`collect_samples` with the first ``greedy_fraction`` of the rows answered greedily and the rest with ``params``
    (generator seeded by ``seed``): a draft that serves both greedy and sampled decoding is best trained on both."""
    if not 0.0 <= greedy_fraction <= 1.0:
        raise ValueError(f"greedy_fraction must be in [0, 1], got {greedy_fraction}")
    n_greedy = round(greedy_fraction * len(rows))
    greedy = dataclasses.replace(params, temperature=0.0)
    samples = collect_samples(engine, tokenizer, rows[:n_greedy], greedy, batch_size, max_prompt_length)
    return samples + collect_samples(engine, tokenizer, rows[n_greedy:], params, batch_size, max_prompt_length, seed)


def fit_draft(
    model: PreTrainedModel,
    samples: list[DraftSample],
    config: DraftTrainConfig,
    target_name: str,
    eos_token_ids: list[int],
    draft_vocab_size: int | None = None,
) -> tuple[DraftHead, DraftFit]:
    """Fit a fresh draft for ``model`` on ``samples`` (with a reduced vocabulary of their most frequent tokens when
    ``draft_vocab_size`` is given). Returns the draft and its losses and first-epoch accuracy."""
    vocab = None
    if draft_vocab_size:
        completions = [s.tokens[s.prompt_len :].tolist() for s in samples]
        vocab = frequent_tokens(completions, draft_vocab_size, eos_token_ids)
    param = next(model.parameters())
    draft = DraftHead(model.config, target_name, vocab).to(device=param.device, dtype=param.dtype)
    trainer = DraftTrainer(draft, model.get_input_embeddings(), model.get_output_embeddings(), config)
    return draft, trainer.fit(samples, progress=True)


def train_offline(
    engine: RolloutEngine,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict[str, Any]],
    params: SamplingParams,
    config: DraftTrainConfig,
    target_name: str,
    batch_size: int = 32,
    max_prompt_length: int = 512,
    draft_vocab_size: int | None = None,
    greedy_fraction: float = 0.0,
) -> tuple[DraftHead, dict[str, float]]:
    """Generate (see `collect_mixed`), then fit a fresh draft. Returns the draft and timings/losses."""
    t0 = time.perf_counter()
    samples = collect_mixed(engine, tokenizer, rows, params, greedy_fraction, batch_size, max_prompt_length)
    t1 = time.perf_counter()
    eos = engine.eos.tolist()
    draft, fit = fit_draft(engine.model, samples, config, target_name, eos, draft_vocab_size)
    t2 = time.perf_counter()
    tokens = sum(s.tokens.numel() - s.prompt_len for s in samples)
    report = {
        "sequences": len(samples),
        "completion_tokens": tokens,
        "generate_seconds": t1 - t0,
        "train_seconds": t2 - t1,
        "first_loss": fit.losses[0],
        "last_loss": sum(fit.losses[-10:]) / len(fit.losses[-10:]),
        "first_epoch_accuracy": fit.accuracy,
    }
    return draft, report
