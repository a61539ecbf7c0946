"""Asynchronous GRPO (`rollout_processes`, gloo, CPU): a rollout process and a training process train exactly what one
synchronous process trains when no sample may be stale, keep every sample within ``max_staleness`` when either side
is slow, and take new weights into rows in flight; a stale sample is dropped and counted, a silent or failing rollout
process is named."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import yaml
from conftest import fork_ranks, free_port, make_tiny_model, save_tiny_llama
from safetensors.torch import load_file
from transformers import LlamaConfig

from fastgrpo import distributed
from fastgrpo.config import load_config
from fastgrpo.device_memory import synchronized
from fastgrpo.errors import Terminated
from fastgrpo.grpo import pipeline
from fastgrpo.grpo.generation import Produced
from fastgrpo.grpo.mailbox import Mailbox
from fastgrpo.grpo.pipeline import RolloutFeed, token_lags, version_runs
from fastgrpo.grpo.rollout_process import InFlight, RolloutProcess
from fastgrpo.grpo.run_dir import checkpoint_bytes
from fastgrpo.grpo.trainer import GRPOTrainer
from fastgrpo.grpo.weight_sync import check_same_parameters, synced_parameters
from fastgrpo.rollout.sequence import Generation as Call
from fastgrpo.speculative.plugin import LEARNERS

STEPS = 3
MERGED: list[bool] = []  # in a rollout process held for weights: whether its call ran with LoRA adapters merged


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"), seed=0, tie_word_embeddings=True)


def write_config(model_dir: Path, out: Path, **overrides) -> Path:
    """``STEPS`` steps of 2 prompts x 4 completions in float64, 12 tokens at most, sampled at temperature 1."""
    values = dict(
        model=str(model_dir),
        dtype="float64",
        dataset={"num_examples": 32},
        reward_funcs=["distributed_rewards:length_reward"],
        num_generations=4,
        per_device_train_batch_size=8,
        max_completion_length=12,
        learning_rate=1e-3,
        max_steps=STEPS,
        save_steps=STEPS,
        output_dir=str(out),
        progress_bar=False,
        logging_steps=1,
        gradient_checkpointing=False,
        device="cpu",
        ddp_timeout=120,
    )
    values.update(overrides)
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def _train(rank: int, world: int, port: int, config: str, slow: str) -> None:
    """One process of the job (``world`` 1: alone, without torchrun); ``slow``: ``update`` holds each optimizer step
    of the training process until the rollout process has sent the generation after it; ``decoding`` holds
    generation 1 of the rollout process, once it has begun and generation 0 was sent, until the update's first weights
    come (neither leaves it to the clock)."""
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
        os.environ["LOCAL_RANK"] = str(rank)
    if slow == "update":
        before = RolloutFeed.before_update

        def before_update(self: RolloutFeed) -> None:
            deadline = time.monotonic() + 60
            with self.ready:
                while self.version < STEPS and self.next not in self.items and time.monotonic() < deadline:
                    self.ready.wait(0.05)
            before(self)

        RolloutFeed.before_update = before_update
    elif slow == "decoding":
        between = RolloutProcess._between_steps

        def between_steps(self: RolloutProcess, call: Call | None) -> None:
            oldest = self.flight[0] if self.flight else None
            begun = oldest is not None and any(s.completion_ids for s in oldest.seqs)
            if call is not None and begun and oldest.generation == 1 and not oldest.marks:
                deadline = time.monotonic() + 60  # generation 1 begun, and 0 sent: wait for the update's weights
                while not oldest.marks and time.monotonic() < deadline:
                    if not self._poll():
                        time.sleep(0.005)
                assert oldest.marks, "the update's first weights did not come within 60 s"
                MERGED.append(bool(self.trainer.rollouts.engine.merged))
            between(self, call)

        RolloutProcess._between_steps = between_steps
    try:
        trainer = GRPOTrainer(load_config(config))
        if trainer.config.fsdp and not trainer.dist.rollout:  # the training processes hold shards
            assert distributed.is_sharded(trainer.update.policy)
        trainer.train()
        if trainer.config.use_peft and trainer.feed is not None:  # the adapters alone travel
            sent = {p.data_ptr() for p in trainer.feed.weights.tensors}
            assert sent == {p.data_ptr() for n, p in trainer.model.named_parameters() if "lora_" in n}
        if trainer.config.use_peft and trainer.dist.rollout:  # and are received into the adapters
            received = {p.data_ptr() for p in synced_parameters(trainer.model)}
            assert received == {p.data_ptr() for n, p in trainer.model.named_parameters() if "lora_" in n}
        if trainer.dist.rollout and trainer.config.use_peft and slow == "decoding":  # merged while weights came
            assert MERGED and all(MERGED), MERGED  # and taken apart for them: the base ends as it began
            model = trainer.model.get_base_model().state_dict()
            base = {k.replace(".base_layer", ""): v for k, v in model.items() if "lora_" not in k}
            initial = load_file(str(Path(trainer.config.model) / "model.safetensors"))
            assert all(torch.allclose(base[k], v.to(base[k].dtype), rtol=0, atol=1e-12) for k, v in initial.items())
        del trainer
    finally:
        distributed.shutdown()


def run(model_dir: Path, root: Path, processes: int, slow: str = "", trainers: int = 1, **overrides) -> list[dict]:
    """A run of ``processes`` processes: ``trainers`` training processes (DDP) and the others rollout processes; its
    logged steps."""
    out = root / "run"
    if processes > trainers:
        overrides["rollout_processes"] = processes - trainers
    config = write_config(model_dir, out, **overrides)
    fork_ranks(_train, (processes, free_port(), str(config), slow), nprocs=processes)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def synchronous(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sync")
    run(model_dir, root, 1)
    return root / "run"


def test_max_staleness_0_trains_exactly_what_one_synchronous_process_trains(
    model_dir: Path, synchronous: Path, tmp_path: Path
) -> None:
    logged = run(model_dir, tmp_path, 2, max_staleness=0)
    expected = [json.loads(line) for line in (synchronous / "metrics.jsonl").read_text().splitlines()]
    assert [m["reward"] for m in logged] == [m["reward"] for m in expected]
    assert [m["loss"] for m in logged] == [m["loss"] for m in expected]
    assert all(m["async/staleness"] == 0 and m["async/dropped_samples"] == 0 for m in logged)
    assert all(m["async/overlapped_step_share"] == 0 for m in logged), "no generation may begin before it is due"
    one = load_file(str(synchronous / f"checkpoint-{STEPS}" / "model.safetensors"))
    two = load_file(str(tmp_path / "run" / f"checkpoint-{STEPS}" / "model.safetensors"))
    initial = load_file(str(model_dir / "model.safetensors"))
    assert any(not torch.equal(one[k], initial[k]) for k in one), "the updates should move the weights"
    assert all(torch.equal(one[k], two[k]) for k in one)


def test_two_training_processes_with_a_rollout_process_train_what_two_synchronous_processes_train(
    model_dir: Path, tmp_path: Path
) -> None:
    """Two training processes (DDP, or FSDP2: gathered whole at each sync for rank 0 to send) and a rollout process
    that makes each generation for both, a share each (the prompts and uniforms each would have sampled itself): with
    no sample stale, the rewards, losses and weights of two synchronous processes; and at max_staleness 1, every
    sample within the bound, on both, here sharded in bfloat16 over float32 master shards (sent in bfloat16). Step 1
    trains nothing (its rewards are all equal), so FSDP2's root unit keeps the parameters its forward gathered
    registered in place of its shards at the first weight sync."""
    for name in ("sync", "async", "fsdp", "stale"):
        (tmp_path / name).mkdir()
    flat_first = {"reward_funcs": ["distributed_rewards:length_reward_after_step_1"]}
    expected = run(model_dir, tmp_path / "sync", 2, trainers=2, **flat_first)
    assert expected[0]["reward"] == 0 and expected[1]["reward"] > 0
    one = load_file(str(tmp_path / "sync" / "run" / f"checkpoint-{STEPS}" / "model.safetensors"))
    for name, sharded in (("async", False), ("fsdp", True)):
        logged = run(model_dir, tmp_path / name, 3, trainers=2, max_staleness=0, fsdp=sharded, **flat_first)
        assert [m["reward"] for m in logged] == [m["reward"] for m in expected], name
        assert [m["completions/mean_length"] for m in logged] == pytest.approx(
            [m["completions/mean_length"] for m in expected]
        )
        assert [m["num_tokens"] for m in logged] == [m["num_tokens"] for m in expected]
        torch.testing.assert_close([m["loss"] for m in logged], [m["loss"] for m in expected], rtol=0, atol=1e-12)
        two = load_file(str(tmp_path / name / "run" / f"checkpoint-{STEPS}" / "model.safetensors"))
        assert all(torch.allclose(one[k], two[k], rtol=0, atol=1e-12) for k in one), name
    options = {"fsdp": True, "dtype": "bfloat16", "master_weights": True, "max_inflight_tasks": 12}
    stale = run(model_dir, tmp_path / "stale", 3, trainers=2, max_staleness=1, **options)
    assert all(m["async/staleness"] <= 1 and m["async/token_lag/max"] <= 1 for m in stale)
    assert all(m["async/dropped_samples"] == 0 for m in stale), "none sampled past the bound"
    assert [m["step"] for m in stale] == list(range(1, STEPS + 1))


def test_lora_adapters_alone_travel_and_max_staleness_0_trains_what_one_process_trains(
    model_dir: Path, tmp_path: Path
) -> None:
    """A LoRA run: the training process sends its adapters alone (the base weights are the same everywhere), and
    with no sample stale the rollout process samples what one synchronous process samples."""
    lora = {"use_peft": True, "lora_r": 4}
    (tmp_path / "async").mkdir()
    (tmp_path / "sync").mkdir()
    logged = run(model_dir, tmp_path / "async", 2, max_staleness=0, **lora)
    expected = run(model_dir, tmp_path / "sync", 1, **lora)
    assert [m["reward"] for m in logged] == [m["reward"] for m in expected]
    assert [m["loss"] for m in logged] == [m["loss"] for m in expected]
    one, two = (
        load_file(str(tmp_path / name / "run" / f"checkpoint-{STEPS}" / "adapter_model.safetensors"))
        for name in ("sync", "async")
    )
    assert any(v.abs().max() > 0 for k, v in one.items() if "lora_B" in k), "the adapters learnt"
    # up to rounding: a synchronous process merges the adapters into its base weights for each rollout and subtracts
    # them again, which leaves the last bits of float64 for its update to compute with
    assert all(torch.allclose(one[k], two[k], rtol=0, atol=1e-12) for k in one)


def test_a_slow_trainer_keeps_every_sample_within_max_staleness(model_dir: Path, tmp_path: Path) -> None:
    """The rollout process runs ahead while the update waits, as far as the bound lets it: the samples come one step
    stale, none more, and none is dropped. Six of a generation's eight completions decode at once: generation 1 is
    due at once, so it takes the rows of generation 0's first six as they end, beside its last two, in the same
    engine call."""
    options = {"max_staleness": 1, "importance_sampling_correction": True, "max_inflight_tasks": 6}
    logged = run(model_dir, tmp_path, 2, slow="update", **options)
    staleness = [m["async/staleness"] for m in logged]
    assert staleness == [0, 1, 1], staleness
    assert all(m["async/dropped_samples"] == 0 for m in logged)
    assert all(m["async/token_lag/max"] <= 1 for m in logged)
    assert logged[0]["async/overlapped_step_share"] > 0
    # the checkpoint holds the drafters of the rollout process, which learnt from every generation (rank 0's made none)
    learners = torch.load(tmp_path / "run" / f"checkpoint-{STEPS}" / "draft" / "learners.pt", weights_only=True)
    assert learners["suffix"]["calls"] >= STEPS and learners["suffix"]["prompts"]


def test_generations_whose_completions_end_in_the_prefill_are_sent(model_dir: Path, tmp_path: Path) -> None:
    """One token per completion: every generation of the rollout process's call ends as it is taken in, and each is
    sent all the same."""
    logged = run(model_dir, tmp_path, 2, max_staleness=1, max_completion_length=1)
    assert [m["step"] for m in logged] == list(range(1, STEPS + 1))
    assert all(m["completions/mean_length"] == 1 for m in logged)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_rows_in_flight_take_new_weights_between_decoding_steps(model_dir: Path, tmp_path: Path, lora: bool) -> None:
    """The trainer's weights come while generation 1 decodes: its rows go on with them, so its tokens are of two
    versions (their mean lag below the oldest's), and suffix trees verify them as plain steps would. With LoRA the
    adapters alone come, taken apart from the base weights the rollout merged them into and merged again: the base
    weights end as they began."""
    logged = run(
        model_dir,
        tmp_path,
        2,
        slow="decoding",
        max_staleness=2,
        speculation={"mode": "static", "drafter": "suffix", "nodes": 4},
        **({"use_peft": True, "lora_r": 4} if lora else {}),
    )
    assert all(m["async/staleness"] <= 2 for m in logged)
    lags = [(m["async/staleness"], m["async/token_lag/mean"]) for m in logged]
    assert lags[1][0] == 1 and 0 < lags[1][1] < 1, lags  # generation 1: versions 0 and 1


def test_version_runs_and_token_lags() -> None:
    # two rows; weights 6 came when the rows held 3 and 5 tokens, weights 7 when they held 4 and 5 (the second ended)
    runs = version_runs(5, [(6, [3, 5]), (7, [4, 5])], [6, 5])
    assert runs == [[(0, 5), (3, 6), (4, 7)], [(0, 5)]]
    assert token_lags(runs, [6, 5], 7) == [2, 2, 2, 1, 0, 0, 2, 2, 2, 2, 2]
    assert version_runs(5, [(6, [0, 0])], [2, 2]) == [[(0, 6)], [(0, 6)]]  # weights taken before the first step


def test_a_sample_past_max_staleness_is_dropped_and_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    told = []
    feed = RolloutFeed.__new__(RolloutFeed)
    feed.cfg = load_config(None, ["--max_staleness=1", "--rollout_processes=1"])
    feed.version, feed.next, feed.dropped, feed.error = 5, 2, 0, None
    feed.figures = dict.fromkeys(("async/trainer_wait_seconds", "async/dropped_samples"), 0.0)
    feed.ready, feed.thread = pipeline.threading.Condition(), pipeline.threading.current_thread()
    monkeypatch.setattr(feed, "_tell", lambda kind: told.append((kind, feed.next, feed.dropped)))
    batch = type("Batch", (), {"completion_mask": torch.ones(2, 3)})()
    feed.items = {
        2: Produced(2, batch, {}, [], [3, 3], [[(0, 3)], [(0, 3)]], oldest=3),  # two steps stale: dropped
        3: Produced(3, batch, {}, [], [3, 3], [[(0, 4), (1, 5)], [(0, 4)]], oldest=4),
    }
    taken = feed.take()
    assert taken.generation == 3 and feed.next == 4 and feed.dropped == 1
    assert told == [(pipeline.PROGRESS, 3, 1), (pipeline.PROGRESS, 4, 1)]  # the rollout processes learn of each
    assert taken.metrics["async/dropped_samples"] == 2 and taken.metrics["async/staleness"] == 1
    assert taken.metrics["async/token_lag/mean"] == pytest.approx(4 / 6)


def _job(rank: int, world: int, port: int, config: str, errors: str, resume: bool, dies: bool, stale: int) -> None:
    """A process of a ``world``-process job (``dies``: its rollout process dies as generation 2 begins; ``stale``:
    the first row of generation ``stale`` comes as if sampled 10 steps before the run began, so that the generation
    is dropped, every share of it by its training process, the first row's or not); a failed process writes
    its error to ``errors``, the training process the generations it trained to ``errors`` with the suffix
    ``.taken``, a resumed rollout process the prompts its suffix drafter remembers to the suffix ``.memory{rank}``."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    part, produce, finished, take = (
        RolloutProcess._part,
        RolloutProcess._produce,
        RolloutProcess._finished,
        RolloutFeed.take,
    )

    def dying_part(self: RolloutProcess, g: int) -> InFlight:  # (generations of a call that spans them)
        if g == 2:
            os._exit(3)
        return part(self, g)

    def dying(self: RolloutProcess, g: int) -> Produced:  # (generations of a call each)
        if g == 2:
            os._exit(3)
        return produce(self, g)

    def staled(self: RolloutProcess, produced: Produced, flight: InFlight) -> Produced:
        produced = finished(self, produced, flight)
        if produced.generation == stale:
            produced.versions[0] = [(0, -10)]
        return produced

    def taking(self: RolloutFeed) -> Produced:
        produced = take(self)
        with Path(errors).with_suffix(".taken").open("a") as f:
            f.write(f"{produced.generation}\n")
        return produced

    if dies:
        RolloutProcess._part, RolloutProcess._produce = dying_part, dying
    RolloutProcess._finished, RolloutFeed.take = staled, taking
    try:
        trainer = GRPOTrainer(load_config(config), resume=resume)
        suffix = trainer.rollouts.drafter("suffix")
        if resume and trainer.dist.rollout and suffix is not None:
            prompts = sorted(prompt for prompt, *_ in suffix.learner.state_dict()["prompts"])
            Path(errors).with_suffix(f".memory{rank}").write_text(json.dumps(prompts))
        trainer.train()
        del trainer
    except Exception as e:
        Path(errors).with_suffix(f".{rank}").write_text(str(e))
        os._exit(1)
    finally:
        distributed.shutdown()


def job(
    config: Path, errors: Path, resume: bool = False, dies: bool = False, stale: int = -1, world: int = 2
) -> list[int | None]:
    """The exit codes of a ``world``-process job of ``config`` (see `_job`), each process forked and awaited alone."""
    port, context = free_port(), torch.multiprocessing.get_context("fork")
    args = (world, port, str(config), str(errors), resume, dies, stale)
    ranks = [context.Process(target=_job, args=(r, *args)) for r in range(world)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(120)
    return [process.exitcode for process in ranks]


def test_a_rollout_process_that_dies_is_named_and_the_run_resumes(
    model_dir: Path, synchronous: Path, tmp_path: Path
) -> None:
    """The training process names the dead rollout process within the heartbeat and the latest complete checkpoint;
    the run resumed goes on from it and ends where the uninterrupted synchronous run ends (no sample trained twice)."""
    config = write_config(
        model_dir, tmp_path / "run", rollout_processes=1, max_staleness=0, save_steps=1, heartbeat_stale_after_s=3
    )
    errors = tmp_path / "error"
    assert job(config, errors, dies=True) == [1, 3]
    message = errors.with_suffix(".0").read_text()
    assert re.fullmatch(r"rollout process rank 1: sent nothing for \d+ s \(heartbeat_stale_after_s 3\).*", message)
    # checkpoint-2 is complete unless the process died before writing its drafters into it
    saved = sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*"))
    assert saved in (["checkpoint-1"], ["checkpoint-1", "checkpoint-2"]), saved
    assert message.endswith(f"the run stops (continue from {tmp_path / 'run' / saved[-1]} with --resume)")
    assert job(config, errors, resume=True) == [0, 0]
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == [1, 2, 3]
    one = load_file(str(synchronous / f"checkpoint-{STEPS}" / "model.safetensors"))
    two = load_file(str(tmp_path / "run" / f"checkpoint-{STEPS}" / "model.safetensors"))
    assert all(torch.equal(one[k], two[k]) for k in one)


def test_a_resumed_run_trains_no_generation_twice_and_each_rollout_process_keeps_its_drafters(
    model_dir: Path, tmp_path: Path
) -> None:
    """Two rollout processes with suffix drafters; generation 1 is dropped, so the run trains generations 0 and 2,
    saving after each step with each rollout process's drafters (learnt from its own generations: 0 and 2, 1 and 3).
    Resumed from its checkpoint, it goes on with generation 3 (not 2 again), and each rollout process drafts from its
    own memory."""
    options = dict(
        rollout_processes=2, max_staleness=0, save_steps=1, speculation={"mode": "static", "drafter": "suffix"}
    )
    errors, run_dir = tmp_path / "error", tmp_path / "run"
    assert job(write_config(model_dir, run_dir, max_steps=2, **options), errors, stale=1, world=3) == [0, 0, 0]
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["async/dropped_samples"] for m in logged] == [0, 8]
    saved = run_dir / "checkpoint-2"
    assert torch.load(saved / "trainer_state.pt", weights_only=False)["generations_dropped"] == 1
    memories = {
        rank: sorted(p for p, *_ in torch.load(saved / folder / LEARNERS)["suffix"]["prompts"])
        for rank, folder in ((1, "draft"), (2, "draft-rank2"))
    }
    assert memories[1] != memories[2]
    assert job(write_config(model_dir, run_dir, max_steps=3, **options), errors, resume=True, world=3) == [0, 0, 0]
    assert (tmp_path / "error.taken").read_text().split() == ["0", "2", "3"]
    for rank, prompts in memories.items():
        assert json.loads(errors.with_suffix(f".memory{rank}").read_text()) == prompts


def test_two_training_processes_drop_the_same_generation_and_resume_after_it(model_dir: Path, tmp_path: Path) -> None:
    """Two training processes and a rollout process; generation 1 comes stale: both drop their shares of it (each
    carries the generation's oldest weights), the drops are the job's sum, and the run trains generations 0 and 2.
    Resumed from its checkpoint (the rollout process compares the options of one process of the joint batch), it
    goes on with generation 3 on both."""
    options = dict(rollout_processes=1, max_staleness=0, save_steps=1)
    errors, run_dir = tmp_path / "error", tmp_path / "run"
    assert job(write_config(model_dir, run_dir, max_steps=2, **options), errors, stale=1, world=3) == [0, 0, 0]
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["async/dropped_samples"] for m in logged] == [0, 16]
    assert job(write_config(model_dir, run_dir, max_steps=3, **options), errors, resume=True, world=3) == [0, 0, 0]
    assert sorted((tmp_path / "error.taken").read_text().split()) == ["0", "0", "2", "2", "3", "3"]


