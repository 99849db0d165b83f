"""The parameter server with averaged SGD (parallel/param_server.py, train/serving.py).

In this process: the running average follows its formula on a scripted
sequence (exponential, then uniform from the switch); the data shares leave
the server out; one client equals sequential SGD on the same minibatches bit
for bit (2 virtual ranks against one rank); a virtual run replays exactly with
the same seed.  Under real ``mpiexec``: 3 ranks learn far above chance (slow);
uneven shards with a 2x slow client finish within a timeout, every client
having taken its own number of minibatches; a resumed run continues from the
checkpoint's model and counters; with 1, 2 and 3 servers each server steps
and averages only its own slice, bit for bit as the whole-buffer step did
(tests/workers/param_server_worker.py).
"""

import os
import shutil

import h5py
import numpy as np
import pytest

from mpitrain.comm.virtual import VirtualCluster
from mpitrain.config import load_config
from mpitrain.nn.model_file import load_model
from mpitrain.parallel.param_server import (EXPONENTIAL, UNIFORM, ModelAverage,
                                            ParameterServer, data_share)
from mpitrain.testing.mpirun import MpiTimeoutError
from mpitrain.train.virtual import ComputeModel, train_virtual

from ..helpers import (QUICKSTART, mpi_output, records, small_overrides, train_in_process,
                       train_on_ranks)

TINY = ["model.hidden_dim=32", "model.hidden_layers=2"]


def _strategy_group(path):
    with h5py.File(path, "r") as f:
        group = f["strategy"]
        state = {k: group[k][()] for k in group}
        state.update(group.attrs)
    return state


# ---------------------------------------------------------------- the average

def test_average_follows_its_formula_on_a_scripted_sequence():
    rng = np.random.default_rng(4)
    thetas = [rng.standard_normal(6).astype(np.float32) for _ in range(40)]
    eta, switch_after = 0.1, 25
    avg = ModelAverage(thetas[0], eta=eta)
    ref = np.float64(thetas[0])
    for t, theta in enumerate(thetas[1:], start=1):
        if t == switch_after + 1:
            avg.switch_to_uniform(updates=switch_after)
            samples = 1                       # theta_bar at t0 is the first sample
        avg.update(theta)
        if t <= switch_after:
            ref = (1 - eta) * ref + eta * np.float64(theta)
            assert avg.mode == EXPONENTIAL
        else:
            samples += 1
            ref = ref + (np.float64(theta) - ref) / (t - switch_after + 1)
            assert avg.mode == UNIFORM and avg.samples == samples == t - switch_after + 1
        np.testing.assert_allclose(avg.average, ref, rtol=1e-5, atol=1e-6)
    # the uniform part is the plain mean of theta_bar(t0) and the thetas after it
    at_switch = np.float64(thetas[0])
    for theta in thetas[1:switch_after + 1]:
        at_switch = (1 - eta) * at_switch + eta * np.float64(theta)
    mean = np.mean([at_switch] + [np.float64(x) for x in thetas[switch_after + 1:]], axis=0)
    np.testing.assert_allclose(avg.average, mean, rtol=1e-5, atol=1e-6)
    assert avg.switched_at == switch_after


def test_average_state_round_trip_and_refusals():
    avg = ModelAverage(np.ones(3, dtype=np.float32), eta=0.5)
    avg.update(np.zeros(3, dtype=np.float32))
    avg.switch_to_uniform(updates=7)
    other = ModelAverage(np.zeros(3, dtype=np.float32), eta=0.5)
    other.load_state_dict(avg.state_dict())
    assert (other.mode, other.samples, other.switched_at) == (UNIFORM, 1, 7)
    np.testing.assert_array_equal(other.average, avg.average)
    with pytest.raises(ValueError, match="average_eta"):
        ModelAverage(np.zeros(2, dtype=np.float32), eta=0.0)
    with pytest.raises(ValueError, match="average_mode"):
        other.load_state_dict(dict(avg.state_dict(), average_mode="cubic"))


