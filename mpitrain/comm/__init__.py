"""Communication layer: the only part of mpitrain that imports mpi4py.

Importing this package does not import mpi4py or initialise MPI; that happens
in :func:`create_communicator`, and only when the process was started by an
MPI launcher with more than one rank, so ``python -m mpitrain train`` works
without one.

Example::

    from mpitrain.comm import create_communicator
    comm = create_communicator()          # SingleCommunicator or MpiCommunicator
    comm.allreduce_(flat_params, op="mean")
"""

from __future__ import annotations

import os
import signal
from typing import Mapping, Optional

from .base import ANY_SOURCE, ANY_TAG, REDUCE_OPS, Communicator, Request
from .single import SingleCommunicator

__all__ = [
    "ANY_SOURCE", "ANY_TAG", "REDUCE_OPS", "Communicator", "Request", "SingleCommunicator",
    "create_communicator", "launched_by_mpi", "world_size_from_env", "local_rank_from_env",
    "rank_from_env", "abort_job_interrupted",
]

KINDS = ("auto", "mpi", "single")

# Variables that MPI launchers put into each rank's environment.
_LAUNCHER_VARS = (
    "PMI_RANK", "PMI_SIZE",                    # MPICH hydra, Intel MPI
    "PMIX_RANK",                               # Open MPI 5 / PRRTE, srun --mpi=pmix
    "OMPI_COMM_WORLD_SIZE",                    # Open MPI
    "MPI_LOCALNRANKS", "HYDI_CONTROL_FD",      # MPICH hydra
    "MV2_COMM_WORLD_SIZE",                     # MVAPICH
    "PALS_RANKID",                             # HPE/Cray PALS
)
_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
# This process's rank in the job, most specific first: srun's SLURM_PROCID comes
# last, since an mpiexec inside a batch script passes the script's own (0) on
# to every rank it starts.
_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK",
              "PALS_RANKID", "SLURM_PROCID")
_LOCAL_RANK_VARS = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK",
                    "MV2_COMM_WORLD_LOCAL_RANK", "PALS_LOCAL_RANKID", "SLURM_LOCALID")


def _int_env(env: Mapping[str, str], name: str) -> Optional[int]:
    try:
        return int(env[name])
    except (KeyError, ValueError):
        return None


def _slurm_step_size(env: Mapping[str, str]) -> Optional[int]:
    # Inside `srun` each task has SLURM_PROCID; a plain batch script has a 1-task step.
    if "SLURM_PROCID" not in env:
        return None
    return _int_env(env, "SLURM_STEP_NUM_TASKS")


def launched_by_mpi(env: Optional[Mapping[str, str]] = None) -> bool:
    """True when the environment shows an MPI launcher (mpiexec, mpirun, srun with >1 task).

    Example::

        launched_by_mpi({"PMI_RANK": "0", "PMI_SIZE": "4"})   # True
        launched_by_mpi({})                                   # False
    """
    env = os.environ if env is None else env
    inherited = _inherited_from_singleton(env)
    if any(name in env for name in _LAUNCHER_VARS if name not in inherited):
        return True
    return (_slurm_step_size(env) or 0) > 1


def _inherited_from_singleton(env: Mapping[str, str]) -> tuple:
    """The launcher variables of ``env`` that no launcher set: Open MPI 4 started
    without a launcher (a singleton, e.g. a script that imported mpi4py) puts
    PMIX_RANK and OMPI_MCA_ess=singleton into its own environment, which the
    programs it starts inherit; a launched rank has OMPI_MCA_ess=^singleton."""
    if env.get("OMPI_MCA_ess") == "singleton" and not any(name in env for name in _SIZE_VARS):
        return ("PMIX_RANK",)
    return ()