def test_a_share_holds_the_rows_a_training_process_would_have_sampled() -> None:
    """Rows ``r * n`` to ``(r + 1) * n`` of a generation, trimmed to their own widths, their lengths, weight versions
    and samples; the generation's metrics with the first share alone."""
    from fastgrpo.grpo.batch import build_batch
    from fastgrpo.grpo.rollout_process import share

    prompts, completions = [[1, 2, 3]] * 2 + [[4]] * 2, [[5] * 6, [6], [7, 8], [9]]
    batch = build_batch(prompts, completions, 0, torch.arange(4.0), [[0.5] * len(c) for c in completions])
    versions = [[(0, 3)], [(0, 3), (1, 4)], [(0, 4)], [(0, 4)]]
    produced = Produced(7, batch, {"reward": 1.0}, ["a", "b", "c", "d"], [6, 1, 2, 1], versions, oldest=3)
    first, second = share(produced, 0, 2), share(produced, 1, 2)
    assert first.metrics == {"reward": 1.0} and second.metrics == {}
    assert (first.samples, second.samples) == (["a", "b"], ["c", "d"])
    assert second.lengths == [2, 1] and second.versions == versions[2:] and second.oldest == 3
    assert second.batch.input_ids.tolist() == [[4, 7, 8], [4, 9, 0]]  # one prompt column, two completion columns
    assert second.batch.advantages.tolist() == [2.0, 3.0] and first.batch.completion_mask.shape == (2, 6)


