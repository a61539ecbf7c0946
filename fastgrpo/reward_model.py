"""Reward models as reward functions: a sequence-classification model (transformers'
``AutoModelForSequenceClassification`` with one label) scores each prompt with its completion, as TRL's
``GRPOTrainer`` scores a ``reward_funcs`` entry that names a model: a conversation (prompt and completion messages)
through the reward tokenizer's chat template, plain text as prompt + completion, padded on the right, the reward the
first logit.

A `RewardModel` named by a path is checked when it is made (a directory with a ``config.json`` and tokenizer files)
and loaded by `load`, which the trainer calls once the policy is on its device: the reward model is a model of its
own on that device, scored without gradients in batches of ``batch_size`` completions."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoModelForSequenceClassification, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from fastgrpo.models import (
    DTYPES,
    check_loaded,
    check_model_source,
    check_tokenizer_files,
    resolve_dtype,
    weight_files,
)
from fastgrpo.paths import expand_user


def assistant(text: str) -> dict[str, str]:
    """A completion's text as the assistant's message."""
    return {"role": "assistant", "content": text}


def load_reward_models(
    funcs: Sequence[Any], device: torch.device, dtype: str, chat_template_kwargs: dict[str, Any] | None = None
) -> None:
    """Load every `RewardModel` of ``funcs`` onto ``device`` in the run's ``dtype`` option (``auto`` resolved as
    the policy's is, `fastgrpo.models.resolve_dtype`), rendering conversations with the run's
    ``chat_template_kwargs`` (as TRL renders them for a reward model)."""
    for func in funcs:
        if isinstance(func, RewardModel):
            func.load(device, DTYPES[resolve_dtype(dtype, device)])
            func.chat_template_kwargs = {**(chat_template_kwargs or {}), **func.chat_template_kwargs}  # its own win


def check_scorer_config(path: str) -> None:
    """Raise ``ValueError`` naming ``reward_funcs`` when the local model directory ``path`` is not a reward model by
    its ``config.json`` alone (nothing loaded): an architecture that is not a sequence classifier (a causal LM's
    directory would load with a score head at random), or a classifier of more than one label (TRL and fastgrpo
    score with one logit)."""
    import json

    config_file = Path(path).expanduser() / "config.json"
    if not config_file.is_file():
        return  # a hub id: checked as it loads
    try:
        config = json.loads(config_file.read_text())
    except ValueError as e:
        raise ValueError(f"reward_funcs: {config_file} is not JSON ({e})") from None
    architectures = config.get("architectures") or []
    if architectures and not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise ValueError(
            f"reward_funcs: {path} is a {architectures[0]}, not a sequence-classification model: its score head would "
            "start at random; give a reward model (saved by AutoModelForSequenceClassification with one label)"
        )
    labels = len(config.get("id2label") or {}) or config.get("num_labels", 2)  # none written: transformers' two
    if labels != 1:
        raise ValueError(
            f"reward_funcs: {path} classifies into {labels} labels; a reward model scores with one (num_labels=1)"
        )


class RewardModel:
    """A reward function that scores with a sequence-classification model.

    Args:
        model: a directory saved by ``save_pretrained`` (with its tokenizer), or a loaded
            ``PreTrainedModel`` (its tokenizer ``tokenizer``, or read from ``model.name_or_path``).
        tokenizer: the reward model's tokenizer (TRL's ``reward_processing_classes``); default: the model's own.
        batch_size: completions scored per forward.
        chat_template_kwargs: what its chat template renders conversations with (`load_reward_models` sets the
            run's, as TRL's ``chat_template_kwargs`` reach a reward model's template).
    """

    def __init__(
        self,
        model: str | Path | PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None = None,
        batch_size: int = 16,
        chat_template_kwargs: dict[str, Any] | None = None,
    ):
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        if batch_size < 1:
            raise ValueError(f"RewardModel: batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self.model: PreTrainedModel | None = None
        self.path: str | None = None
        if isinstance(model, PreTrainedModel):
            self.model = model.eval()
            self.path = model.name_or_path or None
        else:
            self.path = expand_user(str(model), "reward_funcs")
            check_model_source(self.path, "reward_funcs")  # a directory with a config.json, or a hub id
            check_tokenizer_files(self.path, "reward_funcs")
            check_scorer_config(self.path)
        if tokenizer is None and self.path is None:
            raise ValueError("RewardModel: a model without a name_or_path needs its tokenizer")
        self.tokenizer = tokenizer
        # the name of its metrics (rewards/<name>/...), as TRL names a reward model: the last part of its path
        self.__name__ = Path(self.path).name if self.path else type(self.model).__name__

    def parameter_count(self) -> int | None:
        """Its parameters: the loaded model's, or those a local directory's safetensors headers list (None: weights
        in another format, or a hub id)."""
        if self.model is not None:
            return sum(p.numel() for p in self.model.parameters())
        files = weight_files(Path(self.path)) if Path(self.path).is_dir() else []
        count = 0
        for file in files:
            with safe_open(file, "pt") as weights:
                count += sum(math.prod(weights.get_slice(key).get_shape()) for key in weights.keys())  # noqa: SIM118
        return count or None

    def load(self, device: torch.device, dtype: torch.dtype) -> None:
        """Load the model (named by a path) onto ``device`` in ``dtype``, and its tokenizer; a loaded model is moved
        there. Its pad token is the tokenizer's (the score is read at each row's last token that is not padding)."""
        if self.model is None:
            try:
                model, info = AutoModelForSequenceClassification.from_pretrained(
                    self.path, num_labels=1, dtype=dtype, device_map=device, output_loading_info=True
                )
            except (OSError, ValueError) as e:
                raise ValueError(
                    f"reward_funcs: cannot load {self.path} as a sequence-classification model: {e}"
                ) from None
            check_loaded(model, self.path, info, "reward_funcs")  # no score head at random, no NaN weights
            self.model = model.eval()
        else:
            self.model.to(device)
        if self.tokenizer is None:
            self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model.config.get_text_config().pad_token_id = self.tokenizer.pad_token_id

    def texts(self, prompts: Sequence[Any], completions: Sequence[Any]) -> list[str]:
        """What the model reads: each conversation (the prompt's messages and the completion, a message list or the
        assistant's text) through the tokenizer's chat template, or each plain prompt followed by its completion."""
        if not prompts or not isinstance(prompts[0], list):
            return [p + c for p, c in zip(prompts, completions, strict=True)]
        if self.tokenizer.chat_template is None:
            raise ValueError(
                f"reward model {self.__name__}: the prompts are conversations and its tokenizer has no chat template; "
                "give a tokenizer that has one"
            )
        return [
            self.tokenizer.apply_chat_template(
                p + (c if isinstance(c, list) else [assistant(c)]), tokenize=False, **self.chat_template_kwargs
            )
            for p, c in zip(prompts, completions, strict=True)
        ]

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float]:
        """The first logit of the model for each prompt with its completion, in batches of ``batch_size``."""
        if self.model is None:
            self.load(torch.device("cpu"), torch.float32)
        device = next(self.model.parameters()).device
        texts, scores = self.texts(prompts, completions), []
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(
                texts[start : start + self.batch_size],
                return_tensors="pt",
                padding=True,
                padding_side="right",
                add_special_tokens=False,
            ).to(device)
            with torch.inference_mode():
                scores += self.model(**batch).logits[:, 0].float().tolist()
        return scores
