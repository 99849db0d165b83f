"""A rank that vanishes mid-message, as the other ranks' MPI reports it.

Usage: peer_lost_worker.py comm
       peer_lost_worker.py train -- CONFIG [--set ...]

``comm``: on every rank, MPI's calls stand in for ones whose peer was killed
(they raise MPI's "Other MPI error", as MPICH does when the peer's memory is
gone mid-message); the communicator names that peer, and leaves alone an
error of the call itself or of this rank's memory and a receive from any rank.  Prints "ok" and exits 0.

``train``: ``mpitrain train`` (param_server) through the command-line entry
point, where server 0's 6th receive from rank 2 fails so; rank 0 first prints
"ERR_OTHER: " and this MPI's words for that error class.  Exits with the
command's status.
"""

import sys

import numpy as np
from mpi4py import MPI

from mpitrain.comm import ANY_SOURCE, create_communicator
from mpitrain.comm import mpi as comm_mpi
from mpitrain.comm.base import PeerLost


def failing(error_class=MPI.ERR_OTHER):
    def call(*args, **kwargs):
        raise MPI.Exception(error_class)
    return call


class Gone:
    """MPI calls whose peer is gone."""
    Send = Recv = staticmethod(failing())

    @staticmethod
    def Isend(*args, **kwargs):
        return Gone.Request()

    Irecv = Isend

    class Request:
        Wait = Test = staticmethod(failing())


def check_comm():
    comm = create_communicator()
    peer = 1 - comm.rank
    comm._comm = Gone()
    buf = np.zeros(4, dtype=np.float32)
    for doing, call in [("received from", lambda: comm.recv(buf, peer, tag=3)),
                        ("sent to", lambda: comm.send(buf, peer, tag=3)),
                        ("received from", lambda: comm.irecv(buf, peer, tag=3).wait()),
                        ("sent to", lambda: comm.isend(buf, peer, tag=3).test())]:
        try:
            call()
        except PeerLost as exc:
            assert exc.peer == peer
            assert str(exc) == (f"comm: rank {peer} is gone (ended, killed or its node lost) "
                                f"or the link to it broke while rank {comm.rank} {doing} it "
                                f"(MPI: {MPI.Get_error_string(MPI.ERR_OTHER)})"), str(exc)
        else:
            raise AssertionError(f"no error {doing} rank {peer}")
    for call in [lambda: comm.recv(buf, ANY_SOURCE, tag=3),     # (no rank to name)
                 lambda: comm_mpi._naming_the_peer(failing(MPI.ERR_TRUNCATE), comm.rank,
                                                   peer, "received from")(),
                 # (this rank's memory ran out: its peer may be well)
                 lambda: comm_mpi._naming_the_peer(failing(MPI.ERR_NO_MEM), comm.rank,
                                                   peer, "sent to")()]:
        try:
            call()
        except PeerLost as exc:
            raise AssertionError(f"named a peer: {exc}")
        except MPI.Exception:
            pass
    print("ok", flush=True)


def train(cli_args):
    from mpitrain.cli import main
    recv = comm_mpi.MpiCommunicator.recv
    taken = [0]

    def recv_losing_rank_2(self, buf, source=ANY_SOURCE, tag=-1):
        if self.rank == 0 and source == 2:
            taken[0] += 1
            if taken[0] == 6:
                return comm_mpi._naming_the_peer(failing(), 0, 2, "received from")()
        return recv(self, buf, source, tag)

    comm_mpi.MpiCommunicator.recv = recv_losing_rank_2
    if MPI.COMM_WORLD.Get_rank() == 0:
        # (this MPI's words for the error class, which the error line quotes)
        print(f"ERR_OTHER: {MPI.Get_error_string(MPI.ERR_OTHER)}", flush=True)
    return main(cli_args)


if sys.argv[1] == "comm":
    check_comm()
else:
    assert sys.argv[2] == "--", sys.argv
    sys.exit(train(["train"] + sys.argv[3:]))