def test_a_restarted_uniform_average_drops_the_models_it_carried():
    rng = np.random.default_rng(5)
    thetas = [rng.standard_normal(6).astype(np.float32) for _ in range(12)]
    avg = ModelAverage(thetas[0], eta=0.1)
    for theta in thetas[1:4]:
        avg.update(theta)
    avg.switch_to_uniform(updates=3)
    for theta in thetas[4:7]:
        avg.update(theta)
    avg.restart_uniform(thetas[6], updates=6)
    assert (avg.mode, avg.samples, avg.switched_at) == (UNIFORM, 1, 6)
    for theta in thetas[7:]:
        avg.update(theta)
    # the mean of theta at the restart and the thetas after it, nothing before
    np.testing.assert_allclose(avg.average, np.mean(np.float64(thetas[6:]), axis=0),
                               rtol=1e-5, atol=1e-6)
    part = ModelAverage(thetas[0], eta=0.1, span=slice(2, 4))
    part.restart_uniform(thetas[5], updates=5)
    assert np.array_equal(part.average[2:4], thetas[5][2:4])
    assert np.array_equal(part.average[:2], thetas[0][:2])     # outside its slice: untouched


@pytest.mark.parametrize("servers,size", [(1, 3), (2, 4)])
def test_an_early_switch_is_undone_when_the_current_model_is_the_better(small_corpus,
                                                                       tmp_path, servers,
                                                                       size):
    """Evaluations from the first minibatches on: the average, a shade better than a
    model near chance, turned uniform at once and then carried those early models
    to the end (held-out accuracy 0.17 here, 0.41 with the restarts).
    Now the uniform average starts again whenever the current model is the better."""
    run = tmp_path / "run"
    _virtual(small_corpus, run, size, ["training.epochs=3", "training.eval_interval=5120",
                                       "training.log_interval=50",
                                       "training.checkpoint_interval=0",
                                       f"parallel.servers={servers}",
                                       # (the scenario: undamped, the current model
                                       # trains slowly near chance at first)
                                       "parallel.damp_staleness=false"])
    averages = records(run, "average")
    assert averages[0]["mode"] == UNIFORM and not averages[0].get("restarted")
    restarts = [r for r in averages[1:] if r.get("restarted")]
    assert restarts and all(r["switched_at"] == r["step"] for r in restarts), averages
    evals = records(run, "eval")
    for record in evals:
        if any(r["step"] == record["step"] for r in restarts):
            # it restarted because the current model was the better
            assert record["current_dev_xent"] < record["dev_xent"], record
    final = evals[-1]
    assert final["dev_acc"] > 0.35, final      # the final model (the better of the two)
    compared = [e for e in evals if "current_dev_acc" in e][-1]
    assert compared["dev_acc"] >= compared["current_dev_acc"] - 0.05, compared


def test_the_server_trains_on_no_data():
    assert data_share(0, 3) == (None, 2)
    assert [data_share(r, 3) for r in (1, 2)] == [(0, 2), (1, 2)]
    with pytest.raises(ValueError, match="at least 2 ranks"):
        data_share(0, 1)


def test_push_and_pull_carry_raw_buffers_on_virtual_ranks():
    """Two clients push twice each; the server sees every push once, with staleness."""
    from mpitrain.nn.network import build_network
    from mpitrain.optim.sgd import SGD

    def work(comm):
        net = build_network(feat_dim=3, num_classes=2, left_context=0, right_context=0,
                            hidden_layers=1, hidden_dim=4)
        net.init_params(seed=1)
        opt = SGD(net, max_change_per_layer=0, max_change_output=0, max_change=0)
        ps = ParameterServer(comm, average_eta=0.5)
        ps.setup(net, opt)
        if ps.is_server:
            for client in ps.clients:
                ps.send_weights(net, client)
            seen, left = [], set(ps.clients)
            while left:
                push = ps.receive_push(net)
                seen.append((push.source, push.kind, push.frames, push.staleness,
                             float(net.grads[0])))
                ps.apply(net, opt, 1.0, push)
                if push.kind == 2:
                    left.discard(push.source)
                else:
                    ps.send_weights(net, push.source)
            return seen, ps.client_steps
        for k in range(2):
            ps.pull(net)
            net.grads[...] = comm.rank * 10 + k
            ps.push(net, loss_sum=1.0, correct=0.0, frames=comm.rank, position=k,
                    last=k == 1)
        return None

    seen, counts = VirtualCluster(3).run(work)[0]
    assert sorted((s, g) for s, _, _, _, g in seen) == [(1, 10.0), (1, 11.0), (2, 20.0),
                                                       (2, 21.0)]
    assert counts == [2, 2]
    assert [f for s, _, f, _, _ in seen] == [s for s, _, _, _, _ in seen]
    # both clients computed on version 0 first: the second gradient applied is 1 old
    assert [st for _, _, _, st, _ in seen][:2] == [0, 1]


