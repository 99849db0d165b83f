"""``python -m mpitrain`` and the ``mpitrain`` command: keep stop signals from the
first moment (train and pretrain), pick BLAS threads before numpy loads, then run
the CLI."""

import sys

from .process import command_line_owns_process, stop_signals_kept


def main(argv=None) -> int:
    """The command line, with stop signals kept while its modules load (a stop
    signal meanwhile ended the rank with the signal's status, which a batch script
    does not requeue)."""
    command_line_owns_process()
    words = sys.argv[1:] if argv is None else argv
    with stop_signals_kept(words, to_the_end=True):
        from .threads import preset_blas_env

        preset_blas_env()

        from .cli import main as cli_main

        return cli_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
