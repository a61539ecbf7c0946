"""FSDP2 as a 7B run uses it, on two gloo processes: float32 master shards behind bfloat16 compute that learn what one
process with float32 master weights learns, and rollouts that gather the parameters once, into the same tensors
every rollout (a captured CUDA graph keeps its parameters' addresses), and run compiled. In one process the master
weights' write-backs and the LoRA merges keep those addresses too.

Compiled with the ``eager`` backend, which runs the graphs Dynamo captures for inductor as captured, in float32
(compared token for token with the eager steps); a graph break (FSDP2's hooks are excluded from tracing) is an error
under ``fullgraph`` with any backend. AOT's trace of these graphs over gathered FSDP2 parameters is left to the GPU
check's torchrun section. The bfloat16 run with float32 master shards decodes eagerly: where its
weights live and what they hold does not depend on the backend. The ranks are forked from the test's process.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import fork_ranks, free_port, save_tiny_llama
from safetensors.torch import load_file
from test_distributed import run_config

from fastgrpo import distributed
from fastgrpo.config import GRPOConfig, load_config
from fastgrpo.grpo.batch import RolloutBatch, build_batch, select_rows
from fastgrpo.grpo.policy_update import PolicyUpdate
from fastgrpo.models import load_model

STEPS = 20  # AdamW steps of the master-weights comparison
ROWS = 8  # the job's rows per step: 4 per process, in micro-batches of 2 rows


def _join(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(1)
    distributed.init("cpu", 120)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"), seed=0, tie_word_embeddings=True)


# -- float32 master shards ----------------------------------------------------------------------------------------
def update_config(model_dir: Path, world: int, **overrides) -> GRPOConfig:
    """bfloat16 weights, learning rate 1e-6, micro-batches of 2 rows: the job's `ROWS` rows a step."""
    values = dict(
        model=str(model_dir),
        dtype="bfloat16",
        device="cpu",
        learning_rate=1e-6,
        lr_scheduler_type="constant",
        num_generations=4,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=ROWS // world // 2,
        max_steps=STEPS,
        max_completion_length=6,
    )
    return GRPOConfig(**{**values, **overrides})


