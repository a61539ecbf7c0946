"""Tests for the rollout engine: the row cache, block forwards, and generation against plain transformers."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import VOCAB, make_tiny_model, tiny_model
from transformers import LlamaConfig, PreTrainedModel

from fastgrpo.rollout.attention import ROLLOUT_ATTENTION, rollout_attention
from fastgrpo.rollout.cache import RowCache
from fastgrpo.rollout.engine import RolloutEngine
from fastgrpo.rollout.forward import decoder_and_head, forward_block, forward_chain, window_attention_mask
from fastgrpo.rollout.sampling import process_logits
from fastgrpo.rollout.sequence import GenerationOutput, fill_holes
from fastgrpo.sampling_params import SamplingParams
from fastgrpo.speculative.eagle.head import DraftHead

F64 = torch.float64
ATOL = 1e-10
MAX_NEW = 24
SAMPLED = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.7, top_p=0.9, top_k=20)
GREEDY = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)


def make_prompts(lengths: tuple[int, ...], seed: int = 1) -> list[list[int]]:
    """Random token prompts of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


PROMPTS = make_prompts((3, 7, 5, 11))


def full_logits(model: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    """``[L, V]`` logits of a plain, cache-free forward over one unpadded sequence."""
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False).logits[0]


def head(model: PreTrainedModel, hidden: torch.Tensor) -> torch.Tensor:
    """Apply the LM head."""
    return decoder_and_head(model)[1](hidden)


