"""A signal reaches some ranks of a training run, as Slurm sends one.

Usage: signal_worker.py SIGNAL RANKS AFTER_BATCHES [POLL_SECONDS] -- train|pretrain CONFIG ...

Runs ``mpitrain train`` (or ``pretrain``) through the command-line entry
point, exactly as ``python -m mpitrain train`` does.  RANKS ("1", "0,1" or
"all") send themselves SIGNAL (e.g. SIGTERM) while they read their
AFTER_BATCHES-th minibatch (a parameter server, which reads none: while it
applies its AFTER_BATCHES-th gradient), so the signal comes at a known step
of each of those ranks and the stop step is known; AFTER_BATCHES 0: while they
read the configuration, before MPI starts (a job preempted as it starts); -1:
just after MPI started, before the run's own handlers are installed; -2: while
MPI starts, once a library there put a handler of its own for SIGNAL (else
just after).  The
ranks tell each other about
signals at log lines only, unless POLL_SECONDS is given: then also about that
often in between (0: after every step; train/stop.py's StopPoll), so that the
stop step does not hang on this machine's speed.  Exits with the command's
status.
"""

import os
import signal
import sys

from mpitrain import comm, config
from mpitrain.cli import main
from mpitrain.data.batcher import MinibatchStream
from mpitrain.parallel.param_server import ParameterServer
from mpitrain.train import stop

signum = signal.Signals[sys.argv[1]]
if signum == signal.SIGHUP:
    # a terminal closed under a run started without nohup (the tests' own runner
    # may have been started with it, and the ranks would inherit the ignored SIGHUP)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
ranks, after_batches = sys.argv[2], int(sys.argv[3])
split = sys.argv.index("--")
assert split in (4, 5), sys.argv
stop.POLL_SECONDS = float(sys.argv[4]) if split == 5 else float("inf")
cli_args = sys.argv[split + 1:]
# (the launcher's rank: mpiexec of MPICH or Open MPI)
rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
signalled = ranks == "all" or str(rank) in ranks.split(",")

original_next_batch = MinibatchStream.next_batch
taken = {"batches": 0}


def next_batch_with_signal(self):
    taken["batches"] += 1
    if signalled and taken["batches"] == after_batches:
        os.kill(os.getpid(), signum)
    return original_next_batch(self)


MinibatchStream.next_batch = next_batch_with_signal
original_apply = ParameterServer.apply


def apply_with_signal(self, *args, **kwargs):
    taken["batches"] += 1
    if signalled and taken["batches"] == after_batches:
        os.kill(os.getpid(), signum)
    return original_apply(self, *args, **kwargs)


ParameterServer.apply = apply_with_signal
original_load_config = config.load_config


def load_config_with_signal(*args, **kwargs):
    if signalled and after_batches == 0:
        os.kill(os.getpid(), signum)
    return original_load_config(*args, **kwargs)


config.load_config = load_config_with_signal
original_create_communicator = comm.create_communicator


def _c_handler(number):
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    old = ctypes.create_string_buffer(512)          # struct sigaction: the handler first
    libc.sigaction(number, None, old)
    return ctypes.c_void_p.from_buffer(old).value


def create_communicator_with_signal(*args, **kwargs):
    import threading
    started, sent = threading.Event(), threading.Event()

    def watch():
        python_handler = _c_handler(signum)
        while not started.is_set():
            if _c_handler(signum) != python_handler:
                os.kill(os.getpid(), signum)
                sent.set()
                return

    watcher = threading.Thread(target=watch, daemon=True)
    if signalled and after_batches == -2:
        watcher.start()
    made = original_create_communicator(*args, **kwargs)
    started.set()
    if watcher.ident is not None:               # (started)
        watcher.join()
    if signalled and after_batches in (-1, -2) and not sent.is_set():
        os.kill(os.getpid(), signum)
    return made


comm.create_communicator = create_communicator_with_signal
sys.exit(main(cli_args))