# ------------------------------------------------------------ whole runs

def _virtual(corpus, run_dir, size, extra=(), *, slowdown=None, resume=False, **trainer_kwargs):
    cfg = load_config(QUICKSTART, small_overrides(corpus) + TINY + [
        "parallel.method=param_server"] + list(extra))
    return train_virtual(cfg, size=size, run_dir=str(run_dir), resume=resume,
                         compute=ComputeModel(step_seconds=0.002, slowdown=slowdown or {}),
                         **trainer_kwargs)


def test_one_client_equals_sequential_sgd_bit_for_bit(small_corpus, tmp_path):
    # the server's step is the one rank's step (max-change included) on the same
    # gradient of the same minibatch at the same weights
    common = TINY + ["training.max_steps=30", "training.log_interval=10",
                     "training.checkpoint_interval=0"]
    sequential = tmp_path / "sequential"
    train_in_process(sequential, small_corpus, common)
    served = tmp_path / "served"
    _virtual(small_corpus, served, 2, common)
    reference, _ = load_model(sequential / "final.h5")
    ckpt = sorted(served.glob("ckpt-*.h5"))[-1]
    state = _strategy_group(ckpt)
    assert state["updates"] == 30 and list(state["client_steps"]) == [30]
    assert np.array_equal(state["current"], reference.params)
    # final.h5 is the better of the two on held-out data: after 30 updates the
    # exponential average (eta 0.01) still lies near the initial model
    final, _ = load_model(served / "final.h5")
    assert records(served, "eval")[-1]["model"] == "current"
    np.testing.assert_array_equal(final.params, state["current"])
    assert not np.array_equal(state["average"], reference.params)


def test_progress_records_name_the_epoch_as_the_lock_step_methods_do(small_corpus, tmp_path):
    # the epoch was the updates over an epoch's: the last update of epoch 0 was
    # logged in epoch 1, and a 2-epoch run ended in "ep 2"
    common = TINY + ["training.epochs=2", "training.log_interval=1", "data.dev=",
                     "training.checkpoint_interval=0"]
    sequential, served = tmp_path / "sequential", tmp_path / "served"
    train_in_process(sequential, small_corpus, common)
    _virtual(small_corpus, served, 2, common)
    expected = {r["step"]: r["epoch"] for r in records(sequential, "train")}
    logged = {r["step"]: r["epoch"] for r in records(served, "train")}
    assert logged == expected and max(logged.values()) == 1


def _final_kept(run):
    """(the final eval record, the final model's parameters, the last checkpoint's
    strategy group)."""
    final, _ = load_model(run / "final.h5")
    return (records(run, "eval")[-1], final.params,
            _strategy_group(sorted(run.glob("ckpt-*.h5"))[-1]))


def test_the_end_keeps_the_current_model_when_the_average_is_worse(small_corpus, tmp_path):
    """A tiny average_eta: the exponential average never left the initial model and
    was saved as the final model (held-out accuracy 0.045 where training had 0.24)."""
    run = tmp_path / "run"
    _virtual(small_corpus, run, 3, ["training.max_steps=60", "training.eval_interval=2560",
                                    "training.checkpoint_interval=0",
                                    "parallel.average_eta=1e-9"])
    assert not records(run, "average")          # never switched to uniform
    final, params, state = _final_kept(run)
    assert final["model"] == "current" and final["average_mode"] == EXPONENTIAL
    assert final["dev_acc"] == final["current_dev_acc"] > final["average_dev_acc"] + 0.05
    assert np.array_equal(params, state["current"])
    assert records(run, "end")[-1]["dev_acc"] == final["current_dev_acc"]
    # best.h5 holds it too (the averaged models evaluated before were worse)
    best, _ = load_model(run / "best.h5")
    assert np.array_equal(best.params, params)
    # and during the run, model selection took the current model where it was the
    # better (best.h5 held an average near chance until the end)
    during = [r for r in records(run, "eval") if "model" not in r]
    selections = records(run, "selection")
    assert during and selections[0]["step"] == during[0]["step"]
    assert selections[0]["best_value"] == during[0]["current_dev_acc"] > during[0]["dev_acc"]


