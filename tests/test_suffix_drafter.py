"""The suffix drafter's memory and trees, merging two drafters' trees into one, and the adaptive controller choosing
among drafters."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fastgrpo.rollout.drafter import Drafter
from fastgrpo.rollout.tree import (
    SCORE_FLOOR,
    DraftTree,
    TreeShape,
    ancestor_mask,
    best_subtree,
    cut_trees,
    empty_tree,
    merge_trees,
    pad_tree,
)
from fastgrpo.speculative.controller import AdaptiveController
from fastgrpo.speculative.merged import priced
from fastgrpo.speculative.profiler import LatencyProfile
from fastgrpo.speculative.suffix.drafter import Price, PromptMemory, SuffixDrafter, SuffixMemory
from fastgrpo.speculative.suffix.search import Matches
from fastgrpo.speculative.suffix.trees import draft_tree, log_shares


def test_the_longest_match_comes_first_and_a_place_counts_once_a_token_follows_it() -> None:
    memory = PromptMemory([1, 2, 3])
    memory.add([4, 5, 6, 7, 8])  # after the prompt's tail: ... 1 2 3 4 5 6 7 8
    memory.add([9, 5, 6, 1, 1])
    found = memory.continuations([3, 4, 5, 6], depth=3)
    assert found[0] == (4, [7, 8])  # "3 4 5 6" matched, "7 8" followed
    assert found[1] == (2, [1, 1])  # only "5 6" matched
    live = memory.add([20, 21])
    assert memory.continuations([20, 21], depth=2) == [], "the last place of a sequence leads nowhere yet"
    memory.extend(live, [22])
    assert memory.continuations([20, 21], depth=2) == [(2, [22])]
    assert memory.continuations([2, 3, 20, 21], depth=2)[0] == (4, [22]), "the prompt's tail is matched too"


def test_a_trie_keeps_the_most_followed_nodes_as_a_tree() -> None:
    """Continuations 7 8 9 (a match of 4 tokens), 7 8 1 and 5 (2 each) after the root 6: the trie 6 -> 7 -> 8 -> {9, 1}
    and 6 -> 5, weighted 6, 6, 4, 2 and 2 of 9 (a match weighs its length, plus 1 for no match)."""
    found = Matches(
        last=np.array([6]),
        rows=np.array([0]),
        length=np.array([[4, 2, 2]]),
        tokens=np.array([[[7, 8, 9], [7, 8, 1], [5, -1, -1]]]),
        ahead=np.array([[3, 3, 1]]),
    )
    tree = draft_tree(found, nodes=4, depth=3).to(torch.device("cpu"))
    assert tree.tokens.tolist() == [[6, 7, 8, 9]] and tree.parent.tolist() == [[-1, 0, 1, 2]]
    assert tree.rank.tolist() == [[0, 1, 2, 3]] and tree.levels == 3
    assert tree.score.tolist() == [[0.0] + [math.log(w / 9) for w in (6, 6, 4)]]
    assert torch.equal(tree.ancestors, ancestor_mask(tree.parent, 3))
    tree = draft_tree(found, nodes=5, depth=3).to(torch.device("cpu"))
    assert tree.tokens.tolist() == [[6, 7, 8, 9, 5]] and tree.parent.tolist() == [[-1, 0, 1, 2, 0]]
    assert tree.rank.tolist() == [[0, 1, 2, 3, 4]], "ties go to the shallower node"
    nothing = Matches(
        np.array([6]), np.zeros(0, dtype=np.int64), *(np.zeros((0, 1, 3)[:k], dtype=np.int64) for k in (2, 3, 2))
    )
    tree = draft_tree(nothing, nodes=3, depth=2).to(torch.device("cpu"))
    assert tree.tokens.tolist() == [[6, 0, 0]] and tree.parent.tolist() == [[-1, 0, 0]], "nothing matched: padding"
    assert tree.score.tolist() == [[0.0, SCORE_FLOOR, SCORE_FLOOR]] and tree.levels == 1


def test_the_memory_drops_the_prompts_used_most_recently_but_not_the_current_calls() -> None:
    memory = SuffixMemory(budget=60)
    for call, prompt in enumerate([[1, 2], [3, 4], [5, 6], [7, 8]]):
        memory.calls = call
        memory.memory(prompt).add(list(range(10, 30)))
    memory.calls = 4
    memory.memory([9, 9]).add(list(range(30, 50)))
    memory.evict()
    # 5 prompts of 22 to 24 tokens each: the most recently used other than the current one go first
    assert list(memory.prompts) == [(1, 2), (9, 9)]
    restored = SuffixMemory()
    restored.load_state_dict(memory.state_dict())
    assert restored.state_dict() == memory.state_dict()
    for key, mem in memory.prompts.items():
        assert restored.prompts[key].continuations([10, 11], 4) == mem.continuations([10, 11], 4)


def test_a_proposal_is_priced_as_a_part_per_step_and_a_part_per_row() -> None:
    """The controller prices the suffix drafter by its measured proposals: a step's array operations cost the same
    for any number of rows, each row's reading in Python adds to it."""
    price = Price()
    assert price.seconds(10) == 0.0, "nothing measured yet"
    for rows in (64, 48, 32, 16, 8, 64, 40):
        price.observe(rows, 3e-4 + 5e-6 * rows)
    assert price.seconds(64) == pytest.approx(3e-4 + 5e-6 * 64)
    assert price.seconds(1) == pytest.approx(3e-4 + 5e-6)
    alone = Price()
    for _ in range(3):
        alone.observe(16, 1.6e-3)
    assert alone.seconds(32) == pytest.approx(3.2e-3), "a single row count: the mean time per row"


