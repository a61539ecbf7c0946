"""Tests for the linear layers the rollout engine runs with on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model
from torch import nn

from fastgrpo.rollout import linear
from fastgrpo.rollout.linear import (
    FEW_ROWS,
    TIMED_ROWS,
    LinearRoutes,
    calibrate,
    rollout_linear,
    rollout_linears,
    routes_for,
)


@pytest.mark.parametrize(
    "shape", [(1, 16), (2, 16), (3, 16), (1, 1, 16), (2, 3, 16), (1, FEW_ROWS + 3, 16), (4, 8, 16)]
)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(
    ("dtype", "rtol", "atol"), [(torch.float64, 0, 1e-12), (torch.float32, 0, 1e-5), (torch.bfloat16, 1.6e-2, 2e-2)]
)
def test_rollout_linear_equals_linear(
    shape: tuple[int, ...], with_bias: bool, dtype: torch.dtype, rtol: float, atol: float
) -> None:
    """Whatever route the row count takes (the default table, or one measured earlier in this process); in bfloat16
    up to the rounding of a different summation order."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g, dtype=dtype)
    weight = torch.randn(24, 16, generator=g, dtype=dtype)
    bias = torch.randn(24, generator=g, dtype=dtype) if with_bias else None
    out = rollout_linear(x, weight, bias)
    assert out.shape == (*shape[:-1], 24) and out.dtype == dtype and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=rtol, atol=atol)


def test_rollout_linear_on_a_strided_input() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 16, 40, generator=g)[..., ::2]  # [3, 16, 20], not contiguous
    weight = torch.randn(8, 20, generator=g)
    torch.testing.assert_close(rollout_linear(x, weight), F.linear(x, weight), rtol=0, atol=1e-5)


def test_rollout_linear_leaves_products_autograd_needs_to_linear() -> None:
    """oneDNN's linear has no backward: a product that needs a gradient goes through ``F.linear``."""
    x = torch.randn(FEW_ROWS + 4, 16, requires_grad=True)
    weight = torch.randn(8, 16)
    rollout_linear(x, weight).square().sum().backward()
    expected = 2 * F.linear(x, weight).detach() @ weight
    torch.testing.assert_close(x.grad, expected)


@pytest.mark.parametrize("rows", [2, FEW_ROWS + 4])
def test_rollout_linear_follows_autocast(rows: int) -> None:
    """Draft training autocasts to bfloat16 and computes the target's logits without autograd: a bfloat16 input
    meets the float32 LM head, as in ``F.linear`` under autocast."""
    x = torch.randn(rows, 16).bfloat16()
    weight = torch.randn(8, 16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(rollout_linear(x, weight), F.linear(x, weight))


def test_rollout_linear_leaves_float16_to_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear, "_product", lambda *a: pytest.fail("a float16 product was routed"))
    x = torch.randn(2, 16, dtype=torch.float16)
    weight = torch.randn(8, 16, dtype=torch.float16)
    assert torch.equal(rollout_linear(x, weight), F.linear(x, weight))


def test_rollout_linears_patches_every_linear_and_restores_them() -> None:
    model = tiny_model("llama")
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    assert linears
    ids = torch.tensor([[3, 5, 7]])
    with torch.no_grad():
        plain = model(ids, use_cache=False).logits
        with rollout_linears(model, None):
            assert all("forward" in m.__dict__ for m in linears)
            patched = model(ids[:, :1], use_cache=False).logits  # one row: the padded path
        assert all("forward" not in m.__dict__ for m in linears)
        with pytest.raises(RuntimeError), rollout_linears(model):
            raise RuntimeError("inside")
        assert all("forward" not in m.__dict__ for m in linears)
        with rollout_linears(model, model.get_output_embeddings()):  # a layer reached twice is restored once
            pass
        assert all("forward" not in m.__dict__ for m in linears)
    torch.testing.assert_close(patched, plain[:, :1], rtol=0, atol=1e-10)


