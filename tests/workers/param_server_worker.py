"""What each parameter server computes and sends, under ``mpiexec -n N``.

Usage: param_server_worker.py SERVERS

Run by tests/parallel/test_param_server.py.  Ranks 0..SERVERS-1 serve, the
others are clients that pull, compute the gradient of random minibatches of
their own (NG-SGD preconditioning on the client) and push.  For each
optimizer case each server records the pushes it applied (their order, its
slice of each gradient, the rate) and every weights message it sent; after
serving it replays the record the way a server stepped before it updated
only its slice: the whole buffer, the gradient zero outside its slice, the
whole-buffer optimizer step and running average.  Checked, bit for bit:

- the server's slice of theta, of theta_bar and of the momentum equals the
  whole-buffer replay's (with the average switched to uniform where the
  server switched);
- nothing outside the server's slice changed on the server (theta and
  theta_bar there are still the initial model), and every weights message
  it sent was its slice only;
- server 0's checkpoint view (``collect_slices``, ``whole_optimizer_state``)
  and the final model (``finalize``) are the concatenation of the replays.

Rank 0 prints one "ok <case>" line per case; a failed assertion aborts the
whole job (abort hook) with the traceback on stderr.
"""

import sys

import numpy as np

from mpitrain.comm import create_communicator
from mpitrain.comm.abort import install_abort_hook
from mpitrain.nn.network import build_network
from mpitrain.optim.ngsgd import NaturalGradientSGD
from mpitrain.optim.sgd import SGD
from mpitrain.parallel.param_server import (LAST, WEIGHTS_TAG, ModelAverage,
                                            ParameterServer)

SERVERS = int(sys.argv[1])
comm = create_communicator("auto")
install_abort_hook(comm)
rank, size = comm.rank, comm.size

FEAT_DIM, CONTEXT, CLASSES, ROWS, STEPS = 5, 1, 7, 16, 12
REFERENCE_TAG = 7601
SERVED_TAG = 7602
#: name -> (optimizer class, options).  L2 with the whole-model max-change off:
#: with it on, the whole-buffer step also counted the L2 change of the layers
#: outside the slice (stale there) in the whole-model norm.
CASES = {
    "sgd": (SGD, dict(momentum=0.5, max_change_per_layer=0.05, max_change_output=0.08,
                      max_change=0.1)),
    "ngsgd": (NaturalGradientSGD, dict(rank_in=2, rank_out=3, update_period=2,
                                       max_change_per_layer=0.05, max_change=0.1)),
    "l2": (SGD, dict(l2_regularize=0.05, l2_regularize_output=0.1, max_change=0)),
}


def make(case):
    net = build_network(feat_dim=FEAT_DIM, num_classes=CLASSES, left_context=CONTEXT,
                        right_context=CONTEXT, hidden_layers=3, hidden_dim=12)
    net.init_params(seed=5)
    net.params[...] += np.random.default_rng(6).standard_normal(
        net.num_params).astype(np.float32) * 0.05
    cls, options = CASES[case]
    return net, cls(net, minibatch=ROWS, **options)


def rate(updates):
    return 0.5 * 0.97 ** updates


def serve(ps, net, opt, record):
    """The serving loop of train/serving.py, recording what this server did."""
    sent = []
    send = ps.comm.send

    def recording_send(buf, dest, tag=0):
        if tag == WEIGHTS_TAG:
            sent.append(buf.size)
        send(buf, dest, tag=tag)

    ps.comm.send = recording_send
    ps.optimizer = opt          # server 0 may ask for its state's slice
    for client in ps.clients:
        ps.send_weights(net, client)
    left, clipped = set(ps.clients), [False]
    while left:
        push = ps.receive_push(net)
        lr = rate(ps.updates)
        # (replayed at the rate the rule applies: divided by 1 + the push's staleness)
        record.append((ps.updates, lr / (1 + push.staleness), np.array(net.grads[ps.own])))
        ps.apply(net, opt, lr, push)
        clipped[0] |= min(opt.last_scales[i] for i in opt.active) < 1.0 - opt.momentum
        if rank == 0 and ps.updates == 5:
            ps.switch_to_uniform()      # the others switch at their own count
        if push.kind == LAST:
            left.discard(push.source)
        else:
            ps.send_weights(net, push.source)
    ps.comm.send = send
    # the max-change was at work (where it is on)
    assert clipped[0] or not opt.max_change, "no step reached a max-change"
    return sent


