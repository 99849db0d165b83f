"""How many BLAS threads a rank uses: the one policy, applied before and after numpy loads.

Ranks that fill a node's cores must not each start a full BLAS thread pool
(2 ranks x 2 threads ran 1.7-3.2x slower than 2 x 1 on 2 cores), and on a GPU
the host's BLAS only sees NG-SGD's small r x r matrices, where threads cost
more than they give.  This module imports nothing heavy, so ``python -m
mpitrain`` can set the environment before numpy starts its pool.

Example::

    blas_threads(0, device="cpu", ranks_on_node=2, cores=16)   # 8
    blas_threads(0, device="gpu", ranks_on_node=2, cores=16)   # 1
    blas_threads(3, device="cpu", ranks_on_node=2, cores=16)   # 3 (asked for)
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

BLAS_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")

# Launchers' variables for the number of ranks on this node, most specific first.
_RANKS_ON_NODE_ENV = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE",
                      "PMI_SIZE")


def blas_threads(requested: int = 0, *, device: str = "cpu", ranks_on_node: int = 1,
                 cores: Optional[int] = None) -> int:
    """Threads per rank: ``requested`` if > 0, else 1 on a GPU, else cores / ranks."""
    if requested > 0:
        return int(requested)
    if device == "gpu":
        return 1
    cores = cores or os.cpu_count() or 1
    return max(1, cores // max(1, ranks_on_node))


def ranks_on_node_from_env(env: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """Ranks on this node as the launcher announced them, or None."""
    env = os.environ if env is None else env
    for name in _RANKS_ON_NODE_ENV:
        value = env.get(name, "").split("(")[0]      # SLURM writes e.g. "2(x3)"
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


def preset_blas_env(env=None) -> None:
    """Before numpy loads: under a launcher with several ranks here, give each rank
    its share of the cores unless the user set the BLAS variables."""
    env = os.environ if env is None else env
    ranks = ranks_on_node_from_env(env)
    if ranks is None or ranks <= 1:
        return
    threads = str(blas_threads(0, ranks_on_node=ranks))
    for name in BLAS_ENV:
        env.setdefault(name, threads)


def apply_blas_threads(requested: int, *, device: str, ranks_on_node: int) -> None:
    """After numpy loads: limit its BLAS to the policy's thread count (``requested`` 0:
    the policy's default, left alone when the user set the BLAS variables)."""
    if requested == 0 and device != "gpu" and any(name in os.environ for name in BLAS_ENV):
        return
    from threadpoolctl import threadpool_limits
    threadpool_limits(blas_threads(requested, device=device, ranks_on_node=ranks_on_node))
