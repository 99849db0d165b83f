"""The benchmark's options: methods from the strategy registry, errors naming the option."""

import math

import pytest

from mpitrain.bench import options as bench_options
from mpitrain.bench.options import BenchOptions
from mpitrain.parallel import registry


def test_methods_come_from_the_strategy_registry(monkeypatch):
    synchronous = tuple(m for m in registry.METHODS if m not in registry.ASYNCHRONOUS_METHODS)
    assert BenchOptions().resolve(2) == ((1, 2), synchronous)
    assert "param_server" not in synchronous     # no common steps, no one-rank group
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


def test_lr_scale_sets_the_rates_of_n_ranks():
    from mpitrain.bench.phases import scaled_rates
    from mpitrain.config import config_from_dict
    cfg = config_from_dict({"optimizer": {"initial_learning_rate": 0.004,
                                          "final_learning_rate": 0.0004}})
    assert scaled_rates(cfg, BenchOptions(), 16) == {}
    assert scaled_rates(cfg, BenchOptions(lr_scale="linear"), 1) == {}
    got = scaled_rates(cfg, BenchOptions(lr_scale="linear"), 16)
    assert got == {"optimizer__initial_learning_rate": pytest.approx(0.064),
                   "optimizer__final_learning_rate": pytest.approx(0.0064)}
    got = scaled_rates(cfg, BenchOptions(lr_scale="sqrt"), 16)
    assert got["optimizer__initial_learning_rate"] == pytest.approx(0.016)
    assert BenchOptions(lr_scale="sqrt").to_dict()["lr_scale"] == "sqrt"
    with pytest.raises(ValueError, match="--lr-scale: expected one of none, linear, sqrt"):
        BenchOptions(lr_scale="cubic")


def test_asynchronous_adpsgd_is_refused_in_one_line():
    from mpitrain.bench.options import check_benchable
    from mpitrain.config import load_config
    from ..helpers import QUICKSTART
    cfg = load_config(QUICKSTART, ["parallel.method=adpsgd", "parallel.asynchronous=true"])
    with pytest.raises(ValueError, match="parallel.asynchronous") as info:
        check_benchable(cfg, ("model_averaging", "adpsgd"))
    assert "\n" not in str(info.value)
    check_benchable(cfg, ("model_averaging",))      # ADPSGD not among the methods: fine


def test_the_accuracy_phase_alone_needs_a_target():
    from mpitrain.bench.options import BenchOptions
    with pytest.raises(ValueError, match="--phases accuracy: .* needs --target-accuracy"):
        BenchOptions(sizes=(1, 2), phases=("accuracy",))
    assert BenchOptions(sizes=(1, 2), phases=("accuracy",), target_accuracy=0.5).phases
    # with the throughput phase as well, the accuracy phase is skipped with a notice
    assert BenchOptions(sizes=(1, 2), phases=("throughput", "accuracy")).phases


def test_hierarchical_adpsgd_without_ranks_per_node_is_refused_in_one_line():
    from mpitrain.bench.options import check_benchable
    from mpitrain.config import load_config
    from ..helpers import QUICKSTART
    cfg = load_config(QUICKSTART, ["parallel.method=adpsgd", "parallel.hierarchical=true"])
    with pytest.raises(ValueError, match="parallel.ranks_per_node") as info:
        check_benchable(cfg, ("adpsgd",))
    assert "\n" not in str(info.value)
    check_benchable(cfg, ("model_averaging",))      # ADPSGD not among the methods: fine
    cfg = load_config(QUICKSTART, ["parallel.method=adpsgd", "parallel.hierarchical=true",
                                   "parallel.ranks_per_node=2"])
    check_benchable(cfg, ("adpsgd",))
