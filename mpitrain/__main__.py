"""``python -m mpitrain``: keep stop signals from the first moment (train and
pretrain), pick BLAS threads before numpy loads, then run the CLI."""

import sys

from .process import stop_signals_kept

# (before the command line's modules load: a stop signal meanwhile ended the rank
# with the signal's status, which a batch script does not requeue)
with stop_signals_kept(sys.argv[1:]):
    from .threads import preset_blas_env

    preset_blas_env()

    from .cli import main

    status = main()

raise SystemExit(status)
