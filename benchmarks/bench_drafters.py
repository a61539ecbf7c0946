"""Which drafter accepts most: ``eagle`` (the learned head), ``suffix`` (earlier completions, no neural forward) and
``eagle+suffix`` (both trees merged into one of the same size), replayed over recorded rollouts of
SmolLM2-135M-Instruct. Acceptance does not depend on the hardware, so it is measured here:

    python benchmarks/bench_drafters.py

Two tasks: (a) the default task (``configs/default.yaml``: 2 arithmetic prompts x 8 completions a step, T=1, 128
new tokens), 20 steps; (b) 16 GSM8K train prompts x 8 completions, two epochs of 4 steps of 4 prompts (the order
of `StepPrompts`, reshuffled each epoch), 256 new tokens, at T=1 and T=0.6. The policy is fixed: each step's
completions are generated once, plainly, with the target's hidden states, and every drafter is replayed over them.

A replay is the engine's step loop with the target's verification replaced by the recorded completion: each drafter
proposes a tree for every live row (the drafters' own `propose`, with the state they keep across steps and calls:
the suffix drafter's memory of earlier completions and of the group's, the EAGLE head's KV cache), the row accepts
the longest path of the tree that the completion follows, and the drafter is handed what was emitted. Sampling
under the same uniforms emits exactly the recorded tokens whoever drafts, so this is the acceptance the engine
would see. The EAGLE head starts fresh, with a reduced vocabulary (``speculation.draft_vocab_size``, 4,096: the most
frequent tokens of the first step's completions, as a run with that option chooses them), and learns online after
every step on that step's completions; its weights at each step are the same for ``eagle`` and ``eagle+suffix``.

Reported: accepted tokens per row per verification (1 + draft tokens accepted, as ``spec/tree_accept_length``) at tree
sizes 4, 8 and 16 (``eagle``: the paper's tree of that many nodes, K = min(N - 1, 8), L from alpha = 0.75; ``suffix``:
chains and branches up to N - 1 deep), per epoch; the suffix drafter's proposing time per step against a plain
decoding step over the same rows (timed in this process, alone), and its memory.

The suffix drafter's host time per row and step (`propose` + `accepted`, and `select` apart) at 16, 64 and 128 rows:
each GSM8K epoch's completions replayed in calls of 2, 8 and 16 prompts, the second epoch's over the memory of the
first. ``--suffix-baseline PATH`` times another implementation of it (its ``drafter.py``, e.g. one written out by
``git show COMMIT:fastgrpo/speculative/suffix/drafter.py``) in the same replay, step by step, the two in turns (the
first to propose alternates), and counts the steps whose trees differ and what each tree would have accepted.
``--task suffix`` records the GSM8K completions (no hidden states) and times the suffix drafter only:

    python benchmarks/bench_drafters.py --task suffix --suffix-baseline /tmp/suffix_before.py
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from record import Record

from fastgrpo.config import DraftTrainConfig, SpeculationConfig, load_config
from fastgrpo.data import DataConfig, load_dataset
from fastgrpo.grpo.prompts import StepPrompts
from fastgrpo.models import eos_token_ids, load_model, load_tokenizer
from fastgrpo.rollout.attention import rollout_attention
from fastgrpo.rollout.drafter import Emitted, Prefill
from fastgrpo.rollout.engine import RolloutEngine
from fastgrpo.rollout.host import read_back
from fastgrpo.rollout.linear import rollout_linears
from fastgrpo.rollout.sequence import ActiveRows, GenerationOutput, Sequence, fill_holes
from fastgrpo.rollout.stats import GenerationStats
from fastgrpo.rollout.tree import DraftTree, TreeShape, merge_trees
from fastgrpo.sampling_params import SamplingParams
from fastgrpo.speculative.eagle.drafter import EagleDrafter
from fastgrpo.speculative.eagle.head import DraftHead
from fastgrpo.speculative.eagle.offline import frequent_tokens
from fastgrpo.speculative.eagle.training import DraftTrainer, rollout_samples
from fastgrpo.speculative.paper import shape_for
from fastgrpo.speculative.suffix.drafter import SuffixDrafter
from fastgrpo.training_rollouts import step_uniforms

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "train.jsonl"
DRAFTERS = ("eagle", "suffix", "eagle+suffix")
SIZES = (4, 8, 16)
DRAFT_VOCAB = 4096
SUFFIX_ROWS = (16, 64, 128)  # rows of a call the suffix drafter is timed at (8 completions a prompt)


@dataclass
class Step:
    """One recorded rollout: ``prompts`` (token ids), ``num_generations`` completions each (prompt-major), the
    target's hidden state of every fed token per completion, and the epoch it belongs to."""

    prompts: list[list[int]]
    completions: list[list[int]]
    hidden: list[torch.Tensor]
    num_generations: int
    epoch: int


