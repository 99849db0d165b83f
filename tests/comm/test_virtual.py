"""The virtual cluster's communicator (comm/virtual.py), in this process.

Reductions are MPICH's recursive-doubling order (measured equal to MPICH's
Allreduce at 2..8 ranks; tests/train/test_virtual.py compares whole training
runs with mpiexec), every call of the contract works across virtual ranks,
mismatched or missing calls raise instead of hanging, and the simulated clock
gives hand-computed times on a scripted case with one slow rank.
"""

import numpy as np
import pytest

from mpitrain.comm.netmodel import NetworkModel
from mpitrain.comm.virtual import VirtualCluster, VirtualClusterError, mpich_order_sum


def _awkward(n, size, dtype=np.float32, seed=0):
    """Per-rank values whose float sums depend on the order of addition."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, size)) * 10.0 ** rng.integers(-4, 5, (n, size))).astype(dtype)


def test_mpich_order_is_recursive_doubling_with_the_remainder_folded_first():
    a = list(_awkward(6, 1000, np.float64))
    assert np.array_equal(mpich_order_sum(a[:4]), (a[0] + a[1]) + (a[2] + a[3]))
    assert np.array_equal(mpich_order_sum(a[:3]), (a[0] + a[1]) + a[2])
    assert np.array_equal(mpich_order_sum(a), ((a[0] + a[1]) + (a[2] + a[3])) + (a[4] + a[5]))
    # the order matters for these values: a sequential sum differs somewhere
    sequential = ((a[0] + a[1]) + a[2]) + a[3]
    assert not np.array_equal(mpich_order_sum(a[:4]), sequential)


@pytest.mark.parametrize("nranks", [1, 2, 3, 4, 7, 16])
@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
def test_allreduce_gives_every_rank_the_ordered_reduction(nranks, op):
    data = _awkward(nranks, 3001)
    if op in ("sum", "mean"):
        expected = mpich_order_sum(list(data))
        if op == "mean" and nranks > 1:
            expected = expected * np.float32(1.0 / nranks)
    else:
        expected = data.max(axis=0) if op == "max" else data.min(axis=0)

    def work(comm):
        buf = data[comm.rank].copy()
        assert comm.allreduce_(buf, op=op) is buf
        return buf

    for buf in VirtualCluster(nranks).run(work):
        assert np.array_equal(buf, expected)


def test_large_buffers_reduce_piece_by_piece_to_the_same_result(monkeypatch):
    from mpitrain.comm import virtual
    data = _awkward(4, 10_000)
    monkeypatch.setattr(virtual, "REDUCE_PIECE", 999)
    out = VirtualCluster(4).run(lambda comm: comm.allreduce_(data[comm.rank].copy(), op="sum"))
    assert all(np.array_equal(b, mpich_order_sum(list(data))) for b in out)


def test_scalars_objects_bcast_and_nonblocking_allreduce():
    def work(comm):
        buf = np.full(5, float(comm.rank), dtype=np.float64)
        comm.bcast_(buf, root=2)
        grads = np.full(3, comm.rank + 1.0, dtype=np.float32)
        comm.iallreduce_(grads, op="mean").wait()
        return (comm.allreduce_scalar(comm.rank), comm.allreduce_scalar(comm.rank, op="max"),
                comm.allreduce_scalar(2.5, op="mean"), buf[0], grads[0],
                comm.bcast_obj({"from": comm.rank}, root=1),
                comm.allgather_obj([comm.rank]), comm.gather_obj(comm.rank, root=0))

    results = VirtualCluster(4).run(work)
    for rank, r in enumerate(results):
        assert r[:5] == (6, 3, 2.5, 2.0, 2.5)
        assert isinstance(r[0], int) and isinstance(r[2], float)
        assert r[5] == {"from": 1}
        assert r[6] == [[0], [1], [2], [3]]
        assert r[7] == ([0, 1, 2, 3] if rank == 0 else None)


def test_split_and_dup_make_groups_with_their_own_collectives():
    def work(comm):
        half = comm.split(comm.rank % 2, key=-comm.rank)        # reversed order
        none = comm.split(None if comm.rank else 0)
        twin = comm.dup()
        return (half.rank, half.size, half.allreduce_scalar(comm.rank),
                none is None, twin.allreduce_scalar(1))

    results = VirtualCluster(5).run(work)
    assert [r[:3] for r in results] == [(2, 3, 6), (1, 2, 4), (1, 3, 6), (0, 2, 4), (0, 3, 6)]
    assert [r[3] for r in results] == [False, True, True, True, True]
    assert all(r[4] == 5 for r in results)


def test_point_to_point_messages_match_by_source_and_tag_in_order():
    def work(comm):
        if comm.rank == 0:
            comm.send(np.array([1.0, 2.0]), 1, tag=7)
            comm.send(np.array([3.0, 4.0]), 1, tag=7)
            comm.send(np.array([9.0, 9.0]), 1, tag=8)
            return None
        if comm.rank == 1:
            first, second, tagged = np.zeros(2), np.zeros(2), np.zeros(2)
            status = comm.recv(tagged, tag=8)
            comm.recv(first, 0, 7)
            request = comm.irecv(second, source=0)
            request.wait()
            swapped = np.zeros(1)
            comm.sendrecv(np.array([10.0]), 2, swapped, 2, tag=1)
            return status, first.tolist(), second.tolist(), request.source, swapped[0]
        swapped = np.zeros(1)
        comm.sendrecv(np.array([20.0]), 1, swapped, 1, tag=1)
        assert comm.iprobe() is None
        return swapped[0]

    _, got, other = VirtualCluster(3).run(work)
    assert got == ((0, 8), [1.0, 2.0], [3.0, 4.0], 0, 20.0)
    assert other == 10.0


def test_mismatched_collectives_raise_on_every_rank_instead_of_hanging():
    with pytest.raises(VirtualClusterError, match="would hang or corrupt"):
        VirtualCluster(2).run(lambda c: c.allreduce_scalar(1) if c.rank == 0 else c.barrier())
    with pytest.raises(VirtualClusterError, match="would hang or corrupt"):
        VirtualCluster(2).run(
            lambda c: c.allreduce_(np.zeros(3 + c.rank, dtype=np.float32), op="sum"))


def test_a_missing_collective_is_a_reported_deadlock():
    with pytest.raises(VirtualClusterError, match="rank 0: barrier"):
        VirtualCluster(3).run(lambda c: c.barrier() if c.rank == 0 else None)
    with pytest.raises(VirtualClusterError, match="recv"):
        VirtualCluster(2).run(lambda c: c.recv(np.zeros(1), 1 - c.rank))


def test_one_rank_error_ends_every_rank_and_is_raised():
    def work(comm):
        if comm.rank == 2:
            raise KeyError("rank 2 broke")
        comm.barrier()

    with pytest.raises(KeyError, match="rank 2 broke"):
        VirtualCluster(4).run(work)
    with pytest.raises(VirtualClusterError, match="aborted the job"):
        VirtualCluster(2).run(lambda c: c.abort(3, "bad input") if c.rank else c.barrier())


def test_scripted_clock_with_one_slow_rank_gives_hand_computed_times():
    # 1 ms latency, 1 MB/s links; 4 ranks; 1000 float32 = 4000 bytes per allreduce:
    # ring cost 2 * 3/4 * 4000 / 1e6 + 2 * 3 * 1e-3 = 0.006 + 0.006 = 0.012 s.
    network = NetworkModel(latency_s=1e-3, bandwidth_bytes_per_s=1e6)
    step = {0: 0.010, 1: 0.010, 2: 0.030, 3: 0.010}          # rank 2 is three times slower

    def work(comm):
        params = np.ones(1000, dtype=np.float32)
        marks = []
        for block in range(2):
            for _ in range(2):
                comm.advance(step[comm.rank])
            comm.allreduce_(params, op="mean")
            marks.append((comm.wtime(), comm.comm_time))
        # rank 0 sends 1000 bytes to rank 1: 1 ms injecting, arrives after 1 ms + 1 ms
        message = np.zeros(250, dtype=np.float32)
        if comm.rank == 0:
            comm.send(message, 1)
        elif comm.rank == 1:
            comm.recv(message, 0)
        marks.append((comm.wtime(), comm.comm_time))
        return marks

    marks = VirtualCluster(4, network=network).run(work)
    # block 1: ranks 0, 1, 3 arrive at 0.020, rank 2 at 0.060; all leave at 0.060 + 0.012
    # block 2: 0.092 and 0.132 -> 0.144
    for rank in range(4):
        assert marks[rank][0][0] == pytest.approx(0.072)
        assert marks[rank][1][0] == pytest.approx(0.144)
    assert marks[0][1][1] == pytest.approx(2 * (0.072 - 0.020))   # waited for rank 2 twice
    assert marks[2][1][1] == pytest.approx(2 * 0.012)             # only the transfers
    assert marks[0][2] == pytest.approx((0.145, 0.104 + 0.001))   # sent: 1 ms injecting
    assert marks[1][2] == pytest.approx((0.146, 0.104 + 0.002))   # waited for the arrival
    assert marks[3][2] == pytest.approx((0.144, 0.104))


def test_clock_is_free_without_a_network_and_comm_time_resets():
    def work(comm):
        comm.advance(0.5 * (comm.rank + 1))
        comm.barrier()
        before = comm.comm_time
        comm.reset_comm_time()
        return comm.wtime(), before, comm.comm_time

    assert VirtualCluster(2).run(work) == [(1.0, 0.5, 0.0), (1.0, 0.0, 0.0)]
    with pytest.raises(ValueError):
        VirtualCluster(1).run(lambda comm: comm.advance(-1.0))


def test_a_receive_from_any_source_takes_messages_in_order_of_arrival():
    """Rank 1 sends at 3 and 6 ms, rank 2 at 1 and 2 ms (free network): rank 0,
    receiving from any source, gets them in the order of the simulated clock,
    whichever rank happened to run first."""
    from mpitrain.comm.base import ANY_SOURCE

    def work(comm):
        if comm.rank == 0:
            order = []
            for _ in range(4):
                buf = np.zeros(1)
                source, _ = comm.recv(buf, source=ANY_SOURCE, tag=5)
                order.append((source, round(comm.wtime(), 6)))
            return order
        step = 0.003 if comm.rank == 1 else 0.001
        for _ in range(2):
            comm.advance(step)
            comm.send(np.full(1, comm.rank, dtype=np.float64), dest=0, tag=5)
        return None

    order = VirtualCluster(3).run(work)[0]
    assert order == [(2, 0.001), (2, 0.002), (1, 0.003), (1, 0.006)]


def test_a_poll_lets_ranks_earlier_on_the_clock_send_first():
    """Rank 0 polls with iprobe; rank 1's message (sent at 5 ms) is in the mailbox
    before rank 2, still at 0 ms, has run: the poll waits for rank 2's at 1 ms."""
    from mpitrain.comm.base import ANY_SOURCE

    def work(comm):
        if comm.rank == 0:
            seen = []
            while len(seen) < 2:
                found = comm.iprobe(ANY_SOURCE, 9)
                if found is None:
                    comm.idle()
                    continue
                buf = np.zeros(1)
                comm.recv(buf, source=found[0], tag=9)
                seen.append(found[0])
            return seen
        if comm.rank == 1:
            comm.advance(0.005)
            comm.send(np.ones(1), dest=0, tag=9)
        else:
            comm.advance(0.001)
            comm.send(np.ones(1), dest=0, tag=9)
        return None

    assert VirtualCluster(3).run(work)[0] == [2, 1]


