"""The learning-rate schedule."""

import pytest

from mpitrain.optim.schedule import ExponentialSchedule


def test_exponential_schedule():
    s = ExponentialSchedule(0.01, 0.001)
    assert s(0) == pytest.approx(0.01)
    assert s(0.5) == pytest.approx(0.01 * 0.1 ** 0.5)
    assert s(1) == pytest.approx(0.001)
    assert s(2) == pytest.approx(0.001)
