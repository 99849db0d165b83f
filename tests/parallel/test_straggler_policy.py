"""``parallel.straggler_policy: adapt`` (parallel/model_averaging.py): a slow rank
trains fewer minibatches per period, its model weighted by the frames it saw, so
one 2x-slow rank no longer halves the job; checked on virtual ranks, where the
clock is simulated and the slow rank is exactly 2x."""

import numpy as np
import pytest

from mpitrain.comm.virtual import VirtualCluster
from mpitrain.config import ConfigError, load_config
from mpitrain.parallel.model_averaging import ModelAveraging
from mpitrain.train.virtual import ComputeModel, run_virtual_trainers

from ..helpers import QUICKSTART, small_overrides


class _Net:
    def __init__(self, values):
        self.params = np.asarray(values, dtype=np.float32)


class _Optimizer:
    def momentum_buffer(self):
        return None

    def after_average(self):
        pass


def test_the_average_weights_each_model_by_its_minibatches():
    def work(comm):
        strategy = ModelAveraging(comm, every_steps=8, straggler_policy="adapt")
        strategy.quotas = [8, 8, 4]
        net = _Net([comm.rank + 1.0, 10.0 * comm.rank])
        strategy.average(net, _Optimizer())
        return net.params

    results = VirtualCluster(3).run(work)
    expected = np.array([(8 * 1 + 8 * 2 + 4 * 3) / 20, (8 * 0 + 8 * 10 + 4 * 20) / 20])
    for params in results:
        assert np.allclose(params, expected, rtol=1e-6)
        assert np.array_equal(params, results[0])


def test_averaged_momentum_is_weighted_as_the_models():
    class WithMomentum(_Optimizer):
        def __init__(self, value):
            self.delta = np.full(2, value, dtype=np.float32)

        def momentum_buffer(self):
            return self.delta

    def work(comm):
        strategy = ModelAveraging(comm, every_steps=8, straggler_policy="adapt",
                                  average_momentum=True)
        strategy.quotas = [8, 4]
        optimizer = WithMomentum(1.0 if comm.rank == 0 else 4.0)
        strategy.average(_Net([0.0, 0.0]), optimizer)
        return optimizer.delta

    for momentum in VirtualCluster(2).run(work):
        assert np.allclose(momentum, (8 * 1.0 + 4 * 4.0) / 12, rtol=1e-6)


def test_a_short_last_period_weights_each_model_by_the_minibatches_it_trained():
    """K = 4, quotas 4 and 2: rank 1 trains at positions 0 and 2.  A run ending
    after 3 steps of the period (finalize), or an evaluation there (average_models_),
    weighs the models 3 : 2, the minibatches each trained, not 4 : 2."""
    def work(comm):
        strategy = ModelAveraging(comm, every_steps=4, straggler_policy="adapt")
        strategy.quotas = [4, 2]
        assert [strategy._trains_at(p, 2) for p in range(4)] == [True, False, True, False]
        evaluated = np.full(3, 1.0 if comm.rank == 0 else 6.0, dtype=np.float32)
        strategy.average_models_(evaluated, 7)          # 3 steps into the second period
        net = _Net(np.full(3, 1.0 if comm.rank == 0 else 6.0))
        strategy.finalize(net, _Optimizer(), 7)
        return evaluated, net.params

    for evaluated, final in VirtualCluster(2).run(work):
        assert np.allclose(evaluated, (3 * 1.0 + 2 * 6.0) / 5, rtol=1e-6)
        assert np.allclose(final, (3 * 1.0 + 2 * 6.0) / 5, rtol=1e-6)


def test_equal_quotas_average_exactly_as_without_the_policy():
    def work(comm, policy):
        strategy = ModelAveraging(comm, every_steps=8, straggler_policy=policy)
        net = _Net(np.linspace(0, 1, 7) * (comm.rank + 1) / 3)
        strategy.average(net, _Optimizer())
        return net.params

    plain = VirtualCluster(3).run(lambda comm: work(comm, "none"))
    adapt = VirtualCluster(3).run(lambda comm: work(comm, "adapt"))
    assert np.array_equal(plain[0], adapt[0])


