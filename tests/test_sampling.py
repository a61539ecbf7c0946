"""Tests for fastgrpo.rollout.sampling: expected distributions are worked out by hand in the comments."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from syncs import counting_dispatch

from fastgrpo.rollout.sampling import CDF_BLOCK, process_logits, sample
from fastgrpo.sampling_params import SamplingParams

F64 = torch.float64
# A 4-token distribution used throughout, stored in a shuffled order so filters must map back through the sort.
PROBS = {0: 0.15, 1: 0.5, 2: 0.1, 3: 0.25}  # ranked: 1 (0.5), 3 (0.25), 0 (0.15), 2 (0.1)


def logits_of(probs: dict[int, float]) -> torch.Tensor:
    return torch.tensor([math.log(probs[i]) for i in range(len(probs))], dtype=F64)


def kept(logprobs: torch.Tensor) -> set[int]:
    return {i for i, v in enumerate(logprobs.tolist()) if v != float("-inf")}


def dist(logprobs: torch.Tensor) -> dict[int, float]:
    """The kept tokens' probabilities."""
    return {i: math.exp(v) for i, v in enumerate(logprobs.tolist()) if v != float("-inf")}


def params(**kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, **kwargs})


def assert_dist(logprobs: torch.Tensor, expected: dict[int, float]) -> None:
    got = dist(logprobs)
    assert set(got) == set(expected)
    for i, p in expected.items():
        assert got[i] == pytest.approx(p, abs=1e-12)


# ---------------------------------------------------------------------------- SamplingParams


def test_params_defaults() -> None:
    p = SamplingParams()
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.stop) == (256, 1.0, 1.0, 0, 0.0, ())
    assert not p.greedy
    assert SamplingParams(temperature=0).greedy
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.5  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.0}, "min_p"),
    ],
)
def test_params_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_params_edge_values_accepted() -> None:
    SamplingParams(max_new_tokens=1, temperature=0, top_p=1.0, top_k=0, min_p=0.0)
    SamplingParams(top_p=1e-6, min_p=0.999, top_k=1)


# ---------------------------------------------------------------------------- process_logits


def test_greedy_is_plain_log_softmax() -> None:
    logits = torch.randn(3, 10, dtype=F64, generator=torch.Generator().manual_seed(0))
    # Filters are ignored under greedy decoding: every token keeps its plain log-probability.
    out = process_logits(logits, SamplingParams(temperature=0, top_k=1, top_p=0.1, min_p=0.5))
    torch.testing.assert_close(out, torch.log_softmax(logits, -1), rtol=0, atol=0)


@pytest.mark.parametrize("temperature", [0.25, 0.7, 1.0, 2.0])
def test_temperature_scaling(temperature: float) -> None:
    logits = torch.randn(2, 10, dtype=F64, generator=torch.Generator().manual_seed(1))
    out = process_logits(logits, params(temperature=temperature))
    torch.testing.assert_close(out, torch.log_softmax(logits / temperature, -1), rtol=0, atol=1e-14)


def test_temperature_sharpens_by_hand() -> None:
    # T = 0.5 squares the probabilities: 0.25, 0.0625, 0.0225, 0.01 over a total of 0.345.
    out = process_logits(logits_of(PROBS), params(temperature=0.5))
    assert_dist(out, {1: 0.25 / 0.345, 3: 0.0625 / 0.345, 0: 0.0225 / 0.345, 2: 0.01 / 0.345})


@pytest.mark.parametrize("k", [1, 2, 5, 9])
def test_top_k_keeps_exactly_k(k: int) -> None:
    logits = torch.randn(4, 10, dtype=F64, generator=torch.Generator().manual_seed(2))
    out = process_logits(logits, params(top_k=k))
    for row, lp in zip(logits, out, strict=True):
        assert kept(lp) == set(row.topk(k).indices.tolist())
        # The survivors are renormalised among themselves.
        torch.testing.assert_close(lp[lp.isfinite()], torch.log_softmax(row[lp.isfinite()], -1), rtol=0, atol=1e-14)


def test_top_k_at_or_above_vocab_is_a_no_op() -> None:
    logits = torch.randn(10, dtype=F64, generator=torch.Generator().manual_seed(3))
    for k in (10, 50):
        torch.testing.assert_close(process_logits(logits, params(top_k=k)), torch.log_softmax(logits, -1))


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        # Cumulative mass by rank: 0.5, 0.75, 0.9, 1.0; keep up to the first rank that reaches top_p.
        (0.4, {1: 1.0}),
        (0.7, {1: 0.5 / 0.75, 3: 0.25 / 0.75}),
        (0.8, {1: 0.5 / 0.9, 3: 0.25 / 0.9, 0: 0.15 / 0.9}),
        (0.95, PROBS),
        (1.0, PROBS),
    ],
)
def test_top_p_smallest_set_reaching_p(top_p: float, expected: dict[int, float]) -> None:
    assert_dist(process_logits(logits_of(PROBS), params(top_p=top_p)), expected)


