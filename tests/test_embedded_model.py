"""The embedded default model's conversion on a fresh machine: processes that convert it at once into an empty cache
(test workers, torchrun's ranks, two runs) make one model, and none of them fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from fastgrpo.models import convert_embedded

CONVERT = (
    "import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stderr); "
    "from fastgrpo.models import resolve_model_path; print(resolve_model_path('smollm2'))"
)


def test_processes_converting_at_once_make_one_model(tmp_path: Path) -> None:
    """Two processes start on a cache that holds an incomplete directory (a conversion whose config.json is gone):
    one replaces it, the other waits and takes its model."""
    target = tmp_path / "SmolLM2-135M-Instruct"
    target.mkdir()
    (target / "model.safetensors").write_bytes(b"cut short")
    env = {**os.environ, "FASTGRPO_CACHE": str(tmp_path)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CONVERT], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    assert {out.strip() for out, _ in outs} == {str(target)}
    assert sum(err.count("Converting SmolLM2") for _, err in outs) == 1, "one process converts, the others wait"
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name, f"{target.name}.lock"], "no temporary left"
    assert json.loads((target / "config.json").read_text())["model_type"] == "llama"
    assert (target / "tokenizer.json").is_file() and (target / "model.safetensors").stat().st_size > 100_000_000
    assert convert_embedded(target) == target  # completed: taken as it is
