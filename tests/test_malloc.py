"""glibc malloc thresholds (`fastgrpo.malloc`): set once per process by the command line, never by a library object."""

import ctypes
import sys

import pytest

from fastgrpo import malloc


def _glibc() -> bool:
    try:
        return sys.platform.startswith("linux") and hasattr(ctypes.CDLL("libc.so.6"), "mallopt")
    except OSError:
        return False


@pytest.fixture
def fresh(monkeypatch):
    """Forget this process's earlier outcome (the thresholds themselves stay as set)."""
    monkeypatch.setattr(malloc, "_applied", None)


@pytest.mark.skipif(not _glibc(), reason="needs glibc")
def test_thresholds_are_set_on_glibc(fresh, monkeypatch):
    monkeypatch.delenv("FASTGRPO_MALLOC", raising=False)
    calls = []
    real = malloc._set_thresholds
    monkeypatch.setattr(malloc, "_set_thresholds", lambda: calls.append(1) or real())
    assert malloc.keep_freed_memory()
    assert malloc.keep_freed_memory()
    assert calls == [1]  # once per process


def test_system_leaves_glibc_alone(fresh, monkeypatch):
    monkeypatch.setenv("FASTGRPO_MALLOC", "system")
    monkeypatch.setattr(malloc, "_set_thresholds", lambda: pytest.fail("mallopt must not run"))
    assert not malloc.keep_freed_memory()


def test_bad_value_names_the_variable(fresh, monkeypatch):
    monkeypatch.setenv("FASTGRPO_MALLOC", "jemalloc")
    with pytest.raises(ValueError, match="FASTGRPO_MALLOC"):
        malloc.keep_freed_memory()


def test_the_cli_sets_them_and_an_engine_does_not(monkeypatch, llama_model, tmp_path):
    """Building an engine changes nothing process-wide; the command line sets the allocator before a command that
    runs a model (here `generate`, stopped by its argument check) and not for `report`."""
    from fastgrpo import cli
    from fastgrpo.rollout.engine import RolloutEngine

    calls = []
    monkeypatch.setattr(malloc, "keep_freed_memory", lambda: calls.append(1))
    RolloutEngine(llama_model, eos_token_ids=[0])
    assert calls == []
    with pytest.raises(SystemExit):
        cli.main(["generate", "--prompt", "hi", "--num-generations", "0"])
    assert calls == [1]
    with pytest.raises(SystemExit):
        cli.main(["report", str(tmp_path)])
    assert calls == [1]