@contextmanager
def gloo_group(rank: int, world: int, port: int) -> Iterator[torch.distributed.ProcessGroup]:
    """A forked process's default gloo group of ``world`` processes on ``port``, destroyed when the block ends."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        yield torch.distributed.group.WORLD
    finally:
        torch.distributed.destroy_process_group()


def _mailboxes(rank: int, port: int, out: str) -> None:
    with gloo_group(rank, 2, port) as group:
        first = Mailbox("down/1", Mailbox.session(group))
        if rank == 0:
            first.post(pipeline.STOP)
            assert first.poll() == [(pipeline.STOP, 0, 0, 0, "")]
            # a pipeline rank 0 began alone, as in a `train` call the other process left before its own
            torch.distributed.distributed_c10d._get_default_store().add("fastgrpo/pipeline/sessions", 1)
        torch.distributed.barrier()
        second = Mailbox("down/1", Mailbox.session(group))  # a later `train` call's
        assert second.poll() == []
        torch.distributed.barrier()
        if rank == 1:
            second.post(pipeline.PROGRESS, 1, 2, 3)
            assert second.poll() == [(pipeline.PROGRESS, 1, 2, 3, "")]
        Path(f"{out}.{rank}").write_text(str(Mailbox.session(group)))


def test_the_mailboxes_of_a_later_train_call_start_empty_and_every_process_reads_the_same(tmp_path: Path) -> None:
    fork_ranks(_mailboxes, (free_port(), str(tmp_path / "session")), nprocs=2)
    assert (tmp_path / "session.0").read_text() == (tmp_path / "session.1").read_text() == "4"


def _compared(rank: int, world: int, port: int, case: str, out: str) -> None:
    """Rank 0 (the training process) and the rollout processes compare their trained parameters: the same (``same``),
    one frozen on the training process alone (``frozen``) or on the last rollout process alone (``rollout-frozen``),
    or another dtype there (``dtype``); each writes the error it raised, or nothing."""
    with gloo_group(rank, world, port) as group:
        model = make_tiny_model("llama")
        if (case == "frozen" and rank == 0) or (case == "rollout-frozen" and rank == world - 1):
            model.model.layers[1].mlp.up_proj.weight.requires_grad_(False)
        if case == "dtype" and rank == world - 1:
            model.float()
        try:
            check_same_parameters(model, group)
            Path(f"{out}.{rank}").write_text("")
        except ValueError as e:
            Path(f"{out}.{rank}").write_text(str(e))


@pytest.mark.parametrize(
    ("case", "world", "error"),
    [
        ("same", 2, ""),
        (
            "frozen",
            2,
            "rank 1 trains model.layers.1.mlp.up_proj.weight, which rank 0 does not (frozen there, or no such "
            "parameter); every process must train the same parameters, frozen before training starts",
        ),
        (
            "rollout-frozen",
            3,
            "rank 0 trains model.layers.1.mlp.up_proj.weight, which rank 2 does not (frozen there, or no such "
            "parameter); every process must train the same parameters, frozen before training starts",
        ),
        (
            "dtype",
            2,
            "model.embed_tokens.weight is [128, 32] float64 on rank 0 but [128, 32] float32 on rank 1; every "
            "process must load the same model in the same dtype",
        ),
    ],
)
def test_every_process_refuses_parameters_the_other_side_does_not_train_alike(
    tmp_path: Path, case: str, world: int, error: str
) -> None:
    """The weights travel as bare tensors in order: before any is sent, every process refuses, with the same line, a
    parameter trained on one side only or held in another dtype (which would land in the wrong tensor); with two
    rollout processes, the one that differs is named to all, the other one's agreement notwithstanding."""
    fork_ranks(_compared, (world, free_port(), case, str(tmp_path / "error")), nprocs=world)
    expected = f"rollout_processes: {error}" if error else ""
    assert [(tmp_path / f"error.{rank}").read_text() for rank in range(world)] == [expected] * world


