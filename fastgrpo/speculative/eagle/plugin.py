"""The EAGLE drafter's plugin (`fastgrpo.speculative.plugin.DrafterPlugin`): a draft head made fresh, loaded from
a saved draft or, with ``speculation.draft_vocab_size``, made after the first rollout over its most frequent tokens;
saved as a draft directory (`DraftHead.save`); priced by one draft tree level timed in the latency profile; trained
online by `EagleLearner`."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel

from fastgrpo.memory.items import MemoryItem
from fastgrpo.rollout.cache import RowCache
from fastgrpo.rollout.compiled import Compiled
from fastgrpo.rollout.drafter import Drafter
from fastgrpo.rollout.forward import forward_block
from fastgrpo.speculative.eagle.drafter import NAME, EagleDrafter
from fastgrpo.speculative.eagle.head import DRAFT_CONFIG, DraftHead, read_draft_config
from fastgrpo.speculative.eagle.memory import eagle_checkpoint_bytes, eagle_memory
from fastgrpo.speculative.eagle.offline import frequent_tokens_on_all_ranks
from fastgrpo.speculative.eagle.training import DraftTrainer, EagleLearner
from fastgrpo.speculative.plugin import DrafterContext, DrafterPlugin, PlannedRun
from fastgrpo.speculative.profiler import CostProbe

PROBE_TOP_K = 4  # children per node of the timed draft level


def fresh_head(model: PreTrainedModel, model_name: str, seed: int, vocab: torch.Tensor | None = None) -> DraftHead:
    """An untrained draft over the ``[V_d]`` target ids ``vocab`` (None: the full vocabulary), on the model's device
    and dtype, initialised from ``seed`` (the run's random state is left alone)."""
    with torch.random.fork_rng(devices=[]):  # the head is built on the CPU
        torch.default_generator.manual_seed(seed)
        head = DraftHead(model.config, model_name, vocab)
    param = next(model.parameters())
    return head.to(device=param.device, dtype=param.dtype)


class EaglePlugin(DrafterPlugin):
    name = NAME
    captures_hidden = True
    parks_rows = True

    def saved_in(self, directory: Path) -> bool:
        return (directory / DRAFT_CONFIG).is_file()

    def check_saved(self, directory: Path) -> None:
        if self.saved_in(directory):
            read_draft_config(directory)

    def _head(self, ctx: DrafterContext, saved: Path | None) -> DraftHead | None:
        if saved is not None and self.saved_in(saved):
            return DraftHead.load(saved, ctx.model)
        size = ctx.speculation.draft_vocab_size
        if size is None:
            return fresh_head(ctx.model, ctx.model_name, ctx.seed)
        if ctx.rollout is None:  # the vocabulary is the first rollout's most frequent tokens
            return None
        vocab = frequent_tokens_on_all_ranks(ctx.rollout.completion_ids, size, ctx.eos_token_ids)
        return fresh_head(ctx.model, ctx.model_name, ctx.seed, vocab)

    def build(self, ctx: DrafterContext, saved: Path | None = None) -> Drafter | None:
        head = self._head(ctx, saved)
        if head is None:
            return None
        learner = None
        if ctx.draft_training.online:
            embed, lm_head = ctx.model.get_input_embeddings(), ctx.model.get_output_embeddings()
            learner = EagleLearner(DraftTrainer(head, embed, lm_head, ctx.draft_training))
        return EagleDrafter(head, ctx.model, ctx.backend, ctx.profile, learner)

    def save(self, drafter: Drafter, directory: Path) -> None:
        assert isinstance(drafter, EagleDrafter)
        drafter.draft.write(directory)  # a checkpoint's temporary directory: the checkpoint is moved into place whole

    def cost_probe(
        self,
        model: PreTrainedModel,
        tokens: tuple[int, ...],
        context_length: int,
        backend: str | None,
        saved: Path | None = None,
    ) -> CostProbe:
        """One draft tree level (features, the draft layer, its LM head and the top-k) over ``t`` tokens each reading
        about ``context_length`` cached ones; a fresh head times what a saved one of the same vocabulary costs."""
        param = next(model.parameters())
        dev = param.device
        head = DraftHead.load(saved, model) if saved is not None and self.saved_in(saved) else None
        head = (head or fresh_head(model, "", 0)).eval()
        cache = RowCache(head.body.config, max(tokens), context_length + 2, param.dtype, dev, backend is not None)
        level = partial(Compiled(draft_level, backend), dev)
        embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
        gen = torch.Generator(device="cpu").manual_seed(1)
        vocab = model.config.get_text_config().vocab_size
        calls = []
        for t in tokens:
            base = context_length - torch.randint(0, 2, (t,), generator=gen, device="cpu").to(dev)
            ids = torch.randint(0, vocab, (t, 1), generator=gen, device="cpu").to(dev)
            block = (
                base,
                torch.zeros(1, dtype=torch.long, device=dev),
                base[:, None],
                torch.ones(1, 1, dtype=torch.bool, device=dev),
            )
            calls.append(partial(level, head, cache, embed(ids), block, lm_head, PROBE_TOP_K, context_length + 1))
        return CostProbe(calls, (head,))

    def memory(self, run: PlannedRun) -> list[MemoryItem]:
        return eagle_memory(run)

    def checkpoint_bytes(self, run: PlannedRun) -> int:
        return eagle_checkpoint_bytes(run)


def draft_level(
    draft: DraftHead, cache: RowCache, embeds: torch.Tensor, block: tuple, head: nn.Module, top_k: int, extent: int
) -> torch.Tensor:
    """One draft tree level over ``[t, 1]`` tokens: features, the draft layer, its LM head and the top-k."""
    x = draft.features(embeds, torch.zeros_like(embeds))
    out = forward_block(draft.decoder, cache, *block, inputs_embeds=x, extent=extent)
    return torch.log_softmax(draft.logits(out, head).float(), dim=-1).topk(top_k, dim=-1).values