def test_the_end_keeps_the_average_when_it_is_the_better(small_corpus, tmp_path):
    # a high constant rate: the current model is noisy, its average better
    run = tmp_path / "run"
    _virtual(small_corpus, run, 2, ["training.max_steps=150", "training.checkpoint_interval=0",
                                    "parallel.average_eta=0.05",
                                    "optimizer.initial_learning_rate=0.05",
                                    "optimizer.final_learning_rate=0.05"])
    final, params, state = _final_kept(run)
    assert final["model"] == "average", final
    assert final["dev_acc"] == final["average_dev_acc"] > final["current_dev_acc"] + 0.05
    assert np.array_equal(params, state["average"])
    assert not np.array_equal(params, state["current"])


def test_virtual_replay_is_identical_with_the_same_seed(small_corpus, tmp_path):
    extra = ["training.max_steps=40", "training.log_interval=10",
             "training.eval_interval=2560", "training.checkpoint_interval=25"]
    runs = [tmp_path / "a", tmp_path / "b"]
    for run in runs:
        _virtual(small_corpus, run, 4, extra, slowdown={2: 2.0})
    a, _ = load_model(runs[0] / "final.h5")
    b, _ = load_model(runs[1] / "final.h5")
    assert np.array_equal(a.params, b.params)
    for kind in ("train", "eval", "end"):
        strip = ("time", "rss_mb")
        ra = [{k: v for k, v in r.items() if k not in strip} for r in records(runs[0], kind)]
        rb = [{k: v for k, v in r.items() if k not in strip} for r in records(runs[1], kind)]
        assert ra == rb and ra, kind
    train = records(runs[0], "train")
    assert train[-1]["step"] == 120 and max(r["staleness_max"] for r in train) >= 2
    assert all(r["staleness_min"] <= r["staleness_mean"] <= r["staleness_max"] for r in train)
    # the server evaluated both models while the average was exponential
    assert "current_dev_xent" in records(runs[0], "eval")[0]


# ------------------------------------------------------------ real launches

def _train(nranks, run_dir, corpus, settings, *, timeout=120, resume=False):
    return train_on_ranks(nranks, run_dir, corpus, ["parallel.method=param_server", *settings],
                          resume=resume, timeout=timeout)


@pytest.mark.mpi
def test_slow_client_on_uneven_shards_finishes(small_corpus, tmp_path_factory, tmp_path):
    from ..train.test_trainer import write_uneven_copy
    corpus = tmp_path_factory.mktemp("uneven")
    write_uneven_copy(os.path.join(small_corpus, "train"), str(corpus / "train"),
                      [0.70, 0.20, 0.07, 0.03])
    shutil.copytree(os.path.join(small_corpus, "dev"), corpus / "dev")
    run = tmp_path / "run"
    try:
        result = _train(3, run, str(corpus), TINY + [
            "training.epochs=1", "training.log_interval=16", "training.checkpoint_interval=40",
            "parallel.straggler.ranks=[1]", "parallel.straggler.slowdown=2.0",
            "parallel.straggler.jitter=0.5"], timeout=150)
    except MpiTimeoutError as exc:
        pytest.fail(f"param_server with a slow client on uneven shards hung: {exc}")
    assert result.returncode == 0, mpi_output(result)
    end = records(run, "end")[-1]
    counts = list(_strategy_group(sorted(run.glob("ckpt-*.h5"))[-1])["client_steps"])
    # every client did its own data, however much: nothing lost to the smallest
    assert end["steps"] == sum(counts) == records(run, "start")[0]["total_steps"]
    assert counts[0] != counts[1], counts
    assert end["frames"] == 256 * end["steps"] and (run / "final.h5").exists()
    train = records(run, "train")
    assert all("staleness_mean" in r for r in train)