def test_a_rollout_process_that_fails_is_named(model_dir: Path, tmp_path: Path) -> None:
    config = write_config(
        model_dir, tmp_path / "run", rollout_processes=1, reward_funcs=["distributed_rewards:fail_on_rank_1"]
    )
    assert job(config, tmp_path / "error") == [1, 1]
    message = (tmp_path / "error.0").read_text()
    assert message.startswith("rollout process rank 1: failed: ") and "reward function failed on rank 1" in message


@pytest.mark.parametrize(
    ("options", "error"),
    [
        (["--rollout_processes=1", "--max_staleness=1", "--weight_sync_steps=3"], "weight_sync_steps (3) must be at"),
        (["--rollout_processes=1", "--queue_maxsize=4"], "queue_maxsize (4) must hold the 8 completions"),
        (["--max_staleness=2"], "max_staleness has no effect with rollout_processes 0"),
    ],
)
def test_asynchronous_options_are_checked(options: list[str], error: str) -> None:
    with pytest.raises(ValueError, match=error.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, options)


def test_rollout_processes_need_their_processes() -> None:
    with pytest.raises(ValueError, match="need a training process besides: start at least 3 processes with torchrun"):
        distributed.init("cpu", 60, rollout_processes=2)


def test_timings_wait_on_the_compute_stream_not_on_weights_leaving(monkeypatch: pytest.MonkeyPatch) -> None:
    """The training process's timings wait on its current stream only, not on NCCL's sends of weights in flight."""
    waited = []
    stream = type("Stream", (), {"synchronize": lambda self: waited.append("stream")})()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append("device"))
    synchronized(torch.device("cuda", 0))
    assert waited == ["stream"]