def record(
    model, tokenizer, eos, prompts: StepPrompts, steps: int, per_epoch: int, params, seed: int, hidden: bool = True
) -> list[Step]:
    """Generate every step's completions once (plain decoding, the uniforms a training run would use), with the
    target's hidden states when ``hidden``."""
    engine = RolloutEngine(model, eos, tokenizer)
    out_steps = []
    for step in range(steps):
        ids = prompts.encode(prompts.rows(step))
        rows = len(ids) * 8
        uniforms = None if params.greedy else step_uniforms(seed, step, rows, params.max_new_tokens)
        out = engine.generate(ids, params, 8, capture_hidden=hidden, uniforms=uniforms)
        out_steps.append(Step(ids, out.completion_ids, out.hidden_states, 8, step // per_epoch))
        print(f"  recorded step {step + 1}/{steps}: {sum(map(len, out.completion_ids))} tokens", file=sys.stderr)
    return out_steps


def eagle_weights(model, steps: list[Step], vocab: torch.Tensor, seed: int) -> list[dict[str, torch.Tensor]]:
    """The fresh draft's weights before each step, learning online after every step on its completions."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        draft = DraftHead(model.config, "smollm2", vocab)
    trainer = DraftTrainer(draft, model.get_input_embeddings(), model.get_output_embeddings(), DraftTrainConfig())
    weights = []
    for step in steps:
        weights.append({k: v.clone() for k, v in draft.state_dict().items()})
        out = _as_output(step)
        trainer.fit(rollout_samples(step.prompts, out, step.num_generations))
    return weights


def _as_output(step: Step) -> GenerationOutput:
    n = len(step.completions)
    return GenerationOutput(step.completions, [[]] * n, ["stop"] * n, GenerationStats(), step.hidden)


@dataclass
class Replayed:
    """What a replay of one call measured: rows x verifications, tokens they emitted, suffix proposing seconds and
    the rows of each of its steps."""

    verifications: int = 0
    emitted: int = 0
    suffix_seconds: float = 0.0
    suffix_rows: list[int] | None = None


def replay_call(model, drafters: list, shape: TreeShape, step: Step, out: Replayed) -> None:
    """The engine's loop over ``step``'s rows with verification replaced by the recorded completions."""
    n = step.num_generations
    plens = [len(p) for p in step.prompts]
    width = max(plens)
    prompt_ids = torch.tensor([p + [0] * (width - len(p)) for p in step.prompts])
    hsize = step.hidden[0].shape[-1]
    prompt_hidden = torch.zeros(len(step.prompts), width, hsize, dtype=step.hidden[0].dtype)
    for p, length in enumerate(plens):
        prompt_hidden[p, :length] = step.hidden[p * n][:length]
    rows = len(step.completions)
    row_prompt = [i // n for i in range(rows)]
    completions = step.completions
    seqs = [Sequence(i, plens[row_prompt[i]], [completions[i][0]]) for i in range(rows)]
    first = torch.tensor([c[0] for c in completions])
    row_index = torch.tensor(row_prompt)
    first_hidden = prompt_hidden[row_index, torch.tensor(plens)[row_index] - 1]
    longest = width + max(map(len, completions)) + 1
    for d in drafters:
        d.begin(rows, longest, shape)
    prefill = Prefill(
        prompt_ids, torch.tensor(plens), prompt_hidden, row_index, first, first_hidden, step.prompts, row_prompt, seqs
    )
    for d in drafters:
        d.start(prefill)
    lengths = [plens[p] for p in row_prompt]
    active = ActiveRows(
        seqs, torch.arange(rows), torch.tensor(lengths), lengths, first, torch.ones(rows, dtype=torch.long)
    )
    active = _drop_finished(active, drafters, completions)
    while active.size:
        proposals = []
        for d in drafters:
            t0 = time.perf_counter()
            proposals.append(d.propose(active, shape))
            if isinstance(d, SuffixDrafter):
                out.suffix_seconds += time.perf_counter() - t0
                out.suffix_rows.append(active.size)
        tree = proposals[0].tree
        for other in proposals[1:]:
            tree = merge_trees(tree, other.tree, shape.nodes)
        counts = emitted_counts(tree, active.seqs, completions)
        emitted_tokens, emitted_hidden = [], []
        for seq, count in zip(active.seqs, counts, strict=True):
            e = len(seq.completion_ids)
            emitted_tokens.append(completions[seq.index][e : e + count])
            plen = seq.prompt_len
            emitted_hidden.append(step.hidden[seq.index][plen + e - 1 : plen + e - 1 + count])
        out.verifications += active.size
        out.emitted += sum(counts)
        width_e = max(counts)
        tok = torch.tensor([t + [0] * (width_e - len(t)) for t in emitted_tokens])
        hid = torch.stack([torch.cat([h, h.new_zeros(width_e - len(h), hsize)]) for h in emitted_hidden])
        count_t = torch.tensor(counts)
        emitted = Emitted(tok, hid, count_t, counts)
        for d in drafters:
            d.accepted(active, emitted)
        for seq, t in zip(active.seqs, emitted_tokens, strict=True):
            seq.completion_ids.extend(t)
        active.row_len = active.row_len + count_t
        active.host_len = [length + c for length, c in zip(active.host_len, counts, strict=True)]
        active.pending = torch.tensor([t[-1] for t in emitted_tokens])
        active.emitted = active.emitted + count_t
        active = _drop_finished(active, drafters, completions)


def emitted_counts(tree: DraftTree, seqs: list[Sequence], completions: list[list[int]]) -> list[int]:
    """Per row, the tokens a step with ``tree`` emits: the longest path of the tree that the recorded completion
    follows, and the token after it (none past the completion's end)."""
    tokens, parents = read_back(tree.tokens, tree.parent)
    counts = []
    for b, seq in enumerate(seqs):
        completion = completions[seq.index]
        e = len(seq.completion_ids)
        children = {(p, t): j for j, (t, p) in enumerate(zip(tokens[b], parents[b], strict=True))}
        node, accepted = 0, 0
        while e + accepted < len(completion):
            child = children.get((node, completion[e + accepted]))
            if child is None:
                break
            node, accepted = child, accepted + 1
        counts.append(min(accepted + 1, len(completion) - e))
    return counts


def _drop_finished(
    active: ActiveRows, drafters: list, completions: list[list[int]], seconds: list[float] | None = None
) -> ActiveRows:
    """The rows still decoding (those whose recorded completion goes on), the drafters narrowed to them; with
    ``seconds``, each drafter's `select` time is added to its entry."""
    keep = [i for i, s in enumerate(active.seqs) if len(s.completion_ids) < len(completions[s.index])]
    if len(keep) == active.size:
        return active
    order = fill_holes(keep)
    index = torch.tensor(order, dtype=torch.long)
    if keep:
        for k, d in enumerate(drafters):
            t0 = time.perf_counter()
            d.select(order, index)
            if seconds is not None:
                seconds[k] += time.perf_counter() - t0
    return active.select(order, index)


def replay(
    model, steps: list[Step], weights, vocab: torch.Tensor, drafter: str, nodes: int
) -> tuple[list[Replayed], SuffixDrafter | None]:
    """Every step replayed in order with one set of drafters (kept across steps); per step what it measured."""
    shape = shape_for(SpeculationConfig().limits(), nodes)
    draft = DraftHead(model.config, "smollm2", vocab) if "eagle" in drafter else None
    drafters = []
    suffix = None
    for name in drafter.split("+"):
        if name == "eagle":
            drafters.append(EagleDrafter(draft, model))
        else:
            suffix = SuffixDrafter()
            drafters.append(suffix)
    results = []
    modules = [m for d in drafters for m in d.modules]
    with torch.inference_mode(), rollout_attention(model, *modules), rollout_linears(model, *modules):
        for step, w in zip(steps, weights, strict=True):
            if draft is not None:
                draft.load_state_dict(w)
            result = Replayed(suffix_rows=[])
            replay_call(model, drafters, shape, step, result)
            results.append(result)
    return results, suffix


def memory_bytes(suffix: SuffixDrafter) -> int:
    """The suffix memory's size: its token store (the buffer and the slots' columns) and each prompt's index (the
    dictionary and its arrays of places)."""
    store = suffix.learner.store
    total = sum(sys.getsizeof(a) for a in (store.tokens, store.base, store.size, store.before, store.written))
    for mem in suffix.learner.prompts.values():
        total += sys.getsizeof(mem.index) + sum(sys.getsizeof(v) for v in mem.index.values())
    return total


def load_suffix_drafter(path: Path) -> type:
    """The `SuffixDrafter` class of another implementation of the suffix drafter, from its ``drafter.py``."""
    spec = importlib.util.spec_from_file_location("suffix_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.SuffixDrafter


@dataclass
class SuffixReplay:
    """Suffix drafters replayed over the same calls: per drafter, host seconds of `propose` + `accepted` and of
    `select`, and the tokens its trees would have emitted; the row steps and steps replayed, and the steps where a
    drafter's trees differ from the first one's (in any field)."""

    seconds: list[float]
    select: list[float]
    emitted: list[int]
    row_steps: int = 0
    steps: int = 0
    differ: int = 0


def replay_suffix_call(drafters: list, shape: TreeShape, prompts, completions, out: SuffixReplay) -> None:
    """One call of ``prompts`` x 8 ``completions`` replayed through ``drafters`` together, every one proposing for
    the same rows at every step (the first to propose alternates); the rows emit what the first drafter's trees
    accept."""
    rows = len(completions)
    row_prompt = [i // 8 for i in range(rows)]
    seqs = [Sequence(i, len(prompts[p]), [completions[i][0]]) for i, p in enumerate(row_prompt)]
    empty = torch.zeros(0)  # the suffix drafter reads the prefill's host fields only
    prefill = Prefill(empty, empty, empty, empty, empty, empty, prompts, row_prompt, seqs)
    for d in drafters:
        d.begin(rows, max(map(len, prompts)) + max(map(len, completions)) + 1, shape)
        d.start(prefill)
    zeros = torch.zeros(rows, dtype=torch.long)
    active = ActiveRows(seqs, torch.arange(rows), zeros, [0] * rows, zeros, zeros)
    active = _drop_finished(active, drafters, completions, out.select)
    while active.size:
        trees = [None] * len(drafters)
        for k in range(len(drafters)) if out.steps % 2 == 0 else reversed(range(len(drafters))):
            t0 = time.perf_counter()
            trees[k] = drafters[k].propose(active, shape).tree
            out.seconds[k] += time.perf_counter() - t0
        counts = [emitted_counts(tree, active.seqs, completions) for tree in trees]
        out.differ += any(not _same_tree(t, trees[0]) for t in trees[1:])
        for k, c in enumerate(counts):
            out.emitted[k] += sum(c)
        out.steps += 1
        out.row_steps += active.size
        emitted_tokens = [
            completions[seq.index][len(seq.completion_ids) :][:count]
            for seq, count in zip(active.seqs, counts[0], strict=True)
        ]
        width = max(counts[0])
        tokens = torch.tensor([t + [0] * (width - len(t)) for t in emitted_tokens])
        emitted = Emitted(tokens, empty, torch.tensor(counts[0]), counts[0])
        for k, d in enumerate(drafters):
            t0 = time.perf_counter()
            d.accepted(active, emitted)
            out.seconds[k] += time.perf_counter() - t0
        for seq, t in zip(active.seqs, emitted_tokens, strict=True):
            seq.completion_ids.extend(t)
        active.pending = torch.tensor([t[-1] for t in emitted_tokens])
        active = _drop_finished(active, drafters, completions, out.select)


def _same_tree(a: DraftTree, b: DraftTree) -> bool:
    fields = ("tokens", "parent", "node_depth", "ancestors", "rank", "score")
    return a.levels == b.levels and all(torch.equal(getattr(a, f), getattr(b, f)) for f in fields)


def suffix_speed(rec: Record, title: str, recorded: list[Step], baseline: type | None, repeats: int) -> None:
    """The suffix drafter's host time per row and step at each of `SUFFIX_ROWS` rows and each tree size (the median
    of ``repeats`` replays); with a ``baseline`` implementation, its time in replays alternating with those (call by
    call, each drafter alone), and one replay of the two together that compares their trees step by step."""
    epochs = sorted({s.epoch for s in recorded})
    kinds = [SuffixDrafter] + ([baseline] if baseline is not None else [])
    table = []
    for rows in SUFFIX_ROWS:
        per_call = rows // 8
        calls = []
        for epoch in epochs:
            steps = [s for s in recorded if s.epoch == epoch]
            prompts = [p for s in steps for p in s.prompts]
            completions = [c for s in steps for c in s.completions]
            calls += [
                (prompts[i : i + per_call], completions[8 * i : 8 * (i + per_call)])
                for i in range(0, len(prompts), per_call)
            ]
        for nodes in SIZES:
            shape = shape_for(SpeculationConfig().limits(), nodes)
            timed = [[] for _ in kinds]
            for _ in range(repeats):
                drafters = [kind() for kind in kinds]
                outs = [SuffixReplay([0.0], [0.0], [0]) for _ in kinds]
                for n, (prompts, completions) in enumerate(calls):
                    for k in range(len(kinds)) if n % 2 == 0 else reversed(range(len(kinds))):
                        replay_suffix_call([drafters[k]], shape, prompts, [list(c) for c in completions], outs[k])
                for k, o in enumerate(outs):
                    timed[k].append(o)
            us = [statistics.median(1e6 * (o.seconds[0]) / o.row_steps for o in runs) for runs in timed]
            select = statistics.median(1e6 * o.select[0] / o.row_steps for o in timed[0])
            accept = [f"{runs[0].emitted[0] / runs[0].row_steps:.3f}" for runs in timed]
            line = [str(rows), str(nodes), f"{us[0]:.1f}", f"{select:.1f}", accept[0]]
            if baseline is not None:
                together = SuffixReplay([0.0, 0.0], [0.0, 0.0], [0, 0])
                drafters = [kind() for kind in kinds]
                for prompts, completions in calls:
                    replay_suffix_call(drafters, shape, prompts, [list(c) for c in completions], together)
                line += [f"{us[1]:.1f}", f"{us[1] / us[0]:.1f}x", accept[1], f"{together.differ} / {together.steps}"]
            table.append(line)
            print(f"  suffix speed {rows} rows, N={nodes}: {line[2:]}", file=sys.stderr)
    columns = ["rows", "tree size", "propose + accepted us/row", "select us/row", "accepted/verification"]
    if baseline is not None:
        columns += ["baseline us/row", "speed-up", "baseline accepted/verification", "steps with other trees"]
    rec.table(f"{title}: the suffix drafter's host time per row and step (median of {repeats})", columns, table)


def plain_step_seconds(model, eos, steps: list[Step], params) -> dict[int, float]:
    """Median seconds of a plain decoding step at each live row count, from the engine's own step times."""
    engine = RolloutEngine(model, eos)
    by_rows: dict[int, list[float]] = {}
    for step in steps[:2]:
        uniforms = None if params.greedy else step_uniforms(0, 0, len(step.completions), params.max_new_tokens)
        out = engine.generate(step.prompts, params, step.num_generations, uniforms=uniforms)
        for rows, seconds in zip(out.stats.concurrency, out.stats.step_times, strict=True):
            by_rows.setdefault(rows, []).append(seconds)
    return {r: statistics.median(s) for r, s in by_rows.items()}


def run_task(
    rec: Record, title: str, model, tokenizer, eos, prompts, steps, per_epoch, params, seed, speed=None
) -> None:
    """Record the task's steps and replay every drafter over them; with ``speed`` (a baseline suffix drafter or
    None, and repeats), time the suffix drafter too (`suffix_speed`)."""
    print(f"{title}: recording {steps} steps", file=sys.stderr)
    recorded = record(model, tokenizer, eos, prompts, steps, per_epoch, params, seed)
    vocab = frequent_tokens(recorded[0].completions, DRAFT_VOCAB, eos)
    weights = eagle_weights(model, recorded, vocab, seed)
    epochs = sorted({s.epoch for s in recorded})
    rows, timing, memory = [], [], []
    for nodes in SIZES:
        line = [str(nodes)]
        for drafter in DRAFTERS:
            results, suffix = replay(model, recorded, weights, vocab, drafter, nodes)
            for epoch in epochs:
                mine = [r for r, s in zip(results, recorded, strict=True) if s.epoch == epoch]
                line.append(f"{sum(r.emitted for r in mine) / sum(r.verifications for r in mine):.3f}")
            if drafter == "suffix":
                timing.append((nodes, results))
                memory.append((nodes, suffix.learner.tokens, memory_bytes(suffix)))
            print(f"  N={nodes} {drafter}: {line[-len(epochs) :]}", file=sys.stderr)
        rows.append(line)
    columns = ["tree size"] + [f"{d} (epoch {e + 1})" if len(epochs) > 1 else d for d in DRAFTERS for e in epochs]
    rec.table(f"{title}: accepted tokens per row per verification", columns, rows)
    plain = plain_step_seconds(model, eos, recorded, params)
    timing_rows = []
    for nodes, results in timing:
        suffix_ms = 1e3 * sum(r.suffix_seconds for r in results) / sum(len(r.suffix_rows) for r in results)
        plain_ms = [1e3 * plain[rows_] for r in results for rows_ in r.suffix_rows if rows_ in plain]
        plain_mean = sum(plain_ms) / max(len(plain_ms), 1)
        timing_rows.append(
            [str(nodes), f"{suffix_ms:.2f}", f"{plain_mean:.1f}", f"{100 * suffix_ms / plain_mean:.1f} %"]
        )
    rec.table(
        f"{title}: suffix drafter's proposing time per step against a plain step over the same rows",
        ["tree size", "suffix propose ms", "plain step ms", "share"],
        timing_rows,
    )
    rec.table(
        f"{title}: suffix memory after the last step",
        ["tree size", "tokens kept", "MB"],
        [[str(n), str(t), f"{b / 2**20:.1f}"] for n, t, b in memory],
    )
    if speed is not None:
        suffix_speed(rec, title, recorded, *speed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--task",
        choices=["default", "gsm8k", "both", "suffix"],
        default="both",
        help="suffix: its timing on GSM8K only",
    )
    parser.add_argument("--default-steps", type=int, default=20)
    parser.add_argument("--gsm8k-prompts", type=int, default=16)
    parser.add_argument("--gsm8k-first", type=int, default=2048, help="first GSM8K train row used")
    parser.add_argument("--gsm8k-tokens", type=int, default=256)
    parser.add_argument("--temperatures", default="1.0,0.6")
    parser.add_argument("--suffix-baseline", type=Path, help="another suffix drafter's drafter.py, timed alongside")
    parser.add_argument("--suffix-repeats", type=int, default=3, help="replays per suffix timing (their median)")
    args = parser.parse_args()
    baseline = load_suffix_drafter(args.suffix_baseline) if args.suffix_baseline is not None else None
    rec = Record("bench_drafters")
    model_name = "smollm2"
    tokenizer = load_tokenizer(model_name)
    model = load_model(model_name, "float32", torch.device("cpu"))
    eos = eos_token_ids(model, tokenizer)
    if args.task in ("default", "both"):
        config = load_config(Path(__file__).resolve().parents[1] / "configs" / "default.yaml")
        data = load_dataset(config.dataset)
        per_generation = config.prompts_per_generation
        prompts = StepPrompts(data, tokenizer, per_generation, 0, 1, config.seed, config.max_prompt_length)
        params = SamplingParams(max_new_tokens=config.max_completion_length, temperature=config.temperature)
        per_epoch = max(len(data) // per_generation, 1)
        run_task(rec, "default task", model, tokenizer, eos, prompts, args.default_steps, per_epoch, params, 0)
    if args.task in ("gsm8k", "both", "suffix"):
        rows = load_dataset(DataConfig(name="gsm8k", path=str(GSM8K)))[
            args.gsm8k_first : args.gsm8k_first + args.gsm8k_prompts
        ]
        prompts = StepPrompts(rows, tokenizer, 4, 0, 1, 0, 512)
        per_epoch = len(rows) // 4
        speed = (baseline, args.suffix_repeats)
        for t in (float(x) for x in args.temperatures.split(",")):
            params = SamplingParams(max_new_tokens=args.gsm8k_tokens, temperature=t)
            title = f"GSM8K T={t:g}"
            if args.task == "suffix":
                print(f"{title}: recording {2 * per_epoch} steps", file=sys.stderr)
                recorded = record(model, tokenizer, eos, prompts, 2 * per_epoch, per_epoch, params, 0, hidden=False)
                suffix_speed(rec, title, recorded, *speed)
            else:
                run_task(rec, title, model, tokenizer, eos, prompts, 2 * per_epoch, per_epoch, params, 0, speed)
    rec.save()


if __name__ == "__main__":
    main()