@pytest.mark.mpi
def test_resume_continues_from_the_saved_model_and_counters(small_corpus, tmp_path):
    common = TINY + ["training.epochs=1", "training.log_interval=10",
                     "training.checkpoint_interval=20"]
    run = tmp_path / "run"
    first = _train(3, run, small_corpus, common + ["training.max_steps=20"])
    assert first.returncode == 0, mpi_output(first)
    saved = _strategy_group(sorted(run.glob("ckpt-*.h5"))[-1])
    assert saved["updates"] == 40 and list(saved["client_steps"]) == [20, 20]
    second = _train(3, run, small_corpus, common + ["training.max_steps=50"], resume=True)
    assert second.returncode == 0, mpi_output(second)
    assert [r["step"] for r in records(run, "start")] == [0, 40]
    end = records(run, "end")[-1]
    assert end["steps"] == 100 and end["frames"] == 100 * 256
    final = _strategy_group(sorted(run.glob("ckpt-*.h5"))[-1])
    assert final["updates"] == 100 and list(final["client_steps"]) == [50, 50]
    # the resumed run went on from the trained model, not from the start: its
    # first windows against the first run's (two each: a window of 10 updates
    # from clients at their own pace swings by half a nat)
    train = records(run, "train")
    fresh = [r["xent"] for r in train if r["step"] <= 20]
    resumed = [r["xent"] for r in train if 40 < r["step"] <= 60]
    assert len(fresh) == len(resumed) == 2 and sum(resumed) < sum(fresh), train


@pytest.mark.parametrize("before", [["parallel.method=bmuf"], ["parallel.method=adpsgd"]])
def test_a_switch_to_it_on_resume_starts_the_server_afresh(small_corpus, tmp_path, before):
    """--resume --accept-changes from a method that saves state of its own (BMUF's
    block, ADPSGD's iteration): the server's average starts afresh from the
    checkpoint's model (a KeyError traceback: the saved state has no 'average')."""
    import io
    run, log = tmp_path / "run", io.StringIO()
    common = TINY + ["training.checkpoint_interval=8", "data.dev="]
    first = load_config(QUICKSTART, small_overrides(small_corpus) + common + before + [
        "training.max_steps=8"])
    train_virtual(first, size=2, run_dir=str(run), compute=ComputeModel(step_seconds=0.002))
    _virtual(small_corpus, run, 2, common + ["training.max_steps=24"], resume=True,
             accept_changes=True, stream=log)
    assert "the parallel method's state starts afresh" in log.getvalue(), log.getvalue()
    assert "no 'average': not a parameter server's state" in log.getvalue()
    assert records(run, "end")[-1]["steps"] == 24
    assert (run / "final.h5").exists()


@pytest.mark.mpi
@pytest.mark.slow
def test_three_ranks_learn_far_above_chance(small_corpus, tmp_path):
    from mpitrain.data.corpus import load_manifest
    run = tmp_path / "run"
    result = _train(3, run, small_corpus, ["training.epochs=2"], timeout=300)
    assert result.returncode == 0, mpi_output(result)
    dev = load_manifest(os.path.join(small_corpus, "dev"))
    counts = np.array(dev.class_counts)
    majority = counts.max() / counts.sum()
    final = records(run, "eval")[-1]
    # the bar of the other methods' two-rank runs (chance: 1/120)
    assert final["dev_acc"] > 0.45, final
    assert final["dev_acc"] > majority + 0.40, (final, majority)


# ------------------------------------------------------ a model split over servers

def test_split_by_layers_cuts_at_layer_boundaries_into_near_equal_parts():
    from mpitrain.parallel.param_server import split_by_layers
    assert split_by_layers([10, 10, 10, 10], 2) == [(0, 20), (20, 40)]
    assert split_by_layers([100, 5, 100, 5], 2) == [(0, 105), (105, 210)]
    assert split_by_layers([3, 4], 2) == [(0, 3), (3, 7)]
    assert split_by_layers([7], 1) == [(0, 7)]
    parts = split_by_layers([40, 8, 400, 8, 400, 8, 120, 2], 3)
    assert parts[0][0] == 0 and parts[-1][1] == 986
    assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
    with pytest.raises(ValueError, match="parallel.servers"):
        split_by_layers([1, 2], 3)


