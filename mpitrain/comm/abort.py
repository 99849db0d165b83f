"""Make one failing rank end the whole MPI job instead of leaving the others hanging.

Without this, an exception on one rank leaves every other rank blocked in its
next collective forever.  With more than one rank, the hook prints the rank and
the traceback to stderr (flushed, so the launcher shows it) and aborts the job.
With one rank, Python's normal handling is kept.

Example::

    comm = create_communicator()
    install_abort_hook(comm)
    with abort_on_error(comm):
        main()
"""

from __future__ import annotations

import sys
import threading
import traceback
from contextlib import contextmanager

from .base import Communicator


def _report(comm: Communicator, exc_type, exc, tb) -> None:
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    if sys.stdout is not None:      # (None: started with it closed)
        sys.stdout.flush()
    sys.stderr.write(f"[rank {comm.rank}/{comm.size}] uncaught "
                     f"{exc_type.__name__}, aborting the job:\n{text}")
    sys.stderr.flush()


def install_abort_hook(comm: Communicator):
    """Replace ``sys.excepthook`` (and ``threading.excepthook``) so an uncaught
    exception aborts all ranks with exit status 1.  Returns the previous sys hook.

    Example::

        install_abort_hook(comm)
        raise RuntimeError("bad shard")    # whole job ends, message on stderr
    """
    previous = sys.excepthook
    previous_thread_hook = threading.excepthook

    def hook(exc_type, exc, tb):
        if comm.size == 1:
            previous(exc_type, exc, tb)
            return
        _report(comm, exc_type, exc, tb)
        comm.abort(1)

    def thread_hook(args):
        # A dead communication thread would leave its partners waiting: abort too.
        if comm.size == 1 or args.exc_type is SystemExit:
            previous_thread_hook(args)
            return
        _report(comm, args.exc_type, args.exc_value, args.exc_traceback)
        comm.abort(1)

    sys.excepthook = hook
    threading.excepthook = thread_hook
    return previous


@contextmanager
def abort_on_error(comm: Communicator):
    """Run a block; an exception (or a non-zero ``sys.exit``) inside it aborts all ranks.

    With one rank the exception propagates unchanged.  ``SystemExit(code)``
    aborts with that code, KeyboardInterrupt with 130.

    Example::

        with abort_on_error(comm):
            trainer.run()
    """
    try:
        yield
    except SystemExit as exc:
        code = exc.code
        if comm.size == 1 or code is None or code == 0:
            raise
        status = code if isinstance(code, int) else 1
        if not isinstance(code, int):
            sys.stderr.write(f"{code}\n")   # sys.exit("message") prints its message
        if sys.stdout is not None:      # (None: started with it closed)
            sys.stdout.flush()
        sys.stderr.write(f"[rank {comm.rank}/{comm.size}] exiting with status {status}, "
                         f"aborting the job\n")
        sys.stderr.flush()
        comm.abort(status)
    except KeyboardInterrupt:
        if comm.size == 1:
            raise
        comm.abort(130, "interrupted")
    except BaseException as exc:
        if comm.size == 1:
            raise
        _report(comm, type(exc), exc, exc.__traceback__)
        comm.abort(1)
