"""Stopping a run when the cluster asks: SIGTERM, SIGUSR1 or SIGUSR2; or when
the terminal it was started from closes: SIGHUP.

Slurm sends SIGTERM to every task on preemption and at the time limit (then
SIGKILL after the cluster's ``KillWait``), and SIGUSR1 (or another signal)
ahead of the time limit when asked to (``--signal``).  ``train`` and
``pretrain`` install :func:`stop_on_signals` around the run: a signal only
sets a flag (a handler runs between two bytecodes of the main thread, so it
does nothing else), and the training loop looks at the flag at its own
points:

- the ranks tell each other about their flags inside a collective they hold
  anyway (the sums of the log line, ``training.log_interval``) and, where log
  lines are further apart than :data:`POLL_SECONDS`, in a small allreduce of
  their own about that often (:class:`StopPoll`); every rank then knows the
  same step, and they stop together at the first step from there where they
  hold the same model (a multiple of the method's averaging period), the
  point a periodic checkpoint would be written;
- asynchronous ADPSGD: each rank's flag travels in its progress report to
  rank 0, which calls the end as it calls a quiet point;
- param_server: a client's flag travels in the header of its next gradient;
  server 0 writes a checkpoint after the update it is applying and ends the
  job (there is no point where every rank waits for the others before the end).

There the run writes a checkpoint of the kind the periodic ones are, rank 0
says in one line why it stopped and where the checkpoint is, and every rank
exits with :data:`EXIT_STOPPED` (75, ``EX_TEMPFAIL``: try again later), which
``jobs/slurm/train.sbatch`` takes to requeue the job.  ``--resume``
continues from that checkpoint; with the same ranks and settings it trains
what an uninterrupted run would have.  A further signal while the checkpoint
is written changes nothing (it only sets the flag again); SIGINT (Ctrl-C) is
left as it was and ends the job at once.

SIGHUP comes when the terminal hangs up (closed without ``nohup``): the
console is gone then, and a write to it fails (EIO), so on SIGHUP the
standard output and error that are a hung-up terminal are pointed at
/dev/null, and the checkpoint and the ``stop`` record in metrics.jsonl are
what is left to say it.  A SIGHUP ignored when the process started (``nohup``)
stays ignored: the run goes on.

Example::

    with stop_on_signals():
        result = trainer.run()          # result["stopped"]: the signal's name, if one
"""

from __future__ import annotations

import contextlib
import signal
import threading

#: The signals that ask a run to stop at its next checkpoint (a new one goes last:
#: the ranks tell each other a signal by its place here).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)
#: Exit status of a run that a signal stopped after writing its checkpoint
#: (sysexits.h EX_TEMPFAIL: a temporary failure; run it again).
EXIT_STOPPED = 75
#: What a training loop returns when a signal stopped it.
STOPPED = "stopped"
#: How often, about, the ranks tell each other about signals between log lines:
#: well inside a cluster's grace period (Slurm's KillWait is 30 s by default),
#: rare enough to cost nothing measurable (one allreduce of a few numbers).
POLL_SECONDS = 2.0


class StopRequest:
    """The signal a run was asked to stop by (0: none yet); the first one counts.

    Example::

        requested.signum            # 0, or signal.SIGTERM once one came
        requested.code()            # 1 + its index in STOP_SIGNALS (0: none)
    """

    def __init__(self):
        self.signum = 0

    def __call__(self, signum, frame=None) -> None:
        if signum == signal.SIGHUP:
            _leave_hung_up_terminal()
        if not self.signum:
            self.signum = int(signum)

    def clear(self) -> None:
        self.signum = 0

    def code(self) -> int:
        """A small number naming the signal, for a message to the other ranks."""
        for index, number in enumerate(STOP_SIGNALS):
            if self.signum == number:
                return index + 1
        return 0


#: This process's request (set by the handlers :func:`stop_on_signals` installs).
requested = StopRequest()


def _leave_hung_up_terminal() -> None:
    """Point standard output and error at /dev/null where they are a terminal that
    hung up: every later line written there (a log line, the stop line) failed
    with EIO, and the run ended in an error instead of its checkpoint.  A live
    terminal or a file (a SIGHUP sent by ``kill``) is kept."""
    import errno
    import os
    import termios
    for fd in (1, 2):
        try:
            termios.tcgetattr(fd)
            continue                    # a live terminal
        except termios.error as exc:
            if exc.args[0] != errno.EIO:     # not a terminal (ENOTTY), or closed
                continue
        except (OSError, ValueError):
            continue
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, fd)
            os.close(devnull)
        except OSError:
            pass


def _stop_signals() -> tuple:
    """The signals of :data:`STOP_SIGNALS` to catch now: SIGHUP only where it is not
    ignored (``nohup``), which asked the run to go on when the terminal closes."""
    # (ignored by ignore_from_now_on at an earlier run's end is not nohup: a later
    # run in this process still stops on it)
    if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN \
            and signal.SIGHUP not in _ignored_at_the_end:
        return tuple(number for number in STOP_SIGNALS if number != signal.SIGHUP)
    return STOP_SIGNALS


def signal_name(code: int) -> str:
    """The name of the signal :meth:`StopRequest.code` gave ``code`` for."""
    if 1 <= code <= len(STOP_SIGNALS):
        return signal.Signals(STOP_SIGNALS[code - 1]).name
    return "a signal"


def agreed_stop(counts, *, is_root: bool):
    """``(signal code, ranks that got one)`` from every rank's stop flags summed
    (one count per signal of :data:`STOP_SIGNALS`, the same on every rank), or
    None when no rank got one.  The signal named is rank 0's own where it got
    one, otherwise the one most ranks got."""
    counts = [int(round(c)) for c in counts]
    if not any(counts):
        return None
    mine = requested.code()
    code = mine if mine and is_root else max(range(len(counts)), key=lambda i: counts[i]) + 1
    return code, sum(counts)


