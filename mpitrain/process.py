"""The command line's process: its standard streams and signals before a command
runs, so that the commands meet one kind of console and one signal policy.

- standard output whose failed writes name it (:class:`NamedStdout`), pointed
  at /dev/null once it failed (:func:`silence_stdout`), and /dev/null on the
  standard descriptors the program was started without
  (:func:`fill_closed_standard_descriptors`);
- ``train``'s and ``pretrain``'s stop signals kept from the first moment
  (:func:`stop_signals_kept`), and Ctrl-C held while the command line is read
  (:func:`interrupt_held`).

Example::

    fill_closed_standard_descriptors()
    with stop_signals_kept(sys.argv[1:]), interrupt_held():
        ...
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys


#: Whether the command line owns this process (``python -m mpitrain``, the
#: ``mpitrain`` command): only then does a command leave stop signals ignored to the
#: process's end once its status is settled; a caller that runs the command line
#: inside its own process (a test, a notebook) keeps its handlers.
_command_line_owns_process = False


def command_line_owns_process() -> None:
    """Called first by the program's own entry point (``mpitrain/__main__.py``)."""
    global _command_line_owns_process
    _command_line_owns_process = True


def process_is_the_command_lines() -> bool:
    return _command_line_owns_process


class NamedStdout:
    """Standard output whose failed writes name it: on a full disk the commands said
    a bare "[Errno 28] No space left on device".  A reader that left (``| head``)
    still ends the command as a Unix tool."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        with self._named():
            try:
                return self.stream.write(text)
            except UnicodeEncodeError:
                # a character the locale's encoding lacks (an utterance named in
                # Japanese, under Latin-1): written as an escape, as stderr does,
                # not failing the command after its work was done
                encoding = getattr(self.stream, "encoding", None) or "ascii"
                return self.stream.write(
                    text.encode(encoding, "backslashreplace").decode(encoding))

    def flush(self):
        with self._named():
            return self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)

    @staticmethod
    @contextlib.contextmanager
    def _named():
        try:
            yield
        except BrokenPipeError:
            raise
        except OSError as exc:
            from .files import WriteError
            silence_stdout()       # (the interpreter's last flush would fail again)
            raise WriteError(exc.errno, "cannot write standard output: "
                             f"{exc.strerror or exc}") from None


def silence_stdout() -> None:
    """Point standard output at /dev/null, so the interpreter's last flush cannot
    fail again."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def fill_closed_standard_descriptors() -> None:
    """Put /dev/null on a standard descriptor the program was started without
    (``0<&-``, ``>&-``), so that no file it opens takes that number, where a
    library's output to the console would land in it.  Python's own stream for
    it stays None (standard error's: a stream to /dev/null): reading ``-`` from a
    closed standard input, or writing ``-`` to a closed output, is refused."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            with contextlib.suppress(OSError):
                opened = os.open(os.devnull, os.O_RDWR)
                if opened != fd:        # a lower one was closed too and is filled now
                    os.dup2(opened, fd)
                    os.close(opened)
    if sys.stderr is None:      # errors go where the caller sent them: nowhere
        sys.stderr = open(os.devnull, "w", encoding="utf-8")


@contextlib.contextmanager
def stop_signals_kept(words, *, to_the_end=False):
    """For ``train`` and ``pretrain`` (no command: train), a stop signal from the
    first moment on (while Python loads numpy, before the command line is read)
    is kept for the run (train/stop.py), real or virtual ranks alike, which stops
    at its first checkpoint instead of the process ending with the signal's
    status.  ``to_the_end`` (the process's own command line): once the block has
    ended without an error, one is ignored to the process's end."""
    if words and words[0] not in ("train", "pretrain"):
        yield
        return
    from .train.stop import ignore_from_now_on, keep_stop_signals
    with keep_stop_signals():
        yield
        if to_the_end:
            # the command's status is settled and nothing is left to save: a signal
            # in the interpreter's exit or MPI's finalize ended a one-rank job with
            # the signal's status after its `done:`
            ignore_from_now_on()


@contextlib.contextmanager
def interrupt_held():
    """Within the block SIGINT (Ctrl-C) is held, and raised as KeyboardInterrupt
    at its end: an interrupt that cuts short the import of a C extension
    (numpy's) can end in an ImportError that blames the installation."""
    came = []
    try:
        previous = signal.signal(signal.SIGINT, lambda *_: came.append(True))
    except ValueError:          # not the main thread: Python allows no handler
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if came:
        raise KeyboardInterrupt
