"""Rollouts of a LoRA policy run with the adapters merged into the base weights, and leave the weights as they were."""

from __future__ import annotations

import copy

import torch
from conftest import VOCAB, make_tiny_model
from peft import LoraConfig, PeftModel, get_peft_model

from fastgrpo.rollout.engine import RolloutEngine
from fastgrpo.rollout.lora import merged_lora
from fastgrpo.sampling_params import SamplingParams

PROMPTS = [[5, 9, 2], [7, 1, 3, 8, 4, 6, 11], [12, 30]]
GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0)
SAMPLED = SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9)


def lora_model(seed: int = 0) -> PeftModel:
    """A tiny float64 Llama with rank-4 adapters on every linear layer, whose B matrices are random (peft starts them
    at zero, which would make merging a no-op)."""
    model = get_peft_model(make_tiny_model("llama", seed), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    return model.eval()


def base_weights(model: PeftModel) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters() if "lora_" not in k}


def test_rollout_of_a_lora_policy_equals_that_of_its_merged_weights() -> None:
    model = lora_model()
    merged = copy.deepcopy(model).merge_and_unload()  # plain transformers model with W + s B A
    before = base_weights(model)
    for params in (GREEDY, SAMPLED):
        outs = [
            RolloutEngine(m, [VOCAB - 1], merge_lora=merge).generate(
                PROMPTS, params, num_generations=2, generator=torch.Generator().manual_seed(3)
            )
            for m, merge in ((model, True), (model, False), (merged, True))
        ]
        assert outs[0].completion_ids == outs[1].completion_ids == outs[2].completion_ids
        for a, b in zip(outs[0].logprobs, outs[2].logprobs, strict=True):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-10)
    after = base_weights(model)
    assert not any(layer.merged for layer in model.modules() if hasattr(layer, "merged"))
    for name, weight in before.items():
        torch.testing.assert_close(after[name], weight, rtol=0, atol=1e-14, msg=name)


def test_lora_layers_run_merged_during_a_rollout() -> None:
    """With merging, no adapter product runs while decoding; without it, every forward runs them."""
    model = lora_model()
    calls = {"count": 0}
    adapters = [m for name, m in model.named_modules() if name.endswith("lora_A.default")]
    assert adapters
    hooks = [m.register_forward_hook(lambda *_: calls.__setitem__("count", calls["count"] + 1)) for m in adapters]
    try:
        RolloutEngine(model, [VOCAB - 1]).generate(PROMPTS, GREEDY)
        merged_calls = calls["count"]
        RolloutEngine(model, [VOCAB - 1], merge_lora=False).generate(PROMPTS, GREEDY)
    finally:
        for hook in hooks:
            hook.remove()
    assert merged_calls == 0
    assert calls["count"] >= len(adapters) * GREEDY.max_new_tokens


def test_adapters_over_bfloat16_weights_are_merged_and_the_base_restored_bit_for_bit() -> None:
    """In bfloat16 (a GPU rollout's dtype) the adapters are merged too; the rollout equals that of the merged model
    (peft's merge_and_unload), and afterwards every base weight is exactly what it was (subtracting the adapters
    again would leave rounding of about 0.4 % in each)."""
    low = lora_model().to(torch.bfloat16)
    merged_copy = copy.deepcopy(low).merge_and_unload()
    before = base_weights(low)
    with merged_lora(low) as merged:
        assert merged
        assert all(layer.merged for layer in low.modules() if hasattr(layer, "merged_adapters"))
    assert not any(layer.merged for layer in low.modules() if hasattr(layer, "merged_adapters"))
    assert all(torch.equal(base_weights(low)[k], v) for k, v in before.items())
    outs = [RolloutEngine(m, [VOCAB - 1]).generate(PROMPTS, GREEDY) for m in (low, merged_copy)]
    assert outs[0].completion_ids == outs[1].completion_ids
    assert all(torch.equal(base_weights(low)[k], v) for k, v in before.items())


def test_disabled_adapters_or_none_stay_unmerged() -> None:
    model = lora_model()
    with model.disable_adapter(), merged_lora(model) as merged:
        assert not merged
    with merged_lora(make_tiny_model("llama")) as merged:  # no adapters at all
        assert not merged


def adapters_of(model: PeftModel) -> list[torch.Tensor]:
    return [p for name, p in model.named_parameters() if "lora_" in name]


def decode_switching_adapters(
    model: PeftModel, merge: bool, new: list[torch.Tensor]
) -> tuple[list[list[int]], list[list[float]], dict[str, torch.Tensor]]:
    """A call of 3 sampled steps, then the adapters replaced by ``new`` (as a rollout process takes weights between
    decoding steps: with merging, inside `MergedAdapters.unmerged`), then the rest; its completions, log-probs and
    the base weights the rest computed with."""
    engine = RolloutEngine(model, [VOCAB - 1], merge_lora=merge)
    with engine.decoding(PROMPTS, SAMPLED, 2, torch.Generator().manual_seed(5)) as run:
        for _ in range(3):
            run.step()
        assert bool(engine.merged) == merge
        with engine.merged.unmerged(), torch.no_grad():
            for p, value in zip(adapters_of(model), new, strict=True):
                p.copy_(value)
        during = base_weights(model)
        run.finish()
    out = run.output()
    assert not engine.merged, "inert once the call ended"
    return out.completion_ids, out.logprobs, during


def test_adapters_taken_between_decoding_steps_are_merged_in_their_place() -> None:
    """New adapter weights taken while a call decodes with its adapters merged: the rest of the call computes with
    them, as the unmerged layers do (which read the adapters at every product), and the base weights are left as
    they were."""
    new = [p.detach().clone() for p in adapters_of(lora_model(seed=7))]
    outs, before = [], None
    for merge in (True, False):
        model = lora_model()
        if before is None:
            before = base_weights(model)
        outs.append(decode_switching_adapters(model, merge, new))
        assert all(torch.equal(p, value) for p, value in zip(adapters_of(model), new, strict=True))
        for name, weight in base_weights(model).items():
            torch.testing.assert_close(weight, before[name], rtol=0, atol=1e-14, msg=name)
    (merged_ids, merged_logps, _), (live_ids, live_logps, _) = outs
    assert merged_ids == live_ids
    for a, b in zip(merged_logps, live_logps, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-10)
    kept = [p.detach().clone() for p in adapters_of(lora_model())]
    assert decode_switching_adapters(lora_model(), True, kept)[0] != merged_ids, "the new adapters changed the rest"


def test_bfloat16_adapters_taken_between_decoding_steps_merge_into_the_base_as_it_was() -> None:
    """In bfloat16 the adapters are taken out of the base weights by restoring their copies, not by subtraction: the
    weights the rest of the call computes with are bit for bit those of a merge of the new adapters alone, and the
    base is restored bit for bit afterwards."""
    low, fresh = lora_model().to(torch.bfloat16), lora_model().to(torch.bfloat16)
    before = base_weights(low)
    new = [p.detach().clone() for p in adapters_of(lora_model(seed=7).to(torch.bfloat16))]
    _, _, during = decode_switching_adapters(low, True, new)
    with torch.no_grad():
        for p, value in zip(adapters_of(fresh), new, strict=True):
            p.copy_(value)
    with merged_lora(fresh):
        expected = base_weights(fresh)
    assert all(torch.equal(during[k], v) for k, v in expected.items())
    assert any(not torch.equal(during[k], before[k]) for k in before), "the merge changed the base"
    assert all(torch.equal(base_weights(low)[k], v) for k, v in before.items())
