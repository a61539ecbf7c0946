"""The options of every ``fastgrpo`` command as dataclasses, the way TRL's ``HfArgumentParser`` reads a script's:
a command reads the dataclasses `COMMANDS` names for it (``train`` `GRPOConfig` alone, ``eval`` and ``draft train``
their own few options beside it), all from one YAML ``--config`` and ``--name value`` overrides
(`fastgrpo.config.files.parse_options`).

An option that several commands take is one field: `shared` copies `GRPOConfig`'s (or another command's) field with
its default, help and allowed values, so that ``generate --temperature`` is ``train --temperature``, with the same
default. A class's ``ALIASES`` are other command-line names of its options (``--max-new-tokens``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from fastgrpo.config.grpo import GRPOConfig
from fastgrpo.config.speculation import SpeculationConfig
from fastgrpo.fields import Range, check_numbers, check_ranges, option
from fastgrpo.sampling_params import SamplingParams

# The token counts `fastgrpo profile` times: fastgrpo.speculative.profiler.DEFAULT_TOKENS (a test checks they agree;
# the profiler is not imported here, so that --help answers without transformers).
PROFILE_TOKENS = "1,2,3,4,6,8,12,16,24,32,48,64,96,128,192,256"


def shared(cls: type, name: str, **metadata: Any) -> Any:
    """A field with the default, help and allowed values of ``cls``'s field ``name``; ``metadata`` replaces some of
    them (a wider ``valid`` range). The annotation is written again where the field is used (a test checks that it
    is the same)."""
    source = next(f for f in dataclasses.fields(cls) if f.name == name)
    merged = {**source.metadata, **metadata}
    if source.default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=source.default_factory, metadata=merged)
    return dataclasses.field(default=source.default, metadata=merged)


def check_options(options: Any, prefix: str = "") -> None:
    """Raise ``ValueError`` naming the first option of ``options`` (nested ones dotted) outside its ``choices``, not a
    number a float32 can hold (`check_numbers`), or outside its ``valid`` range."""
    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        if dataclasses.is_dataclass(value):
            check_options(value, f"{prefix}{f.name}.")
        elif "choices" in f.metadata and value not in f.metadata["choices"]:
            raise ValueError(f"{prefix}{f.name} must be one of {list(f.metadata['choices'])}, got {value!r}")
    check_numbers(options, prefix)
    check_ranges(options, prefix)


@dataclass
class GenerateOptions:
    """``fastgrpo generate``: sample completions for prompts, with the model and sampling options of training."""

    ALIASES: ClassVar[dict[str, str]] = {"max_new_tokens": "max_completion_length"}

    prompt: list[str] = option(
        default_factory=list, help="user messages (on the command line one per --prompt, which can be repeated)"
    )
    prompts_file: str | None = option(
        None, help="a .txt file (one prompt per line) or a .jsonl with a 'prompt' column", path=True
    )
    output: str | None = option(None, help="a JSONL file to write (None: print to the terminal)", path=True)
    model: str = shared(GRPOConfig, "model")
    dtype: str = shared(GRPOConfig, "dtype")
    device: str = shared(GRPOConfig, "device")
    num_generations: int = shared(GRPOConfig, "num_generations", valid=Range(1))  # one completion is no group here
    max_prompt_length: int = shared(GRPOConfig, "max_prompt_length")
    max_completion_length: int = shared(GRPOConfig, "max_completion_length")
    temperature: float = shared(GRPOConfig, "temperature")
    top_p: float = shared(GRPOConfig, "top_p")
    top_k: int = shared(GRPOConfig, "top_k")
    min_p: float = shared(GRPOConfig, "min_p")
    seed: int = shared(GRPOConfig, "seed")

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=self.max_completion_length,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
        )

    def validate(self) -> None:
        check_options(self)


@dataclass
class ProfileSpeculation:
    """The ``speculation`` options of ``fastgrpo profile``: the drafters to time and a saved draft to time."""

    drafter: str = shared(SpeculationConfig, "drafter")
    draft: str | None = shared(SpeculationConfig, "draft")


@dataclass
class ProfileOptions:
    """``fastgrpo profile``: forward latency against tokens per forward, and the verification capacity."""

    ALIASES: ClassVar[dict[str, str]] = {"draft": "speculation.draft"}

    model: str = shared(GRPOConfig, "model")
    dtype: str = shared(GRPOConfig, "dtype")
    device: str = shared(GRPOConfig, "device")
    compile: str = shared(GRPOConfig, "compile")
    speculation: ProfileSpeculation = option(
        default_factory=ProfileSpeculation, help="the drafters to time (`speculation.drafter`, `speculation.draft`)"
    )
    tokens: str = option(PROFILE_TOKENS, help="the tokens per forward to time, increasing, comma-separated")
    context_length: int = option(256, help="cached tokens each row attends to", valid=Range(2))
    repeats: int = option(9, help="rounds timing every token count once (each count keeps its median)", valid=Range(1))
    output: str | None = option(
        None,
        help="a JSON file to write, a plot beside it (None: the profile cache, where training finds it)",
        path=True,
    )

    @property
    def draft(self) -> str | None:
        """The saved draft to time (``speculation.draft``; None: a fresh draft of the model's architecture)."""
        return self.speculation.draft

    def token_counts(self) -> tuple[int, ...]:
        """``tokens`` as integers."""
        try:
            counts = tuple(int(t) for t in self.tokens.split(","))
        except ValueError:
            raise ValueError(f"tokens must be comma-separated integers, got {self.tokens!r}") from None
        if min(counts) < 1 or list(counts) != sorted(set(counts)):
            raise ValueError(f"tokens must be increasing positive integers, got {self.tokens!r}")
        return counts

    def validate(self) -> None:
        check_options(self)
        self.token_counts()
        if self.draft is not None and not Path(self.draft).is_dir():
            raise ValueError(f"speculation.draft: {self.draft} is not a directory with a saved draft")


@dataclass
class EvalOptions:
    """``fastgrpo eval``'s own option; the model, dataset, rewards and sampling are `GRPOConfig`'s."""

    batch_size: int = option(32, help="prompts generated at once", valid=Range(1))

    def validate(self) -> None:
        check_options(self)


@dataclass
class DraftTrainOptions:
    """``fastgrpo draft train``'s own options; the model, dataset, sampling and ``draft_training.*`` are
    `GRPOConfig`'s, the draft's reduced vocabulary is ``speculation.draft_vocab_size``."""

    ALIASES: ClassVar[dict[str, str]] = {"draft_vocab_size": "speculation.draft_vocab_size"}

    output: str = option(help="the directory to save the draft in", path=True)
    batch_size: int = shared(EvalOptions, "batch_size")
    greedy_fraction: float = option(
        0.0,
        help="share of the prompts answered greedily; the rest are sampled with the sampling options",
        valid=Range(0, 1),
    )

    def validate(self) -> None:
        check_options(self)


# The dataclasses each command reads its options into, in the order `parse_options` returns them.
COMMANDS: dict[str, tuple[type, ...]] = {
    "train": (GRPOConfig,),
    "generate": (GenerateOptions,),
    "eval": (EvalOptions, GRPOConfig),
    "draft train": (DraftTrainOptions, GRPOConfig),
    "profile": (ProfileOptions,),
}
