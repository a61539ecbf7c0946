"""The correctness sections of `gpu_check`: greedy completions against transformers' ``generate``, sampled
frequencies against the model's distribution, speculative = plain sampling under the same noise, and which SDPA kernel
the engine's attention runs (and how fast, for decode-shaped calls with and without a mask)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from gpu_check_common import (
    FAMILIES,
    TINY_LLAMA_SHAPE,
    TINY_VOCAB,
    Check,
    Section,
    backend_of,
    build_model,
    median_seconds,
    profiled_names,
    random_prompts,
    release,
    tiny_draft,
    tiny_model,
)
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, Qwen2Config, Qwen2ForCausalLM

from fastgrpo.config import DraftTrainConfig
from fastgrpo.rollout.attention import gqa_sdpa_attention, rollout_attention
from fastgrpo.rollout.cache import RowCache
from fastgrpo.rollout.engine import RolloutEngine
from fastgrpo.rollout.forward import decoder_and_head, forward_block, forward_chain
from fastgrpo.rollout.linear import rollout_linears
from fastgrpo.rollout.sampling import process_logits
from fastgrpo.rollout.sequence import GenerationOutput
from fastgrpo.rollout.tree import TreeShape
from fastgrpo.sampling_params import SamplingParams
from fastgrpo.speculative.eagle.drafter import EagleDrafter
from fastgrpo.speculative.eagle.head import DraftHead
from fastgrpo.speculative.eagle.training import DraftTrainer, rollout_samples

# ------------------------------------------------------------------------------------------------ greedy equality


def hf_greedy(model: PreTrainedModel, prompt: list[int], eos: int | None, max_new: int) -> list[int]:
    """transformers' greedy completion of one unpadded prompt."""
    ids = torch.tensor([prompt], dtype=torch.long, device=model.device)  # [1, L]
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@torch.no_grad()
def forward_logprobs(model: PreTrainedModel, prompt: list[int], completion: list[int]) -> list[float]:
    """Log-softmax of each completion token under a plain, cache-free forward over prompt and completion (generate's
    own logits are float32, so they cannot check float64 log-probs)."""
    ids = torch.tensor([prompt + completion], dtype=torch.long, device=model.device)  # [1, L + C]
    logits = model(ids, use_cache=False).logits[0, len(prompt) - 1 : -1].double()  # [C, V]
    target = torch.tensor(completion, dtype=torch.long, device=model.device)[:, None]
    return torch.log_softmax(logits, -1).gather(1, target).squeeze(1).tolist()


def pick_eos(completions: list[list[int]], max_new: int) -> int:
    """A token the free-running greedy completions emit in some rows but not all (the most such rows, then the
    earliest first occurrence), so that an EOS on it ends rows at different steps."""
    rows_with = Counter(t for c in completions for t in set(c))
    first = {t: min(c.index(t) for c in completions if t in c) for t in rows_with}
    candidates = [t for t, n in rows_with.items() if n < len(completions) and first[t] < max_new - 1]
    if not candidates:
        raise RuntimeError("the tiny model's greedy completions offer no token to use as EOS")
    return max(candidates, key=lambda t: (rows_with[t], -first[t], -t))