def test_several_servers_train_on_no_data():
    assert [data_share(r, 5, servers=2) for r in range(5)] == [
        (None, 3), (None, 3), (0, 3), (1, 3), (2, 3)]
    with pytest.raises(ValueError, match="at least 3 ranks"):
        data_share(0, 2, servers=2)


def test_one_client_of_two_servers_equals_sequential_sgd_bit_for_bit(small_corpus, tmp_path):
    # each server steps its own layers; with the whole-model max-change off (it
    # would see one slice) that is the one rank's step, element for element
    common = TINY + ["training.max_steps=30", "training.log_interval=10",
                     "training.checkpoint_interval=0", "optimizer.max_change=0"]
    sequential = tmp_path / "sequential"
    train_in_process(sequential, small_corpus, common)
    served = tmp_path / "served"
    _virtual(small_corpus, served, 3, common + ["parallel.servers=2"])
    reference, _ = load_model(sequential / "final.h5")
    state = _strategy_group(sorted(served.glob("ckpt-*.h5"))[-1])
    assert state["updates"] == 30 and list(state["client_steps"]) == [30]
    assert np.array_equal(state["current"], reference.params)
    final, _ = load_model(served / "final.h5")
    kept = records(served, "eval")[-1]["model"]
    np.testing.assert_array_equal(final.params, state[kept])


def test_split_servers_log_evaluate_switch_and_checkpoint_on_virtual_ranks(small_corpus,
                                                                           tmp_path):
    extra = ["training.epochs=1", "training.log_interval=10", "training.eval_interval=1280",
             "training.checkpoint_interval=30", "parallel.servers=2",
             "parallel.average_eta=0.2"]
    runs = [tmp_path / "a", tmp_path / "b"]
    for run in runs:
        _virtual(small_corpus, run, 5, extra, slowdown={3: 2.0})
    a, _ = load_model(runs[0] / "final.h5")
    b, _ = load_model(runs[1] / "final.h5")
    assert np.array_equal(a.params, b.params)         # replayed exactly
    end = records(runs[0], "end")[-1]
    assert end["steps"] == records(runs[0], "start")[0]["total_steps"]
    # server 0 asked server 1 for its slices: the whole averaged model was evaluated
    evals = records(runs[0], "eval")
    assert len(evals) > 3 and evals[-1]["dev_xent"] < evals[0]["current_dev_xent"], evals
    assert records(runs[0], "average"), "the average never turned uniform"
    train = records(runs[0], "train")
    assert train[-1]["xent"] < train[0]["xent"]
    assert len(list(runs[0].glob("ckpt-*.h5"))) >= 2


def test_servers_refused_for_another_method():
    from mpitrain.config import ConfigError
    with pytest.raises(ConfigError, match="parallel.servers"):
        load_config(QUICKSTART, ["parallel.servers=2"])


@pytest.mark.mpi
def test_two_servers_with_a_slow_client_finish_on_real_ranks(small_corpus, tmp_path):
    run = tmp_path / "run"
    try:
        result = _train(4, run, small_corpus, TINY + [
            "parallel.servers=2", "training.epochs=1", "training.log_interval=16",
            "training.eval_interval=2560", "training.checkpoint_interval=40",
            "parallel.straggler.ranks=[3]", "parallel.straggler.slowdown=2.0"], timeout=150)
    except MpiTimeoutError as exc:
        pytest.fail(f"param_server with two servers hung: {exc}")
    assert result.returncode == 0, mpi_output(result)
    end = records(run, "end")[-1]
    counts = list(_strategy_group(sorted(run.glob("ckpt-*.h5"))[-1])["client_steps"])
    assert end["steps"] == sum(counts) == records(run, "start")[0]["total_steps"]
    train = records(run, "train")
    assert train[-1]["xent"] < train[0]["xent"], train


