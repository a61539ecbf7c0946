"""The engine's decoding step reads the device once: counted on CPU with a dispatch mode (`benchmarks/syncs.py`),
for plain and tree steps, greedy, sampled and with top-p, static and adaptive trees, with rows ending on the way.

On a CPU, where reading a value back stalls nothing, top-p ranks by heads it reads back; the tests run the ranking a
GPU runs (`fastgrpo.rollout.sampling.host_reads_are_free` false)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import VOCAB, tiny_model
from conftest import adaptive as adaptive_over
from syncs import counting_dispatch

from fastgrpo.rollout.engine import RolloutEngine
from fastgrpo.rollout.tree import TreeShape
from fastgrpo.sampling_params import SamplingParams
from fastgrpo.speculative.controller import AdaptiveController
from fastgrpo.speculative.eagle.drafter import EagleDrafter
from fastgrpo.speculative.eagle.head import DraftHead
from fastgrpo.speculative.profiler import LatencyProfile

PROMPTS = [[5, 17, 3], [40, 2, 9, 11, 60, 7], [1, 90]]
MAX_NEW = 16
PARAMS = {
    "greedy": SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0),
    "T=1": SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0),
    "top-p": SamplingParams(max_new_tokens=MAX_NEW, temperature=0.8, top_p=0.9, top_k=50),
}


@pytest.fixture(autouse=True)
def as_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from fastgrpo.rollout import sampling

    monkeypatch.setattr(sampling, "host_reads_are_free", lambda t: False)


def eos_midway() -> int:
    """A token the model emits greedily in some rows but not all, early enough that rows end at different steps."""
    engine = RolloutEngine(tiny_model("llama"), [VOCAB])  # an id out of vocabulary: never emitted
    completions = engine.generate(PROMPTS, PARAMS["greedy"]).completion_ids
    early = Counter(t for c in completions for t in set(c[1 : MAX_NEW // 2]))
    return min((t for t, n in early.items() if n < len(PROMPTS)), key=lambda t: (-early[t], t))


def steps_counted(engine: RolloutEngine, params: SamplingParams) -> tuple[list[Counter], list[int]]:
    """The host synchronisations of each decoding step of one call (by name), and the call's concurrency."""
    counted, step = [], engine.step

    def counting_step(rows, call):
        with counting_dispatch() as counter:
            out = step(rows, call)
        counted.append(counter.syncs.copy())
        return out

    engine.step = counting_step
    out = engine.generate(PROMPTS, params, num_generations=2, generator=torch.Generator().manual_seed(3))
    return counted, out.stats.concurrency


def adaptive() -> AdaptiveController:
    """A controller whose profile makes trees cheap, so that it runs trees and plain steps both."""
    tokens = [1, 2, 4, 8, 16, 32, 64, 128]
    seconds = [0.05 * max(1.0, t / 32) for t in tokens]
    profile = LatencyProfile(
        "synthetic", "none", "float64", 64, tokens, seconds, 32, {"eagle": [s / 20 for s in seconds]}
    )
    return adaptive_over(profile)


def test_the_counter_sees_every_kind_of_host_read() -> None:
    """What the tests below rely on: scalar reads under inference mode, boolean masks, compactions and host copies
    are each counted once, and ops that stay on the device are not."""
    x = torch.arange(6)
    with torch.inference_mode(), counting_dispatch() as counter:
        int(x.max()), float(x.sum()), bool(x.any()), x[0].item()
        x[x > 2], x.nonzero(), x.tolist(), x.numpy(), torch.repeat_interleave(x)
        torch.where(x > 2, x, 0).cumsum(0).topk(2), x[torch.tensor([1, 2])]
    assert counter.syncs == Counter(
        {"int": 1, "float": 1, "bool": 1, "item": 1, "index": 1, "nonzero": 1, "tolist": 1, "numpy": 1}
        | {"repeat_interleave": 1}
    )
    assert counter.sync_count == 9 and counter.ops > 9


@pytest.mark.parametrize("sampling", PARAMS)
def test_a_plain_step_reads_the_device_once(sampling: str) -> None:
    engine = RolloutEngine(tiny_model("llama"), [eos_midway()])
    counted, concurrency = steps_counted(engine, PARAMS[sampling])
    assert concurrency[-1] < concurrency[0], "rows ended on the way (their removal is counted too)"
    assert all(sum(c.values()) == 1 for c in counted), counted


@pytest.mark.parametrize("sampling", PARAMS)
@pytest.mark.parametrize("shape", [TreeShape(4, 2, 3), TreeShape(16, 4, 5), "adaptive"], ids=str)
def test_a_tree_step_reads_the_device_at_most_twice(sampling: str, shape: TreeShape | str) -> None:
    model = tiny_model("llama")
    torch.manual_seed(0)
    drafter = EagleDrafter(DraftHead(model.config).double(), model)
    if shape == "adaptive":
        engine = RolloutEngine(model, [eos_midway()], drafter=drafter, controller=adaptive())
    else:
        engine = RolloutEngine(model, [eos_midway()], drafter=drafter, tree=shape)
    counted, concurrency = steps_counted(engine, PARAMS[sampling])
    assert concurrency[-1] < concurrency[0]
    assert max(sum(c.values()) for c in counted) <= 2, counted