def _train(corpus, tmp_path, policy):
    cfg = load_config(QUICKSTART, small_overrides(corpus) + [
        "model.hidden_dim=32", "model.hidden_layers=2", "training.minibatch=64",
        "training.max_steps=240", "parallel.average_every=8", "training.log_interval=40",
        "training.checkpoint_interval=0", f"parallel.straggler_policy={policy}"])
    compute = ComputeModel(step_seconds=0.01, slowdown={3: 2.0})
    pairs = run_virtual_trainers(cfg, size=4, run_dir=str(tmp_path / policy), compute=compute)
    return [trainer for trainer, _ in pairs], pairs[0][1]


def test_one_slow_rank_no_longer_halves_the_job(small_corpus, tmp_path):
    _, waiting = _train(small_corpus, tmp_path, "none")
    trainers, adapting = _train(small_corpus, tmp_path, "adapt")
    # without the policy every period takes the slow rank's 8 x 20 ms
    assert waiting["seconds"] == pytest.approx(240 * 0.02, rel=0.02)
    # with it the slow rank trains 4 of each 8 minibatches (after the first period)
    assert [t.strategy.quotas for t in trainers] == [[8, 8, 8, 4]] * 4
    assert adapting["seconds"] < 0.56 * waiting["seconds"]
    frames_ratio = adapting["frames"] / waiting["frames"]
    assert frames_ratio == pytest.approx((3 + 0.5) / 4, abs=0.02)
    # throughput (frames per simulated second) against the run that waits
    throughput = (adapting["frames"] / adapting["seconds"]) / (
        waiting["frames"] / waiting["seconds"])
    assert throughput > 1.5
    assert adapting["dev_acc"] > 0.1                       # it learned (chance: 1/120)


def test_quotas_travel_in_checkpoints():
    def work(comm):
        strategy = ModelAveraging(comm, every_steps=8, straggler_policy="adapt")
        strategy.quotas, strategy.step_seconds = [8, 3], [0.01, 0.027]
        state = strategy.state_dict()
        again = ModelAveraging(comm, every_steps=8, straggler_policy="adapt")
        again.load_state_dict(state)
        return again.quotas, again.step_seconds, [again.is_active(s) for s in range(8)]

    quotas, seconds, active = VirtualCluster(2).run(work)[1]
    assert quotas == [8, 3] and seconds == [0.01, 0.027]
    # 3 of 8, spread evenly: positions 0, 3 and 6
    assert active == [True, False, False, True, False, False, True, False]


def test_the_policy_is_for_model_averaging_only():
    with pytest.raises(ConfigError, match="parallel.straggler_policy: adapt works with "
                                          "parallel.method model_averaging, not allreduce"):
        load_config(QUICKSTART, ["parallel.method=allreduce",
                                 "parallel.straggler_policy=adapt"])


@pytest.mark.mpi
def test_under_mpiexec_a_sleeping_rank_gets_a_smaller_quota(mpiexec, small_corpus, tmp_path):
    """Real ranks and wall time: rank 1 sleeps its step twice over (3x slow); the
    quotas measured from wall time give it about a third of each period."""
    from mpitrain.train.checkpoint import list_checkpoints, load_checkpoint
    from ..helpers import mpi_output, records, train_on_ranks

    run = tmp_path / "run"
    result = train_on_ranks(2, run, small_corpus, [
        "model.hidden_dim=64", "model.hidden_layers=2", "training.max_steps=160",
        "parallel.average_every=8", "parallel.straggler_policy=adapt",
        "parallel.straggler.ranks=[1]", "parallel.straggler.slowdown=3.0",
        "training.log_interval=40", "blas_threads=1"], timeout=240)
    assert result.returncode == 0, mpi_output(result)
    quotas = list(load_checkpoint(list_checkpoints(str(run))[-1], ranks=[]).strategy_state[
        "quotas"])
    # (about 3 on an idle machine; foreign load slows rank 0 as well, which brings
    # the measured ratio nearer 1: 6 was seen on a loaded 2-core machine)
    assert quotas[0] == 8 and 1 <= quotas[1] < 8, quotas
    end = records(run, "end")[0]
    assert end["frames"] < 160 * 2 * 256 and end["dev_acc"] > 0.05     # minibatch 256