def test_rollout_linears_patches_bfloat16_layers_and_leaves_float16_ones_alone() -> None:
    routed, kept = nn.Linear(16, 8).to(torch.bfloat16), nn.Linear(16, 8).to(torch.float16)
    with rollout_linears(routed, kept):
        assert "forward" in routed.__dict__ and "forward" not in kept.__dict__
    assert "forward" not in routed.__dict__


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_every_route_computes_the_product(dtype: torch.dtype, rows: int) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 16, generator=g).to(dtype)
    weight = torch.randn(24, 16, generator=g).to(dtype)
    bias = torch.randn(24, generator=g).to(dtype)
    tol = {"rtol": 1.6e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {}
    for name in routes_for(dtype, rows):
        torch.testing.assert_close(linear._product(name, x, weight, bias), F.linear(x, weight, bias), **tol)
    assert ("vector" in routes_for(dtype, rows)) == (rows == 1)  # a matrix-vector product takes one row
    assert ("split" in routes_for(dtype, rows)) == (rows == 1)
    assert "onednn" not in routes_for(torch.float64, rows)  # oneDNN has no float64 linear
    assert "onednn" not in routes_for(torch.bfloat16, rows)  # in bfloat16, F.linear already runs on oneDNN


@pytest.mark.parametrize(("threads", "out"), [(2, 24), (3, 24), (2, 25), (1, 24)])
def test_the_split_route_cuts_the_rows_into_one_block_per_thread(threads: int, out: int) -> None:
    """One row: blocks of output rows in one batched product, as many as threads where they divide the rows equally
    (else, and on one thread, the matrix-vector product)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, generator=g, dtype=torch.float64)
    weight = torch.randn(out, 16, generator=g, dtype=torch.float64)
    bias = torch.randn(out, generator=g, dtype=torch.float64)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for b in (None, bias):
            product = linear._product("split", x, weight, b)
            assert product.shape == (1, out) and product.is_contiguous()
            torch.testing.assert_close(product, F.linear(x, weight, b), rtol=0, atol=1e-12)
    finally:
        torch.set_num_threads(before)


def test_calibration_picks_the_fastest_route(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a fake clock that each product advances by its route's cost, the cheapest route of every timed row count is
    chosen, and a route made slow never is."""
    clock = [0.0]
    cost = {"linear": 3.0, "transposed": 1.0, "onednn": 2.0, "vector": 0.5, "split": 0.7}
    product = linear._product

    def timed_product(name, x, weight, bias):
        clock[0] += cost[name]
        return product(name, x, weight, bias)

    monkeypatch.setattr(linear, "_product", timed_product)
    monkeypatch.setattr(linear.time, "perf_counter", lambda: clock[0])
    weights = [torch.randn(24, 16, dtype=torch.float64), torch.randn(16, 24, dtype=torch.float64)]
    table = calibrate(weights)
    assert set(table) == set(TIMED_ROWS) and "linear" not in table.values()
    assert table[1] == "vector" and {table[m] for m in TIMED_ROWS[1:]} == {"transposed"}


@pytest.mark.parametrize(("transposed_cost", "chosen"), [(0.9, "transposed"), (0.99, "linear")])
def test_calibration_keeps_linear_unless_another_route_is_clearly_faster(
    monkeypatch: pytest.MonkeyPatch, transposed_cost: float, chosen: str
) -> None:
    """Timed on a clock that each product advances by its route's cost: ``transposed`` replaces ``linear`` when it
    is 10 % faster, not when it is 1 % faster (`CALIBRATION_MARGIN`)."""
    clock = [0.0]
    cost = {"linear": 1.0, "transposed": transposed_cost, "onednn": 2.0, "vector": 2.0, "split": 2.0}
    product = linear._product

    def timed_product(name, x, weight, bias):
        clock[0] += cost[name]
        return product(name, x, weight, bias)

    monkeypatch.setattr(linear, "_product", timed_product)
    monkeypatch.setattr(linear.time, "perf_counter", lambda: clock[0])
    table = calibrate([torch.randn(24, 16, dtype=torch.float32)])
    assert set(table.values()) == {chosen}


def test_products_follow_the_measured_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """A row count takes the route of the nearest timed row count at or above it (the largest beyond them)."""
    table = {m: ("linear" if i % 2 else "transposed") for i, m in enumerate(TIMED_ROWS)}  # 1: transposed, 2: linear..
    routes = LinearRoutes("measured")
    routes.tables[torch.float64] = table
    assert [routes.route(torch.float64, m) for m in (1, 2, 3, 4, 5, 9, 17, 1000)] == [
        table[1],
        table[2],
        table[4],
        table[4],
        table[8],
        table[16],
        table[32],
        table[128],
    ]
    taken = []
    product = linear._product
    monkeypatch.setattr(linear, "_product", lambda name, *a: taken.append(name) or product(name, *a))
    x, weight = torch.randn(3, 16, dtype=torch.float64), torch.randn(8, 16, dtype=torch.float64)
    with routes.applied():
        rollout_linear(x, weight)
    with LinearRoutes("default").applied():
        rollout_linear(x, weight)
    rollout_linear(x, weight)  # outside any routes: the default table
    assert taken == [table[4], "transposed", "transposed"]


def test_only_one_row_products_take_the_vector_route(monkeypatch: pytest.MonkeyPatch) -> None:
    """A table that times ``vector`` fastest at one row sends one-row products there, and only those; an empty
    product takes ``linear``."""
    routes = LinearRoutes("measured")
    routes.tables[torch.float64] = {**dict.fromkeys(TIMED_ROWS, "transposed"), 1: "vector"}
    taken = []
    product = linear._product
    monkeypatch.setattr(linear, "_product", lambda name, *a: taken.append(name) or product(name, *a))
    weight, bias = torch.randn(8, 16, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    for shape in [(1, 1, 16), (2, 16), (0, 16)]:
        x = torch.randn(*shape, dtype=torch.float64)
        with routes.applied():
            torch.testing.assert_close(rollout_linear(x, weight, bias), F.linear(x, weight, bias))
    assert taken == ["vector", "transposed", "linear"]


def test_routes_are_measured_once_per_machine_and_model_shape(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The first engine on a machine measures its model's routes and saves them; a later one (another process) reads
    them without measuring; a model of other shapes, though of the same dtype, is measured for itself; a damaged file
    is measured again."""
    monkeypatch.setenv("FASTGRPO_CACHE", str(tmp_path))
    calls = []

    def fake_calibrate(weights: list[torch.Tensor]) -> dict[int, str]:
        calls.append(weights)
        return {**dict.fromkeys(TIMED_ROWS, "linear"), 2: "transposed"}

    monkeypatch.setattr(linear, "calibrate", fake_calibrate)
    model = tiny_model("llama")
    routes = LinearRoutes()
    routes.measure(model)
    with routes.applied(model):  # measured already
        pass
    assert len(calls) == 1 and all(w.dtype == torch.float64 for w in calls[0])
    assert routes.route(torch.float64, 3) == "linear" and routes.route(torch.float64, 2) == "transposed"
    (saved,) = (tmp_path / "linear_routes").iterdir()
    later = LinearRoutes()  # a new process on the same machine
    with later.applied(model):
        assert later.route(torch.float64, 2) == "transposed"
    assert len(calls) == 1
    wider = nn.Linear(64, 48).double()
    LinearRoutes().measure(wider)
    assert len(calls) == 2 and [tuple(w.shape) for w in calls[1]] == [(48, 64)]
    saved.write_text("{not json")
    LinearRoutes().measure(model)
    assert len(calls) == 3 and json.loads(saved.read_text())["2"] == "transposed"


def test_calibration_times_at_most_its_budget_of_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a big model only the first weights are timed (at least one), each tensor once."""
    shared = torch.randn(4, 4)
    weights = [shared, shared, torch.randn(4, 4), torch.randn(4, 4)]
    monkeypatch.setattr(linear, "CALIBRATION_ELEMENTS", 40)
    chosen = linear._calibration_weights(weights)
    assert [w.data_ptr() for w in chosen] == [weights[0].data_ptr(), weights[2].data_ptr()]
    monkeypatch.setattr(linear, "CALIBRATION_ELEMENTS", 1)
    assert len(linear._calibration_weights(weights)) == 1


def test_routes_pinned_to_the_default_table_or_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear, "calibrate", lambda weights: pytest.fail("calibrated although pinned"))
    monkeypatch.setenv("FASTGRPO_LINEAR_ROUTES", "default")
    routes = LinearRoutes()
    with routes.applied(tiny_model("llama")):  # float64 layers: not calibrated
        assert routes.route(torch.float32, 2) == "transposed"
    monkeypatch.setenv("FASTGRPO_LINEAR_ROUTES", "off")
    routes = LinearRoutes()
    routes.tables[torch.float32] = dict.fromkeys(TIMED_ROWS, "transposed")
    with routes.applied(tiny_model("llama")):  # F.linear everywhere, whatever was measured
        assert routes.route(torch.float32, 2) == "linear"
    monkeypatch.setenv("FASTGRPO_LINEAR_ROUTES", "fastest")
    with pytest.raises(ValueError, match="FASTGRPO_LINEAR_ROUTES"):
        LinearRoutes()
