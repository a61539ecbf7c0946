"""The ceiling of speculative rollouts on this hardware: how many tokens per target forward any draft could get
accepted, what speedup that would buy at each concurrency, and how close the trained draft comes.

SmolLM2-135M-Instruct samples GRPO rollouts (GSM8K test prompts x ``--num-generations``, T=1, top-p 0.95, up to 256
new tokens, as in ``bench_controller.py``), capturing its hidden states. Along the sampled completions (`ceiling.py`,
beside this script) it measures the accepted length of full trees proposed by a perfect draft (the target's own
top-K) and by the trained draft (its top-K, fed its own drafted features below depth 1, as in the engine), and an
upper bound on the accepted length of any N-node tree from any draft under any lossless rule.

It then times target forwards over N tokens in each of B rows, t(B, N): a step verifying N-node trees costs at
least that, so ``bound(N) x t(B, 1) / t(B, N)`` bounds the speedup of any draft at B rows (drafting and bookkeeping
free). Summed over the concurrency of each rollout's autoregressive steps, the same bound applies to
whole rollouts.

    python benchmarks/bench_ceiling.py --draft drafts/smollm2-gsm8k-v8192
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from ceiling import (
    NO_RANK,
    CompletionRanks,
    depth_bound,
    depth_in_full_tree,
    nodes_needed,
    ranks_against,
)
from record import Record

from fastgrpo.config import DraftTrainConfig
from fastgrpo.data import load_gsm8k
from fastgrpo.models import encode_prompts, eos_token_ids, load_model, load_tokenizer
from fastgrpo.rollout.attention import rollout_attention
from fastgrpo.rollout.cache import RowCache
from fastgrpo.rollout.engine import RolloutEngine
from fastgrpo.rollout.forward import decoder_and_head, forward_block
from fastgrpo.rollout.linear import rollout_linears
from fastgrpo.rollout.sampling import process_logits
from fastgrpo.sampling_params import SamplingParams
from fastgrpo.speculative.eagle.head import DraftHead
from fastgrpo.speculative.eagle.training import DraftTrainer
from fastgrpo.speculative.profiler import interleaved_medians, interpolate

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"
SHAPES = [(1, 1), (1, 2), (1, 3), (1, 4), (2, 1), (2, 2), (2, 3), (4, 1), (4, 2)]  # (K children, L levels)
MAX_NODES = 32


@dataclass
class Ranks:
    """A completion's ranks under the target (`CompletionRanks`) and, ``[levels, C]``, under the draft at each tree
    depth ``s + 1`` (row ``s``; its first ``1 + s`` entries are `NO_RANK`)."""

    target: CompletionRanks
    drafted: torch.Tensor


def completion_ranks(
    model,
    draft: DraftHead,
    unroller: DraftTrainer,
    prompt: list[int],
    completion: list[int],
    hidden: torch.Tensor,
    params: SamplingParams,
    draft_index: torch.Tensor,
    levels: int,
) -> Ranks:
    """Ranks of a completion's tokens; ``hidden`` is ``[P + C - 1, H]``, the target's hidden states captured while it
    generated the completion."""
    p, c = len(prompt), len(completion)
    tokens = torch.tensor(prompt + completion)
    head = model.get_output_embeddings()
    logp = process_logits(head(hidden[p - 1 :]), params)  # [C, V]: row c samples completion token c
    target = CompletionRanks.from_logprobs(logp, tokens[p:], MAX_NODES)
    # Row j of unroll step s is the pair (x_{j+1}, h_j) fed s drafted ancestors; it predicts x_{j+2}.
    t = hidden.shape[0]
    embeds = model.get_input_embeddings()(tokens[1 : t + 1])[None]
    preds = unroller.unrolled_predictions(embeds, hidden[None], torch.arange(1, t + 1)[None])
    drafted = torch.full((levels, c), NO_RANK, dtype=torch.long)
    for s, pred in enumerate(preds):
        rows = pred[0, p - 1 + s : t - 1]  # predicting completion tokens 1 + s .. C - 1
        nxt = tokens[p + 1 + s :]
        logits = draft.logits(rows, head).float()
        index = draft_index[nxt]
        inside = index >= 0
        ranks = torch.full_like(nxt, NO_RANK)
        ranks[inside] = ranks_against(logits[inside], index[inside])
        drafted[s, 1 + s :] = ranks
    return Ranks(target, drafted)


def step_costs(model, rows: list[int], nodes: list[int], context: int, repeats: int) -> dict[tuple[int, int], float]:
    """Median seconds, over ``repeats`` interleaved rounds, of one target forward (with the LM head) over ``N``
    tokens in each of ``B`` rows, every row reading ``context`` cached tokens, for each ``(B, N)``. A draft tree of
    N nodes costs as much to verify, whatever its shape: only the attention mask differs."""
    decoder, head = decoder_and_head(model)
    cache = RowCache(model.config, max(rows), context + max(nodes), model.dtype, model.device)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def forward(base, offsets, positions, mask, ids) -> None:
        head(forward_block(decoder, cache, base, offsets, positions, mask, input_ids=ids))

    keys, fns = [], []
    for b in rows:
        for n in nodes:
            base = context - torch.arange(b) % 2  # ragged rows, as in a rollout
            offsets = torch.arange(n)
            mask = torch.ones(n, n, dtype=torch.bool).tril()
            ids = torch.randint(0, vocab, (b, n), generator=gen)
            keys.append((b, n))
            fns.append(partial(forward, base, offsets, base[:, None] + offsets, mask, ids))
    with torch.inference_mode(), rollout_attention(model), rollout_linears(model):
        seconds = interleaved_medians(fns, repeats, model.device, progress=True)
    return dict(zip(keys, seconds, strict=True))


class StepCosts:
    """`step_costs` measured at some row counts, linearly interpolated in between (per N)."""

    def __init__(self, measured: dict[tuple[int, int], float]):
        self.measured = measured
        self.rows = sorted({b for b, _ in measured})
        self.nodes = sorted({n for _, n in measured})

    def __call__(self, rows: int, nodes: int) -> float:
        return interpolate(self.rows, [self.measured[b, nodes] for b in self.rows], rows)


def speedup_bound(cost: StepCosts, rows: int, bound: dict[int, float]) -> tuple[float, int]:
    """The best ``bound(N) x t(B, 1) / t(B, N)`` over the timed N at ``rows`` rows, and its N."""
    return max((bound[n] * cost(rows, 1) / cost(rows, n), n) for n in cost.nodes)


def rollout_times(cost: StepCosts, lengths: list[int], bound: dict[int, float]) -> tuple[float, float]:
    """Autoregressive seconds of a rollout whose rows have ``lengths`` tokens, and the least seconds speculation
    could take (every autoregressive step at B rows sped up by at most the bound at B rows)."""
    plain = fast = 0.0
    for step in range(max(lengths)):
        rows = sum(n > step for n in lengths)
        plain += cost(rows, 1)
        fast += cost(rows, 1) / speedup_bound(cost, rows, bound)[0]
    return plain, fast


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default="drafts/smollm2-gsm8k-v8192")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--concurrency", default="1,2,4,8,16,32", help="rows of the fixed-concurrency table")
    parser.add_argument("--nodes", default="1,2,3,4,6,8,12,16", help="tree sizes N whose verification is timed")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved timing rounds")
    parser.add_argument("--dtype", default="float32", help="float32 or bfloat16 (on CPUs with bf16 matrix units)")
    parser.add_argument(
        "--replay-prompts", type=int, default=4, help="prompts whose rows decode together, as bench_controller's replay"
    )
    args = parser.parse_args()
    record = Record("bench_ceiling")
    torch.set_num_threads(os.cpu_count())
    start = time.perf_counter()
    model, tokenizer = load_model("smollm2", dtype=args.dtype), load_tokenizer("smollm2")
    model.requires_grad_(False)
    draft = DraftHead.load(args.draft, model).eval()
    levels = max(depth for _, depth in SHAPES)
    unroller = DraftTrainer(
        draft, model.get_input_embeddings(), model.get_output_embeddings(), DraftTrainConfig(unroll=levels)
    )
    vocab = model.config.vocab_size
    draft_index = torch.full((vocab,), -1, dtype=torch.long)
    ids = draft.draft_vocab if draft.draft_vocab is not None else torch.arange(vocab)
    draft_index[ids] = torch.arange(ids.numel())

    rows = load_gsm8k(GSM8K / "test.jsonl")[: args.prompts]
    prompts = encode_prompts(tokenizer, [r["prompt"] for r in rows], 512)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, top_p=0.95)
    engine = RolloutEngine(model, eos_token_ids(model, tokenizer), tokenizer)
    out = engine.generate(
        prompts, params, args.num_generations, generator=torch.Generator().manual_seed(0), capture_hidden=True
    )
    print(
        f"SmolLM2-135M-Instruct ({args.dtype}), {args.prompts} GSM8K test prompts x {args.num_generations} "
        f"generations, T=1, top-p 0.95, {out.stats.tokens_emitted} tokens sampled in "
        f"{time.perf_counter() - start:.0f} s; draft {args.draft}, {torch.get_num_threads()} threads"
    )

    completions: list[Ranks] = []
    with torch.inference_mode():
        for i, (completion, hidden) in enumerate(zip(out.completion_ids, out.hidden_states, strict=True)):
            if len(completion) >= 2:
                prompt = prompts[i // args.num_generations]
                completions.append(
                    completion_ranks(model, draft, unroller, prompt, completion, hidden, params, draft_index, levels)
                )
    roots = sum(r.drafted.shape[1] - 1 for r in completions)
    target_top = float((torch.cat([r.target.target[1:] for r in completions]) == 0).float().mean())
    draft_top = float((torch.cat([r.drafted[0, 1:] for r in completions]) == 0).float().mean())
    print(
        f"\n{roots} step roots; the sampled token is the target's most probable one at {target_top:.3f} of "
        f"positions, the draft's (depth 1) at {draft_top:.3f}"
    )

    def mean_accepted(depths: list[torch.Tensor]) -> float:
        return 1.0 + float(torch.cat(depths).float().mean())

    table = []
    for k, depth in SHAPES:
        n = sum(k**i for i in range(depth + 1))
        oracle = mean_accepted(
            [depth_in_full_tree(r.target.target[None].expand(depth, -1), k, depth) for r in completions]
        )
        trained = mean_accepted([depth_in_full_tree(r.drafted, k, depth) for r in completions])
        table.append([k, depth, n, f"{oracle:.2f}", f"{trained:.2f}"])
    record.table(
        "Accepted tokens per step, full trees (K children per node, L levels, N nodes with the root)",
        ["K", "L", "N", "perfect draft", "trained draft"],
        table,
    )

    needs = [nodes_needed(r.target, MAX_NODES - 1) for r in completions]
    bound = {n: mean_accepted([depth_bound(need, n) for need in needs]) for n in range(1, MAX_NODES + 1)}
    shown = [2, 3, 4, 6, 8, 12, 16, 24, 32]
    record.table(
        "Upper bound on the accepted tokens per step of any N-node tree, any draft, any lossless rule",
        ["N", *map(str, shown)],
        [["bound", *(f"{bound[n]:.2f}" for n in shown)]],
    )

    g = args.num_generations
    concurrency = [int(c) for c in args.concurrency.split(",")]
    nodes = [int(n) for n in args.nodes.split(",")]
    if nodes[0] != 1 or max(nodes) > MAX_NODES:
        raise SystemExit(f"--nodes must start at 1 and stay within {MAX_NODES}")
    replay_rows = min(args.replay_prompts, args.prompts) * g
    spaced = [b for b in (12, 16, 24, 32, 48, 64, 96, 128) if b < replay_rows]  # interpolated in between
    timed_rows = sorted(set(concurrency) | set(range(1, g + 1)) | set(spaced) | {replay_rows})
    cost = StepCosts(step_costs(model, timed_rows, nodes, context=256, repeats=args.repeats))
    record.table(
        "Cost of verifying N tokens per row against one token per row, t(B, N) / t(B, 1)",
        ["rows", "t(B, 1) ms", *(f"N={n}" for n in nodes[1:])],
        [[b, f"{1000 * cost(b, 1):.1f}", *(f"{cost(b, n) / cost(b, 1):.2f}" for n in nodes[1:])] for b in concurrency],
    )
    record.table(
        "Upper bound on the speedup over autoregressive decoding at fixed concurrency (drafting free)",
        ["rows", "bound", "at N"],
        [[b, f"{best:.2f}x", n] for b in concurrency for best, n in [speedup_bound(cost, b, bound)]],
    )

    lengths = [len(c) for c in out.completion_ids]
    times = [rollout_times(cost, lengths[i : i + g], bound) for i in range(0, len(lengths), g)]
    ratios = [plain / fast for plain, fast in times]
    total = sum(plain for plain, _ in times) / sum(fast for _, fast in times)
    plain, fast = rollout_times(cost, lengths[:replay_rows], bound)
    record.table(
        "Upper bound on the speedup of whole rollouts, from the concurrency of their autoregressive steps",
        ["rollouts", "bound"],
        [
            [f"one prompt x {g} generations (a bench_e2e step), total time", f"{total:.2f}x"],
            ["the same, per rollout", f"{min(ratios):.2f}x to {max(ratios):.2f}x"],
            [
                f"the first {replay_rows // g} prompts' {replay_rows} rows together (bench_controller's replay)",
                f"{plain / fast:.2f}x",
            ],
        ],
    )
    record.save()
    print(f"\ntotal wall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