def hf_greedy(model: PreTrainedModel, prompt: list[int], eos: int | None) -> list[int]:
    """Greedy completion of one prompt (no padding) by transformers' ``generate``."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=MAX_NEW,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


_REFERENCE: dict[str, tuple[int, list[list[int]]]] = {}


def greedy_reference(family: str) -> tuple[int, list[list[int]]]:
    """An EOS id the model emits under greedy decoding for some prompts but not all, and HF's completions with it.

    Without an EOS, greedy completions are computed by HF; the chosen id appears in the most rows while still
    missing from at least one (ties broken by the earliest first occurrence, so rows stop at different steps).
    """
    if family not in _REFERENCE:
        model = tiny_model(family)
        free = [hf_greedy(model, p, None) for p in PROMPTS]
        rows_with = Counter(t for c in free for t in set(c))
        first = {t: min(c.index(t) for c in free if t in c) for t in rows_with}
        candidates = [t for t, n in rows_with.items() if n < len(PROMPTS) and first[t] < MAX_NEW - 1]
        assert candidates, "the tiny model emits no usable EOS candidate"
        eos = max(candidates, key=lambda t: (rows_with[t], -first[t], -t))
        _REFERENCE[family] = eos, [hf_greedy(model, p, eos) for p in PROMPTS]
    return _REFERENCE[family]


# ---------------------------------------------------------------------------- RowCache


def small_cache(rows: int = 4, slots: int = 6) -> RowCache:
    """A two-layer cache whose key/value entries identify (layer, kind, row, slot)."""
    config = LlamaConfig(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2)
    cache = RowCache(config, rows, slots, F64, torch.device("cpu"))
    for li, layer in enumerate(cache.layers):
        for kind, buf in enumerate((layer.keys, layer.values)):
            r = torch.arange(rows, dtype=F64)[:, None, None, None]
            s = torch.arange(slots, dtype=F64)[None, None, :, None]
            buf.copy_((1000 * li + 100 * kind + 10 * r + s).expand_as(buf))
    return cache


def snapshot(cache: RowCache) -> list[torch.Tensor]:
    return [buf.clone() for layer in cache.layers for buf in (layer.keys, layer.values)]


def test_row_cache_shapes() -> None:
    cache = small_cache()
    assert len(cache.layers) == 2
    assert cache.layers[0].keys.shape == (4, 1, 6, 4)  # head_dim = hidden / heads
    assert cache.layers[0].get_max_length() == 6


def test_select_rows_replicates() -> None:
    cache = small_cache()
    before = snapshot(cache)
    cache.select_rows(torch.tensor([2, 0, 2]))
    for old, layer in zip(before[::2], cache.layers, strict=True):
        torch.testing.assert_close(layer.keys[:3], old[[2, 0, 2]], rtol=0, atol=0)
        torch.testing.assert_close(layer.keys[3], old[3], rtol=0, atol=0)  # rows past len(rows) untouched
    for old, layer in zip(before[1::2], cache.layers, strict=True):
        torch.testing.assert_close(layer.values[:3], old[[2, 0, 2]], rtol=0, atol=0)


def test_select_rows_compacts_up_to() -> None:
    cache = small_cache()
    before = snapshot(cache)
    cache.select_rows(torch.tensor([1, 3]), upto=4)
    for old, buf in zip(before, (b for layer in cache.layers for b in (layer.keys, layer.values)), strict=True):
        torch.testing.assert_close(buf[:2, :, :4], old[[1, 3], :, :4], rtol=0, atol=0)
        torch.testing.assert_close(buf[:2, :, 4:], old[:2, :, 4:], rtol=0, atol=0)  # slots past upto untouched
        torch.testing.assert_close(buf[2:], old[2:], rtol=0, atol=0)


def test_dropping_finished_rows_moves_only_rows_from_the_tail_into_their_slots() -> None:
    # Rows 1 and 4 of 6 finish: kept rows 0, 2, 3 stay; row 5, past the new size 4, fills the hole at 1.
    assert fill_holes([0, 2, 3, 5]) == [0, 5, 2, 3]
    assert fill_holes([0, 1, 2]) == [0, 1, 2]  # the last rows finished: nothing moves
    assert fill_holes([4, 5]) == [5, 4]
    assert fill_holes([]) == []
    cache = small_cache()
    before = snapshot(cache)
    cache.select_rows(torch.tensor([0, 3]))  # only row 1 changes
    for old, buf in zip(before, (b for layer in cache.layers for b in (layer.keys, layer.values)), strict=True):
        torch.testing.assert_close(buf[1], old[3], rtol=0, atol=0)
        torch.testing.assert_close(buf[[0, 2, 3]], old[[0, 2, 3]], rtol=0, atol=0)


def test_select_rows_too_many() -> None:
    with pytest.raises(ValueError, match="cannot hold"):
        small_cache(rows=2).select_rows(torch.tensor([0, 1, 0]))


def test_move_slots() -> None:
    cache = small_cache()
    before = snapshot(cache)
    # Row 0: slots 4, 5 -> 1, 2 (overlapping a source slot is fine: sources are read first). Row 1: 3 -> 0, 5 -> 1.
    src = torch.tensor([[4, 5], [3, 5]])
    dst = torch.tensor([[1, 2], [0, 1]])
    cache.move_slots(src, dst)
    for old, buf in zip(before, (b for layer in cache.layers for b in (layer.keys, layer.values)), strict=True):
        expected = old.clone()
        expected[0, :, [1, 2]] = old[0, :, [4, 5]]
        expected[1, :, [0, 1]] = old[1, :, [3, 5]]
        torch.testing.assert_close(buf, expected, rtol=0, atol=0)  # rows 2, 3 and other slots untouched


def test_prepare_overflow() -> None:
    cache = small_cache(slots=6)
    with pytest.raises(ValueError, match="overflow"):
        cache.prepare(torch.tensor([[5, 6]]), 7)


def test_update_writes_slots_and_returns_prefix() -> None:
    cache = small_cache(rows=3, slots=6)
    cache.prepare(torch.tensor([[2, 3], [0, 1]]), kv_len=4)
    new = torch.full((2, 1, 2, 4), -1.0, dtype=F64)
    keys, values = cache.layers[0].update(new, new - 1)
    assert keys.shape == (2, 1, 4, 4) and values.shape == (2, 1, 4, 4)
    assert (keys[0, :, 2:4] == -1).all() and (keys[1, :, 0:2] == -1).all()
    assert (values[0, :, 2:4] == -2).all()
    torch.testing.assert_close(keys[0, 0, :2, 0], torch.tensor([0.0, 1.0], dtype=F64))  # old slots kept
    assert cache.get_seq_length() == 4


def test_window_attention_mask() -> None:
    # Row 0 has 2 filled slots, row 1 has 0; a window of 4 slots holding a 3-token tree (token 0 is the root of
    # tokens 1 and 2) and a spare slot that no query sees.
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0]], dtype=torch.bool)
    mask = window_attention_mask(torch.tensor([2, 0]), tree, dtype=F64)
    assert mask.shape == (2, 1, 3, 6)
    allowed = mask[:, 0] == 0
    expected0 = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 1, 0]], dtype=torch.bool)
    expected1 = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(allowed[0], expected0)
    assert torch.equal(allowed[1], expected1)
    assert (mask[~allowed[:, None]] == torch.finfo(F64).min).all()


# ---------------------------------------------------------------------------- forward_block through the cache


def prefill(model: PreTrainedModel, cache: RowCache, prompts: list[list[int]]) -> torch.Tensor:
    """Prefill right-padded ragged prompts at slot 0 with one causal forward; returns ``[B, width, V]`` logits."""
    ids = torch.zeros(len(prompts), max(map(len, prompts)), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
    decoder = decoder_and_head(model)[0]
    with torch.no_grad():
        return head(model, forward_chain(decoder, cache, torch.zeros(len(prompts), dtype=torch.long), input_ids=ids))


def test_forward_chain_matches_full_forward(family_model: PreTrainedModel) -> None:
    model = family_model
    decoder = decoder_and_head(model)[0]
    lens = [5, 9, 3]
    seqs = make_prompts(tuple(n + 8 for n in lens), seed=7)  # prompt, then a block of 4, then 4 single tokens
    cache = RowCache(model.config, len(lens), 32, F64, torch.device("cpu"))
    refs = [full_logits(model, s) for s in seqs]

    # (a) ragged prompts prefilled together, right-padded at slot 0.
    logits = prefill(model, cache, [s[:n] for s, n in zip(seqs, lens, strict=True)])
    for i, n in enumerate(lens):
        torch.testing.assert_close(logits[i, :n], refs[i][:n], rtol=0, atol=ATOL)

    # (b) a block of 4 tokens per row at each row's own offset (the rows' lengths differ).
    row_len = torch.tensor(lens)
    block = torch.tensor([s[n : n + 4] for s, n in zip(seqs, lens, strict=True)])
    with torch.no_grad():
        logits = head(model, forward_chain(decoder, cache, row_len, input_ids=block))
    for i, n in enumerate(lens):
        torch.testing.assert_close(logits[i], refs[i][n : n + 4], rtol=0, atol=ATOL)
    row_len = row_len + 4

    # (c) then one token per row, four times.
    for _ in range(4):
        tok = torch.tensor([[s[n]] for s, n in zip(seqs, row_len.tolist(), strict=True)])
        with torch.no_grad():
            logits = head(model, forward_chain(decoder, cache, row_len, input_ids=tok))
        for i, n in enumerate(row_len.tolist()):
            torch.testing.assert_close(logits[i, 0], refs[i][n], rtol=0, atol=ATOL)
        row_len = row_len + 1


def test_forward_block_tree_matches_chains(family_model: PreTrainedModel) -> None:
    """A draft tree (root with two children) scores each branch as its own chain would."""
    model = family_model
    decoder = decoder_and_head(model)[0]
    prompts = make_prompts((4, 6), seed=3)
    cache = RowCache(model.config, 2, 16, F64, torch.device("cpu"))
    prefill(model, cache, prompts)
    row_len = torch.tensor([len(p) for p in prompts])
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    block = torch.tensor([[10, 20, 30], [40, 50, 60]])
    positions = row_len[:, None] + torch.tensor([0, 1, 1])
    with torch.no_grad():
        logits = head(model, forward_block(decoder, cache, row_len, torch.arange(3), positions, tree, input_ids=block))
    for i, p in enumerate(prompts):
        root, a, b = block[i].tolist()
        ref_a, ref_b = full_logits(model, p + [root, a]), full_logits(model, p + [root, b])
        torch.testing.assert_close(logits[i, 0], ref_a[len(p)], rtol=0, atol=ATOL)
        torch.testing.assert_close(logits[i, 1], ref_a[len(p) + 1], rtol=0, atol=ATOL)
        torch.testing.assert_close(logits[i, 2], ref_b[len(p) + 1], rtol=0, atol=ATOL)


def test_forward_block_window_levels(llama_model: PreTrainedModel) -> None:
    """Tokens written into a window by one forward are seen by a later forward's tokens in the same window."""
    model = llama_model
    decoder = decoder_and_head(model)[0]
    prompts = make_prompts((3, 7), seed=4)
    cache = RowCache(model.config, 2, 16, F64, torch.device("cpu"))
    prefill(model, cache, prompts)
    base = torch.tensor([len(p) for p in prompts])
    level1 = torch.tensor([[11, 12], [13, 14]])  # a chain of two at window slots 0, 1
    level2 = torch.tensor([[21, 22], [23, 24]])  # two children of the chain's end, at window slots 2 and 3
    with torch.no_grad():
        causal = torch.ones(2, 2, dtype=torch.bool).tril()
        forward_block(decoder, cache, base, torch.arange(2), base[:, None] + torch.arange(2), causal, input_ids=level1)
        sees = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
        hidden = forward_block(
            decoder, cache, base, torch.tensor([2, 3]), base[:, None] + torch.tensor([2, 2]), sees, input_ids=level2
        )
    logits = head(model, hidden)
    for i, p in enumerate(prompts):
        for j in range(2):
            ref = full_logits(model, p + level1[i].tolist() + [int(level2[i, j])])
            torch.testing.assert_close(logits[i, j], ref[-1], rtol=0, atol=ATOL)