@pytest.mark.mpi
@pytest.mark.parametrize("nranks, servers", [(4, 1), (4, 2), (5, 3)])
def test_each_server_steps_and_averages_only_its_slice_as_the_whole_step_did(nranks,
                                                                             servers):
    # tests/workers/param_server_worker.py: each server's record of the pushes it
    # applied, replayed with the whole-buffer step and average, equals its slice bit
    # for bit (SGD with momentum and max-change, NG-SGD, L2); it changed nothing
    # outside its slice and sent only its slice; the checkpoint's view and the final
    # model are the replays put together
    from mpitrain.testing.mpirun import run_mpi
    from ..helpers import WORKERS
    result = run_mpi(nranks, [str(WORKERS / "param_server_worker.py"), str(servers)],
                     timeout=120)
    assert result.returncode == 0, mpi_output(result)
    passed = [line[3:] for line in result.stdout.splitlines() if line.startswith("ok ")]
    assert passed == ["sgd", "ngsgd", "l2"], mpi_output(result)


def test_an_average_over_a_slice_follows_the_whole_average_there():
    rng = np.random.default_rng(4)
    start = rng.standard_normal(10).astype(np.float32)
    whole, part = ModelAverage(start, eta=0.3), ModelAverage(start, eta=0.3, span=slice(3, 7))
    for k in range(6):
        theta = rng.standard_normal(10).astype(np.float32)
        whole.update(theta)
        part.update(theta)
        if k == 2:
            whole.switch_to_uniform(updates=3)
            part.switch_to_uniform(updates=3)
    assert np.array_equal(part.average[3:7], whole.average[3:7])
    assert np.array_equal(part.average[:3], start[:3]) and np.array_equal(part.average[7:],
                                                                         start[7:])


def test_resume_from_a_checkpoint_taken_while_serving_is_bit_exact_with_one_client(
        small_corpus, tmp_path):
    # one client: the run is sequential; the checkpoint at step 20 is taken by the
    # server while serving, with the model, the average and the momentum
    common = TINY + ["training.log_interval=10", "training.checkpoint_interval=10",
                     "optimizer.max_change=0", "optimizer.momentum=0.5",
                     "training.max_steps=30"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    _virtual(small_corpus, straight, 2, common)
    _virtual(small_corpus, split, 2, common)
    for name in ("ckpt-00000030.h5", "final.h5", "best.h5"):
        (split / name).unlink(missing_ok=True)
    _virtual(small_corpus, split, 2, common, resume=True)
    assert [r["step"] for r in records(split, "start")] == [0, 20]
    a = _strategy_group(straight / "ckpt-00000030.h5")
    b = _strategy_group(split / "ckpt-00000030.h5")
    assert np.array_equal(a["current"], b["current"])
    assert np.array_equal(a["average"], b["average"])


def test_a_split_servers_checkpoint_holds_every_servers_momentum(small_corpus, tmp_path):
    run = tmp_path / "run"
    _virtual(small_corpus, run, 4, TINY + [
        "training.log_interval=10", "training.checkpoint_interval=20",
        "optimizer.momentum=0.5", "training.max_steps=30", "parallel.servers=2"])
    from mpitrain.parallel.param_server import split_by_layers
    from mpitrain.train.checkpoint import load_checkpoint
    ckpt = load_checkpoint(str(run / "ckpt-00000040.h5"), ranks=[0])
    momentum = np.asarray(ckpt.rank_state(0)["optimizer"]["delta"])
    net, _ = load_model(run / "final.h5")
    (_, cut), (_, end) = split_by_layers([sl.stop - sl.start for _, sl in net.param_slices], 2)
    # server 1's slice came from server 1 (server 0's own buffer is zero there)
    assert np.abs(momentum[:cut]).max() > 0 and np.abs(momentum[cut:end]).max() > 0


def test_a_stale_gradient_is_applied_at_the_rate_over_one_plus_its_staleness():
    # (without it, three clients at the one-rank rate hovered near chance for the
    # first hundreds of updates: docs/benchmarks.md)
    from types import SimpleNamespace

    from mpitrain.parallel.param_server import GRADIENT, Push

    class Stepped:              # the optimizer: the rate it was asked to step at
        def step(self, lr):
            self.lr = lr

    net = SimpleNamespace(params=np.zeros(2, np.float32))
    for damp, staleness, expected in ((True, 0, 0.004), (True, 3, 0.001), (False, 3, 0.004)):
        ps = ParameterServer(SimpleNamespace(rank=0, size=2), damp_staleness=damp)
        ps.average = ModelAverage(net.params, eta=0.5)      # (one server: no split)
        optimizer = Stepped()
        ps.apply(net, optimizer, 0.004, Push(source=1, kind=GRADIENT, loss_sum=0.0,
                                             correct=0.0, frames=1, position=0,
                                             staleness=staleness, stop=0))
        assert optimizer.lr == pytest.approx(expected)


def test_the_documented_header_has_the_fields_a_push_sends():
    """docs/parallel.md and the module's docstring list the header's fields."""
    import re

    import mpitrain.parallel.param_server as module
    page = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), "docs", "parallel.md")
    with open(page, encoding="utf-8") as fh:
        text = " ".join(fh.read().split())
    for where in (text, " ".join(module.__doc__.split())):
        fields = re.search(r"header `{0,2}\[(kind[^\]]*)\]", where).group(1).split(", ")
        assert len(fields) == module.HEADER_SIZE, fields


