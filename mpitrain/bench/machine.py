"""What a benchmark ran on: CPU, cores, BLAS, GPU, MPI, versions and load.

Benchmark figures on a shared machine mean little without the machine, so
every benchmark stores this probe with its results:

- :func:`machine_info`: one process (the single-rank throughput benchmark's
  header and ``--json``): CPU model, cores, numpy's BLAS, PyTorch; the GPU,
  driver and CuPy on a GPU;
- :func:`environment`: every rank of a job, collective (``mpitrain bench``'s
  ``bench.json``): hosts, ranks per host, oversubscription, every BLAS pool,
  GPUs, the MPI library, package versions, load average and date.

Also :func:`import_torch` (PyTorch, or None: it is a benchmark-only extra)
and :func:`load_average`.

Example::

    info = machine_info("cpu")
    print(info["cpu"], info["cores"], info["numpy_blas"])
    env = environment(comm, cfg)        # on every rank; the same dict everywhere
"""

from __future__ import annotations

import os
import platform
import socket
import sys
import time
from typing import Optional

import numpy as np

from mpitrain.threads import BLAS_ENV


def device_problem(device: str) -> Optional[str]:
    """Why ``device`` cannot be used here (no CuPy, or no GPU), None when it can;
    selects it for the array backend."""
    if device != "gpu":
        return None
    from .. import backend
    try:
        backend.select("gpu")
    except backend.DeviceError as exc:
        return str(exc)
    return None


def import_torch():
    """The ``torch`` module, or None when PyTorch is not installed."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def load_average() -> Optional[list]:
    """The 1, 5 and 15 minute load averages, or None where the OS has none."""
    # other work on a shared machine shows here, and in every timing
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def cpu_model() -> str:
    """The CPU's name as /proc/cpuinfo gives it, or 'unknown'."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def numpy_blas() -> Optional[dict]:
    """The BLAS library numpy calls (API, version, kernels, threading), or None."""
    from threadpoolctl import threadpool_info
    blas = [{"internal_api": i.get("internal_api"), "version": i.get("version"),
             "architecture": i.get("architecture"), "threading_layer": i.get("threading_layer")}
            for i in threadpool_info()
            if i.get("user_api") == "blas" and "numpy" in (i.get("filepath") or "")]
    return blas[0] if blas else None


def blas_pools() -> list:
    """Every thread pool threadpoolctl sees (BLAS, OpenMP), without file paths."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return [{"note": "threadpoolctl not installed"}]
    keep = ("user_api", "internal_api", "version", "num_threads", "threading_layer",
            "architecture")
    # no file paths: they name this machine's directories
    return [{k: pool.get(k) for k in keep if k in pool} for pool in threadpool_info()]


def machine_info(device: str = "cpu") -> dict:
    """CPU model, core count, numpy's BLAS, PyTorch; GPU, driver and CuPy on a GPU.

    Example::

        machine_info()["numpy_blas"]["internal_api"]     # e.g. 'openblas'
    """
    torch = import_torch()
    info = {"cpu": cpu_model(), "cores": os.cpu_count(), "numpy": np.__version__,
            "numpy_blas": numpy_blas(),
            "torch": torch.__version__ if torch is not None else None,
            "python": sys.version.split()[0]}
    if device == "gpu":
        from mpitrain import backend
        info.update(backend.device_info(backend.select("gpu")))
    return info


def package_versions(device: str = "cpu") -> dict:
    """mpitrain, Python, numpy, h5py, matplotlib (None when missing); CuPy on a GPU."""
    import h5py
    from mpitrain import __version__
    versions = {"mpitrain": __version__, "python": sys.version.split()[0],
                "numpy": np.__version__, "h5py": h5py.__version__}
    try:
        import matplotlib
        versions["matplotlib"] = matplotlib.__version__
    except ImportError:
        versions["matplotlib"] = None
    if device == "gpu":
        from mpitrain import backend
        versions["cupy"] = backend.select("gpu").__version__
    return versions


def environment(world, cfg) -> dict:
    """Ranks, hosts, cores, BLAS, GPU, MPI library and versions; collective over ``world``.

    Example::

        environment(comm, cfg)["mpi"]["library_version"]
    """
    from mpitrain.comm.info import mpi_info
    host = socket.gethostname()
    gpu, missing = "not used (device: cpu)", None
    if cfg.device == "gpu":
        from mpitrain import backend
        try:
            gpu = backend.device_name(backend.select("gpu", world.device_rank))
        except backend.DeviceError as exc:
            missing = str(exc)
    per_rank = world.allgather_obj({"host": host, "gpu": gpu, "missing": missing})
    lacking = [rank for rank, r in enumerate(per_rank) if r["missing"]]
    if lacking:
        # no CuPy or no GPU: said once by rank 0, not by every rank
        from mpitrain.train.errors import TrainingError, some_ranks
        raise TrainingError(per_rank[lacking[0]]["missing"] + some_ranks(lacking, world.size),
                            agreed=True)
    hosts = sorted({r["host"] for r in per_rank})
    ranks_per_host = {h: sum(r["host"] == h for r in per_rank) for h in hosts}
    cores = os.cpu_count() or 1
    return {"ranks": world.size, "hosts": hosts, "ranks_per_host": ranks_per_host,
            "cpu_count": cores, "oversubscribed": max(ranks_per_host.values()) > cores,
            "platform": platform.platform(), "machine": platform.machine(),
            "processor": platform.processor(), "device": cfg.device,
            "gpus": sorted({r["gpu"] for r in per_rank}), "blas": blas_pools(),
            "blas_threads_env": {k: os.environ.get(k) for k in BLAS_ENV},
            "mpi": mpi_info(world), "versions": package_versions(cfg.device),
            "load_average_at_start": load_average(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %z")}
