"""The synchronous parallel methods against float64 references of their rules.

Each reference below is written from the method's rule as the spec
(parallel-algorithms.md) and docs/parallel.md state it, not from the
strategy's code.  The strategies run on virtual ranks with a stand-in for
training: rank r's gradient at step k is g = c(r, k) + a w (it depends on the
weights, so a rule that took it at the wrong weights shows), and a stand-in
optimizer takes w <- w - lr g.  The hooks are called as the training step
calls them (``learning_rate``, ``is_active``, ``reduce_gradients``, the step,
``after_update``; ``finalize`` at the end).  Odd cases: a period that does not
divide the step count, 1 and 3 ranks, BMUF's default block momentum with and
without Nesterov and a block rate other than 1, the Kaldi job ramp at its
iteration boundaries, ADPSGD's partner on each step (the same matching on every
rank, random ring too) and delay-by-one's older gradient.
"""

import numpy as np
import pytest

from mpitrain.comm.virtual import VirtualCluster
from mpitrain.parallel.adpsgd import RingMixing
from mpitrain.parallel.bmuf import BlockMomentum
from mpitrain.parallel.gradient_allreduce import GradientAllreduce
from mpitrain.parallel.kaldi_averaging import KaldiAveraging
from mpitrain.parallel.model_averaging import ModelAveraging

P = 7           # parameters
A = 0.3         # the gradient's dependence on the weights
LR = 0.1
# where the stand-in's layers start in the flat buffer
LAYER_OFFSETS = (5, 2, 0)


def _offset(rank, k):
    return np.random.default_rng([11, rank, k]).standard_normal(P)


def gradient(rank, k, w):
    """Rank ``rank``'s gradient at 1-based step ``k`` and weights ``w`` (float64)."""
    return _offset(rank, k) + A * np.float64(w)


def _start():
    return np.random.default_rng(3).standard_normal(P)


class Net:
    """The flat buffers a strategy touches."""

    xp = np
    param_slices = ()

    def __init__(self, rank):
        # every rank starts elsewhere: setup must broadcast rank 0's model
        self.params = (_start() + rank).astype(np.float32)
        self.grads = np.zeros(P, np.float32)
        self.num_params = P


class Optimizer:
    """w <- w - lr g; a momentum buffer the strategies may average or clear."""

    def __init__(self, net):
        self.net = net
        self.momentum = np.full(P, 1.0 + net.params[0], np.float32)
        self.cleared = self.averages = 0

    def step(self, lr):
        self.net.params -= np.float32(lr) * self.net.grads

    def momentum_buffer(self):
        return self.momentum

    def clear_momentum(self):
        self.momentum[...] = 0
        self.cleared += 1

    def after_average(self):
        self.averages += 1


def drive(strategy, comm, steps, *, lr=LR):
    """Train ``steps`` stand-in steps as train/step.py does; the final model, the
    rates used and the optimizer."""
    net = Net(comm.rank)
    opt = Optimizer(net)
    strategy.setup(net, opt)
    rates = []
    for step in range(steps):
        rate = strategy.learning_rate(lr, step)
        rates.append(rate)
        if strategy.is_active(step):
            net.grads[...] = gradient(comm.rank, step + 1, net.params)
            hook = getattr(net, "grad_ready_hook", None)
            for offset in (LAYER_OFFSETS if hook else ()):   # backward: last layer first
                hook(offset)
            strategy.reduce_gradients(net)
            opt.step(rate)
        strategy.after_update(net, opt, step + 1)
    strategy.finalize(net, opt, steps)
    strategy.close()
    return net.params.copy(), rates, opt


def close(actual, expected):
    np.testing.assert_allclose(actual, expected, rtol=2e-5, atol=2e-5)


# ------------------------------------------------------------ model averaging

def reference_model_averaging(size, steps, every):
    """Local steps; every K steps w_i <- mean_j w_j; a last average if K does not
    divide the steps."""
    w = [_start() for _ in range(size)]
    for k in range(1, steps + 1):
        w = [w[r] - LR * gradient(r, k, w[r]) for r in range(size)]
        if k % every == 0 or k == steps:
            w = [np.mean(w, axis=0)] * size
    return w[0]


@pytest.mark.parametrize("size,steps,every", [(2, 12, 4), (3, 11, 4), (1, 7, 3), (4, 5, 1),
                                              (3, 2, 5)])
