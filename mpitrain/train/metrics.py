"""Progress lines on the console and a JSON-lines metrics file (rank 0 only)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time

from ..files import WriteError, disk_full_error


def resident_mb() -> float | None:
    """This process's resident memory in MiB now (Linux), else None."""
    try:
        with open("/proc/self/statm", encoding="ascii") as fh:
            pages = int(fh.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def epoch_of_step(step: int, steps_per_epoch: int) -> int:
    """The 0-based epoch of the ``step``-th minibatch, as the lock-step methods log
    it (their reader's epoch): the last step of epoch 0 is in epoch 0, not 1."""
    return max(step - 1, 0) // steps_per_epoch


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


BAR_WIDTH = 20


def progress_bar(done: int, total: int, width: int = BAR_WIDTH) -> str:
    """``[#####.....]  50%`` for ``done`` of ``total``.

    Example::

        progress_bar(1, 4)      # '[#####...............]  25%'
    """
    frac = min(max(done / total, 0.0), 1.0) if total > 0 else 1.0
    filled = int(round(frac * width))
    return f"[{'#' * filled}{'.' * (width - filled)}] {frac:4.0%}"


def drop_partial_last_line(path: str) -> None:
    """Cut a last line without its newline (a write cut short by a crash or a full
    disk), so records appended after it stay readable."""
    try:
        with open(path, "rb+") as fh:
            size = fh.seek(0, os.SEEK_END)
            if size == 0:
                return
            fh.seek(size - 1)
            if fh.read(1) == b"\n":
                return
            keep = size
            while keep > 0:           # back to the last newline
                step = min(4096, keep)
                fh.seek(keep - step)
                block = fh.read(step)
                cut = block.rfind(b"\n")
                if cut >= 0:
                    keep = keep - step + cut + 1
                    break
                keep -= step
            fh.truncate(keep)
    except FileNotFoundError:
        return


class MetricsLog:
    """Writes one JSON object per line to ``metrics.jsonl`` and echoes a summary.

    With ``tensorboard`` the ``train`` and ``eval`` scalars also go to event
    files (:mod:`mpitrain.train.tensorboard`).  :meth:`progress` redraws one
    line with a bar when the stream is a terminal, and prints the plain line
    otherwise (a log file, a pipe, a batch job's output).

    Example::

        log = MetricsLog(run_dir, enabled=(rank == 0))
        log.write("train", step=100, xent=1.2, acc=0.6)
        log.progress(100, 1400, "step 100/1400 xent 1.2000 ...")
    """

    def __init__(self, run_dir, *, enabled: bool = True, stream=None, append: bool = False,
                 tensorboard: bool = False, start: float | None = None):
        self.enabled = enabled
        self.stream = stream or sys.stdout
        # records carry seconds since the start on the monotonic clock: a step of
        # the system clock would move them (plot --x time); ``start``: another log's,
        # for records added to a run after its own log was closed
        self.start = time.monotonic() if start is None else start
        self._fh = None
        self._write_failed = False
        self._board = None
        self._bar_open = False      # a progress line is on screen without its newline
        if enabled:
            os.makedirs(run_dir, exist_ok=True)
            path = os.path.join(run_dir, "metrics.jsonl")
            if append:
                drop_partial_last_line(path)
            self._fh = open(path, "a" if append else "w", encoding="utf-8")
            if tensorboard:
                from .tensorboard import TensorBoardLog
                self._board = TensorBoardLog(run_dir, append=append)

    def write(self, kind: str, **fields) -> None:
        if not self.enabled:
            return
        record = {"type": kind, "time": round(time.monotonic() - self.start, 3), **fields}
        try:
            self._fh.write(json.dumps(record) + "\n")
            self._fh.flush()
        except OSError as exc:                  # a full disk: name the file
            self._write_failed = True
            raise disk_full_error(exc, self._fh.name) or WriteError(
                exc.errno, f"cannot write {self._fh.name}: {exc.strerror}") from exc
        if self._board is not None:
            self._board.record(kind, fields)

    def say(self, text: str) -> None:
        if self.enabled:
            with self._console():
                self._end_bar()
                print(text, file=self.stream, flush=True)

    def progress(self, done: int, total: int, text: str) -> None:
        """A progress line: redrawn in place with a bar on a terminal, else printed."""
        if not self.enabled:
            return
        with self._console():
            self._progress(done, total, text)

    @contextlib.contextmanager
    def _console(self):
        """A console line that cannot be written (the output file on a full disk) is
        one line naming the console; a reader that left (``| head``) stays quiet."""
        try:
            yield
        except (BrokenPipeError, WriteError):      # (WriteError: named already)
            raise
        except OSError as exc:
            where = "standard output" if self.stream is sys.stdout else "the console stream"
            raise WriteError(exc.errno, f"cannot write {where}: {exc.strerror or exc}") \
                from exc

    def _progress(self, done: int, total: int, text: str) -> None:
        if not _is_tty(self.stream):
            print(text, file=self.stream, flush=True)
            return
        line = f"{progress_bar(done, total)} {text}"
        columns = shutil.get_terminal_size((120, 24)).columns
        if len(line) >= columns:
            # a narrow terminal: the step and figures without the bar, then cut (cut
            # alone, the line was the bar and nothing else)
            line = text[:max(columns - 1, 0)]
        # \r and clear-to-end: the new line replaces the previous one
        self.stream.write("\r" + line + "\x1b[K")
        self.stream.flush()
        self._bar_open = True

    def _end_bar(self) -> None:
        if self._bar_open:
            self.stream.write("\n")
            self._bar_open = False

    def close(self) -> None:
        if self.enabled:
            self._end_bar()
        if self._fh is not None:
            fh, self._fh = self._fh, None
            try:
                fh.close()
            except OSError:
                # closing writes the record that failed once more: the failed write's
                # error, which names the file, is the one to tell
                if not self._write_failed:
                    raise
        if self._board is not None:
            self._board.close()
            self._board = None


def _is_tty(stream) -> bool:
    """Whether ``stream`` is the terminal the user watches: a terminal that is this
    process's controlling one.  Open MPI's launcher gives each rank's output a
    terminal of its own, whatever its own output is (a batch job's log)."""
    try:
        if not stream.isatty():
            return False
    except (AttributeError, ValueError):
        return False
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return True             # a stream without a descriptor that says it is one
    try:
        os.tcgetpgrp(fd)        # fails on a terminal that is not the controlling one
    except OSError:
        return False
    return True
