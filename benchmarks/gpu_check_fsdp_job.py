"""The job of `gpu_check`'s torchrun section: ``fastgrpo train`` as it is, with, at each rollout, the CUDA graphs
recorded during it counted and the addresses of the parameters it computes with noted (FSDP2 gathers them anew for
every rollout: where they move, CUDA graph trees record the rollout's graphs again). Rank 0 writes them to ``RECORD``
as JSON, also when the run fails.

    python -m torch.distributed.run --nproc_per_node 1 benchmarks/gpu_check_fsdp_job.py RECORD --config CONFIG
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from gpu_check_common import counted_captures

from fastgrpo import distributed
from fastgrpo.cli import main


def run(record: Path, args: list[str]) -> None:
    """``fastgrpo train ARGS`` with each rollout's recordings and parameter addresses written to ``record``."""
    rollouts: list[dict] = []
    gathered = distributed.gathered

    @contextlib.contextmanager
    def noted(policy: torch.nn.Module) -> Iterator[None]:
        with gathered(policy):
            addresses = [p.data_ptr() for p in policy.parameters()]
            before = captures.count
            try:
                yield
            finally:
                recorded = None if before is None else captures.count - before
                sharded = distributed.is_sharded(policy)
                rollouts.append({"recordings": recorded, "addresses": addresses, "sharded": sharded})

    distributed.gathered = noted  # the trainer gathers through the module's attribute
    try:
        with counted_captures() as captures:
            main(["train", *args])
    finally:
        if os.environ.get("RANK", "0") == "0":
            record.write_text(json.dumps({"rollouts": rollouts}))


if __name__ == "__main__":
    run(Path(sys.argv[1]), sys.argv[2:])