def fixed_batch() -> RolloutBatch:
    """`ROWS` rows of random prompt (5) and completion (6) tokens with random advantages, the same every call."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(10, 1000, (ROWS, 11), generator=generator, device="cpu").tolist()
    advantages = torch.randn(ROWS, generator=generator, device="cpu")
    return build_batch([r[:5] for r in ids], [r[5:] for r in ids], 0, advantages)


def _update_worker(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    _join(rank, world, port)
    try:
        model = load_model(model_dir, "bfloat16", torch.device("cpu"))
        update = PolicyUpdate(model, None, update_config(Path(model_dir), world, fsdp=True), world)
        part = select_rows(fixed_batch(), torch.arange(rank * ROWS // world, (rank + 1) * ROWS // world))
        for _ in range(STEPS):
            update.optimize(part)
        weights, _, saved = update.full_state()
        # A resumed run: a fresh policy from the bfloat16 file, its shards set from the saved masters.
        fresh = load_model(model_dir, "bfloat16", torch.device("cpu"))
        resumed = PolicyUpdate(fresh, None, update_config(Path(model_dir), world, fsdp=True), world)
        resumed.load_masters(distributed.gather(saved)[0])  # rank 0's, as every rank reads the checkpoint
        restored = resumed.full_state()[2]
        if rank == 0:
            result = {"masters": saved, "weights": weights, "float32_shards": update.float32_shards}
            torch.save({**result, "restored": restored}, out)
    finally:
        distributed.shutdown()


def fsdp_update(model_dir: Path, out: Path) -> dict:
    fork_ranks(_update_worker, (2, free_port(), str(model_dir), str(out)))
    return torch.load(out)


def test_fsdp_float32_shards_learn_what_one_process_with_master_weights_learns(model_dir: Path, tmp_path: Path) -> None:
    """20 AdamW steps of lr 1e-6 on bfloat16 compute: FSDP2's float32 shards end equal (1e-6 relative) to one
    process's float32 master weights on the same micro-batches, and at least 95 % of the weights moved. Without
    master weights the bfloat16 weights keep few of those updates: each is under half a bfloat16 spacing."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each process of the job: the same kernels, the same roundings
    try:
        model = load_model(str(model_dir), "bfloat16", torch.device("cpu"))
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        initial = [p.detach().float().clone() for p in model.parameters() if p.requires_grad]
        single = PolicyUpdate(model, None, update_config(model_dir, 1), 1)
        for _ in range(STEPS):
            single.optimize(fixed_batch())
    finally:
        torch.set_num_threads(threads)
    assert single.masters is not None
    sharded = fsdp_update(model_dir, tmp_path / "masters.pt")
    assert sharded["float32_shards"]
    moved, total = 0, 0
    for name, start, one, two in zip(names, initial, single.masters.copies, sharded["masters"]["masters"], strict=True):
        assert two.dtype == torch.float32, name
        torch.testing.assert_close(two, one, rtol=1e-6, atol=1e-9, msg=name)
        moved += int((two != start).sum())
        total += start.numel()
    assert moved / total >= 0.95, f"only {moved / total:.1%} of the weights moved"
    # The model file holds the shards rounded to bfloat16, as the module computes with them; a resumed run's shards
    # are the saved masters.
    assert all(sharded["weights"][n].dtype == torch.bfloat16 for n in names)
    for saved, restored in zip(sharded["masters"]["masters"], sharded["restored"]["masters"], strict=True):
        assert torch.equal(saved, restored)

    # Without master weights AdamW updates the bfloat16 weights themselves (sharded or not: the same rounding).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = load_model(str(model_dir), "bfloat16", torch.device("cpu"))
        plain = PolicyUpdate(model, None, update_config(model_dir, 1, master_weights=False), 1)
        for _ in range(STEPS):
            plain.optimize(fixed_batch())
    finally:
        torch.set_num_threads(threads)
    assert plain.masters is None
    trained = [p.detach().float() for p in model.parameters() if p.requires_grad]
    kept = sum(int((after != start).sum()) for after, start in zip(trained, initial, strict=True))
    assert kept / total < 0.5, f"{kept / total:.1%} of the bfloat16 weights moved"


# -- rollouts under FSDP2 -----------------------------------------------------------------------------------------
RUNS = (("float32", True), ("float32", False), ("bfloat16", False))  # (dtype, compiled) of the sharded runs
STEPS_OF = 3  # GRPO steps of each run: 3 rollouts, 2 updates between them


