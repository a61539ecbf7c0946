"""Precision as GPU training has it: `dtype: auto`, float32 master weights behind bfloat16 module weights (saved and
resumed), TF32 products on CUDA only inside training, checkpoints read into host memory with the GPU's generator."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import save_tiny_llama
from test_trainer import make_config, make_trainer

from fastgrpo.grpo.checkpoint import STATE_FILE, load_state, rng_state, set_rng_state
from fastgrpo.models import resolve_dtype
from fastgrpo.precision import MasterWeights, tf32_matmuls


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"), seed=0, tie_word_embeddings=True)


def test_auto_dtype_is_bfloat16_on_a_gpu_and_float32_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_dtype("auto", torch.device("cpu")) == "float32"
    assert resolve_dtype("float64", torch.device("cpu")) == "float64"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert resolve_dtype("auto", torch.device("cuda", 0)) == "bfloat16"
    # a GPU without bfloat16 units (V100, T4) only emulates it: float32 there
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert resolve_dtype("auto", torch.device("cuda", 0)) == "float32"
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("half", torch.device("cpu"))


def adam_steps(weight: torch.nn.Parameter, masters: MasterWeights | None, steps: int) -> None:
    """``steps`` AdamW steps of lr 1e-4 that each push ``weight`` down (a constant positive gradient)."""
    optimizer = torch.optim.AdamW(masters.copies if masters else [weight], lr=1e-4, weight_decay=0.0)
    for _ in range(steps):
        weight.grad = torch.ones_like(weight)
        if masters is not None:
            masters.take_grads()
        optimizer.step()
        if masters is not None:
            masters.write_back()
        optimizer.zero_grad(set_to_none=True)


def test_small_updates_round_away_in_bfloat16_and_accumulate_in_master_weights() -> None:
    """Adam moves a weight of 1 by 1e-4 a step, under half of bfloat16's spacing there (2**-7): alone, the bfloat16
    weight never moves; with float32 masters, 100 steps move it by 0.01, and the module holds the master rounded."""
    plain = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16, device="cpu"))
    adam_steps(plain, None, 100)
    assert torch.equal(plain.detach(), torch.ones(4, dtype=torch.bfloat16, device="cpu"))

    weight = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16, device="cpu"))
    masters = MasterWeights([weight])
    assert MasterWeights.needed([weight]) and not MasterWeights.needed([torch.nn.Parameter(torch.ones(1))])
    adam_steps(weight, masters, 100)
    assert masters.copies[0].dtype == torch.float32
    torch.testing.assert_close(masters.copies[0], torch.full((4,), 0.99, device="cpu"), rtol=0, atol=1e-4)
    assert torch.equal(weight.detach(), masters.copies[0].to(torch.bfloat16))
    assert weight.grad is None and masters.copies[0].grad is None

    restored = MasterWeights([torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16, device="cpu"))])
    restored.load_state_dict(masters.state_dict())
    assert torch.equal(restored.copies[0], masters.copies[0])
    assert torch.equal(restored.params[0].detach(), weight.detach())
    with pytest.raises(ValueError, match="other trainable parameters"):
        MasterWeights([torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16, device="cpu"))]).load_state_dict(
            masters.state_dict()
        )


def test_a_bfloat16_run_keeps_float32_masters_saves_them_and_resumes_exactly(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    def config(out: str, **kw):
        return make_config(tiny_model_dir, tmp_path / out, dtype="bfloat16", max_steps=4, save_steps=2, **kw)

    full_trainer = make_trainer(config("full"))
    masters = full_trainer.update.masters
    assert masters is not None and all(m.dtype == torch.float32 for m in masters.copies)
    assert {p.dtype for p in full_trainer.model.parameters()} == {torch.bfloat16}  # one copy of the weights
    assert full_trainer.update.optimizer.param_groups[0]["params"][0] is masters.copies[0]
    full = full_trainer.train()
    for p, m in zip(masters.params, masters.copies, strict=True):
        assert torch.equal(p.detach(), m.to(torch.bfloat16))
    assert "master_weights" in load_state(tmp_path / "full" / "checkpoint-2")

    cut = make_trainer(config("cut"))
    cut.config.max_steps = 2
    cut.train()
    cut.config.max_steps = 4
    resumed = make_trainer(config("cut"), resume=True)
    rest = resumed.train()
    for again, uninterrupted in zip(rest, full[2:], strict=True):
        assert again["loss"] == uninterrupted["loss"]
    for a, b in zip(resumed.update.masters.copies, masters.copies, strict=True):
        assert torch.equal(a, b)

    no_masters = make_trainer(config("plain", master_weights=False))
    assert no_masters.update.masters is None
    assert no_masters.update.optimizer.param_groups[0]["params"][0].dtype == torch.bfloat16


def test_tf32_is_allowed_on_cuda_inside_the_block_only() -> None:
    before = torch.get_float32_matmul_precision()
    assert before == "highest"  # torch's default: no TF32
    with tf32_matmuls(torch.device("cpu")):
        assert torch.get_float32_matmul_precision() == before
    with tf32_matmuls(torch.device("cuda", 0)):
        assert torch.get_float32_matmul_precision() == "high"
        assert torch.backends.cuda.matmul.allow_tf32
    assert torch.get_float32_matmul_precision() == before


def test_checkpoint_state_loads_into_host_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 saves from its GPU; every rank must not load that state onto cuda:0."""
    torch.save({"step": 1}, tmp_path / STATE_FILE)
    seen = {}
    real_load = torch.load

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    assert load_state(tmp_path) == {"step": 1}
    assert seen["map_location"] == "cpu"