def test_weights_that_cannot_leave_for_a_dead_rollout_process_stop_the_run_once_it_is_named(tmp_path: Path) -> None:
    """A send to a rollout process that died never completes: the update's wait ends as soon as the process is named
    (not at the process group's timeout), with the run's one-line error. Where rank 0 sends copies (FSDP2), the update
    does not wait for them."""
    feed = bare_feed(tmp_path)
    stuck = type("Work", (), {"wait": lambda self: pipeline.threading.Event().wait(10)})()  # (never completes)
    feed.sending = [(1, stuck)]
    feed.weights = type("Weights", (), {"copies": True})()
    feed.before_update()
    assert feed.sending == [(1, stuck)]
    feed.weights.copies = False  # the parameters themselves are being sent
    pipeline.threading.Timer(0.05, lambda: setattr(feed, "error", "rollout process rank 1: sent nothing")).start()
    with pytest.raises(pipeline.RolloutFailed, match="^rollout process rank 1: sent nothing; the run stops"):
        feed.before_update()


GLOO_CLOSED = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:40338. This is typically caused by a remote worker crashing."
)


def test_weights_whose_send_fails_name_the_rollout_process_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gloo fails a send to a process that died, when it is issued or while it waits: the run stops at once, naming
    the process it went to, with the run's one-line error."""
    named = (
        "^rollout process rank 2: weights could not be sent to it \\(Connection closed by peer \\[127.0.0.1\\]:40338\\)"
    )
    feed = bare_feed(tmp_path)
    done = type("Work", (), {"wait": lambda self: None})()
    failing = type("Work", (), {"wait": lambda self: (_ for _ in ()).throw(RuntimeError(GLOO_CLOSED))})()
    feed.sending, feed.weights = [(1, done), (2, failing)], type("Weights", (), {"copies": False})()
    with pytest.raises(pipeline.RolloutFailed, match=named + "; the run stops \\(no checkpoint was written yet\\)$"):
        feed.before_update()
    assert feed.error.startswith("rollout process rank 2: ")

    def isend(tensor: torch.Tensor, rank: int, tag: int) -> None:
        raise RuntimeError(GLOO_CLOSED)

    feed = bare_feed(tmp_path)
    feed.cfg = load_config(None, ["--rollout_processes=2", f"--output_dir={tmp_path}"])
    feed.main, feed.ranks, feed.down, feed.sending = True, [2, 3], {}, []
    feed.weights = type("Weights", (), {"copies": False, "tensors": [torch.zeros(2)], "gather": lambda self: None})()
    monkeypatch.setattr(pipeline.dist, "isend", isend)
    with pytest.raises(pipeline.RolloutFailed, match=named):
        feed.after_step(1)