def test_top_p_tiny_keeps_the_top_token() -> None:
    assert_dist(process_logits(logits_of(PROBS), params(top_p=1e-9)), {1: 1.0})


@pytest.mark.parametrize(
    ("min_p", "expected"),
    [
        # The floor is min_p times the top probability 0.5.
        (0.1, PROBS),  # floor 0.05: all stay
        (0.25, {1: 0.5 / 0.9, 3: 0.25 / 0.9, 0: 0.15 / 0.9}),  # floor 0.125: 0.1 goes
        (0.4, {1: 0.5 / 0.75, 3: 0.25 / 0.75}),  # floor 0.2
        (0.9, {1: 1.0}),  # floor 0.45
    ],
)
def test_min_p(min_p: float, expected: dict[int, float]) -> None:
    assert_dist(process_logits(logits_of(PROBS), params(min_p=min_p)), expected)


def test_filters_apply_in_order() -> None:
    logits = logits_of(PROBS)
    # Temperature first: at T = 0.5 the top token holds 0.25 / 0.345 = 0.725 > 0.7, so top-p keeps it alone
    # (top-p at T = 1 would keep two tokens).
    assert_dist(process_logits(logits, params(temperature=0.5, top_p=0.7)), {1: 1.0})
    # Top-k before top-p: after top-2 the top token holds 2/3 >= 0.6, so top-p keeps it alone
    # (top-p on the full distribution would keep two tokens, 0.5 < 0.6).
    assert_dist(process_logits(logits, params(top_k=2, top_p=0.6)), {1: 1.0})
    # Temperature before min-p (min-p compares ratios to the top token, so its order relative to top-k/top-p
    # does not matter): ratios 0.5, 0.3, 0.2 at T = 1 become 0.25, 0.09, 0.04 at T = 0.5, so min-p 0.22 keeps
    # two tokens (it would keep three before the temperature). At T = 0.5 those two hold 0.25 and 0.0625.
    assert_dist(process_logits(logits, params(temperature=0.5, min_p=0.22)), {1: 0.25 / 0.3125, 3: 0.0625 / 0.3125})


@pytest.mark.parametrize(
    "sp",
    [
        params(),
        params(temperature=0.7, top_p=0.9, top_k=20),
        params(temperature=1.3, min_p=0.05),
        params(temperature=0.5, top_k=3, top_p=0.5, min_p=0.2),
        SamplingParams(temperature=0),
    ],
)
def test_distribution_sums_to_one(sp: SamplingParams) -> None:
    logits = 3 * torch.randn(2, 5, 64, dtype=F64, generator=torch.Generator().manual_seed(4))
    out = process_logits(logits, sp)
    assert out.shape == logits.shape
    torch.testing.assert_close(out.exp().sum(-1), torch.ones(2, 5, dtype=F64), rtol=0, atol=1e-12)
    assert (out.isfinite().sum(-1) >= 1).all()
    assert not out.isnan().any()


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [(torch.bfloat16, torch.float32), (torch.float16, torch.float32), (torch.float32, torch.float32), (F64, F64)],
)
def test_output_dtype_at_least_float32(dtype: torch.dtype, expected: torch.dtype) -> None:
    logits = torch.randn(2, 8).to(dtype)
    assert process_logits(logits, params(top_p=0.9)).dtype == expected
    assert process_logits(logits, SamplingParams(temperature=0)).dtype == expected


# ---------------------------------------------------------------------------- sample


def uniforms(n: int, seed: int) -> torch.Tensor:
    return torch.rand(n, dtype=F64, generator=torch.Generator().manual_seed(seed))


def test_sample_greedy_is_argmax() -> None:
    logits = torch.randn(6, 20, dtype=F64, generator=torch.Generator().manual_seed(5))
    sp = SamplingParams(temperature=0)
    assert torch.equal(sample(process_logits(logits, sp), sp), logits.argmax(-1))


def test_sample_reproducible_and_respects_filters() -> None:
    logits = torch.randn(8, 30, dtype=F64, generator=torch.Generator().manual_seed(6))
    sp = params(top_k=4)
    lp = process_logits(logits, sp)
    draws = [sample(lp, sp, uniforms(8, s)) for s in (0, 0, 1)]
    assert torch.equal(draws[0], draws[1])
    assert not torch.equal(draws[0], draws[2])
    many = torch.stack([sample(lp, sp, uniforms(8, s)) for s in range(50)])
    assert lp.gather(-1, many.T).isfinite().all()  # filtered tokens are never drawn
    edges = sample(lp, sp, torch.tensor([0.0, 1.0 - 1e-12] * 4, dtype=F64))
    assert lp.gather(-1, edges[:, None]).isfinite().all()  # nor at the ends of the unit interval


