"""What a generation call did, step by step: concurrency, tokens per forward, tree sizes and acceptance by depth,
and where its time went (prefill, drafting, verification)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerationStats:
    """What one generation call did. Per-step lists have one entry per target forward after the prefill."""

    target_forwards: int = 0
    draft_forwards: int = 0
    tokens_emitted: int = 0
    prefill_time: float = 0.0
    decode_time: float = 0.0
    draft_time: float = 0.0
    time_saved: float = 0.0  # seconds the timed tree steps saved against plain steps, by the controller's prices
    verify_time: float = 0.0
    compiled: bool = False  # the decoding steps ran compiled (`fastgrpo.rollout.compiled`)
    compile_time: float = 0.0  # seconds of decoding steps that compiled a graph
    compile_graphs: int = 0  # graphs compiled during the call
    compile_shapes: int = 0  # shapes compiled functions met for the first time during the call (CUDA graphs on a GPU)
    cold_steps: int = 0  # decoding steps that compiled or warmed up a graph (not timed into the controller's prices)
    eager_fallbacks: dict[str, int] = field(default_factory=dict)  # per compiled function, calls that ran eagerly
    concurrency: list[int] = field(default_factory=list)
    tokens_per_forward: list[int] = field(default_factory=list)  # tokens emitted by each decoding forward
    step_times: list[float] = field(default_factory=list)  # seconds of each decoding step, bookkeeping included
    tree_nodes: list[int] = field(default_factory=list)
    depth_offered: list[int] = field(default_factory=list)
    depth_accepted: list[int] = field(default_factory=list)
    drafter_steps: dict[str, int] = field(default_factory=dict)  # per drafter (or merged drafters): steps it drafted
    drafter_rows: dict[str, int] = field(default_factory=dict)  # ... the rows of those steps
    drafter_accepted: dict[str, int] = field(default_factory=dict)  # ... and the draft tokens they accepted
    drafter_trees: dict[str, int] = field(default_factory=dict)  # per drafter: steps it drafted, alone or merged
    waiting: list[int] = field(default_factory=list)  # with tools: rows waiting on them at each step
    tool_prefill_tokens: int = 0  # tokens of tool turns fed to the rows' caches (`fastgrpo.rollout.turns`)
    tool_wait_time: float = 0.0  # seconds spent waiting on tools while no row was live
    refills: int = 0  # intakes of waiting completions as rows finished, a prefill forward each (`Refill`)

    @property
    def total_time(self) -> float:
        return self.prefill_time + self.decode_time

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_emitted / max(self.total_time, 1e-9)

    @property
    def concurrency_mean(self) -> float:
        return sum(self.concurrency) / max(len(self.concurrency), 1)

    @property
    def decode_tokens(self) -> int:
        """Tokens emitted by decoding forwards (the first token of each row comes from the prefill)."""
        return sum(self.tokens_per_forward)

    @property
    def n_verify_mean(self) -> float:
        """Mean tokens verified per row per target forward (1 for autoregressive steps)."""
        steps = len(self.concurrency)
        return (sum(self.tree_nodes) + steps - len(self.tree_nodes)) / max(steps, 1)

    @property
    def accept_length(self) -> float:
        """Tokens emitted per row per decoding forward (1.0 for autoregressive decoding)."""
        return self.decode_tokens / max(sum(self.concurrency), 1)

    @property
    def tree_accept_length(self) -> float:
        """1 + draft tokens accepted per row per speculative step: the draft's acceptance, apart from how often the
        controller chose a tree (`accept_length` counts plain steps as 1.0). NaN without a speculative step."""
        if not self.depth_offered:
            return float("nan")
        return 1.0 + sum(self.depth_accepted) / self.depth_offered[0]

    def record_depths(self, tree_depth: list[int], accepted: list[int]) -> None:
        """``tree_depth`` the deepest node of each row's tree, ``accepted`` the draft tokens each row accepted."""
        for d in range(1, max(tree_depth) + 1):
            if len(self.depth_offered) < d:
                self.depth_offered.append(0)
                self.depth_accepted.append(0)
            self.depth_offered[d - 1] += sum(t >= d for t in tree_depth)
            self.depth_accepted[d - 1] += sum(a >= d for a in accepted)

    def record_drafter(self, name: str, accepted: list[int]) -> None:
        """A tree step drafted by ``name`` in which each row accepted ``accepted`` draft tokens."""
        self.drafter_steps[name] = self.drafter_steps.get(name, 0) + 1
        self.drafter_rows[name] = self.drafter_rows.get(name, 0) + len(accepted)
        self.drafter_accepted[name] = self.drafter_accepted.get(name, 0) + sum(accepted)

    def drafter_metrics(self) -> dict[str, float]:
        """Per drafter: ``spec/drafter/<name>/share``, the share of decoding steps whose tree it drafted, and
        ``spec/drafter/<name>/accept_length``, 1 + the draft tokens a row accepted per step it drafted."""
        metrics = {}
        for name, steps in self.drafter_steps.items():
            metrics[f"spec/drafter/{name}/share"] = steps / max(len(self.concurrency), 1)
            metrics[f"spec/drafter/{name}/accept_length"] = 1 + self.drafter_accepted[name] / self.drafter_rows[name]
        return metrics

    def metrics(self) -> dict[str, float]:
        """The call's figures under the names the trainers log (``rollout/*``, ``spec/*``, and with compiled steps
        ``compile/graphs`` and ``compile/seconds``, the graphs the call compiled and the time that took,
        ``compile/shapes``, the shapes met for the first time (on a GPU, CUDA graphs recorded), and
        ``compile/cold_steps``, the steps that compiled or warmed up a graph: zero once a run has met its shapes;
        ``compile/eager_fallbacks``, the calls of compiled functions that ran eagerly (a graph the backend failed to
        compile, or past the graph limit), and per function that did, ``compile/eager_fallbacks/<function>``; with
        tools, ``tools/rows_waiting`` on them per step, ``tools/prefill_tokens`` of their results fed to the caches
        and ``tools/wait_seconds`` spent with no row to decode)."""
        compiled = {
            "compile/graphs": self.compile_graphs,
            "compile/shapes": self.compile_shapes,
            "compile/seconds": self.compile_time,
            "compile/cold_steps": self.cold_steps,
            "compile/eager_fallbacks": sum(self.eager_fallbacks.values()),
            **{f"compile/eager_fallbacks/{name}": n for name, n in self.eager_fallbacks.items()},
        }
        tools = {
            "tools/rows_waiting": sum(self.waiting) / max(len(self.waiting), 1),  # per step, mean
            "tools/prefill_tokens": self.tool_prefill_tokens,
            "tools/wait_seconds": self.tool_wait_time,
        }
        return (
            (compiled if self.compiled else {})
            | (tools if self.waiting else {})
            | {
                "rollout/tokens_per_second": self.tokens_per_second,
                "rollout/target_forwards": self.target_forwards,
                "spec/accept_length": self.accept_length,
                "spec/tree_accept_length": self.tree_accept_length,
                "spec/n_verify_mean": self.n_verify_mean,
                "spec/concurrency_mean": self.concurrency_mean,
                "spec/draft_time": self.draft_time,
                "spec/time_saved": self.time_saved,
                "spec/verify_time": self.verify_time,
                **self.drafter_metrics(),
            }
        )