def replay(case, ps, record, switched_at):
    """The server's slice as the whole-buffer step computed it."""
    net, opt = make(case)
    average = ModelAverage(net.params, eta=ps.average_eta)
    if switched_at == 0:
        average.switch_to_uniform(updates=0)
    for updates, lr, grads in record:
        net.grads[...] = 0
        net.grads[ps.own] = grads
        opt.step(lr)
        average.update(net.params)
        if updates + 1 == switched_at:
            average.switch_to_uniform(updates=switched_at)
    return net, opt, average


def check(case):
    net, opt = make(case)
    initial = net.params.copy()
    ps = ParameterServer(comm, average_eta=0.3, servers=SERVERS)
    ps.setup(net, opt)
    own = ps.own
    if not ps.is_server:
        rng = np.random.default_rng([rank, 17])
        for k in range(STEPS):
            ps.pull(net)
            x = rng.standard_normal((ROWS, FEAT_DIM * (2 * CONTEXT + 1))).astype(np.float32)
            labels = rng.integers(0, CLASSES, ROWS).astype(np.int32)
            loss, correct = net.forward_backward(x, labels)
            ps.push(net, loss_sum=float(loss), correct=float(correct), frames=ROWS,
                    position=k, last=k == STEPS - 1)
        ps.finalize(net, opt)
        return
    record = []
    sent = serve(ps, net, opt, record)
    assert len(record) == ps.updates == STEPS * len(ps.clients), (len(record), ps.updates)
    assert sent and set(sent) == {own.stop - own.start}, (sent, own)
    # server 0's view below is of every server's whole serving: a server answers a
    # SNAPSHOT between pushes, so one still serving would send an earlier slice
    if rank:
        comm.send(np.zeros(1), 0, tag=SERVED_TAG)
        ps.serve_until_released(net)        # answers server 0's requests below
    else:
        for server in ps.servers[1:]:
            comm.recv(np.zeros(1), server, tag=SERVED_TAG)
    outside = np.ones(net.num_params, dtype=bool)
    outside[own] = False
    # this server computed nothing outside its slice
    assert np.array_equal(net.params[outside], initial[outside]), case
    assert np.array_equal(ps.average.average[outside], initial[outside]), case
    if opt.delta is not None:
        assert not opt.delta[outside].any(), case
    # and inside it what the whole-buffer step computed
    switched_at = ps.average.switched_at
    assert switched_at is not None, "server 0's SWITCH never came"
    ref_net, ref_opt, ref_average = replay(case, ps, record, switched_at)
    assert np.array_equal(net.params[own], ref_net.params[own]), \
        f"{case}: theta differs by {np.abs(net.params[own] - ref_net.params[own]).max()}"
    assert np.array_equal(ps.average.average[own], ref_average.average[own]), case
    if opt.delta is not None:
        assert np.array_equal(opt.delta[own], ref_opt.delta[own]), case
    assert opt.num_skipped == 0, case
    if rank == 0:
        # a checkpoint's view of the whole model, the other servers still serving
        ps.collect_slices(net)
        state = ps.whole_optimizer_state(opt, net)
        collected = (net.params.copy(), ps.average.average.copy(), state.get("delta"))
        ps.release_servers()
    # the whole model: every server's replay on server 0
    reference = [ref_net.params, ref_average.average, ref_opt.delta]
    if rank:
        for array in reference:
            if array is not None:
                comm.send(np.ascontiguousarray(array[own]), 0, tag=REFERENCE_TAG)
    else:
        for server, (start, stop) in enumerate(ps.slices[1:], start=1):
            for array in reference:
                if array is not None:
                    comm.recv(array[start:stop], server, tag=REFERENCE_TAG)
        for name, got, want in zip(("theta", "theta_bar", "momentum"), collected, reference):
            if want is not None:
                assert np.array_equal(got, want), f"{case}: collected {name} differs"
    ps.finalize(net, opt)
    if rank == 0:
        assert np.array_equal(net.params, reference[1]), f"{case}: final average differs"
        assert np.array_equal(ps.current, reference[0]), f"{case}: final theta differs"
        print(f"ok {case}", flush=True)


for name in CASES:
    check(name)
if rank == 0:
    print(f"all param_server checks passed with {SERVERS} server(s) on {size} ranks",
          flush=True)