def test_a_poll_never_sees_a_message_before_it_arrives_and_idle_waits_for_it():
    """Rank 1 sends at 4 ms; rank 0, computing 1 ms per step, polls after each
    step: it sees nothing until its clock passes 4 ms, and went on computing
    meanwhile.  Then it idles until a second message, sent at 10 ms, arrives."""
    def work(comm):
        if comm.rank == 1:
            comm.advance(0.004)
            comm.send(np.ones(1), dest=0, tag=3)
            comm.advance(0.006)
            comm.send(np.ones(1), dest=0, tag=3)
            return None
        steps = 0
        while comm.iprobe(1, 3) is None:
            comm.advance(0.001)
            steps += 1
        comm.recv(np.zeros(1), 1, tag=3)
        first = comm.wtime()
        while comm.iprobe(1, 3) is None:
            comm.idle()
        comm.recv(np.zeros(1), 1, tag=3)
        return steps, first, comm.wtime()

    steps, first, second = VirtualCluster(2).run(work)[0]
    assert steps == 4 and first == pytest.approx(0.004)
    assert second == pytest.approx(0.010)


def test_idle_after_polls_for_two_tags_does_not_sleep_through_the_first_kind():
    """Rank 0 polls for tag 1, then for tag 2, then idles.  Rank 1's tag-1 message,
    sent at rank 0's own time while its first poll let rank 1 run, counted as seen
    by the second poll: rank 0 slept until the next message came (here at 10 ms;
    without one, for ever: asynchronous ADPSGD's quiesce hung there)."""
    def work(comm):
        if comm.rank == 1:
            comm.send(np.ones(1), dest=0, tag=1)
            comm.advance(0.010)
            comm.send(np.ones(1), dest=0, tag=2)
            return None
        taken = {}
        while len(taken) < 2:
            polled = False
            for tag in (1, 2):
                if tag not in taken and comm.iprobe(1, tag) is not None:
                    comm.recv(np.zeros(1), 1, tag=tag)
                    taken[tag] = comm.wtime()
                    polled = True
            if not polled:
                comm.idle()
        return taken

    taken = VirtualCluster(2).run(work)[0]
    assert taken[1] == 0.0 and taken[2] == pytest.approx(0.010), taken


