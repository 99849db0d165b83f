"""``python -m mpitrain``: pick BLAS threads before numpy loads, then run the CLI."""

import os


def _default_blas_threads() -> None:
    # Ranks that fill the cores must not each start a full BLAS thread pool:
    # 2 ranks x 2 threads ran 1.7-3.2x slower than 2 x 1 on 2 cores.
    ranks_here = None
    for var in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE",
                "PMI_SIZE"):
        value = os.environ.get(var, "").split("(")[0]
        if value.isdigit() and int(value) > 1:
            ranks_here = int(value)
            break
    if ranks_here is None:
        return
    threads = str(max(1, (os.cpu_count() or 1) // ranks_here))
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, threads)


_default_blas_threads()

from .cli import main  # noqa: E402  (after the BLAS environment is set)

raise SystemExit(main())