def test_the_first_proposal_builds_no_table() -> None:
    """The trees' score table, which takes tens of proposals' time to build, is built when the drafter is made: the
    first proposal, timed into the price, would otherwise price the drafter's trees out of the controller's choice."""
    log_shares.cache_clear()
    SuffixDrafter()
    assert log_shares.cache_info().currsize == 1


def tree(tokens: list[int], parents: list[int], scores: list[float]) -> DraftTree:
    t = torch.tensor([tokens])
    p = torch.tensor([parents])
    depth = [0]
    for parent in parents[1:]:
        depth.append(depth[parent] + 1)
    levels = max(depth)
    return DraftTree(
        t,
        p,
        torch.tensor([depth]),
        ancestor_mask(p, levels),
        torch.arange(len(tokens))[None],
        levels,
        torch.tensor([scores], dtype=torch.float64),
    )


def paths(t: DraftTree) -> dict[tuple[int, ...], float]:
    """Every node's token path (root excluded) -> its score."""
    out = {}
    for i in range(1, t.tokens.shape[1]):
        path, node = [], i
        while node > 0:
            path.append(int(t.tokens[0, node]))
            node = int(t.parent[0, node])
        out[tuple(reversed(path))] = float(t.score[0, i])
    return out


def test_merging_keeps_the_best_nodes_of_both_trees_once_each() -> None:
    eagle = tree([5, 10, 11, 12], [-1, 0, 0, 1], [0.0, -0.1, -2.0, -0.5])  # 10, 11, 10-12
    suffix = tree([5, 10, 13, 14], [-1, 0, 1, 2], [0.0, -0.05, -0.2, -0.3])  # 10, 10-13, 10-13-14
    merged = merge_trees(eagle, suffix, nodes=5)
    assert paths(merged) == pytest.approx({(10,): -0.05, (10, 13): -0.2, (10, 13, 14): -0.3, (10, 12): -0.5})
    assert merged.levels == 3
    assert torch.equal(merged.ancestors, ancestor_mask(merged.parent, 3))
    assert merged.rank[0].tolist() == [0, 1, 4, 2, 3], "each node's place by score"
    # a tree of padding adds nothing: merged with an empty tree (a compiled EAGLE proposal alone), a tree is itself
    padding = tree([5, 0, 0, 0], [-1, 0, 0, 0], [0.0, -math.inf, -math.inf, -math.inf])
    alone = merge_trees(eagle, padding, nodes=4)
    assert paths(alone) == paths(eagle)
    drafted = best_subtree(eagle.tokens, eagle.parent, eagle.node_depth, eagle.score, 4, 3)  # as a drafter cuts it
    alone = merge_trees(drafted, empty_tree(1, 4, 3, torch.device("cpu")), nodes=4)
    for field in ("tokens", "parent", "node_depth", "ancestors", "rank", "score"):
        assert torch.equal(getattr(alone, field), getattr(drafted, field)), field