def compare_greedy(
    out: GenerationOutput, reference: list[list[int]], ref_logprobs: list[list[float]], copies: int
) -> tuple[bool, float]:
    """Whether every row of ``out`` (``copies`` per prompt) equals the reference completion, and the largest
    difference between emitted and reference log-probs."""
    equal, worst = True, 0.0
    for row, (ids, lps) in enumerate(zip(out.completion_ids, out.logprobs, strict=True)):
        expected = reference[row // copies]
        equal &= ids == expected
        if ids == expected:
            worst = max([worst] + [abs(a - b) for a, b in zip(lps, ref_logprobs[row // copies], strict=True)])
    return equal, worst


def section_greedy(check: Check, section: Section) -> None:
    dev = check.device
    max_new = 24
    prompts = random_prompts([3, 7, 5, 11, 2, 9], TINY_VOCAB, seed=1, low=0)
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0)
    table, results = [], {}
    section.results["families"] = results
    for family in FAMILIES:
        model = tiny_model(family, dev)
        with torch.no_grad():
            eos = pick_eos([hf_greedy(model, p, None, max_new) for p in prompts], max_new)
            ref_ids = [hf_greedy(model, p, eos, max_new) for p in prompts]
        ref_lps = [forward_logprobs(model, p, c) for p, c in zip(prompts, ref_ids, strict=True)]
        stopped = sum(eos in r for r in ref_ids)
        engines = {
            "plain": (RolloutEngine(model, [eos]), 1),
            "speculative (static tree 8x3x4)": (
                RolloutEngine(
                    model, [eos], drafter=EagleDrafter(tiny_draft(model, dev), model), tree=TreeShape(8, 3, 4)
                ),
                2,
            ),
        }
        for mode, (engine, copies) in engines.items():
            out = engine.generate(prompts, params, num_generations=copies)
            equal, worst = compare_greedy(out, ref_ids, ref_lps, copies)
            reasons_ok = out.finish_reasons[::copies] == ["stop" if eos in r else "length" for r in ref_ids]
            results[f"{family}/{mode}"] = {
                "equal": equal,
                "finish_reasons_equal": reasons_ok,
                "max_logprob_diff": worst,
                "accept_length": out.stats.accept_length,
                "rows_stopped_by_eos": stopped,
            }
            section.expect(equal, f"{family} {mode}: completions differ from generate's")
            section.expect(reasons_ok, f"{family} {mode}: finish reasons differ")
            section.expect(worst < 1e-8, f"{family} {mode}: log-probs differ from a plain forward's by {worst:.2e}")
            table.append(
                [family, mode, "yes" if equal else "NO", "yes" if reasons_ok else "NO", f"{worst:.1e}"]
                + [f"{out.stats.accept_length:.2f}", f"{stopped}/{len(prompts)}"]
            )
        del model
        release(dev)
        check.save(section)
    check.record.table(
        f"Greedy completions (float64, {max_new} new tokens, {len(prompts)} prompts) against transformers' generate "
        f"on {dev}",
        ["family", "engine", "same tokens", "same finish reasons", "max logprob diff", "accept length", "EOS rows"],
        table,
    )


# ------------------------------------------------------------------------------------------------ sampling


def chi_square(counts: Counter, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int, float]:
    """Goodness of fit of ``counts`` (token -> draws) to the ``[V]`` distribution ``probs``: the statistic, its
    degrees of freedom and p-value. Tokens expected fewer than ``min_expected`` times are pooled into one cell (so a
    token of probability zero that was drawn lands there), merged into the smallest other cell while it is still
    expected fewer times."""
    n = sum(counts.values())
    expected = (probs.double() * n).tolist()
    cells = [[counts.get(t, 0), e] for t, e in enumerate(expected) if e >= min_expected]
    rare = [
        sum(c for t, c in counts.items() if not 0 <= t < len(expected) or expected[t] < min_expected),
        sum(e for e in expected if e < min_expected),
    ]
    if rare[1] >= min_expected or not cells:
        cells.append(rare)
    elif rare[0] or rare[1] > 0:
        smallest = min(cells, key=lambda cell: cell[1])
        smallest[0] += rare[0]
        smallest[1] += rare[1]
    stat = sum((o - e) ** 2 / e for o, e in cells if e > 0)
    dof = max(len(cells) - 1, 1)
    cpu = torch.device("cpu")
    half_dof = torch.tensor(dof / 2.0, dtype=torch.float64, device=cpu)
    p = torch.special.gammaincc(half_dof, torch.tensor(stat / 2.0, dtype=torch.float64, device=cpu))
    return stat, dof, float(p)


def bigram_model(device: torch.device, sharpen: float) -> PreTrainedModel:
    """A tiny float64 Llama whose logits depend on the current token only (attention and MLP outputs zeroed), with
    its LM head scaled by ``sharpen``: a few plausible tokens per step, which a draft learns in seconds."""
    model = tiny_model("llama", device, seed=2)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.mul_(sharpen)
    return model


def trained_draft(model: PreTrainedModel, prompt: list[int], epochs: int) -> DraftHead:
    """A draft fitted (`DraftTrainer`) on the model's own sampled continuations of ``prompt`` and of random prompts,
    so that its trees are accepted often from ``prompt`` on."""
    dev = model.device
    draft = tiny_draft(model, dev, seed=3)
    engine = RolloutEngine(model, [])
    others = random_prompts([2 + i % 6 for i in range(32)], TINY_VOCAB, seed=4)
    samples = []
    for prompts, copies, length in (([prompt], 64, 16), (others, 1, 32)):
        params = SamplingParams(max_new_tokens=length, temperature=1.0)
        generator = torch.Generator(device=dev).manual_seed(5)
        out = engine.generate(prompts, params, copies, capture_hidden=True, generator=generator)
        samples += rollout_samples(prompts, out, num_generations=copies)
    config = DraftTrainConfig(learning_rate=3e-3, epochs=epochs, token_budget=512, token_loss_weight=1.0)
    DraftTrainer(draft, model.get_input_embeddings(), model.get_output_embeddings(), config).fit(samples)
    return draft


@torch.no_grad()
def next_token_logits(model: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    """``[V]`` float64 logits of the model after ``ids`` (a plain forward, no cache)."""
    x = torch.tensor([ids], dtype=torch.long, device=model.device)  # [1, L]
    return model(x, use_cache=False).logits[0, -1].double()


def section_sampling(check: Check, section: Section) -> None:
    dev = check.device
    draws = 3000 if check.quick else 20000
    model = bigram_model(dev, sharpen=6.0)
    prompt = [7, 21, 40]
    draft = trained_draft(model, prompt, epochs=16 if check.quick else 30)
    tree = TreeShape(8, 3, 4)
    plain = RolloutEngine(model, [])
    spec = RolloutEngine(model, [], drafter=EagleDrafter(draft, model), tree=tree)
    logits = next_token_logits(model, prompt)  # [V]
    table, results = [], {}
    section.results["chi_square"] = results

    def test(name: str, counts: Counter, probs: torch.Tensor, accept: float | None = None) -> None:
        stat, dof, p = chi_square(counts, probs)
        results[name] = {"draws": sum(counts.values()), "chi2": stat, "dof": dof, "p_value": p, "accept_length": accept}
        section.expect(p > 1e-3, f"{name}: chi-square p-value {p:.2e}")
        accept_cell = "-" if accept is None else f"{accept:.2f}"
        table.append([name, sum(counts.values()), f"{stat:.1f}", dof, f"{p:.3f}", accept_cell])
        check.save(section)

    # First tokens (sampled after the prefill) against the model's softmax, and against the filtered distribution
    # (`process_logits`) under temperature, top-k and top-p.
    plain_t1 = SamplingParams(max_new_tokens=1, temperature=1.0)
    filtered = SamplingParams(max_new_tokens=1, temperature=1.5, top_k=8, top_p=0.95)
    for params, expected, name in (
        (plain_t1, torch.softmax(logits, -1), "first token, T=1"),
        (filtered, process_logits(logits[None], filtered)[0].exp(), "first token, T=1.5 top-k 8 top-p 0.95"),
    ):
        out = plain.generate([prompt], params, draws, generator=torch.Generator(device=dev).manual_seed(11))
        test(name, Counter(c[0] for c in out.completion_ids), expected)
    # The second token, emitted by a tree step, given the most frequent first token (another seed for each engine:
    # under the same one they would emit the very same tokens, see `same_uniforms`).
    params = SamplingParams(max_new_tokens=2, temperature=1.0)
    for seed, engine, name in (
        (12, plain, "next token, plain"),
        (13, spec, f"next token, speculative {tree.nodes}x{tree.top_k}x{tree.max_levels}"),
    ):
        out = engine.generate([prompt], params, draws, generator=torch.Generator(device=dev).manual_seed(seed))
        first = Counter(c[0] for c in out.completion_ids).most_common(1)[0][0]
        seconds = Counter(c[1] for c in out.completion_ids if c[0] == first and len(c) > 1)
        # Tokens per row per tree step before the length limit cut the path (the limit leaves one to emit).
        accept = out.stats.tree_accept_length if engine is spec else None
        expected = torch.softmax(next_token_logits(model, prompt + [first]), -1)
        test(f"{name} (after token {first})", seconds, expected, accept)
        if engine is spec:
            section.expect(accept > 1.2, f"{name}: tree accept length {accept:.2f}, too low to exercise the tree")
    check.record.table(
        f"Sampled token frequencies against the model's distribution (chi-square, float64 tiny Llama, {dev})",
        ["test", "draws", "chi2", "dof", "p-value", "tree accept length"],
        table,
    )
    section.results["same_uniforms"] = same_uniforms(check, section, model, draft)
    check.save(section)
    section.results["same_uniforms_low_precision"] = low_precision_agreement(check)


def logprob_gap(a: GenerationOutput, b: GenerationOutput) -> float:
    """The largest difference between the log-probs of two outputs of the same tokens."""
    pairs = zip(a.logprobs, b.logprobs, strict=True)
    return max((abs(x - y) for la, lb in pairs for x, y in zip(la, lb, strict=True)), default=0.0)


def plain_and_speculative(
    model: PreTrainedModel, draft: DraftHead, prompts: list[list[int]], params: SamplingParams, source: str
) -> tuple[GenerationOutput, GenerationOutput]:
    """Two completions per prompt sampled plainly and with a static 8x3x4 tree from the same noise: ``source``
    ``uniforms`` hands both engines the same ``[rows, max_new_tokens]`` uniforms (as `TrainingRollouts` does),
    ``generator`` the same seeded generator."""
    dev, copies = model.device, 2
    outs = []
    for drafter in (None, EagleDrafter(draft, model)):
        engine = RolloutEngine(model, [3], drafter=drafter, tree=TreeShape(8, 3, 4) if drafter else None)
        if source == "uniforms":
            generator = torch.Generator(device=dev).manual_seed(7)
            shape = (len(prompts) * copies, params.max_new_tokens)
            noise = torch.rand(shape, generator=generator, dtype=torch.float64, device=dev)
            outs.append(engine.generate(prompts, params, copies, uniforms=noise))
        else:
            outs.append(engine.generate(prompts, params, copies, generator=torch.Generator(device=dev).manual_seed(8)))
    return outs[0], outs[1]


def same_uniforms(check: Check, section: Section, bigram: PreTrainedModel, draft: DraftHead) -> dict[str, Any]:
    """Speculative and plain sampling from the same noise give the same tokens and log-probs: for the trained draft
    on the bigram model and for random drafts on the three families."""
    dev = check.device
    prompts = random_prompts([5, 2, 8, 1], TINY_VOCAB, seed=6)
    params = SamplingParams(max_new_tokens=30, temperature=1.0, top_p=0.9)
    cases = [("llama (bigram), trained draft", bigram, draft)]
    for family in FAMILIES:
        model = tiny_model(family, dev)
        cases.append((f"{family}, random draft", model, tiny_draft(model, dev)))
    table, results = [], {}
    for name, model, head in cases:
        for source in ("uniforms", "generator"):
            ref, out = plain_and_speculative(model, head, prompts, params, source)
            same = out.completion_ids == ref.completion_ids
            gap = logprob_gap(out, ref) if same else float("nan")
            key = f"{name} / {source}"
            results[key] = {"same_tokens": same, "max_logprob_diff": gap, "accept_length": out.stats.accept_length}
            section.expect(same, f"{key}: speculative tokens differ from plain ones under the same noise")
            section.expect(not same or gap < 1e-8, f"{key}: log-probs differ by {gap:.2e}")
            table.append([name, source, "yes" if same else "NO", f"{gap:.1e}", f"{out.stats.accept_length:.2f}"])
    check.record.table(
        f"Speculative (static tree 8x3x4) = plain sampling under the same noise (T=1, top-p 0.9, {dev})",
        ["model", "noise", "same tokens", "max logprob diff", "accept length"],
        table,
    )
    return results


def low_precision_agreement(check: Check) -> dict[str, Any]:
    """Not a pass/fail check: in float32 and bfloat16, how many completions plain and speculative sampling share
    under the same uniforms (random Llama, vocabulary 4096, random draft). A tree's verification forward rounds
    differently from the single-token forwards of plain decoding, so a token whose uniform falls near a boundary of
    the sampling CDF can come out differently; float64 (checked above) leaves no such rounding."""
    dev = check.device
    prompts = random_prompts([5, 9, 3, 7], 4096, seed=3)
    params = SamplingParams(max_new_tokens=32, temperature=1.0)
    config = dict(TINY_LLAMA_SHAPE, vocab_size=4096, tie_word_embeddings=False)
    table, results = [], {}
    for dtype in (torch.float32, torch.bfloat16):
        model = build_model(LlamaForCausalLM, LlamaConfig(**config), dtype, dev)
        ref, out = plain_and_speculative(model, tiny_draft(model, dev), prompts, params, "uniforms")
        same = sum(a == b for a, b in zip(ref.completion_ids, out.completion_ids, strict=True))
        name = str(dtype).removeprefix("torch.")
        results[name] = {"same_completions": same, "completions": len(ref.completion_ids)}
        results[name]["accept_length"] = out.stats.accept_length
        table.append([name, f"{same}/{len(ref.completion_ids)}", f"{out.stats.accept_length:.2f}"])
    check.record.table(
        f"Informational: completions equal between plain and speculative sampling under the same uniforms in low "
        f"precision (random Llama, 32 tokens, random draft, static tree 8x3x4, {dev})",
        ["dtype", "same completions", "accept length"],
        table,
    )
    return results


# ------------------------------------------------------------------------------------------------ SDPA kernels


def attention_model(device: torch.device, dtype: torch.dtype, quick: bool) -> PreTrainedModel:
    """A small Qwen2 with Qwen2.5-7B's head size (128) and grouping (7 query heads per KV head, 4 KV heads; one KV
    head with ``quick``)."""
    heads, kv = (7, 1) if quick else (28, 4)
    config = Qwen2Config(
        hidden_size=heads * 128,
        num_hidden_layers=1 if quick else 2,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=256 if quick else 2048,
        vocab_size=512,
        max_position_embeddings=4096,
    )
    return build_model(Qwen2ForCausalLM, config, dtype, device)


def sdpa_cases(model: PreTrainedModel, rows: int, context: int) -> dict[str, Callable[[], torch.Tensor]]:
    """One forward each of: a decoding step over rows of equal length (no mask), over ragged rows (a mask), and an
    8-token tree window (a mask), through a `RowCache` filled with ``context`` tokens per row. Call inside
    `rollout_attention` and inference mode."""
    dev = model.device
    decoder, _ = decoder_and_head(model)
    cache = RowCache(model.config, rows, context + 16, model.dtype, dev)
    generator = torch.Generator(device=dev).manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (rows, context), generator=generator, device=dev)
    equal = torch.full((rows,), context, dtype=torch.long, device=dev)
    ragged = equal - torch.arange(rows, dtype=torch.long, device=dev)  # [B]: lengths context, context - 1, ...
    chain = torch.arange(8, dtype=torch.long, device=dev)
    tree_mask = torch.ones(8, 8, dtype=torch.bool, device=dev).tril()  # [T, W]
    forward_chain(decoder, cache, torch.zeros_like(equal), input_ids=ids)  # the context
    positions = equal[:, None] + chain[None, :]  # [B, 8]
    return {
        "decode step, equal lengths (no mask)": partial(forward_chain, decoder, cache, equal, input_ids=ids[:, :1]),
        "decode step, ragged lengths (mask)": partial(forward_chain, decoder, cache, ragged, input_ids=ids[:, :1]),
        "tree of 8 tokens (mask)": partial(
            forward_block, decoder, cache, equal, chain, positions, tree_mask, input_ids=ids[:, :8]
        ),
    }


def attention_inputs(
    rows: int, context: int, masked: bool, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A decoding step's attention inputs with Qwen2.5-7B's heads: ``[B, 28, 1, 128]`` queries, ``[B, 4, S, 128]``
    keys and values (``S = context``) and, with ``masked``, the ``[B, 1, 1, S]`` additive mask of ragged rows (row
    ``b`` sees its first ``S - b % (S / 2)`` slots), as the engine hands every layer; else None."""
    generator = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(rows, 28, 1, 128, generator=generator, dtype=dtype, device=device)
    k = torch.randn(rows, 4, context, 128, generator=generator, dtype=dtype, device=device)
    v = torch.randn(rows, 4, context, 128, generator=generator, dtype=dtype, device=device)
    if not masked:
        return q, k, v, None
    lengths = context - torch.arange(rows, device=device) % (context // 2)  # [B]
    hidden = torch.arange(context, device=device)[None, :] >= lengths[:, None]  # [B, S]
    mask = torch.zeros(rows, 1, 1, context, dtype=dtype, device=device)
    return q, k, v, mask.masked_fill_(hidden[:, None, None, :], float("-inf"))


@torch.inference_mode()
def attention_point(check: Check, rows: int, context: int, masked: bool) -> dict[str, Any]:
    """The SDPA backend and kernels `gqa_sdpa_attention` runs for one decode-shaped call in bfloat16, its median
    time and the keys and values it reads per second."""
    dev = check.device
    q, k, v, mask = attention_inputs(rows, context, masked, dev, torch.bfloat16)
    call = partial(gqa_sdpa_attention, nn.Module(), q, k, v, mask)
    call()  # warm-up, outside the profile
    ops, kernels = profiled_names(call, dev)
    seconds = median_seconds(call, dev, repeats=20 if dev.type == "cuda" else 3)
    kv_bytes = 2 * k.numel() * k.element_size()
    return {
        "rows": rows,
        "context": context,
        "masked": masked,
        "backend": backend_of(ops),
        "aten_ops": ops,
        "kernels": kernels,
        "seconds": seconds,
        "kv_gb_s": kv_bytes / seconds / 1e9,
    }


def section_sdpa(check: Check, section: Section) -> None:
    dev = check.device
    rows, context = 4, 64 if check.quick else 512
    table, forwards = [], {}
    for dtype in (torch.float32, torch.bfloat16):
        name_of_dtype = str(dtype).removeprefix("torch.")
        model = attention_model(dev, dtype, check.quick)
        with torch.inference_mode(), rollout_attention(model), rollout_linears(model):
            for name, fn in sdpa_cases(model, rows, context).items():
                fn()  # warm-up, outside the profile
                ops, kernels = profiled_names(fn, dev)
                backend = backend_of(ops)
                key = f"{name_of_dtype} / {name}"
                forwards[key] = {"backend": backend, "aten_ops": ops, "kernels": kernels}
                shown = "; ".join(k[:90] for k in kernels) if kernels else "-"
                table.append([name_of_dtype, name, backend, ", ".join(ops), shown])
                section.expect(backend != "none found", f"{key}: no SDPA op in the profile")
    section.results["forwards"] = forwards
    check.record.table(
        f"SDPA kernel of the engine's attention for one forward ({rows} rows, {context} cached tokens, head size 128, "
        f"{dev})",
        ["dtype", "forward", "backend", "aten ops", "kernels"],
        table,
    )
    release(dev)
    check.save(section)
    points, table = [], []
    section.results["attention"] = points
    rows_list, contexts = ((2, 4), (64, 256)) if check.quick else ((16, 64), (1024, 4096))
    for context in contexts:
        for rows in rows_list:
            for masked in (False, True):
                label = f"attention at {rows} rows x {context} ({'mask' if masked else 'no mask'})"
                if not section.in_time(check, label):
                    continue
                point = attention_point(check, rows, context, masked)
                points.append(point)
                section.expect(point["backend"] != "none found", f"{label}: no SDPA op in the profile")
                shown = "; ".join(k[:90] for k in point["kernels"]) if point["kernels"] else "-"
                table.append(
                    [rows, context, "yes" if masked else "no", point["backend"], f"{1e6 * point['seconds']:.1f}"]
                    + [f"{point['kv_gb_s']:.3g}", shown]
                )
                check.save(section)
    check.record.table(
        f"The engine's attention (`gqa_sdpa_attention`) for one decoding step, bfloat16, 28 query heads over 4 KV "
        f"heads of 128, {dev}: the SDPA backend, microseconds per call and keys and values read per second",
        ["rows", "context", "mask", "backend", "us", "KV GB/s", "kernels"],
        table,
    )
