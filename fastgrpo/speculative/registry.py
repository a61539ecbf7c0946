"""The drafters a run can draft with, by name (``speculation.drafter``): ``eagle`` (the learned EAGLE head,
`fastgrpo.speculative.eagle`), ``suffix`` (trees from earlier completions, `fastgrpo.speculative.suffix`), or several
(``eagle+suffix``), between which the adaptive controller chooses at every step, merged trees of them included. A
new drafter is a `fastgrpo.rollout.drafter.Drafter` and a `fastgrpo.speculative.plugin.DrafterPlugin` registered
here with `register_drafter`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from fastgrpo.config import DraftTrainConfig, SpeculationConfig
from fastgrpo.speculative.eagle.plugin import EaglePlugin
from fastgrpo.speculative.plugin import LEARNERS, DrafterPlugin
from fastgrpo.speculative.suffix.plugin import SuffixPlugin

PLUGINS: dict[str, DrafterPlugin] = {plugin.name: plugin for plugin in (EaglePlugin(), SuffixPlugin())}


def register_drafter(plugin: DrafterPlugin) -> None:
    """Make ``plugin.name`` a drafter ``speculation.drafter`` can name."""
    if not plugin.name or "+" in plugin.name:
        raise ValueError(f"a drafter's name must be non-empty and hold no '+', got {plugin.name!r}")
    PLUGINS[plugin.name] = plugin


def drafter_names(choice: str) -> list[str]:
    """The drafters ``speculation.drafter`` names (``eagle+suffix``: both), checked."""
    names = choice.split("+")
    unknown = [n for n in names if n not in PLUGINS]
    if unknown or len(set(names)) != len(names):
        raise ValueError(
            f"speculation.drafter must be one of {sorted(PLUGINS)} or several joined by '+' (each once), got {choice!r}"
        )
    return names


def plugins(speculation: SpeculationConfig) -> list[DrafterPlugin]:
    """The plugins of the drafters ``speculation`` drafts with, in the order named (none with ``mode: off``)."""
    if speculation.mode == "off":
        return []
    return [PLUGINS[name] for name in drafter_names(speculation.drafter)]


def check_speculation(speculation: SpeculationConfig) -> None:
    """Refuse, before any model loads, drafters that are not registered and a ``speculation.draft`` directory that
    holds neither a saved drafter of the drafters named nor a checkpoint's drafters (their learners' states), or
    whose saved files cannot be read (`check_saved_drafts`)."""
    names = drafter_names(speculation.drafter)
    if speculation.draft is None:
        return
    directory = Path(speculation.draft)
    if not any(PLUGINS[n].saved_in(directory) for n in names) and not (directory / LEARNERS).is_file():
        raise ValueError(
            f"speculation.draft: {directory} is neither a directory saved by a drafter of speculation.drafter "
            f"({speculation.drafter}; `fastgrpo draft train` saves the eagle head's) nor a checkpoint's drafters "
            f"(no {LEARNERS})"
        )
    check_saved_drafts(directory, names)


def check_tools(speculation: SpeculationConfig, tools: bool) -> None:
    """Refuse, before any model loads, a run with tools whose drafters cannot keep a waiting row's state aside
    (`DrafterPlugin.parks_rows`)."""
    if not tools or speculation.mode == "off":
        return
    cannot = [n for n in drafter_names(speculation.drafter) if not PLUGINS[n].parks_rows]
    if cannot:
        raise ValueError(
            f"speculation.drafter: {', '.join(cannot)} cannot draft for rows that wait on tools (its plugin does not "
            "set parks_rows); with tools or environment_factory, choose drafters that can, or speculation.mode: off"
        )


def check_draft_training(speculation: SpeculationConfig, draft_training: DraftTrainConfig) -> None:
    """Refuse ``draft_training.*`` options set away from their defaults where the run learns no draft network:
    speculation off, or only drafters that learn without them (the suffix drafter's memory of completions). The
    drafters that read them are those that learn from the target's hidden states (`DrafterPlugin.captures_hidden`);
    ``fastgrpo draft train`` trains the EAGLE head with them whatever ``speculation.drafter`` names, and does not
    call this."""
    default = DraftTrainConfig()
    changed = [
        f.name
        for f in dataclasses.fields(draft_training)
        if getattr(draft_training, f.name) != getattr(default, f.name)
    ]
    if not changed or any(plugin.captures_hidden for plugin in plugins(speculation)):
        return
    if speculation.mode == "off":
        why = "speculation.mode: off (no drafter runs)"
    else:
        why = f"speculation.drafter {speculation.drafter} (it learns no draft network)"
    names = ", ".join(f"draft_training.{name} ({getattr(draft_training, name)})" for name in changed)
    raise ValueError(f"{names}: no effect with {why}; remove it, or speculate with a drafter that learns (eagle)")


def check_saved_drafts(directory: Path, names: list[str]) -> None:
    """Refuse, before any model loads, files the drafters ``names`` saved in ``directory`` that cannot be read (a
    config cut short or edited by hand), naming the file."""
    try:
        for name in names:
            PLUGINS[name].check_saved(directory)
    except ValueError as e:
        raise ValueError(f"speculation.draft: {e}") from None
