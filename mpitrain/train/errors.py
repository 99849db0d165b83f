"""The error that stops training with a message for the user, and the record of
an error a run ended on.

Rank 0 writes its ``error`` record into ``metrics.jsonl``, which only it holds
open.  A rank other than 0 that fails alone ends the job with MPI's abort,
which ends rank 0 wherever it waits, before it could say anything: that rank
writes its record into a file of its own in the run directory,
``error-rank-NNNNN.json``, whole or not at all, before the abort, and
``status`` reads it where metrics.jsonl holds none.  The files are removed when
the run directory is next taken (a resumed or new run).
"""

from __future__ import annotations

import json
import os
import re


class TrainingError(RuntimeError):
    """A problem that stops training, with a message for the user.

    ``agreed``: every rank raises it at the same point (a decision taken from
    collective results), so the job can end without an abort and one rank
    alone needs to print it.  ``setting``: a setting of the configuration that
    this job cannot run (with its number of ranks, say); the command line puts
    the configuration file's name in front.
    """

    def __init__(self, message: str, *, agreed: bool = False, setting: bool = False):
        super().__init__(message)
        self.agreed = agreed
        self.setting = setting


def some_ranks(ranks: list, size: int) -> str:
    """`` (ranks 1, 3 of 4)`` after a reason some ranks gave; nothing when all did."""
    if len(ranks) == size:
        return ""
    return f" (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of {size})"


def error_record(exc: BaseException) -> dict:
    """The fields of the ``error`` record a run writes as it ends on ``exc``, so that
    ``status`` says how it ended (a failure, or Ctrl-C) rather than that it was cut off.

    Example::

        log.write("error", step=step, **error_record(exc))
    """
    return {"error": type(exc).__name__, "message": error_message(exc)[:1000]}


def error_message(exc: BaseException) -> str:
    """What ``exc`` says, on one line; never empty (a bare MemoryError says nothing,
    and status showed 'failed at step S: ' alone).

    Example::

        error_message(MemoryError())        # 'out of memory'
    """
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted (SIGINT, Ctrl-C)"
    message = " ".join(str(exc).split())
    if isinstance(exc, MemoryError) and not message:
        return "out of memory"
    return message or type(exc).__name__


#: The file a rank other than 0 writes its error record into (its rank: 5 digits or more).
RANK_ERROR_NAME = re.compile(r"error-rank-(?P<rank>[0-9]{5,})\.json")


def rank_error_path(run_dir, rank: int) -> str:
    return os.path.join(os.fspath(run_dir), f"error-rank-{int(rank):05d}.json")


def write_rank_error(run_dir, rank: int, record: dict) -> None:
    """The ``error`` record (:func:`error_record` and where: step, layer) of rank
    ``rank``, which failed alone, into its own file in ``run_dir``; call it before
    the abort that ends the job.

    Example::

        write_rank_error("runs/x", 1, {"step": 5, **error_record(exc)})
    """
    from ..files import atomic_open
    with atomic_open(rank_error_path(run_dir, rank)) as fh:
        fh.write(json.dumps({"type": "error", **record, "rank": int(rank)}) + "\n")


def record_failure_alone(comm, run_dir, exc: BaseException, **where) -> None:
    """On a rank other than 0 of an MPI job, where ``exc`` is this rank's alone (not
    one every rank raised together): its record into its own file (rank 0 writes
    its records into metrics.jsonl).  ``where``: step (and layer).  A failure to
    write it changes nothing: the error itself is what goes on to the abort."""
    if comm.rank == 0 or getattr(comm, "name", "") != "mpi" or getattr(exc, "agreed", False):
        return          # (virtual ranks: rank 0 records the failure of any of them)
    try:
        write_rank_error(run_dir, comm.rank, {**where, **error_record(exc)})
    except Exception:
        pass


def rank_error_files(run_dir) -> list:
    """The rank error files in ``run_dir``, first written first."""
    run_dir = os.fspath(run_dir)
    try:
        names = os.listdir(run_dir)
    except OSError:
        return []
    found = []
    for name in names:
        match = RANK_ERROR_NAME.fullmatch(name)
        if match:
            path = os.path.join(run_dir, name)
            try:
                found.append((os.stat(path).st_mtime_ns, int(match.group("rank")), path))
            except OSError:
                continue
    return [path for _, _, path in sorted(found)]


def remove_rank_errors(run_dir) -> None:
    """Remove the rank error files of an earlier start of the run in ``run_dir``
    (rank 0, before the other ranks go on: a new failure's file is its own)."""
    for path in rank_error_files(run_dir):
        try:
            os.remove(path)
        except OSError:     # (then status may name an old failure; the run goes on)
            pass