def stop_requested() -> bool:
    return bool(requested.signum)


_caught_early = False
#: Set once every rank has passed the run's last barrier, or stopped at an error
#: every rank reached (:func:`ignore_from_now_on`).
_run_complete = False
#: The stop signals :func:`ignore_from_now_on` set to SIG_IGN (not ignored before).
_ignored_at_the_end: set = set()


def ignore_from_now_on() -> None:
    """The run is complete on every rank (its files written, its status known; or
    every rank stopped at the same error, the status 2): a stop signal from here
    to the process's end has nothing left to save, so it is ignored, through
    MPI's finalize too, where a rank waits for the slowest one
    (it died of the signal there, and the launcher failed the finished job).
    SIG_IGN, not a Python handler: the interpreter puts back the default action
    of the signals it handles before MPI's finalize runs.  Ctrl-C and SIGKILL
    still end a process that hangs there.  In the main thread only."""
    global _run_complete
    if threading.current_thread() is not threading.main_thread():
        return
    _run_complete = True
    for number in _stop_signals():
        if signal.signal(number, signal.SIG_IGN) != signal.SIG_IGN:
            _ignored_at_the_end.add(number)


@contextlib.contextmanager
def keep_stop_signals():
    """Within the block, :data:`STOP_SIGNALS` set :data:`requested`, before and
    around the run's own :func:`stop_on_signals`: a signal while the job starts
    (the configuration read, MPI started, the ranks' agreement; a job preempted
    as it starts) is kept for the run, which stops at its first checkpoint with
    :data:`EXIT_STOPPED`, instead of ending the process with the signal's status,
    which a batch script does not take for a stop to requeue.  In the main
    thread only (else it changes nothing)."""
    global _caught_early
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {number: signal.signal(number, requested) for number in _stop_signals()}
    for number in previous:
        signal.siginterrupt(number, False)
    _caught_early = True
    try:
        yield
    finally:
        _caught_early = False
        for number, handler in previous.items():
            signal.signal(number, signal.SIG_IGN if _run_complete else handler)
        requested.clear()


@contextlib.contextmanager
def stop_on_signals():
    """Within the block, :data:`STOP_SIGNALS` set :data:`requested` instead of
    ending the process; the previous handlers come back after it.  Outside the
    main thread (where Python allows no handler) it changes nothing.  A signal
    caught before the block (:func:`keep_stop_signals`) counts in it."""
    if threading.current_thread() is not threading.main_thread():
        yield requested
        return
    if not _caught_early:
        requested.clear()
    previous = {}
    try:
        for number in _stop_signals():
            previous[number] = signal.signal(number, requested)
            # system calls interrupted by it resume (a library's write, MPI's poll)
            # instead of failing with EINTR
            signal.siginterrupt(number, False)
        yield requested
    finally:
        for number, handler in previous.items():
            signal.signal(number, signal.SIG_IGN if _run_complete else handler)
        requested.clear()


class StopPoll:
    """When the ranks of a lock-step loop tell each other about their stop flags
    between log lines: every :attr:`every` steps, a number rank 0 sets from its
    own step time at each exchange so that exchanges are about
    :data:`POLL_SECONDS` apart (at most ``max_every``, the log interval, whose
    line carries the flags anyway).  Every rank learns the number in the same
    exchange, so all ranks poll at the same steps.

    Example::

        poll = StopPoll(comm, max_every=cfg.training.log_interval)
        poll.start(step)
        ...                                  # after each step:
        if log_line_due:
            poll.heard(step)                 # the log line's sums held the flags
        elif poll.due(step):
            flags, _ = poll.exchange(step)   # every rank's flags, summed
    """

    def __init__(self, comm, *, max_every: int, seconds: float | None = None):
        self.comm = comm
        self.max_every = max(1, int(max_every))
        self.seconds = POLL_SECONDS if seconds is None else seconds
        self.every = 1               # (the first exchange: after the first step)
        self._next = None
        self._since = (0, 0.0)       # (step, rank 0's time) of the last exchange

    def start(self, step: int) -> None:
        self.heard(step)

    def heard(self, step: int) -> None:
        """The ranks exchanged their flags at ``step`` (a log line's sums)."""
        self._next = step + self.every
        self._since = (step, self.comm.wtime())

    def due(self, step: int) -> bool:
        return self.comm.size > 1 and self._next is not None and step >= self._next

    def exchange(self, step: int, *, rank0_flag: bool = False) -> tuple:
        """``(flags, rank0_flag)``: every rank's stop flags summed (one count per
        signal of :data:`STOP_SIGNALS`), and rank 0's ``rank0_flag`` on every
        rank (a checkpoint its clock says is due); sets the steps to the next
        exchange."""
        import numpy as np      # (imported here: the command line imports this module early)
        buf = np.zeros(len(STOP_SIGNALS) + 2, dtype=np.float64)
        if requested.code():
            buf[requested.code() - 1] = 1
        if self.comm.rank == 0:
            since_step, since_time = self._since
            per_step = (self.comm.wtime() - since_time) / max(step - since_step, 1)
            every = self.seconds / per_step if per_step > 0 else self.max_every
            buf[-2] = max(int(min(every, self.max_every)), 1)
            buf[-1] = float(bool(rank0_flag))
        self.comm.allreduce_(buf, op="sum")
        self.every = int(buf[-2])
        self.heard(step)
        return buf[:-2], bool(buf[-1])
