"""Slow ranks on purpose (parallel/straggler.py, ``parallel.straggler``).

A listed rank sleeps (slowdown - 1 + jitter u) times its step's compute time,
time inside communicator calls not counted; the jitter is seeded; unlisted
ranks get no straggler; settings out of range and ranks outside the job are
one-line errors naming the key, from the config and from ``mpitrain train``.
"""

import time

import numpy as np
import pytest

from mpitrain.cli import main
from mpitrain.comm.single import SingleCommunicator
from mpitrain.config import ConfigError, RunConfig, load_config
from mpitrain.parallel import straggler as straggler_module
from mpitrain.parallel.registry import build_strategy
from mpitrain.parallel.straggler import Straggler, StragglerRankError, build_straggler

from ..helpers import small_overrides, QUICKSTART


class _Comm:
    """Just what a straggler reads: rank, size and the time spent communicating."""

    def __init__(self, rank=1, size=4):
        self.rank, self.size, self.comm_time = rank, size, 0.0


@pytest.fixture
def sleeps(monkeypatch):
    """Record the sleeps instead of sleeping; the clock advances by hand."""
    clock = {"now": 100.0}
    slept = []
    monkeypatch.setattr(straggler_module.time, "perf_counter", lambda: clock["now"])
    monkeypatch.setattr(straggler_module.time, "sleep", slept.append)
    return clock, slept


def test_sleeps_the_compute_time_times_slowdown_minus_one(sleeps):
    clock, slept = sleeps
    comm = _Comm()
    slow = Straggler(comm, slowdown=3.0)
    slow.step_started()
    clock["now"] += 0.5           # a 0.5 s step ...
    comm.comm_time += 0.1         # ... of which 0.1 s inside communication calls
    assert slow.step_finished() == pytest.approx(0.8)     # (3 - 1) x 0.4 s
    assert slept == [pytest.approx(0.8)] and slow.steps == 1


def test_jitter_is_a_seeded_extra_fraction(sleeps):
    clock, slept = sleeps

    def pauses(seed, rank=1):
        slow = Straggler(_Comm(rank=rank), slowdown=2.0, jitter=0.5, seed=seed)
        out = []
        for _ in range(20):
            slow.step_started()
            clock["now"] += 1.0
            out.append(slow.step_finished())
        return np.array(out)

    a = pauses(seed=1)
    assert np.all(a >= 1.0) and np.all(a < 1.5) and a.std() > 0
    assert np.array_equal(a, pauses(seed=1))
    assert not np.array_equal(a, pauses(seed=2))
    assert not np.array_equal(a, pauses(seed=1, rank=2))


def test_each_repeat_of_a_benchmark_draws_its_own_jitter(sleeps):
    # a benchmark's repeats of a run with the same seed were one draw N times: each
    # repeat is seeded apart, and the first is a single run's draw
    clock, _ = sleeps

    def pauses(**repeat):
        slow = Straggler(_Comm(), slowdown=2.0, jitter=0.5, seed=1, **repeat)
        out = []
        for _ in range(10):
            slow.step_started()
            clock["now"] += 1.0
            out.append(slow.step_finished())
        return out

    draws = [pauses(repeat=k) for k in range(3)]
    assert draws[0] == pauses()
    assert draws[0] != draws[1] and draws[1] != draws[2] and draws[0] != draws[2]
    assert draws == [pauses(repeat=k) for k in range(3)]


def test_slowdown_one_does_not_sleep(sleeps):
    clock, slept = sleeps
    slow = Straggler(_Comm(), slowdown=1.0)
    slow.step_started()
    clock["now"] += 1.0
    assert slow.step_finished() == 0.0 and slept == []


def test_really_sleeps():
    slow = Straggler(_Comm(), slowdown=2.0)
    slow.step_started()
    time.sleep(0.05)
    start = time.perf_counter()
    slow.step_finished()
    assert time.perf_counter() - start >= 0.045


def test_only_listed_ranks_are_slowed():
    assert build_straggler([1, 3], _Comm(rank=0)) is None
    assert isinstance(build_straggler([1, 3], _Comm(rank=3)), Straggler)
    assert build_straggler([], _Comm(rank=0)) is None


def test_rank_outside_the_job_is_one_line_naming_the_key():
    with pytest.raises(StragglerRankError) as info:
        build_straggler([1, 4], _Comm(rank=0, size=4))
    message = str(info.value)
    assert message.startswith("parallel.straggler.ranks:") and "4" in message
    assert "\n" not in message
    assert info.value.agreed            # every rank raises it together: no abort


def test_registry_attaches_the_straggler_to_every_method():
    cfg = load_config(None, ["parallel.straggler.ranks=[0]"])
    for method in ("model_averaging", "allreduce", "bmuf", "kaldi", "adpsgd"):
        cfg.parallel.method = method
        strategy = build_strategy(cfg, SingleCommunicator(), total_steps=10)
        assert isinstance(strategy.straggler, Straggler), method
    assert build_strategy(RunConfig(), SingleCommunicator()).straggler is None


@pytest.mark.parametrize("setting,expected", [
    ("parallel.straggler.ranks=[-1]", "parallel.straggler.ranks: expected a list of integers"),
    ("parallel.straggler.ranks=[1.5]", "parallel.straggler.ranks: expected a list of integers"),
    ("parallel.straggler.ranks=1", "parallel.straggler.ranks: expected a list of integers"),
    ("parallel.straggler.slowdown=0.5", "parallel.straggler.slowdown: expected a number in [1"),
    ("parallel.straggler.jitter=-0.1", "parallel.straggler.jitter: expected a number in [0"),
    ("parallel.straggler.speed=2", "parallel.straggler.speed: unknown key"),
])
def test_bad_settings_are_one_line_naming_the_key(setting, expected):
    with pytest.raises(ConfigError) as info:
        load_config(None, [setting])
    assert str(info.value).startswith(expected), str(info.value)
    assert "\n" not in str(info.value)


def test_train_with_a_rank_outside_the_job_stops_at_start(small_corpus, tmp_path, capsys):
    argv = ["train", QUICKSTART, "--run-dir", str(tmp_path / "run")]
    for item in small_overrides(small_corpus) + ["parallel.straggler.ranks=[0,2]",
                                                  "model.hidden_dim=16"]:
        argv += ["--set", item]
    assert main(argv) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "parallel.straggler.ranks: rank 2 is not in this job" in err[0], err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