def test_model_averaging_follows_the_rule(size, steps, every):
    out = VirtualCluster(size).run(
        lambda comm: drive(ModelAveraging(comm, every_steps=every), comm, steps))
    expected = reference_model_averaging(size, steps, every)
    for params, _, _ in out:
        close(params, expected)
        assert np.array_equal(params, out[0][0])


def test_model_averaging_averages_momentum_only_when_asked():
    def unequal(comm, average_momentum):
        net = Net(comm.rank)
        opt = Optimizer(net)
        strategy = ModelAveraging(comm, every_steps=1, average_momentum=average_momentum)
        strategy.setup(net, opt)
        opt.momentum[...] = comm.rank
        strategy.after_update(net, opt, 1)
        return opt.momentum.copy()

    assert [m[0] for m in VirtualCluster(3).run(lambda c: unequal(c, False))] == [0, 1, 2]
    assert [m[0] for m in VirtualCluster(3).run(lambda c: unequal(c, True))] == [1, 1, 1]


# ------------------------------------------------------------ gradient allreduce

@pytest.mark.parametrize("size", [1, 3])
@pytest.mark.parametrize("overlap", [False, True])
def test_allreduce_steps_with_the_mean_gradient(size, overlap):
    steps = 4
    out = VirtualCluster(size).run(
        lambda comm: drive(GradientAllreduce(comm, overlap=overlap, bucket_bytes=8), comm, steps))
    w = _start()
    for k in range(1, steps + 1):
        w = w - LR * np.mean([gradient(r, k, w) for r in range(size)], axis=0)
    for params, _, _ in out:
        close(params, w)
        assert np.array_equal(params, out[0][0])


def test_model_averaging_every_step_equals_allreduce():
    # the spec: for plain SGD, K = 1 from a common start equals sync SGD
    ma = VirtualCluster(3).run(lambda comm: drive(ModelAveraging(comm, every_steps=1),
                                                  comm, 5))
    ar = VirtualCluster(3).run(lambda comm: drive(GradientAllreduce(comm), comm, 5))
    close(ma[0][0], ar[0][0])


# ------------------------------------------------------------ Kaldi averaging

def kaldi_jobs(num_iters, initial, final, step=1):
    """train_dnn.py's get_current_num_jobs: a linear ramp, multiples of ``step`` past it."""
    jobs = []
    for i in range(num_iters):
        ideal = initial + (final - initial) * i / num_iters
        jobs.append(int(0.5 + ideal) if ideal < step else int(0.5 + ideal / step) * step)
    return jobs


