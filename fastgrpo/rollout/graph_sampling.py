"""A sampling setting as a compiled decoding step takes it (`GraphSampling`): the temperature and greedy decoding as
tensors, so that one graph serves every temperature and greedy decoding alike (a greedy evaluation during sampled
training compiles and records nothing more); top-k, top-p and min-p stay constants, as they change what the graph
computes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastgrpo.sampling_params import SamplingParams


@dataclass(frozen=True)
class GraphSampling:
    """Sampling as a compiled step runs it: every row is drawn by its uniform (`fastgrpo.rollout.sampling.sample`) at
    ``temperature`` (``[1]``), then, where ``argmax`` (``[1]`` bool) holds, replaced by the distribution's argmax.
    (One element, not a 0-d tensor: the compiler takes a 0-d CPU tensor for a number, and traces every graph twice.)
    Greedy decoding is the argmax at temperature 1 without filters: the plain softmax's argmax and log-probabilities,
    as an eager greedy step gives them, whatever the uniforms. ``greedy`` is what the sampling functions branch on:
    never, in a graph that always samples."""

    temperature: torch.Tensor
    argmax: torch.Tensor
    top_k: int
    top_p: float
    min_p: float
    greedy: bool = False

    @staticmethod
    def filters(params: SamplingParams) -> tuple[int, float, float]:
        """The constants of ``params``' graph: its top-k, top-p and min-p (none when greedy)."""
        return (0, 1.0, 0.0) if params.greedy else (params.top_k, params.top_p, params.min_p)

    @classmethod
    def of(cls, params: SamplingParams, device: torch.device) -> GraphSampling:
        temperature = torch.tensor([1.0 if params.greedy else params.temperature], dtype=torch.float64, device=device)
        argmax = torch.tensor([params.greedy], device=device)
        return cls(temperature, argmax, *cls.filters(params))