def test_a_wide_merge_cut_to_each_size_is_the_merge_of_that_size() -> None:
    """A compiled EAGLE proposal merges its widest tree with the other drafter's tree widened by padding
    (`pad_tree`), then cuts the result to the size asked for (`cut_trees`): the paths and scores of merging the
    trees of that size."""
    eagle = tree([5, 10, 11, 12, 20, 21], [-1, 0, 0, 1, 3, 2], [0.0, -0.1, -2.0, -0.5, -0.7, -2.5])
    suffix = tree([5, 10, 13, 14], [-1, 0, 1, 2], [0.0, -0.05, -0.2, -0.3])
    empty = empty_tree(1, 6, 4, torch.device("cpu"))
    wide = pad_tree(suffix, empty)
    assert wide.tokens.shape == (1, 6) and paths(merge_trees(suffix, empty, 4)) == paths(suffix)
    assert torch.equal(wide.ancestors, ancestor_mask(wide.parent, 4))
    cuts = cut_trees(merge_trees(eagle, wide, 6), (2, 3, 4, 6))
    for size, cut in zip((2, 3, 4, 6), cuts, strict=True):
        own = best_subtree(eagle.tokens, eagle.parent, eagle.node_depth, eagle.score, size, 4)
        assert paths(cut) == pytest.approx(paths(merge_trees(own, suffix, size))), size
        assert torch.equal(cut.ancestors, ancestor_mask(cut.parent, 4)), size


def flat(target: float = 0.05) -> LatencyProfile:
    tokens = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    return LatencyProfile("synthetic", "none", "float32", 128, tokens, [target] * 9, 256, {"eagle": [0.002] * 9})


class Cost(Drafter):
    def __init__(self, name: str, seconds: float, deep: bool = False):
        self.name, self.seconds, self.deep = name, seconds, deep

    def cost(self, rows: int, shape: TreeShape, backlog: int = 1) -> float:
        return self.seconds * rows

    def deepest(self, shape: TreeShape) -> int:
        return shape.nodes - 1 if self.deep else shape.levels


def test_the_controller_runs_the_drafter_that_pays_and_probes_the_others() -> None:
    drafters = priced([Cost("eagle", 0.004), Cost("suffix", 0.0, deep=True)])
    limits = {"probe_interval": 2, "max_probe_interval": 2, "explore_share": 1.0}  # probes not held back by cost
    controller = AdaptiveController(flat(), drafters=drafters, **limits)
    assert {s.drafter for s in controller.shapes} == {"", "eagle", "suffix", "eagle+suffix"}
    assert controller.levels(controller.groups["suffix"][-1]) == controller.limits.n_max - 1
    chosen = []
    for _ in range(60):
        shape = controller.choose(4)
        chosen.append(shape.drafter)
        if shape.speculative:  # the suffix drafter's trees accept 3 tokens, the others none
            accepted = [3 if shape.drafter == "suffix" else 0] * 4
            ranks = [[1, 2, 3, shape.nodes] if shape.drafter == "suffix" else [shape.nodes] * 4] * 4
            controller.observe(4, shape, controller._profiled_seconds(4, shape), accepted, np.array(ranks))
        else:
            controller.observe(4, shape, controller._profiled_seconds(4, shape), None)
    assert chosen[-20:].count("suffix") >= 10, chosen
    assert {"eagle", "eagle+suffix"} <= set(chosen), "the other drafters are probed"
    assert controller.expected_tokens(controller.best(4)) > 3.5


def test_a_prompt_of_every_call_is_trimmed_to_the_budget_keeping_its_newest_completions() -> None:
    memory = SuffixMemory(budget=40)
    mem = memory.memory([1, 2])
    for i in range(5):
        mem.add(list(range(10 * i, 10 * i + 10)))  # 12 tokens each, after the prompt's 2
    memory.learn([])
    assert memory.tokens == 2 + 3 * 12
    assert mem.continuations([40, 41], 3) == [(2, [42, 43, 44])]
    assert mem.continuations([0, 1], 3) == [], "the oldest completions went first"


def test_a_suffix_only_run_profiles_and_builds_no_draft_head(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The latency profile of a run that drafts with the suffix drafter alone times the target and nothing else (no
    draft head is built, timed or saved); adding the EAGLE head later times it into the same saved profile."""
    from conftest import tiny_model

    from fastgrpo.config import DraftTrainConfig, SpeculationConfig
    from fastgrpo.training_rollouts import TrainingRollouts

    monkeypatch.setenv("FASTGRPO_CACHE", str(tmp_path))
    model = tiny_model("llama")

    def rollouts(drafter: str) -> TrainingRollouts:
        spec = SpeculationConfig(mode="adaptive", drafter=drafter)
        return TrainingRollouts(model, None, [1], spec, DraftTrainConfig(), "tiny")

    suffix = rollouts("suffix")
    assert suffix.profile.drafter_seconds == {}
    assert [d.name for d in suffix.drafters] == ["suffix"] and all(d.modules == () for d in suffix.drafters)
    suffix.save(tmp_path / "checkpoint")
    assert not (tmp_path / "checkpoint" / "draft" / "draft_config.json").exists()
    both = rollouts("eagle+suffix")
    assert (
        list(both.profile.drafter_seconds) == ["eagle"] and both.profile.target_seconds == suffix.profile.target_seconds
    )
