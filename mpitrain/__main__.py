"""``python -m mpitrain``: pick BLAS threads before numpy loads, then run the CLI."""

from .threads import preset_blas_env

preset_blas_env()

from .cli import main  # noqa: E402  (after the BLAS environment is set)

raise SystemExit(main())