def test_a_rank_on_a_device_hands_over_only_when_its_device_work_is_done():
    """Virtual ranks share module-level device scratch and each other's buffers, and
    with streams of their own (cuda_graph) a GPU would run two ranks' queued work
    at once: a rank's device work must be done before another rank runs.  On the
    CuPy stand-in a queued copy to the host stands for that work: it lands only
    when the rank's stream is waited for."""
    from mpitrain import backend
    from mpitrain.testing import standin_cupy

    seen, outs = [], []       # (outs: the host buffers stay alive until the copies land)

    def work(comm):
        xp = backend.select("gpu")
        comm.setup_device_transport(xp)
        mine = None
        for _ in range(3):
            # what other ranks left queued on the device while this one runs
            own = 0 if mine is None or mine[0] == 7.0 else 1
            seen.append((comm.rank, standin_cupy.copies_in_flight() - own))
            mine = np.zeros(4, np.float32)
            outs.append(mine)
            backend.copy_to_host_async(xp.full(4, 7.0, dtype=xp.float32), out=mine)
            x = xp.full(4, comm.rank + 1.0, dtype=xp.float32)
            comm.allreduce_(x, op="sum")
            assert backend.to_host(x)[0] == 6.0
            comm.barrier()

    with standin_cupy.installed(), standin_cupy.deferred_copies():
        VirtualCluster(3).run(work)
    assert len(seen) == 9 and all(in_flight == 0 for _, in_flight in seen), seen