def test_sample_inverts_the_cdf() -> None:
    lp = torch.tensor([[0.2, 0.0, 0.5, 0.3]], dtype=F64).log().expand(5, 4)
    u = torch.tensor([0.0, 0.19, 0.21, 0.69, 0.71], dtype=F64)
    assert sample(lp, params(), u).tolist() == [0, 0, 2, 2, 3]


def test_sample_inverts_the_cdf_across_blocks() -> None:
    """Over a vocabulary of several `CDF_BLOCK` blocks (the last one partial), the two-stage draw picks the token a
    single cumulative sum over the whole vocabulary picks, and never one of probability zero: not in empty blocks,
    not in the padding past the vocabulary, not at the ends of the unit interval, nor at 1 (a point at the total,
    which rounding can produce)."""
    g = torch.Generator().manual_seed(8)
    vocab = 3 * CDF_BLOCK + 17
    probs = torch.rand(4, vocab, dtype=F64, generator=g) ** 4
    probs[0, CDF_BLOCK : 2 * CDF_BLOCK] = 0.0  # an empty block in the middle
    probs[1, 300:] = 0.0  # nothing past token 299
    probs[2, :-1] = 0.0  # all mass on the last token, in the partial block
    lp = (probs / probs.sum(-1, keepdim=True)).log()
    u = torch.cat([torch.rand(2000, dtype=F64, generator=g), torch.tensor([0.0, 1.0 - 1e-16, 1.0], dtype=F64)])
    rows = lp.repeat_interleave(u.numel(), dim=0)
    drawn = sample(rows, params(), u.repeat(4))
    cdf = torch.softmax(rows, dim=-1).cumsum(dim=-1)
    direct = torch.searchsorted(cdf, u.repeat(4)[:, None] * cdf[:, -1:], right=True).squeeze(1)
    assert rows.gather(1, drawn[:, None]).isfinite().all()
    assert (drawn == direct.clamp(max=vocab - 1)).double().mean() > 0.999  # equal up to rounding at boundaries
    assert (drawn.view(4, -1)[2] == vocab - 1).all()


def test_sample_needs_one_uniform_per_row() -> None:
    with pytest.raises(ValueError, match="uniform"):
        sample(torch.zeros(3, 4, dtype=F64), params(), torch.zeros(2, dtype=F64))


def test_sample_frequencies_follow_distribution() -> None:
    sp = params(top_p=0.8)  # keeps tokens 1, 3, 0 with probabilities 0.556, 0.278, 0.167
    lp = process_logits(logits_of(PROBS), sp).expand(20000, 4)
    counts = torch.bincount(sample(lp, sp, uniforms(20000, 7)), minlength=4).double() / 20000
    expected = torch.tensor([0.15 / 0.9, 0.5 / 0.9, 0.0, 0.25 / 0.9], dtype=F64)
    torch.testing.assert_close(counts, expected, rtol=0, atol=0.015)


@pytest.mark.parametrize("reads_free", [True, False], ids=["by heads", "by one sort"])
def test_top_p_filters_peaked_and_flat_rows_alike(reads_free: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows whose nucleus lies in the first head (peaked), in the second (wider) or in neither (flat) are filtered
    exactly as by their own sort, by both rankings; the one a GPU runs reads nothing back from the device."""
    from fastgrpo.rollout import sampling

    monkeypatch.setattr(sampling, "TOP_P_HEADS", (8, 64))
    monkeypatch.setattr(sampling, "host_reads_are_free", lambda t: reads_free)
    gen = torch.Generator().manual_seed(8)
    scale = torch.tensor([8.0, 8.0, 0.1, 2.0, 6.0, 1.2], dtype=F64)[:, None, None]
    logits = scale * torch.randn(6, 3, 256, dtype=F64, generator=gen)
    sorted_probs, order = torch.sort(torch.softmax(logits, -1), dim=-1, descending=True)
    drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= 0.9
    expected = drop_sorted.scatter(-1, order, drop_sorted)
    with counting_dispatch() as counter:
        dropped = sampling._top_p_drop(logits, 0.9)
    assert torch.equal(dropped, expected)
    kept = (~dropped).sum(-1)
    assert kept[0].max() <= 8 and kept[2].min() > 64, "nuclei within the first head and past every head"
    assert ((kept > 8) & (kept <= 64)).any(), "the second head holds some nuclei"
    assert (counter.sync_count == 0) != reads_free, counter.syncs