def world_size_from_env(env: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """Number of ranks the launcher announced, or None when it does not say.

    Example::

        world_size_from_env({"OMPI_COMM_WORLD_SIZE": "8"})    # 8
    """
    env = os.environ if env is None else env
    for name in _SIZE_VARS:
        size = _int_env(env, name)
        if size is not None:
            return size
    return _slurm_step_size(env)


def local_rank_from_env(env: Optional[Mapping[str, str]] = None) -> int:
    """This process's rank on its node according to the launcher, 0 when unknown.

    Usable before MPI starts, e.g. to pick the GPU first.

    Example::

        local_rank_from_env({"MPI_LOCALRANKID": "3"})          # 3
    """
    return _first_int(os.environ if env is None else env, _LOCAL_RANK_VARS)


def rank_from_env(env: Optional[Mapping[str, str]] = None) -> int:
    """This process's rank in the job according to the launcher, 0 when unknown.

    Usable before MPI starts, e.g. so that rank 0 alone reports an error every
    rank meets alike.

    Example::

        rank_from_env({"PMI_RANK": "3", "PMI_SIZE": "4"})     # 3
        rank_from_env({})                                     # 0
    """
    return _first_int(os.environ if env is None else env, _RANK_VARS)


def _first_int(env: Mapping[str, str], names) -> int:
    """The first of ``names`` that ``env`` holds as an integer; 0 when none does."""
    for name in names:
        value = _int_env(env, name)
        if value is not None:
            return value
    return 0


#: Signals whose handler MPI's start may take over: UCX (under MPICH and Open MPI)
#: makes SIGHUP its debug signal, which only raises its log level, so a stop
#: signal that the process caught before MPI started went unseen after it.
_HANDLED_SIGNALS = tuple(getattr(signal, name) for name in ("SIGHUP", "SIGTERM", "SIGUSR1",
                                                           "SIGUSR2") if hasattr(signal, name))


def _python_handlers() -> dict:
    """The signals of :data:`_HANDLED_SIGNALS` that Python handles or ignores now
    (in the main thread only: elsewhere Python sets no handler)."""
    import threading
    if threading.current_thread() is not threading.main_thread():
        return {}
    kept = {}
    for number in _HANDLED_SIGNALS:
        handler = signal.getsignal(number)
        if callable(handler) or handler == signal.SIG_IGN:
            kept[number] = handler
    return kept


def _put_back(kept: dict) -> None:
    """Install ``kept`` again: Python still names them, but the library's start
    may have put its own handler in their place."""
    for number, handler in kept.items():
        signal.signal(number, handler)
        if callable(handler):
            # as train/stop.py installs them: system calls resume (MPI's poll)
            signal.siginterrupt(number, False)


def create_communicator(kind: str = "auto", *, device_transport: str = "auto") -> Communicator:
    """The communicator for this process.

    ``kind``: 'auto' (MPI when started by a launcher with more than one rank,
    otherwise a single rank), 'mpi' (always MPI; fails without mpi4py/libmpi)
    or 'single' (never MPI).  ``device_transport`` picks the route for cupy
    buffers ('auto', 'nccl', 'cuda-aware-mpi', 'host-staged').

    Example::

        comm = create_communicator("auto")
        if comm.rank == 0:
            print(f"{comm.size} ranks over {comm.name}")
    """
    if kind not in KINDS:
        raise ValueError(f"communicator kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if kind == "single":
        return SingleCommunicator()
    if kind == "auto":
        if not launched_by_mpi():
            return SingleCommunicator()
        announced = world_size_from_env()
        if announced is not None and announced <= 1:
            return SingleCommunicator()
    kept = _python_handlers()
    if signal.SIGHUP in kept:
        # UCX's own SIGHUP handler, taken over from MPI's start until _put_back,
        # swallowed one that came meanwhile; a UCX_DEBUG_SIGNO of the user's is kept
        os.environ.setdefault("UCX_DEBUG_SIGNO", "0")
    try:
        from .mpi import MpiCommunicator
    except ImportError as exc:
        raise RuntimeError(
            "comm: MPI was requested (or an MPI launcher was detected) but mpi4py cannot "
            "load an MPI library; `pip install mpi4py mpich` in the virtualenv, or build "
            "mpi4py against the cluster's MPI") from exc
    finally:
        _put_back(kept)
    comm = MpiCommunicator(device_transport=device_transport)
    announced = world_size_from_env()
    if announced is not None and announced > 1 and comm.size == 1:
        # e.g. srun without an MPI plugin this MPI understands: every task would
        # otherwise train alone, silently, into the same run directory
        raise RuntimeError(
            f"comm: the launcher started {announced} tasks but MPI sees a world of 1; "
            "the launcher and the MPI library do not talk to each other (with srun, try "
            "--mpi=pmi2 or --mpi=pmix; or launch with this MPI's own mpiexec)")
    if kind == "auto" and comm.size == 1:
        return SingleCommunicator()
    return comm


def abort_job_interrupted() -> None:
    """End every process of a job that an MPI launcher started with several ranks
    after an interrupt (SIGINT) on this rank, whether it has started MPI or not;
    without such a launcher it does nothing.

    The other ranks may be waiting for this one inside MPI (in its start, or in
    the ranks' first exchange), where only an abort of the whole job reaches
    them: a rank that just exits with status 130 leaves them waiting (MPICH's
    launcher waits on).  MPI is started first where it was not (the others'
    start waits for this rank anyway), then the job aborts with status 130;
    where even that fails, this process ends itself by SIGINT, which launchers
    take as a failed rank.

    Example::

        except KeyboardInterrupt:
            abort_job_interrupted()     # every rank ends, none waits for this one
    """
    if not launched_by_mpi() or (world_size_from_env() or 2) <= 1:
        return
    try:
        from .mpi import abort_world
        abort_world(130)
    except Exception:
        pass
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
