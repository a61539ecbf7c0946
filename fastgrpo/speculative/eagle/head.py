"""EAGLE-style draft head: one decoder layer of the target's own architecture, fed the target's features.

For a sequence ``x_0 .. x_n`` with target final hidden states ``h_0 .. h_n`` (``lm_head(h_i)`` predicts
``x_{i+1}``), the draft reads the pair ``(embed(x_{i+1}), h_i)`` at position ``i + 1``, projects the
concatenation back to the hidden size, runs one decoder layer (built from the target's config, so Llama, Qwen2,
Qwen3 and Mistral all work) and predicts ``h_{i+1}``; the target's LM head turns that into next-token logits.
The embedding and LM head are the target's own modules, passed in at call time: shared, never copied.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModel, PretrainedConfig, PreTrainedModel

from fastgrpo.paths import free_bytes, read_text, size_text
from fastgrpo.rollout.linear import rollout_linear

DRAFT_WEIGHTS = "draft.safetensors"
DRAFT_CONFIG = "draft_config.json"  # the file that makes a directory a saved draft
REMAKE = "make the draft again with `fastgrpo draft train`, or start from a fresh draft without it"
# Architecture fields a draft must share with its target.
TARGET_FIELDS = ("model_type", "hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads")


def target_signature(config: PretrainedConfig) -> dict[str, object]:
    """What identifies the target a draft belongs to (architecture, not weights: the policy keeps training)."""
    text = config.get_text_config()
    return {name: getattr(text, name, None) for name in TARGET_FIELDS}


def _body_config(target_config: PretrainedConfig) -> PretrainedConfig:
    """The target's config cut to one decoder layer, without a vocabulary of its own."""
    cfg = copy.deepcopy(target_config.get_text_config())
    cfg.num_hidden_layers = 1
    cfg.vocab_size = 1  # the body is fed embeddings; its own embedding table is never used
    cfg.pad_token_id = None
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = ["full_attention"]
    if hasattr(cfg, "use_sliding_window"):
        cfg.use_sliding_window = False
    cfg._attn_implementation = "sdpa"
    return cfg