def _rollout_worker(rank: int, world: int, port: int, root: str) -> None:
    """`STEPS_OF` GRPO steps of a sharded policy for each of `RUNS`, in turn; writes each run's completions
    per step, the all-gathers counted when each rollout began and at each of its decoding steps, how many calls ran
    compiled, and the addresses of the parameters each rollout computes with; rank 0 also saves those parameters
    (``NAME-weights.pt``: one dict of them per rollout)."""
    import fastgrpo.grpo.trainer as trainer_module
    from fastgrpo.rollout import compiled as compiled_module
    from fastgrpo.rollout.engine import RolloutEngine
    from fastgrpo.training_rollouts import TrainingRollouts

    _join(rank, world, port)
    gathers = [0]
    for name in ("all_gather_single", "all_gather_into_tensor"):  # FSDP2's all-gather, by torch version
        if hasattr(dist, name):
            original = getattr(dist, name)

            def counted(*args, _original=original, **kwargs):
                gathers[0] += 1
                return _original(*args, **kwargs)

            setattr(dist, name, counted)
    calls = [0]
    call = compiled_module.Compiled.__call__

    def counted_call(self, *args):
        calls[0] += self.compiled
        return call(self, *args)

    compiled_module.Compiled.__call__ = counted_call
    rollouts: list[dict] = []
    weights: list[dict[str, torch.Tensor]] = []
    generate, step = TrainingRollouts.generate, RolloutEngine.step

    def recorded_generate(self, *args, **kwargs):
        rollouts.append({"start": gathers[0], "steps": []})
        result = generate(self, *args, **kwargs)
        rollouts[-1]["completions"] = result.completion_ids
        return result

    def recorded_step(self, *args, **kwargs):
        if not rollouts[-1]["steps"]:  # at the first decoding step, as the rollout computes with them
            rollouts[-1]["addresses"] = {n: p.data_ptr() for n, p in self.model.named_parameters()}
            weights.append({n: p.detach().clone() for n, p in self.model.named_parameters()})
        rollouts[-1]["steps"].append(gathers[0])
        return step(self, *args, **kwargs)

    TrainingRollouts.generate, RolloutEngine.step = recorded_generate, recorded_step
    compile_backend = trainer_module.compile_backend
    try:
        for dtype, compiled in RUNS:
            name = f"{dtype}-{'compiled' if compiled else 'eager'}"
            trainer_module.compile_backend = (lambda choice, device: "eager") if compiled else compile_backend
            calls[0] = 0
            rollouts.clear()
            weights.clear()
            history = trainer_module.GRPOTrainer(load_config(Path(root, f"{name}.yaml"))).train()
            graphs = [m.get("compile/graphs", 0.0) for m in history]
            result = {"rollouts": rollouts, "calls": calls[0], "graphs": graphs}
            Path(root, f"{name}-rank{rank}.json").write_text(json.dumps(result))
            if rank == 0:
                torch.save(weights, Path(root, f"{name}-weights.pt"))
    finally:
        distributed.shutdown()


def run_name(dtype: str, compiled: bool) -> str:
    return f"{dtype}-{'compiled' if compiled else 'eager'}"


