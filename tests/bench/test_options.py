"""The benchmark's options: methods from the strategy registry, errors naming the option."""

import math

import pytest

from mpitrain.bench import options as bench_options
from mpitrain.bench.options import BenchOptions
from mpitrain.parallel import registry


def test_methods_come_from_the_strategy_registry(monkeypatch):
    assert BenchOptions().resolve(2) == ((1, 2), tuple(registry.METHODS))
    monkeypatch.setitem(registry.METHODS, "ring_mix", registry.METHODS["model_averaging"])
    assert "ring_mix" in BenchOptions().resolve(2)[1]
    assert BenchOptions(methods=("ring_mix",)).methods == ("ring_mix",)
    assert bench_options.METHODS is registry.METHODS


def test_bad_options_name_the_option():
    with pytest.raises(ValueError, match="--sizes: must include 1"):
        BenchOptions(sizes=(2, 4))
    with pytest.raises(ValueError, match="--methods: unknown nope"):
        BenchOptions(methods=("nope",))
    with pytest.raises(ValueError, match="--target-accuracy"):
        BenchOptions(target_accuracy=1.5)
    with pytest.raises(ValueError, match="--sizes: 4 ranks asked for, but the job has 2"):
        BenchOptions(sizes=(1, 4)).resolve(2)
    assert not math.isnan(BenchOptions().network.latency_s)