# ---------------------------------------------------------------------------- greedy generation vs transformers


def check_eos_layout(out: GenerationOutput, eos: int, max_new: int) -> None:
    """Stopped rows end with exactly one EOS; the others hold ``max_new`` tokens without EOS."""
    for ids, lps, reason in zip(out.completion_ids, out.logprobs, out.finish_reasons, strict=True):
        assert len(lps) == len(ids)
        if reason == "stop":
            assert ids[-1] == eos and eos not in ids[:-1]
            assert len(ids) <= max_new
        else:
            assert reason == "length"
            assert len(ids) == max_new and eos not in ids


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_greedy_matches_hf_generate(family: str) -> None:
    model = tiny_model(family)
    eos, ref = greedy_reference(family)
    out = RolloutEngine(model, [eos]).generate(PROMPTS, GREEDY)
    assert out.completion_ids == ref
    reasons = ["stop" if eos in r else "length" for r in ref]
    assert out.finish_reasons == reasons
    assert "stop" in reasons and "length" in reasons
    check_eos_layout(out, eos, MAX_NEW)
    # Greedy log-probs are the plain log-softmax of the chosen token.
    for prompt, ids, lps in zip(PROMPTS, out.completion_ids, out.logprobs, strict=True):
        logits = full_logits(model, prompt + ids)[len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(lps, dtype=F64), expected, rtol=0, atol=1e-8)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_num_generations_prompt_major(family: str) -> None:
    model = tiny_model(family)
    eos, ref = greedy_reference(family)
    out = RolloutEngine(model, [eos]).generate(PROMPTS, GREEDY, num_generations=3)
    assert len(out.completion_ids) == 3 * len(PROMPTS)
    for row, ids in enumerate(out.completion_ids):
        assert ids == ref[row // 3], f"row {row}"
        torch.testing.assert_close(out.logprobs[row], out.logprobs[(row // 3) * 3], rtol=0, atol=1e-12)


def test_cache_reuse_across_calls(llama_model: PreTrainedModel) -> None:
    """A second call on a bigger-than-needed cache left dirty by the first gives the same completions."""
    eos, ref = greedy_reference("llama")
    engine = RolloutEngine(llama_model, [eos])
    engine.generate(make_prompts((9, 2, 6, 4, 8), seed=11), GREEDY, num_generations=2)
    cache = engine.cache
    out = engine.generate(PROMPTS[::-1], SamplingParams(max_new_tokens=MAX_NEW - 4, temperature=0))
    assert engine.cache is cache  # reused, not reallocated
    assert out.completion_ids == [r[: MAX_NEW - 4] for r in ref[::-1]]


def test_released_caches_are_freed_and_made_again(llama_model: PreTrainedModel) -> None:
    """`release` (before a policy update) drops the target's and the drafter's caches; the next call allocates them
    again and decodes as before."""
    from fastgrpo.rollout.tree import TreeShape
    from fastgrpo.speculative.eagle.drafter import EagleDrafter

    eos, ref = greedy_reference("llama")
    drafter = EagleDrafter(DraftHead(llama_model.config).double(), llama_model)
    engine = RolloutEngine(llama_model, [eos], drafter=drafter, tree=TreeShape(4, 2, 3))
    first = engine.generate(PROMPTS, GREEDY)
    assert engine.cache is not None and drafter.cache is not None
    engine.release()
    assert engine.cache is None and drafter.cache is None
    again = engine.generate(PROMPTS, GREEDY)
    assert first.completion_ids == again.completion_ids == ref


def test_two_engines_decoding_step_by_step_in_turn_give_what_each_generates(llama_model: PreTrainedModel) -> None:
    """`RolloutEngine.decoding` hands a call out step by step: a plain engine's steps and a speculative engine's,
    alternating inside nested blocks (as a benchmark times them side by side), give each one's `generate` output,
    greedy and sampled, with its decoding time the sum of its steps'; the output is refused while rows are live."""
    from fastgrpo.rollout.tree import TreeShape
    from fastgrpo.speculative.eagle.drafter import EagleDrafter

    eos, ref = greedy_reference("llama")
    drafter = EagleDrafter(DraftHead(llama_model.config).double(), llama_model)
    engines = [
        RolloutEngine(llama_model, [eos]),
        RolloutEngine(llama_model, [eos], drafter=drafter, tree=TreeShape(4, 2, 3)),
    ]
    sampled = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0)
    for params, seed in ((GREEDY, None), (sampled, 5)):
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        alone = [
            e.generate(PROMPTS, params, 2, generator=None if seed is None else torch.Generator().manual_seed(seed))
            for e in engines
        ]
        with engines[0].decoding(PROMPTS, params, 2, generator=generator) as plain:
            generator = None if seed is None else torch.Generator().manual_seed(seed)
            with engines[1].decoding(PROMPTS, params, 2, generator=generator) as speculative:
                with pytest.raises(RuntimeError, match="still has live rows"):
                    plain.output()
                while not (plain.done and speculative.done):
                    for call in (plain, speculative):
                        if not call.done:
                            call.step()
        for call, out in zip((plain, speculative), alone, strict=True):
            assert call.output().completion_ids == out.completion_ids
            assert call.output().stats.decode_time == sum(call.output().stats.step_times)
        if seed is None:
            assert plain.output().completion_ids == [r for r in ref for _ in range(2)]


# ---------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_sampled_logprobs_match_fresh_forward(family: str) -> None:
    """Sampled with top-k and top-p filters, each token is scored under the policy's distribution at the sampling
    temperature before the filters, as a training forward scores it."""
    model = tiny_model(family)
    eos, _ = greedy_reference(family)
    g = torch.Generator().manual_seed(5)
    out = RolloutEngine(model, [eos]).generate(PROMPTS, SAMPLED, num_generations=2, generator=g)
    check_eos_layout(out, eos, MAX_NEW)
    for row, (ids, lps) in enumerate(zip(out.completion_ids, out.logprobs, strict=True)):
        prompt = PROMPTS[row // 2]  # prompt-major layout
        logits = full_logits(model, prompt + ids)[len(prompt) - 1 : -1]
        tokens = torch.tensor(ids)[:, None]
        assert torch.isfinite(process_logits(logits, SAMPLED).gather(-1, tokens)).all()  # they survive the filters
        expected = torch.log_softmax(logits / SAMPLED.temperature, dim=-1).gather(-1, tokens).squeeze(-1)
        torch.testing.assert_close(torch.tensor(lps, dtype=F64), expected, rtol=0, atol=1e-8)


def sample_once(model: PreTrainedModel, seed: int, **kwargs) -> GenerationOutput:
    params = SamplingParams(max_new_tokens=kwargs.pop("max_new_tokens", MAX_NEW), temperature=1.0, **kwargs)
    return RolloutEngine(model, [VOCAB + 1]).generate(
        PROMPTS, params, num_generations=2, generator=torch.Generator().manual_seed(seed)
    )


def test_sampling_reproducible_with_seed(llama_model: PreTrainedModel) -> None:
    a, b = sample_once(llama_model, 0), sample_once(llama_model, 0)
    assert a.completion_ids == b.completion_ids
    assert a.logprobs == b.logprobs
    c = sample_once(llama_model, 1)
    assert c.completion_ids != a.completion_ids


def test_generations_of_a_prompt_differ(llama_model: PreTrainedModel) -> None:
    out = sample_once(llama_model, 0)
    assert any(out.completion_ids[2 * p] != out.completion_ids[2 * p + 1] for p in range(len(PROMPTS)))


@pytest.mark.parametrize("max_new", [1, 2, 7])
def test_max_new_tokens_exact(llama_model: PreTrainedModel, max_new: int) -> None:
    out = sample_once(llama_model, 0, max_new_tokens=max_new)  # the EOS id is out of vocabulary: never emitted
    assert [len(c) for c in out.completion_ids] == [max_new] * 2 * len(PROMPTS)
    assert out.finish_reasons == ["length"] * 2 * len(PROMPTS)
    assert out.stats.target_forwards == max_new - 1  # the prefill emits the first token
    assert out.stats.tokens_emitted == 2 * len(PROMPTS) * max_new


def test_concurrency_falls_as_rows_stop(llama_model: PreTrainedModel) -> None:
    eos, ref = greedy_reference("llama")
    out = RolloutEngine(llama_model, [eos]).generate(PROMPTS, GREEDY, num_generations=2)
    stats = out.stats
    conc = stats.concurrency
    assert len(conc) == stats.target_forwards == max(map(len, ref)) - 1
    assert conc[0] == sum(len(r) > 1 for r in ref) * 2
    assert all(a >= b for a, b in zip(conc, conc[1:], strict=False))
    assert conc[-1] < conc[0]
    # Before step s (0-based) the active rows are those with more than s + 1 tokens.
    assert conc == [2 * sum(len(r) > s + 1 for r in ref) for s in range(len(conc))]
    assert stats.tokens_per_forward == conc  # one token per row per autoregressive forward
    assert stats.decode_tokens == sum(conc) and stats.accept_length == 1.0
    assert stats.tokens_emitted == sum(map(len, out.completion_ids)) == 2 * len(PROMPTS) + sum(conc)
    assert stats.total_time > 0 and stats.tokens_per_second > 0
    assert stats.concurrency_mean == pytest.approx(sum(conc) / len(conc))
    assert len(stats.step_times) == len(conc) and min(stats.step_times) > 0
    assert sum(stats.step_times) <= stats.decode_time


def test_capture_hidden_matches_decoder(llama_model: PreTrainedModel) -> None:
    """Captured hidden states are the decoder's final hidden states of every token fed to the target."""
    eos, _ = greedy_reference("llama")
    out = RolloutEngine(llama_model, [eos]).generate(
        PROMPTS, SAMPLED, num_generations=2, generator=torch.Generator().manual_seed(2), capture_hidden=True
    )
    assert out.hidden_states is not None and len(out.hidden_states) == len(out.completion_ids)
    decoder = decoder_and_head(llama_model)[0]
    for row, (ids, hidden) in enumerate(zip(out.completion_ids, out.hidden_states, strict=True)):
        seq = PROMPTS[row // 2] + ids
        with torch.no_grad():
            ref = decoder(torch.tensor([seq[:-1]])).last_hidden_state[0]
        assert hidden.shape == ref.shape
        torch.testing.assert_close(hidden, ref, rtol=0, atol=ATOL)


class TagTokenizer:
    """A tokenizer stand-in: token ``i`` decodes to ``<i>``."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(f"<{i}>" for i in ids)


def test_stop_strings_end_rows(llama_model: PreTrainedModel) -> None:
    _, ref = greedy_reference("llama")
    row = max(range(len(ref)), key=lambda i: len(ref[i]))
    pair = ref[row][5:7]
    stop = "".join(f"<{t}>" for t in pair)

    def expected(completion: list[int]) -> tuple[list[int], str]:
        for end in range(1, len(completion) + 1):
            if stop in TagTokenizer().decode(completion[:end]):
                return completion[:end], "stop"
        return completion, "length"

    free = [hf_greedy(llama_model, p, None) for p in PROMPTS]
    engine = RolloutEngine(llama_model, [VOCAB + 1], tokenizer=TagTokenizer())
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0, stop=("<no-such-string>", stop))
    out = engine.generate(PROMPTS, params)
    for i, completion in enumerate(free):
        ids, reason = expected(completion)
        assert out.completion_ids[i] == ids
        assert out.finish_reasons[i] == reason
    assert out.finish_reasons[row] == "stop" and len(out.completion_ids[row]) <= 7


def test_generate_validation(llama_model: PreTrainedModel) -> None:
    engine = RolloutEngine(llama_model, [0])
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate([[1, 2], []], GREEDY)
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate([], GREEDY)
    with pytest.raises(ValueError, match="tokenizer"):
        engine.generate([[1]], SamplingParams(stop=("x",)))


def test_generate_restores_training_mode(llama_model: PreTrainedModel) -> None:
    llama_model.train()
    try:
        RolloutEngine(llama_model, [0]).generate([[1, 2, 3]], SamplingParams(max_new_tokens=2, temperature=0))
        assert llama_model.training
    finally:
        llama_model.eval()


def test_rollout_attention_switches_the_target_and_the_draft_body_and_restores_them() -> None:
    model = make_tiny_model("llama")
    body = DraftHead(model.config).body
    configs = [model.config.get_text_config(), body.config]
    with rollout_attention(model, None, body, model):  # None skipped, a model given twice switched once
        assert [c._attn_implementation for c in configs] == [ROLLOUT_ATTENTION] * 2
    assert [c._attn_implementation for c in configs] == ["sdpa"] * 2
    with pytest.raises(RuntimeError), rollout_attention(body):
        raise RuntimeError("inside")
    assert body.config._attn_implementation == "sdpa"
    for own in ("eager", "flash_attention_2"):  # a TRL user's model: switched too (its layers get 4-D masks)
        body.config._attn_implementation = own
        with rollout_attention(body):
            assert body.config._attn_implementation == ROLLOUT_ATTENTION
        assert body.config._attn_implementation == own


def test_a_model_loaded_with_eager_attention_rolls_out_as_with_sdpa() -> None:
    """Ragged prompts make the engine pass a 4-D mask; a model set to another attention still decodes the same."""
    sdpa, eager = make_tiny_model("qwen2"), make_tiny_model("qwen2")
    eager.config._attn_implementation = "eager"
    prompts, params = [[1, 2, 3], [4, 5, 6, 7, 8]], SamplingParams(max_new_tokens=8, temperature=0)
    outs = [RolloutEngine(m, [0]).generate(prompts, params) for m in (sdpa, eager)]
    assert outs[0].completion_ids == outs[1].completion_ids
    assert eager.config._attn_implementation == "eager"