@pytest.fixture(scope="module")
def sharded_root(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where one two-process job ran each of `RUNS` in turn: ``NAME/`` its output directory, ``NAME-rankR.json``
    what rank R recorded, ``NAME-weights.pt`` the parameters of each of its rollouts on rank 0."""
    root = tmp_path_factory.mktemp("sharded")
    for dtype, compiled in RUNS:
        run_config(
            model_dir,
            root / run_name(dtype, compiled),
            per_device=4,
            dtype=dtype,
            fsdp=True,
            compile="on" if compiled else "off",
            temperature=1.0,
            speculation={"mode": "static", "drafter": "eagle", "nodes": 4, "k_max": 2, "depth": 2},
            max_steps=STEPS_OF,
        )
    fork_ranks(_rollout_worker, (2, free_port(), str(root)))
    return root


@pytest.fixture(scope="module")
def sharded_runs(sharded_root: Path) -> dict[tuple[str, bool], list[dict]]:
    """What each of `RUNS` recorded on each rank."""
    return {
        (dtype, compiled): [
            json.loads((sharded_root / f"{run_name(dtype, compiled)}-rank{r}.json").read_text()) for r in range(2)
        ]
        for dtype, compiled in RUNS
    }


def assert_compiled_and_gathered_once(ranks: list[dict]) -> None:
    """Every decoding step ran compiled, graphs were compiled at the first step, and the parameters were gathered
    before each rollout and never during it."""
    for mine in ranks:
        assert len(mine["rollouts"]) == len(mine["graphs"]) and mine["graphs"][0] > 0
        assert mine["calls"] >= sum(len(r["steps"]) for r in mine["rollouts"])
        for rollout in mine["rollouts"]:
            assert rollout["start"] > 0, "the parameters are gathered before a rollout"
            assert set(rollout["steps"]) == {rollout["start"]}, "no all-gather while decoding"


def test_sharded_rollouts_run_compiled_gather_once_and_emit_what_they_emit_eagerly(sharded_runs) -> None:
    """Three GRPO steps of a float32 policy under FSDP2, the decoding steps compiled (plain and EAGLE-tree, AOT's
    trace): every decoding step runs compiled, nothing compiles after the first rollout, the parameters are gathered
    before a rollout and never in it, and the completions are the eager steps', step for step."""
    compiled, eager = sharded_runs["float32", True], sharded_runs["float32", False]
    assert_compiled_and_gathered_once(compiled)
    for mine, theirs in zip(compiled, eager, strict=True):
        assert not any(mine["graphs"][1:]) and theirs["calls"] == 0
        assert [r["completions"] for r in mine["rollouts"]] == [r["completions"] for r in theirs["rollouts"]]


def test_sharded_rollouts_compute_with_the_policys_weights_at_the_same_addresses(
    model_dir: Path, sharded_root: Path, sharded_runs
) -> None:
    """Three rollouts of a bfloat16 policy under FSDP2 (float32 shards) with two policy updates between them, and of
    the float32 one compiled: every parameter a rollout computes with is at the same address in every rollout on each
    rank (a captured CUDA graph replays them there), and the bfloat16 parameters hold the policy's weights of that
    step, rounded to bfloat16 as FSDP2 gathers them: the model file of the start for the first rollout, the
    checkpoint after step 2 for the third."""
    for mine in sharded_runs["bfloat16", False] + sharded_runs["float32", True]:
        addresses = [r["addresses"] for r in mine["rollouts"]]
        assert len(addresses) == 3 and addresses[0]
        for later in addresses[1:]:
            moved = [name for name in addresses[0] if later[name] != addresses[0][name]]
            assert not moved, f"{len(moved)} of {len(addresses[0])} parameters at new addresses: {moved[:3]}"
    first, _, third = torch.load(sharded_root / "bfloat16-eager-weights.pt")
    for rollout, file in ((first, model_dir), (third, sharded_root / "bfloat16-eager" / "checkpoint-2")):
        saved = load_file(str(file / "model.safetensors"))
        assert rollout.keys() <= saved.keys()
        for name, weight in rollout.items():
            assert weight.dtype == torch.bfloat16 and torch.equal(weight, saved[name].to(torch.bfloat16)), name
    assert any(not torch.equal(first[n], third[n]) for n in first), "the updates should move the weights"


# -- one process: master-weight write-backs and LoRA merges -------------------------------------------------------
@pytest.mark.parametrize("use_peft", [False, True], ids=["float32-masters", "lora"])
def test_one_process_rollouts_compute_with_the_same_tensors_after_updates(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, use_peft: bool
) -> None:
    """Three GRPO steps of a bfloat16 policy in one process: whether AdamW updates float32 master weights that are
    written back into the module's bfloat16 weights, or LoRA adapters that each rollout merges into them (and that
    are restored from a copy after it), every parameter a rollout computes with is at the same address in every
    rollout, and holds other values after the updates."""
    from fastgrpo.grpo.trainer import GRPOTrainer
    from fastgrpo.rollout.engine import RolloutEngine
    from fastgrpo.training_rollouts import TrainingRollouts

    seen: list[dict[str, tuple[int, torch.Tensor]]] = []
    generate, step = TrainingRollouts.generate, RolloutEngine.step

    def recorded_generate(self, *args, **kwargs):
        seen.append({})
        return generate(self, *args, **kwargs)

    def recorded_step(self, *args, **kwargs):
        if not seen[-1]:  # at the first decoding step, adapters merged
            seen[-1].update({n: (p.data_ptr(), p.detach().clone()) for n, p in self.model.named_parameters()})
        return step(self, *args, **kwargs)

    monkeypatch.setattr(TrainingRollouts, "generate", recorded_generate)
    monkeypatch.setattr(RolloutEngine, "step", recorded_step)
    options = dict(dtype="bfloat16", use_peft=use_peft, max_steps=3, speculation={"mode": "off"})
    config = run_config(model_dir, tmp_path / "run", per_device=8, **options)
    GRPOTrainer(config).train()
    assert len(seen) == 3
    first, *later = seen
    for rollout in later:
        moved = [name for name in first if rollout[name][0] != first[name][0]]
        assert not moved, f"{len(moved)} of {len(first)} parameters at new addresses: {moved[:3]}"
    assert any(not torch.equal(first[n][1], seen[-1][n][1]) for n in first), "the updates should move the weights"
