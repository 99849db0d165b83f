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
    available_cores()      # e.g. 4 in a container limited to 4 CPUs on a 64-core host

The cores are those this process may use: its CPU affinity (taskset, Slurm's
and mpiexec's binding), capped by a cgroup CPU quota (containers, Slurm's
cgroup plugin) -- not ``os.cpu_count()``, the host's count.
"""

from __future__ import annotations

import math
import os
from typing import Callable, Mapping, Optional

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
    cores = cores or available_cores()
    return max(1, cores // max(1, ranks_on_node))


def cpu_affinity() -> Optional[set]:
    """The CPUs this process may run on (its affinity), or None where that is unknown."""
    if not hasattr(os, "sched_getaffinity"):      # macOS
        return None
    try:
        return set(os.sched_getaffinity(0))
    except OSError:
        return None


def cores_per_rank(affinity: Optional[set], node_affinities: list, *,
                   ranks_on_node: int, quota: Optional[int] = None) -> int:
    """This rank's share of the cores, knowing every rank's affinity on its node.

    The cores of ``affinity`` are shared by the ranks of ``node_affinities``
    (this rank's included) whose affinity overlaps it: all the node's ranks
    when none is bound, one when each is bound to cores of its own (``srun``'s
    task binding, Intel MPI's pinning), the ranks of a socket when bound per
    socket.  A cgroup CPU ``quota`` is shared by all ``ranks_on_node``.

    Example::

        cores_per_rank({0, 1, 2, 3}, [{0, 1, 2, 3}, {4, 5, 6, 7}], ranks_on_node=2)   # 4
        cores_per_rank(set(range(8)), [set(range(8))] * 2, ranks_on_node=2)           # 4
    """
    if not affinity:
        cores = os.cpu_count() or 1
        sharing = max(1, ranks_on_node)
    else:
        cores = len(affinity)
        sharing = max(1, sum(1 for other in node_affinities if other and other & affinity))
    share = cores // sharing
    if quota is not None:
        share = min(share, quota // max(1, ranks_on_node))
    return max(1, share)


def available_cores(*, affinity: Optional[Callable[[], set]] = None,
                    cgroup_root: str = "/sys/fs/cgroup",
                    proc_cgroup: str = "/proc/self/cgroup") -> int:
    """Cores this process may run on: its affinity, capped by a cgroup CPU quota.

    ``affinity``, ``cgroup_root`` and ``proc_cgroup`` are for tests.
    """
    if affinity is None and hasattr(os, "sched_getaffinity"):   # not on macOS
        affinity = lambda: os.sched_getaffinity(0)  # noqa: E731
    try:
        cores = len(affinity()) if affinity else 0
    except OSError:
        cores = 0
    cores = cores or os.cpu_count() or 1
    quota = cgroup_cpu_limit(cgroup_root, proc_cgroup)
    if quota is not None:
        cores = min(cores, quota)
    return max(1, cores)


def cgroup_cpu_limit(cgroup_root: str = "/sys/fs/cgroup",
                     proc_cgroup: str = "/proc/self/cgroup") -> Optional[int]:
    """CPUs the cgroup quota allows (rounded up), or None without a readable quota.

    cgroup v2: ``cpu.max`` ("QUOTA PERIOD" or "max PERIOD") of this process'
    cgroup and its ancestors, the tightest; v1: ``cpu.cfs_quota_us`` over
    ``cpu.cfs_period_us`` (quota -1: none).
    """
    v2_path, v1_path = _cgroup_paths(proc_cgroup)
    limits = []
    # v2: the limit of any ancestor applies too
    path = v2_path
    while path is not None:
        pair = _read_words(os.path.join(cgroup_root, path.lstrip("/"), "cpu.max"))
        if pair and len(pair) == 2 and pair[0] != "max":
            limits.append(_cpus(pair[0], pair[1]))
        path = None if path in ("/", "") else os.path.dirname(path.rstrip("/")) or "/"
    for controller in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        for sub in {v1_path or "/", "/"}:
            base = os.path.join(cgroup_root, controller, sub.lstrip("/"))
            quota = _read_words(os.path.join(base, "cpu.cfs_quota_us"))
            period = _read_words(os.path.join(base, "cpu.cfs_period_us"))
            if quota and period:
                limits.append(_cpus(quota[0], period[0]))
    limits = [n for n in limits if n is not None]
    return min(limits) if limits else None


def _cgroup_paths(proc_cgroup: str):
    """(v2 path, v1 cpu controller path) of this process, each None when absent."""
    v2 = v1 = None
    try:
        with open(proc_cgroup, encoding="utf-8") as f:
            for line in f:
                hierarchy, _, rest = line.strip().partition(":")
                controllers, _, path = rest.partition(":")
                if hierarchy == "0" and controllers == "":
                    v2 = path or "/"
                elif "cpu" in controllers.split(","):
                    v1 = path or "/"
    except OSError:
        v2 = "/"
    return v2, v1


def _read_words(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().split()
    except (OSError, UnicodeDecodeError):
        return None


def _cpus(quota: str, period: str) -> Optional[int]:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    if q <= 0 or p <= 0:
        return None           # -1: no quota (cgroup v1)
    return max(1, math.ceil(q / p))


def ranks_on_node_from_env(env: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """Ranks on this node as the launcher announced them, or None."""
    env = os.environ if env is None else env
    for name in _RANKS_ON_NODE_ENV:
        value = env.get(name, "").split("(")[0]      # SLURM writes e.g. "2(x3)"
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


# The BLAS variables preset_blas_env set itself (a first guess, not the user's choice).
_preset: dict = {}


def _a_thread_count(value: str) -> bool:
    """Whether a BLAS variable gives a number of threads: a positive integer (or an
    OpenMP list such as "4,2", by its first).  An empty, zero or other value (as
    ``OMP_NUM_THREADS=$SLURM_CPUS_PER_TASK`` gives without --cpus-per-task) is no
    choice: OpenBLAS and OpenMP take it as every core, for each rank."""
    first = value.split(",")[0].strip()
    return first.isdigit() and int(first) > 0


def preset_blas_env(env=None) -> None:
    """Before numpy loads: under a launcher with several ranks here, give each rank
    its share of the cores unless the user set the BLAS variables.

    A first guess from the launcher's variables (they need not tell whether
    each rank is bound to cores of its own); :func:`apply_blas_threads`
    corrects it once the ranks have compared their affinities.
    """
    env = os.environ if env is None else env
    ranks = ranks_on_node_from_env(env)
    if ranks is None or ranks <= 1:
        return
    threads = str(blas_threads(0, ranks_on_node=ranks))   # the cores we may use, shared
    for name in BLAS_ENV:
        if not _a_thread_count(env.get(name, "")):
            env[name] = threads
            if env is os.environ:
                _preset[name] = threads


def user_set_blas_env() -> bool:
    """True when the user (not :func:`preset_blas_env`) set a BLAS variable to a
    number of threads."""
    return any(_a_thread_count(os.environ.get(name, ""))
               and _preset.get(name) != os.environ[name] for name in BLAS_ENV)


def current_blas_threads() -> Optional[int]:
    """The threads numpy's BLAS uses now (the largest of its pools), None when
    threadpoolctl sees no BLAS."""
    from threadpoolctl import threadpool_info
    counts = [pool["num_threads"] for pool in threadpool_info()
              if pool.get("user_api") == "blas"]
    return max(counts) if counts else None


def apply_blas_threads(requested: int, *, device: str, ranks_on_node: int,
                       cores: Optional[int] = None) -> int:
    """After numpy loads: limit its BLAS to the policy's thread count (``requested`` 0:
    the policy's default, left alone when the user set the BLAS variables).

    ``cores``: this rank's share of the cores (:func:`cores_per_rank`), when
    known; else the cores this process may use over ``ranks_on_node``.
    Returns the thread count, 0 when the user's variables were left alone.
    """
    if requested == 0 and device != "gpu" and user_set_blas_env():
        return 0
    threads = blas_threads(requested, device=device, ranks_on_node=1 if cores else ranks_on_node,
                           cores=cores)
    from threadpoolctl import threadpool_limits
    threadpool_limits(threads)
    return threads


def planned_blas_threads(requested: int, *, device: str, ranks_on_node: int = 1,
                         env: Optional[Mapping[str, str]] = None) -> int:
    """The BLAS threads :func:`apply_blas_threads` will give each rank, told before
    the ranks start (a batch script's banner): the user's BLAS variables where the
    policy leaves them alone, else the policy's count."""
    env = os.environ if env is None else env
    if requested == 0 and device != "gpu":
        for name in BLAS_ENV:
            if _a_thread_count(env.get(name, "")):
                return int(env[name].split(",")[0])
    return blas_threads(requested, device=device, ranks_on_node=ranks_on_node)