def test_the_gpu_generator_is_saved_and_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where CUDA is in use its generator (LoRA dropout on the GPU draws from it) travels with the RNG state."""
    gpu_state = torch.arange(16, dtype=torch.uint8, device="cpu")
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda *a: gpu_state.clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, *a: restored.append(state))
    state = rng_state()
    assert torch.equal(state["cuda"], gpu_state)
    set_rng_state(state)
    assert len(restored) == 1 and torch.equal(restored[0], gpu_state)


def test_a_bfloat16_draft_is_trained_through_float32_masters_that_its_state_carries() -> None:
    from conftest import make_tiny_model

    from fastgrpo.config import DraftTrainConfig
    from fastgrpo.speculative.eagle.head import DraftHead
    from fastgrpo.speculative.eagle.training import DraftSample, DraftTrainer

    model = make_tiny_model("llama").to(torch.bfloat16)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()

    def trainer() -> DraftTrainer:
        torch.manual_seed(0)
        return DraftTrainer(DraftHead(model.config).to(torch.bfloat16), embed, head, DraftTrainConfig())

    first = trainer()
    frozen = [i for i, p in enumerate(first.draft.parameters()) if not p.requires_grad]
    assert first.masters is not None and frozen
    assert all(p.dtype == torch.float32 for p in first.optimizer.param_groups[0]["params"])
    gen = torch.Generator(device="cpu").manual_seed(1)
    samples = [
        DraftSample(
            torch.randint(0, 100, (13,), generator=gen, device="cpu"),
            torch.randn(12, model.config.hidden_size, generator=gen, device="cpu").to(torch.bfloat16),
            4,
        )
        for _ in range(4)
    ]
    before = [c.clone() for c in first.masters.copies]
    first.fit(samples)
    assert any(not torch.equal(b, c) for b, c in zip(before, first.masters.copies, strict=True))
    assert all(torch.equal(before[i], first.masters.copies[i]) for i in frozen)  # skipped, not decayed
    for p, c in zip(first.masters.params, first.masters.copies, strict=True):
        assert torch.equal(p.detach(), c.to(torch.bfloat16))  # the module holds the masters rounded
    second = trainer()
    second.load_state_dict(first.state_dict())
    for a, b in zip(second.masters.copies, first.masters.copies, strict=True):
        assert torch.equal(a, b)
    float_draft = DraftTrainer(DraftHead(make_tiny_model("llama").config).float(), embed, head, DraftTrainConfig())
    assert float_draft.masters is None and "master_weights" not in float_draft.state_dict()


def test_a_float32_run_resumes_a_checkpoint_with_master_weights_from_them(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A bfloat16 run's checkpoint resumed in float32 (master_weights: false, say) takes the exact float32 masters,
    not the bfloat16 rounding saved as weights; a float32 checkpoint resumed with master weights is refused."""
    out = tmp_path / "run"
    make_trainer(make_config(tiny_model_dir, out, dtype="bfloat16", max_steps=2, save_steps=2)).train()
    saved = load_state(out / "checkpoint-2")["master_weights"]["masters"]
    resumed = make_trainer(make_config(tiny_model_dir, out, dtype="float32", max_steps=4, save_steps=2), resume=True)
    trainable = [p for p in resumed.model.parameters() if p.requires_grad]
    assert all(torch.equal(p.detach(), c) for p, c in zip(trainable, saved, strict=True))

    plain = tmp_path / "plain"
    make_trainer(make_config(tiny_model_dir, plain, dtype="float32", max_steps=2, save_steps=2)).train()
    with pytest.raises(ValueError, match="holds no float32 master weights"):
        make_trainer(make_config(tiny_model_dir, plain, dtype="bfloat16", max_steps=4, save_steps=2), resume=True)