class DraftHead(nn.Module):
    """The draft model's own parameters: the input projection and one decoder layer (with its final norm).

    Args:
        target_config: config of the target model.
        target_name: a human-readable name of the target, stored with the draft.
        draft_vocab: optional ``[V_d]`` target token ids the draft may propose (a reduced vocabulary); the LM
            head is then evaluated on those rows only.
    """

    def __init__(self, target_config: PretrainedConfig, target_name: str = "", draft_vocab: torch.Tensor | None = None):
        super().__init__()
        self.signature = target_signature(target_config)
        self.target_name = target_name
        hidden = self.signature["hidden_size"]
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)
        self.body = AutoModel.from_config(_body_config(target_config))
        self.body.get_input_embeddings().requires_grad_(False)  # the body is fed features, never token ids
        self.register_buffer("draft_vocab", draft_vocab)  # None (full vocabulary) is kept out of the state dict

    @property
    def decoder(self) -> nn.Module:
        """The transformers base model the rollout engine runs with a `RowCache` of one layer."""
        return self.body

    def features(self, token_embeds: torch.Tensor, target_hidden: torch.Tensor) -> torch.Tensor:
        """``[B, T, 2H] -> [B, T, H]`` input features from token embeddings and (target or draft) hidden states."""
        return self.fc(torch.cat([token_embeds, target_hidden.to(token_embeds.dtype)], dim=-1))

    def forward(
        self,
        token_embeds: torch.Tensor,
        target_hidden: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **body_kwargs,
    ) -> torch.Tensor:
        """Forward over whole sequences (training): ``[B, T, H]`` predicted next hidden states.

        Pair ``j`` is ``(embed(x_{j+1}), h_j)`` at position ``j + 1``; ``attention_mask`` is the ``[B, T]`` padding
        mask (right padding) of a causal forward, or a 4D mask; ``body_kwargs`` (a cache) go to the decoder layer.
        """
        x = self.features(token_embeds, target_hidden)
        out = self.body(inputs_embeds=x, attention_mask=attention_mask, position_ids=position_ids, **body_kwargs)
        return out.last_hidden_state

    def logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """Next-token logits over the draft vocabulary: ``[..., V]`` (or ``[..., V_d]`` with a reduced one).

        The LM head is the target's and stays frozen here: no gradient reaches it from the draft's loss."""
        if self.draft_vocab is None:
            bias = getattr(lm_head, "bias", None)
            return rollout_linear(hidden, lm_head.weight.detach(), None if bias is None else bias.detach())
        return rollout_linear(hidden, self._head_rows(lm_head.weight))

    def forget_head_rows(self) -> None:
        """Gather the LM-head rows again at the next draft: the target's weights may have been written in a way its
        version counter does not show (FSDP2 gathers a rollout's parameters into the same tensors)."""
        self._rows_key = None

    def _head_rows(self, weight: torch.Tensor) -> torch.Tensor:
        """``[V_d, H]`` LM-head rows of the draft vocabulary. While drafting (no autograd) the gathered rows are kept
        until the head's weights change or `forget_head_rows`, instead of being gathered again at every tree level."""
        if torch.is_grad_enabled() or torch.compiler.is_compiling():  # a compiled graph gathers them in place
            return weight.detach()[self.draft_vocab]
        key = (weight.data_ptr(), weight._version)
        if getattr(self, "_rows_key", None) != key:
            self._rows, self._rows_key = weight[self.draft_vocab], key
        return self._rows

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary ids to target ids (identity without a reduced vocabulary)."""
        return ids if self.draft_vocab is None else self.draft_vocab[ids]

    # -- persistence ---------------------------------------------------------------------------------------
    def write(self, directory: str | Path) -> Path:
        """Write ``draft.safetensors`` and ``draft_config.json`` (naming the target) into ``directory``, made when
        missing; what the disk refuses is an ``OSError`` naming the file. A checkpoint writes its draft so, inside
        its own temporary directory; `save` writes a draft directory of its own."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        weights = directory / DRAFT_WEIGHTS
        try:
            save_file(tensors, str(weights))
        except SafetensorError as e:  # how safetensors reports a full disk
            raise OSError(f"{weights}: {e}") from e
        meta = {
            "target": self.signature,
            "target_name": self.target_name,
            "body_config": self.body.config.to_dict(),
            "draft_vocab_size": None if self.draft_vocab is None else int(self.draft_vocab.numel()),
        }
        (directory / DRAFT_CONFIG).write_text(json.dumps(meta, indent=2))
        return directory

    def save(self, directory: str | Path) -> Path:
        """Write the draft (`write`) into a temporary directory beside ``directory`` and move it into place, so that
        a failure leaves no half-written draft; ``ValueError`` naming ``directory`` and the space free on its disk
        when the disk refuses it. Other files in an existing ``directory`` are kept."""
        directory = Path(directory).absolute()
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = directory.with_name(f".{directory.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            self.write(tmp)
            _move_into(tmp, directory)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            reason = e.strerror or str(e.__cause__ or e)  # not the temporary file's name
            free = size_text(free_bytes(directory))
            raise ValueError(f"could not write the draft to {directory}: {reason} ({free} free on its disk)") from e
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return directory

    @classmethod
    def load(cls, directory: str | Path, target: PreTrainedModel) -> DraftHead:
        """Load a draft saved by `save` for ``target``; a draft made for another architecture is refused."""
        directory = Path(directory)
        meta = read_draft_config(directory)
        expected = target_signature(target.config)
        if meta["target"] != expected:
            diff = {k: (meta["target"].get(k), v) for k, v in expected.items() if meta["target"].get(k) != v}
            raise ValueError(
                f"draft in {directory} was made for target {meta.get('target_name') or meta['target']}, not for "
                f"this model; mismatching fields (draft, target): {diff}"
            )
        tensors = _read_weights(directory / DRAFT_WEIGHTS)
        param = next(target.parameters())
        draft = cls(target.config, meta.get("target_name", ""), tensors.get("draft_vocab"))
        draft = draft.to(device=param.device, dtype=param.dtype)  # before loading, so no precision is lost
        draft.load_state_dict(tensors)
        return draft


def _move_into(tmp: Path, directory: Path) -> None:
    """Move the draft written in ``tmp`` to ``directory``: the whole directory where there is none yet, else file by
    file (each replaced at once, files of others kept), the config that makes a directory a draft last."""
    if not directory.exists():
        os.replace(tmp, directory)
        return
    for name in (DRAFT_WEIGHTS, DRAFT_CONFIG):
        os.replace(tmp / name, directory / name)
    tmp.rmdir()


def read_draft_config(directory: Path) -> dict[str, Any]:
    """The ``draft_config.json`` of the draft saved in ``directory``; ``ValueError`` naming the file when it is not a
    JSON object holding the draft's ``target`` (a file cut short, edited by hand or written by another tool)."""
    path = directory / DRAFT_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {directory} is not a saved draft")
    try:
        meta = json.loads(read_text(path))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg}: line {e.lineno}, column {e.colno}); {REMAKE}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("target"), dict):
        found = f"keys {sorted(meta)}" if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(
            f"{path}: expected a JSON object whose 'target' names the architecture the draft was made for, got "
            f"{found}; {REMAKE}"
        )
    return meta


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a draft's weights file; ``ValueError`` naming it when it is not a readable safetensors file."""
    try:
        return load_file(str(path))
    except SafetensorError as e:
        raise ValueError(f"{path}: not a readable safetensors file ({e}); {REMAKE}") from None
