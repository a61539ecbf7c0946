"""How close the rollout engine's steps run to this machine's roofline, for SmolLM2-135M-Instruct.

In one run, on the machine at hand:
- the ceilings, with plain torch: memory read bandwidth (summing a buffer as large as the model's matrices) and
  matrix-product throughput at the model's own shapes (``F.linear`` of every decoder matrix and the LM head over
  `PEAK_ROWS` rows);
- one target forward with the LM head over B rows x N tokens per row, every row reading ``--context`` cached tokens:
  N = 1 is a plain decoding step's forward, N > 1 what verifying an N-node tree costs;
- the matrix products of that forward alone (every decoder matrix and the LM head over B x N rows, by the engine's
  CPU linear-layer routes): how close torch's kernels themselves come to the roofline;
- the engine's whole plain decoding step (forward, sampling, bookkeeping) at B rows, from a generation with EOS off;
and prints for each the measured time, the roofline time, max(weight bytes / bandwidth, FLOPs / throughput) plus the
KV-cache bytes read / bandwidth, and their ratio: the share of a step that is neither streaming weights nor
arithmetic.

Usage::

    python benchmarks/bench_roofline.py [--dtype bfloat16] [--rows 1,2,4,8,16,32,64] [--nodes 1,2,4,8,16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from bench_ceiling import step_costs
from record import Record

from fastgrpo.models import load_model
from fastgrpo.rollout.engine import RolloutEngine
from fastgrpo.rollout.forward import decoder_and_head
from fastgrpo.rollout.linear import rollout_linear, rollout_linears
from fastgrpo.sampling_params import SamplingParams
from fastgrpo.speculative.profiler import interleaved_medians

PEAK_ROWS = 256


def matrices(model) -> list[torch.Tensor]:
    """The weights every token multiplies: each decoder linear layer's and the LM head's, ``[out, in]``."""
    decoder, head = decoder_and_head(model)
    found = [m.weight for m in decoder.modules() if isinstance(m, torch.nn.Linear)]
    return [*found, head.weight]


def ceilings(weights: list[torch.Tensor], repeats: int) -> tuple[float, float]:
    """Read bandwidth (bytes/s) over a buffer as large as ``weights``, and product throughput (FLOP/s) of
    ``F.linear`` over `PEAK_ROWS` rows on each of them."""
    total = sum(w.numel() for w in weights)
    buffer = torch.ones(total, dtype=weights[0].dtype)
    inputs = {w.shape[1]: torch.randn(PEAK_ROWS, w.shape[1], dtype=w.dtype) for w in weights}

    def products() -> None:
        for w in weights:
            F.linear(inputs[w.shape[1]], w)

    with torch.inference_mode():
        read, matmul = interleaved_medians([buffer.sum, products], repeats, buffer.device, progress=False)
    return total * buffer.element_size() / read, 2 * PEAK_ROWS * total / matmul


def product_costs(model, weights: list[torch.Tensor], tokens: list[int], repeats: int) -> dict[int, float]:
    """Median seconds of the products of one forward alone, ``rollout_linear`` of ``T`` rows on every matrix (the
    engine's routes), for each ``T`` in ``tokens``."""
    gen = torch.Generator().manual_seed(0)

    def products(inputs: dict[int, torch.Tensor]) -> None:
        for w in weights:
            rollout_linear(inputs[w.shape[1]], w)

    fns = []
    for t in tokens:
        inputs = {w.shape[1]: torch.randn(t, w.shape[1], generator=gen, dtype=w.dtype) for w in weights}
        fns.append(lambda inputs=inputs: products(inputs))
    with torch.inference_mode(), rollout_linears(model):
        seconds = interleaved_medians(fns, repeats, weights[0].device, progress=False)
    return dict(zip(tokens, seconds, strict=True))


def engine_steps(model, rows: list[int], context: int, tokens: int) -> dict[int, float]:
    """Median seconds of the engine's plain decoding steps at each row count (T=1, no row ends early)."""
    engine = RolloutEngine(model, eos_token_ids=[])
    engine.eos = torch.empty(0, dtype=torch.long)  # no token ends a row: the concurrency stays B
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_new_tokens=tokens, temperature=1.0)
    engine.generate([[1, 2]], SamplingParams(max_new_tokens=4, temperature=1.0))  # one-off costs
    out = {}
    for b in rows:
        prompts = torch.randint(0, vocab, (b, context), generator=gen).tolist()
        stats = engine.generate(prompts, params, generator=torch.Generator().manual_seed(b)).stats
        out[b] = statistics.median(stats.step_times[1:])  # the first decoding step pays one-off costs of its shape
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", help="float32, or bfloat16 on CPUs with bf16 matrix units")
    parser.add_argument("--rows", default="1,2,4,8,16,32,64")
    parser.add_argument("--nodes", default="1,2,4,8,16", help="tokens per row of the timed forwards (1 first)")
    parser.add_argument("--context", type=int, default=256, help="cached tokens each row reads")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved timing rounds")
    parser.add_argument("--engine-tokens", type=int, default=16, help="decoding steps timed per row count")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    nodes = [int(n) for n in args.nodes.split(",")]
    if nodes[0] != 1 or min(rows) < 1 or args.context < 1 or args.repeats < 1 or args.engine_tokens < 2:
        raise SystemExit("--nodes must start at 1; --rows, --context, --repeats >= 1; --engine-tokens >= 2")
    record = Record("bench_roofline")
    start = time.perf_counter()
    model = load_model("smollm2", dtype=args.dtype).eval()
    model.requires_grad_(False)
    weights = matrices(model)
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    bandwidth, throughput = ceilings(weights, args.repeats)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_bytes_per_row = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * args.context
    kv_bytes_per_row *= weights[0].element_size()
    attention_flops = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * args.context  # per token
    flops_per_token = 2 * sum(w.numel() for w in weights) + attention_flops
    record.notes.update(
        weight_mb=round(weight_bytes / 2**20, 1),
        read_bandwidth_gb_s=round(bandwidth / 1e9, 2),
        product_gflop_s=round(throughput / 1e9, 2),
        context=args.context,
    )
    record.table(
        f"Ceilings ({args.dtype}, {torch.get_num_threads()} threads)",
        ["weights", "read bandwidth", f"F.linear throughput at {PEAK_ROWS} rows", "weights streamed once"],
        [
            [
                f"{weight_bytes / 2**20:.0f} MB",
                f"{bandwidth / 1e9:.1f} GB/s",
                f"{throughput / 1e9:.1f} GFLOP/s",
                f"{1e3 * weight_bytes / bandwidth:.1f} ms",
            ]
        ],
    )

    def roofline(b: int, n: int) -> tuple[float, str]:
        stream, compute = weight_bytes / bandwidth, b * n * flops_per_token / throughput
        return max(stream, compute) + b * kv_bytes_per_row / bandwidth, "weights" if stream >= compute else "FLOPs"

    forwards = step_costs(model, rows, nodes, args.context, args.repeats)
    products = product_costs(model, weights, sorted({b * n for b in rows for n in nodes}), args.repeats)
    table = []
    for b in rows:
        for n in nodes:
            bound, by = roofline(b, n)
            measured, alone = forwards[(b, n)], products[b * n]
            table.append(
                [b, n, b * n, f"{1e3 * measured:.1f}", f"{1e3 * bound:.1f}", f"{measured / bound:.2f}", by]
                + [f"{1e3 * alone:.1f}", f"{alone / bound:.2f}"]
            )
    record.table(
        f"Target forward with the LM head over B rows x N tokens, {args.context} cached tokens per row: measured "
        "against the roofline, and its matrix products alone",
        ["rows B", "tokens per row N", "tokens", "measured ms", "roofline ms", "measured / roofline", "bound by"]
        + ["products alone ms", "products / roofline"],
        table,
    )
    with torch.inference_mode():
        steps = engine_steps(model, rows, args.context, args.engine_tokens)
    record.table(
        f"The engine's plain decoding step (T=1, {args.context}-token prompts), against its forward and the roofline",
        ["rows B", "engine step ms", "its forward ms", "roofline ms", "step / roofline", "outside the forward"],
        [
            [b, f"{1e3 * s:.1f}", f"{1e3 * forwards[(b, 1)]:.1f}", f"{1e3 * roofline(b, 1)[0]:.1f}"]
            + [f"{s / roofline(b, 1)[0]:.2f}", f"{max(0.0, 1 - forwards[(b, 1)] / s):.0%}"]
            for b, s in steps.items()
        ],
    )
    record.save()
    print(f"\ntotal wall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