@pytest.mark.mpi
def test_a_rank_gone_mid_message_is_named_in_one_line(small_corpus, tmp_path):
    # a client killed by SIGKILL showed on its server as MPI's raw error stack ("Other
    # MPI error, error stack: internal_Recv_c(339)...: MPI_Recv_c(...) failed ...
    # process_vm_readv failed (errno 3)"), naming the rank in words nowhere
    from mpitrain.testing.mpirun import run_mpi
    from ..helpers import WORKERS
    done = run_mpi(2, [str(WORKERS / "peer_lost_worker.py"), "comm"], timeout=60)
    assert done.returncode == 0 and done.stdout.count("ok") == 2, mpi_output(done)
    args = [str(WORKERS / "peer_lost_worker.py"), "train", "--", QUICKSTART,
            "--run-dir", str(tmp_path / "run")]
    for item in small_overrides(small_corpus) + [
            "parallel.method=param_server", "model.hidden_dim=32", "model.hidden_layers=2",
            "training.max_steps=40"]:
        args += ["--set", item]
    done = run_mpi(3, args, timeout=120)
    assert done.returncode == 2, mpi_output(done)
    lines = [line for line in done.stderr.splitlines() if "error:" in line]
    # MPI's words for the error class are its own: MPICH's "Other MPI error", Open
    # MPI's "MPI_ERR_OTHER: known error not in list"; the worker prints them
    said = [line.split(": ", 1)[1] for line in done.stdout.splitlines()
            if line.startswith("ERR_OTHER: ")]
    assert len(said) == 1, mpi_output(done)
    assert lines == [
        "mpitrain train: rank 0: error: comm: rank 2 is gone (ended, killed or its node "
        f"lost) or the link to it broke while rank 0 received from it (MPI: {said[0]}); "
        "the job ends: --resume continues from the newest checkpoint"], \
        mpi_output(done)


def test_the_hand_schedule_counts_the_servers_updates(small_corpus, tmp_path, monkeypatch):
    """You & Xu's ASGD-hand: the rate is multiplied by f after every minibatch the
    server applies, whichever client sent it, so update t (0-based) steps at
    r0 f^t / (1 + its staleness)."""
    applied = []
    apply = ParameterServer.apply

    def recording(self, net, optimizer, lr, push):
        # the rate the optimizer is asked to step at
        step = optimizer.step
        optimizer.step = lambda rate: (applied.append((self.updates, rate, push.staleness)),
                                       step(rate))
        try:
            apply(self, net, optimizer, lr, push)
        finally:
            del optimizer.step

    monkeypatch.setattr(ParameterServer, "apply", recording)
    _virtual(small_corpus, tmp_path / "run", 3, [
        "optimizer.schedule=hand", "optimizer.hand_factor=0.99",
        "optimizer.initial_learning_rate=0.004", "training.max_steps=12",
        "training.log_interval=10", "training.checkpoint_interval=0"])
    assert [t for t, _, _ in applied] == list(range(24))      # 12 minibatches per client
    assert any(staleness for _, _, staleness in applied)
    for t, lr, staleness in applied:
        assert lr == pytest.approx(0.004 * 0.99 ** t / (1 + staleness), rel=1e-12)