@pytest.mark.parametrize("cause", ["error", "error, the store gone while it waits", "signal"])
def test_a_rollout_process_whose_training_processes_are_gone_stops_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cause: str
) -> None:
    """The job's store fails (it is rank 0's, or the first machine's torchrun agent's, gone with the training
    processes) as the rollout process posts its error: an error in the rollout process becomes the run's one-line
    error saying so; a signal (a launcher's SIGTERM) ends it as it would have, not as the store's error. Posted, the
    error is the process's own once the store goes while it waits to be named (rank 0 may end on hearing of it)."""

    class Store:
        def post(self, *args: object, **kwargs: object) -> None:
            if cause != "error, the store gone while it waits":
                raise torch.distributed.DistNetworkError("Broken pipe")

        def poll(self) -> list:
            raise torch.distributed.DistNetworkError("Broken pipe")

    def fail(g: int) -> None:
        raise Terminated if cause == "signal" else torch.distributed.DistNetworkError("Connection reset by peer")

    process = RolloutProcess.__new__(RolloutProcess)
    process.cfg = load_config(None, ["--rollout_processes=1", f"--output_dir={tmp_path}"])
    process.trainer = type("Trainer", (), {"rollouts": type("Rollouts", (), {})()})()
    process.next, process.index, process.count, process.done = 0, 0, 1, pipeline.threading.Event()
    process.step_began = None
    process.up, process.down, process.boxes, process._wait_until_due = Store(), Store(), [Store()], fail
    monkeypatch.setattr(pipeline.dist, "get_rank", lambda group=None: 1)
    if cause == "signal":
        with pytest.raises(Terminated):
            process.run()
    elif cause == "error, the store gone while it waits":
        with pytest.raises(torch.distributed.DistNetworkError, match="^Connection reset by peer$"):
            process.run()
    else:
        gone = (
            "^rollout process rank 1: the training processes are gone \\(Broken pipe\\); the run stops \\(no checkpoint"
        )
        with pytest.raises(pipeline.RolloutFailed, match=gone):
            process.run()


def bare_feed(tmp_path: Path) -> RolloutFeed:
    """A feed of one rollout process without its process group or thread: its waits and error alone."""
    feed = RolloutFeed.__new__(RolloutFeed)
    feed.cfg = load_config(None, ["--rollout_processes=1", f"--output_dir={tmp_path}"])
    feed.figures, feed.error, feed.ready = {"async/weight_send_seconds": 0.0}, None, pipeline.threading.Condition()
    return feed


def test_a_checkpoint_is_sized_with_every_rollout_process_drafters() -> None:
    shape = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=1000)  # fmt: skip
    off, one, two = (
        checkpoint_bytes(load_config(None, options), shape, torch.device("cpu"))
        for options in (["--speculation.mode=off"], [], ["--rollout_processes=2"])
    )
    assert two - one == one - off > 0  # the drafters' files and learners twice
