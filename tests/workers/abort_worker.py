"""One rank fails while the others wait in a collective; the job must end at once.

Usage: abort_worker.py hook|context|exit

- hook:    an uncaught exception with install_abort_hook
- context: an exception inside abort_on_error
- exit:    sys.exit(3) inside abort_on_error
Without the abort the healthy ranks would block in barrier() forever.
"""

import sys

from mpitrain.comm import create_communicator
from mpitrain.comm.abort import abort_on_error, install_abort_hook

mode = sys.argv[1]
comm = create_communicator("auto")
failing_rank = comm.size - 1


def work():
    comm.barrier()
    if comm.rank == failing_rank:
        if mode == "exit":
            sys.exit(3)
        raise RuntimeError(f"deliberate failure on rank {comm.rank} ({mode})")
    comm.barrier()           # never returns: the failing rank does not arrive
    print(f"rank {comm.rank} passed a barrier it should not have", flush=True)


if mode == "hook":
    install_abort_hook(comm)
    work()
elif mode in ("context", "exit"):
    with abort_on_error(comm):
        work()
else:
    raise SystemExit(f"abort_worker.py: unknown mode {mode!r}")
