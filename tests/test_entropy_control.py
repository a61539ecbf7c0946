"""The entropy bonus's coefficient under adaptive entropy control: moved after each optimizer step towards the
target, bounded, applied only after a step at or below the target, and carried through a checkpoint."""

from __future__ import annotations

import math

import pytest

from fastgrpo import GRPOConfig
from fastgrpo.grpo.entropy_control import EntropyControl


def test_the_coefficient_follows_the_entropy_within_its_bounds() -> None:
    config = GRPOConfig(
        entropy_coef=0.1,
        use_adaptive_entropy=True,
        entropy_target=1.0,
        entropy_coef_delta=0.05,
        entropy_coef_min=0.02,
        entropy_coef_max=0.2,
    )
    control = EntropyControl(config)
    assert control.enabled and control.applied() == 0.0 and control.last_entropy == math.inf  # none measured yet
    control.observe(entropy_sum=8.0, tokens=10.0)  # 0.8: at most the target, the coefficient rises and applies
    assert control.coef == pytest.approx(0.15) and control.applied() == pytest.approx(0.15)
    control.observe(9.0, 10.0)
    control.observe(9.0, 10.0)
    assert control.coef == pytest.approx(0.2), "capped at entropy_coef_max"
    for _ in range(5):
        control.observe(30.0, 10.0)  # above the target: it falls, and the bonus is off
    assert control.coef == pytest.approx(0.02) and control.applied() == 0.0
    restored = EntropyControl(config)
    restored.load_state_dict(control.state_dict())
    assert (restored.coef, restored.last_entropy) == (control.coef, control.last_entropy)


def test_a_fixed_coefficient_stays_and_idle_options_are_refused() -> None:
    control = EntropyControl(GRPOConfig(entropy_coef=0.3))
    control.observe(1.0, 10.0)
    assert control.applied() == 0.3 and control.enabled
    assert not EntropyControl(GRPOConfig()).enabled
    with pytest.raises(ValueError, match="entropy_target has no effect with use_adaptive_entropy false"):
        GRPOConfig(entropy_target=1.0).check_given({"entropy_target": 1.0})
    with pytest.raises(ValueError, match=r"entropy_coef_min \(0.5\) must not be above entropy_coef_max \(0.1\)"):
        GRPOConfig(use_adaptive_entropy=True, entropy_coef_min=0.5, entropy_coef_max=0.1).validate()
