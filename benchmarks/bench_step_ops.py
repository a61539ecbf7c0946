"""What one decoding step of the rollout engine asks of torch: the aten ops it dispatches (each a kernel launch on a
GPU, a few microseconds of host time when eager) and the host synchronisations among them (each a stall of the
host until the device has drained its queue), counted with `syncs.py` (beside this script) on the machine at hand. The
counts do not depend on the hardware, so a CPU tells what a GPU step would launch and wait for. Top-p runs the
ranking a GPU runs (one sort; on a CPU the engine ranks by heads, reading back which rows go on, which costs nothing
there).

The model is Qwen2-shaped with 28 layers (the depth of Qwen2.5-7B, which sets the ops per forward) but narrow, so that
it runs in seconds on a CPU; the draft is a random EAGLE head (a tree step's ops depend on its shape, not on what it
accepts), alone or with the suffix drafter, their trees merged. Each configuration decodes ``--rows`` rows for
``--steps`` steps with no EOS (every row runs to the end); per step kind the table gives the median ops and the median
and largest synchronisations per step, eagerly and with the compiled steps (`fastgrpo.rollout.compiled`): there the
ops dispatched outside the compiled graphs and the graphs called (each one launch when captured as a CUDA graph). The
compiled columns compile with the ``aot_eager`` backend, which captures the same graphs as inductor in seconds (what
runs outside them does not depend on the backend); the first call of each configuration, which compiles, is not
counted.

Usage::

    python benchmarks/bench_step_ops.py [--rows 8] [--steps 16] [--layers 28]
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter

import torch
from record import Record
from syncs import counting_dispatch
from torch.utils._python_dispatch import _disable_current_modes
from transformers import Qwen2Config, Qwen2ForCausalLM

from fastgrpo.rollout import sampling
from fastgrpo.rollout.compiled import Compiled
from fastgrpo.rollout.engine import RolloutEngine
from fastgrpo.rollout.tree import TreeShape
from fastgrpo.sampling_params import SamplingParams
from fastgrpo.speculative.eagle.drafter import EagleDrafter
from fastgrpo.speculative.eagle.head import DraftHead
from fastgrpo.speculative.suffix.drafter import SuffixDrafter

VOCAB = 2048
SAMPLING = {
    "greedy": {"temperature": 0.0},
    "T=1": {"temperature": 1.0},
    "top-p 0.95": {"temperature": 1.0, "top_p": 0.95},
}
TREES = {
    "plain": None,
    "tree 4 (K2, L3)": TreeShape(4, 2, 3),
    "tree 16 (K4, L5)": TreeShape(16, 4, 5),
    "tree 16 (K4, L5), eagle+suffix merged": TreeShape(16, 4, 5, "eagle+suffix"),
}


def qwen2_shaped(layers: int) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).eval()


def count_steps(engine: RolloutEngine, params: SamplingParams, rows: int) -> list[tuple[int, int, int, Counter]]:
    """(ops, graphs called, synchronisations, synchronisations by name) of each decoding step of one call, after a
    first call (which compiles, when the engine does)."""
    prompts = [[(7 * i + j) % VOCAB for j in range(24 + 5 * i)] for i in range(rows // 2)]
    engine.generate(prompts, params, num_generations=2, generator=torch.Generator().manual_seed(0))
    counted, step, current = [], engine.step, []

    def counting_step(active, call):
        with counting_dispatch() as counter:
            current[:] = [counter, 0]
            out = step(active, call)
        counted.append((counter.ops, current[1], counter.sync_count, counter.syncs.copy()))
        return out

    def graph_call(self: Compiled, device: torch.device, *args):
        if not self.compiled or not current:
            return run_compiled(self, device, *args)
        current[1] += 1  # one graph; its ops run where the counter does not look (torch.compile refuses it there)
        with _disable_current_modes():
            return run_compiled(self, device, *args)

    engine.step = counting_step
    run_compiled, Compiled.__call__ = Compiled.__call__, graph_call
    try:
        engine.generate(prompts, params, num_generations=2, generator=torch.Generator().manual_seed(0))
    finally:
        Compiled.__call__ = run_compiled
    return counted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8, help="rows decoded together (an even number)")
    parser.add_argument("--steps", type=int, default=16, help="decoding steps per configuration")
    parser.add_argument("--layers", type=int, default=28)
    args = parser.parse_args()
    record = Record("bench_step_ops")
    sampling.host_reads_are_free = lambda t: False  # the ranking a GPU runs, see the docstring
    model = qwen2_shaped(args.layers)
    draft = DraftHead(model.config)
    rows = []
    for tree_name, shape in TREES.items():
        for sampling_name, options in SAMPLING.items():
            params = SamplingParams(max_new_tokens=args.steps + 1, **options)
            cells = [tree_name, sampling_name]
            for compile in (None, "aot_eager"):
                drafter = None
                if shape is not None:
                    drafter = [EagleDrafter(draft, model, compile)]
                    drafter += [SuffixDrafter()] if "suffix" in shape.drafter else []
                engine = RolloutEngine(model, [VOCAB], drafter=drafter, tree=shape, backend=compile)  # EOS unused
                counted = count_steps(engine, params, args.rows)
                ops, graphs, syncs = ([c[i] for c in counted] for i in range(3))
                cells += [f"{statistics.median(ops):.0f}"]
                if compile is not None:
                    cells += [f"{statistics.median(graphs):.0f}"]
                cells += [f"{statistics.median(syncs):.0f} (at most {max(syncs)})"]
                kinds = sum((c[3] for c in counted), Counter())
                record.notes.setdefault("syncs_by_kind", {})[f"{tree_name}, {sampling_name}, {compile or 'eager'}"] = {
                    name: n / len(counted) for name, n in kinds.items()
                }
            rows.append(cells)
    record.table(
        f"Ops and host synchronisations per decoding step, {args.layers}-layer Qwen2-shaped model, {args.rows} rows,"
        f" {args.steps} steps",
        ["step", "sampling", "eager: ops", "eager: syncs", "compiled: ops outside graphs", "compiled: graphs"]
        + ["compiled: syncs"],
        rows,
    )
    record.save()


if __name__ == "__main__":
    main()