def reference_kaldi(size, steps, every, initial, final, jobs_step=1):
    """Iterations of K steps; J_i jobs (ranks 0..J_i-1) train from the same model at
    J_i lr, the rest wait; the average of the J_i jobs goes to every rank.  Also
    the rate at each step and the data fraction p_i / A of each iteration."""
    iters = -(-steps // every)
    jobs = kaldi_jobs(iters, initial, final, jobs_step)
    lengths = [min(every, steps - i * every) for i in range(iters)]
    total = sum(j * n for j, n in zip(jobs, lengths))
    fractions = [sum(j * n for j, n in zip(jobs[:i], lengths[:i])) / total
                 for i in range(iters)]
    w, rates = _start(), []
    for i in range(iters):
        models = []
        for r in range(jobs[i]):
            v = w.copy()
            for k in range(i * every + 1, i * every + lengths[i] + 1):
                v = v - jobs[i] * LR * gradient(r, k, v)
            models.append(v)
        rates += [jobs[i] * LR] * lengths[i]
        w = np.mean(models, axis=0)
    return w, rates, jobs, fractions


@pytest.mark.parametrize("size,steps,every,initial,final", [
    (3, 12, 3, 1, 3),       # ramp 1, 2, 2, 3 over 4 iterations (Kaldi's rounding)
    (4, 10, 4, 1, 4),       # a short last iteration
    (3, 7, 2, 0, 0),        # no ramp: every rank, every iteration
    (1, 5, 2, 0, 0),
    (4, 9, 3, 2, 4),
])
def test_kaldi_averaging_follows_the_ramp_and_the_rule(size, steps, every, initial, final):
    def work(comm):
        strategy = KaldiAveraging(comm, every_steps=every, total_steps=steps,
                                  jobs_initial=initial, jobs_final=final)
        boundaries = [(s, strategy.num_jobs(s), strategy.rate_fraction(s),
                       strategy.data_fraction(s)) for s in range(steps)]
        return drive(strategy, comm, steps) + (boundaries,)

    out = VirtualCluster(size).run(work)
    w, rates, jobs, fractions = reference_kaldi(size, steps, every, initial or final or size,
                                                final or size)
    for params, used, opt, boundaries in out:
        close(params, w)
        assert np.allclose(used, rates)
        for s, num_jobs, rate_fraction, data_fraction in boundaries:
            i = s // every
            assert num_jobs == jobs[i], (s, num_jobs, jobs)
            assert data_fraction == pytest.approx(fractions[i])
            # the last iteration trains at the final rate
            assert rate_fraction == pytest.approx(1.0 if i == len(jobs) - 1 else fractions[i])
        assert opt.cleared >= steps // every    # fresh momentum after every average


# ------------------------------------------------------------ BMUF

def reference_bmuf(size, steps, every, eta, zeta, nesterov):
    """Blocks of K local steps from the start w0: G = mean w_i - w0,
    Delta = eta Delta + zeta G, w_g = w0 + Delta, next start w_g + eta Delta
    (Nesterov) or w_g; a last, shorter block syncs too; the model is w_g."""
    start, delta, w_g = _start(), np.zeros(P), _start()
    k = 0
    while k < steps:
        length = min(every, steps - k)
        models = []
        for r in range(size):
            v = start.copy()
            for s in range(k + 1, k + length + 1):
                v = v - LR * gradient(r, s, v)
            models.append(v)
        k += length
        delta = eta * delta + zeta * (np.mean(models, axis=0) - start)
        w_g = start + delta
        start = w_g + eta * delta if nesterov else w_g
    return w_g


@pytest.mark.parametrize("size,steps,every,momentum,zeta,nesterov", [
    (2, 12, 3, None, 1.0, True),
    (3, 12, 3, None, 1.0, True),
    (3, 12, 3, None, 1.0, False),
    (3, 11, 4, None, 1.0, True),        # the last block is short
    (4, 10, 2, 0.5, 0.7, True),          # block_lr != 1
    (3, 9, 3, 0.9, 1.5, False),
    (1, 7, 3, None, 1.0, True),          # eta_b = 0: plain local SGD
])
def test_bmuf_follows_the_block_rule(size, steps, every, momentum, zeta, nesterov):
    out = VirtualCluster(size).run(lambda comm: drive(
        BlockMomentum(comm, every_steps=every, block_momentum=momentum, block_lr=zeta,
                      nesterov=nesterov), comm, steps))
    eta = 1 - 1 / size if momentum is None else momentum
    expected = reference_bmuf(size, steps, every, eta, zeta, nesterov)
    for params, _, opt in out:
        close(params, expected)
        assert np.array_equal(params, out[0][0])
        assert opt.cleared == -(-steps // every)        # local momentum reset at each sync


def test_bmuf_one_rank_is_local_sgd():
    out = VirtualCluster(1).run(lambda comm: drive(BlockMomentum(comm, every_steps=3), comm, 7))
    w = _start()
    for k in range(1, 8):
        w = w - LR * gradient(0, k, w)
    close(out[0][0], w)


# ------------------------------------------------------------ ADPSGD (lock-step)

def reference_adpsgd(size, steps, matchings, delay_by_one):
    """w_i^{k+1} = (w_i^k + w_j^k)/2 - lr g_i(w_i^k) (j: i's partner at step k;
    a rank with none keeps w_i^k), or with delay-by-one
    - lr g_i(w_i^{k-1}) (none at the first step); the result is the mean."""
    w = [_start() for _ in range(size)]
    previous = [None] * size
    for k in range(1, steps + 1):
        mixed = list(w)
        for a, b in matchings[k - 1]:
            mixed[a] = mixed[b] = (w[a] + w[b]) / 2
        new = []
        for r in range(size):
            if delay_by_one:
                g = 0 if previous[r] is None else gradient(r, k - 1, previous[r])
            else:
                g = gradient(r, k, w[r])
            new.append(mixed[r] - LR * g)
        previous, w = w, new
    return w


def _pairs_from_partners(partners, size, steps):
    """The matching each step from every rank's own partner; checks the ranks agree."""
    matchings = []
    for k in range(steps):
        pairs = set()
        for r in range(size):
            j = partners[r][k]
            if j is None:
                continue
            assert j != r and partners[j][k] == r, (k + 1, r, j)   # both see the pair
            pairs.add((min(r, j), max(r, j)))
        unmatched = size - 2 * len(pairs)
        assert unmatched == size % 2            # a perfect matching, or one sits out
        matchings.append(sorted(pairs))
    return matchings


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("topology", ["fixed_ring", "random_ring"])
@pytest.mark.parametrize("delay_by_one", [False, True])
def test_adpsgd_follows_the_mixing_rule(size, topology, delay_by_one):
    steps = 6

    def work(comm):
        strategy = RingMixing(comm, topology=topology, delay_by_one=delay_by_one, seed=5)
        partners = [strategy.partner(k) for k in range(1, steps + 1)]
        net = Net(comm.rank)
        opt = Optimizer(net)
        strategy.setup(net, opt)
        models = []
        for step in range(steps):
            net.grads[...] = gradient(comm.rank, step + 1, net.params)
            strategy.reduce_gradients(net)
            opt.step(LR)
            strategy.after_update(net, opt, step + 1)
            models.append(net.params.copy())
        strategy.finalize(net, opt, steps)
        return partners, models, net.params.copy(), strategy.num_mixes

    out = VirtualCluster(size).run(work)
    partners = [o[0] for o in out]
    matchings = _pairs_from_partners(partners, size, steps)
    if topology == "fixed_ring":
        # documented: ring places (p, p+1) pair for p = k mod 2, k mod 2 + 2, ...
        for k, pairs in enumerate(matchings, start=1):
            expected = {tuple(sorted((p % size, (p + 1) % size)))
                        for p in range(k % 2, k % 2 + 2 * (size // 2), 2)}
            assert set(pairs) == expected, (k, pairs)
    elif size > 2:
        assert len({tuple(m) for m in matchings}) > 1      # the matching changes
    expected = reference_adpsgd(size, steps, matchings, delay_by_one)
    for rank, (_, models, final, mixes) in enumerate(out):
        close(models[-1], expected[rank])
        close(final, np.mean(expected, axis=0))
        assert mixes == sum(any(rank in p for p in m) for m in matchings)
    # every mix keeps the mean: the mean model moves by the mean step only
    if size > 1 and not delay_by_one:
        assert not np.allclose(out[0][1][-1], out[1][1][-1])


# ------------------------------------------------------------ hierarchical ADPSGD

@pytest.mark.parametrize("size,per_node,topology", [(5, 2, "fixed_ring"), (6, 2, "random_ring"),
                                                   (3, 3, "fixed_ring")])
def test_hierarchical_adpsgd_mixes_nodes_that_step_with_their_mean_gradient(size, per_node,
                                                                            topology):
    """Nodes of ``per_node`` ranks (the last one smaller with 5 ranks):
    w_n <- (w_n + w_m)/2 - lr g_n, g_n the mean gradient of node n's ranks at w_n;
    the result is the mean over the nodes (one node: synchronous SGD)."""
    from mpitrain.parallel.hierarchical_adpsgd import NodeRingMixing
    steps = 5

    def work(comm):
        strategy = NodeRingMixing(comm, topology=topology, seed=2, ranks_per_node=per_node)
        partners = [strategy.ring.partner(k) if strategy.ring else None
                    for k in range(1, steps + 1)]
        params, _, _ = drive(strategy, comm, steps)
        return partners, strategy.rank_state_dict()["params"], params

    out = VirtualCluster(size).run(work)
    nodes = [list(range(n, min(n + per_node, size))) for n in range(0, size, per_node)]
    matchings = _pairs_from_partners([out[ranks[0]][0] for ranks in nodes], len(nodes), steps)
    w = [_start() for _ in nodes]
    for k in range(1, steps + 1):
        mixed = list(w)
        for a, b in matchings[k - 1]:
            mixed[a] = mixed[b] = (w[a] + w[b]) / 2
        w = [mixed[n] - LR * np.mean([gradient(r, k, w[n]) for r in ranks], axis=0)
             for n, ranks in enumerate(nodes)]
    for n, ranks in enumerate(nodes):
        for r in ranks:
            close(out[r][1], w[n])
            close(out[r][2], np.mean(w, axis=0))


# ------------------------------------------------------------ asynchronous methods

@pytest.mark.parametrize("size", [3, 5])
@pytest.mark.parametrize("topology", ["fixed_ring", "random_ring"])
def test_async_adpsgd_mixes_keep_the_mean_of_the_models(size, topology):
    """Ranks of different paces add their own steps and mix; the mean of the models
    moves by the mean of the steps taken only (each mix's two changes cancel), an
    odd ring included (the last active rank mixes with its left neighbour)."""
    from mpitrain.parallel.async_adpsgd import AsyncRingMixing

    def work(comm):
        net = Net(comm.rank)
        opt = Optimizer(net)
        ring = AsyncRingMixing(comm, topology=topology, seed=4)
        ring.bind(net)
        start = np.float64(net.params)
        taken = np.zeros(P)
        for k in range(1, 16):
            comm.advance(0.001 * (1 + comm.rank / 3))
            delta = 0.01 * _offset(comm.rank, k)
            net.params += delta.astype(np.float32)
            taken += np.float64(delta.astype(np.float32))
            ring.after_update(net, opt, k)
        ring.quiesce()
        return start, taken, np.float64(net.params), ring.mixes

    out = VirtualCluster(size).run(work)
    mean_start = np.mean([o[0] for o in out], axis=0)
    mean_steps = np.mean([o[1] for o in out], axis=0)
    np.testing.assert_allclose(np.mean([o[2] for o in out], axis=0), mean_start + mean_steps,
                               atol=1e-5)
    assert all(o[3] > 0 for o in out)       # every rank mixed, the odd ring's ends too


def test_param_server_applies_each_push_damped_by_its_staleness_and_averages():
    """Three clients; the server applies each gradient, taken at the weights it sent
    that client last, to its current weights at lr / (1 + staleness) (staleness: the
    updates since those weights were sent) and theta_bar <- (1 - eta) theta_bar +
    eta theta after each; finalize gives every rank theta_bar."""
    from mpitrain.nn.network import build_network
    from mpitrain.parallel.param_server import ParameterServer
    eta, pushes = 0.2, 3

    def work(comm):
        net = build_network(feat_dim=3, num_classes=2, left_context=0, right_context=0,
                            hidden_layers=1, hidden_dim=2)
        net.params[...] = np.resize(_start(), net.num_params).astype(np.float32) + comm.rank
        opt = Optimizer(net)
        ps = ParameterServer(comm, average_eta=eta)
        ps.setup(net, opt)
        if ps.is_server:
            history = [np.float64(net.params)]        # theta after t updates
            applied = []
            for client in ps.clients:
                ps.send_weights(net, client)
            left = set(ps.clients)
            while left:
                push = ps.receive_push(net)
                applied.append((push.source, push.position, push.staleness))
                ps.apply(net, opt, LR, push)
                history.append(np.float64(net.params))
                if push.kind == 2:
                    left.discard(push.source)
                else:
                    ps.send_weights(net, push.source)
            ps.finalize(net, opt)
            return history, applied, np.float64(net.params), ps.current.copy()
        for k in range(pushes):
            ps.pull(net)
            comm.advance(0.001 * comm.rank)
            net.grads[...] = _offset(comm.rank, k + 1)[0] + A * net.params
            ps.push(net, loss_sum=0.0, correct=0.0, frames=1, position=k,
                    last=k == pushes - 1)
        ps.finalize(net, opt)
        return np.float64(net.params)

    out = VirtualCluster(4).run(work)
    history, applied, average, current = out[0]
    theta = history[0].copy()
    theta_bar = theta.copy()
    sent = {c: 0 for c in (1, 2, 3)}       # the version each client computes on
    stalenesses = []
    for t, (client, position, staleness) in enumerate(applied):
        stalenesses.append(t - sent[client])
        assert staleness == t - sent[client]
        at = history[sent[client]]
        g = _offset(client, position + 1)[0] + A * at
        theta = theta - LR / (1 + staleness) * g
        close(history[t + 1], theta)
        theta_bar = (1 - eta) * theta_bar + eta * theta
        sent[client] = t + 1
    assert max(stalenesses) > 0
    close(current, theta)
    close(average, theta_bar)
    for client_model in out[1:]:
        assert np.array_equal(client_model, average)
