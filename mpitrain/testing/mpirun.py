"""Launch worker scripts under ``mpiexec`` from pytest.

Workers are plain scripts run by ``mpiexec -n N python worker.py``; they
assert, install the abort hook (so a failure ends the job instead of hanging)
and may exit with :data:`SKIP_EXIT_CODE` via :func:`skip_worker`, which
:func:`run_mpi` turns into ``pytest.skip``.

Example::

    result = run_mpi(2, ["tests/workers/comm_worker.py"], timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Mapping, Optional, Sequence

#: Exit status a worker uses to say "skip me" (the automake convention).
SKIP_EXIT_CODE = 77
#: Marker line before the skip reason on a worker's stdout.
SKIP_MARKER = "MPITRAIN-SKIP:"


class MpiTimeoutError(RuntimeError):
    """An mpiexec job ran past its timeout and was killed."""


def find_mpiexec() -> Optional[str]:
    """Path of the MPI launcher, or None.

    Looks at ``$MPIEXEC`` first, then next to ``sys.executable`` (a virtualenv
    with the ``mpich`` wheel), then ``mpiexec``/``mpirun`` on PATH.

    Example::

        launcher = find_mpiexec()     # '.../.venv/bin/mpiexec' or None
    """
    configured = os.environ.get("MPIEXEC", "").strip()
    if configured:
        return shutil.which(configured)
    beside_python = Path(sys.executable).parent / "mpiexec"
    if beside_python.is_file() and os.access(beside_python, os.X_OK):
        return str(beside_python)
    return shutil.which("mpiexec") or shutil.which("mpirun")


@functools.lru_cache(maxsize=None)
def _is_open_mpi(launcher: str) -> bool:
    try:
        out = subprocess.run([launcher, "--version"], capture_output=True, text=True,
                             encoding="utf-8", errors="replace", timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    text = out.stdout + out.stderr
    return "Open MPI" in text or "OpenRTE" in text


def launcher_is_open_mpi() -> bool:
    """Whether :func:`run_mpi` starts its jobs with Open MPI's launcher, which ends
    the whole job as soon as one rank exits with a non-zero status (MPICH's lets
    the other ranks end on their own).

    Example::

        if launcher_is_open_mpi():
            ...     # the ranks other than the failing one may be ended by the launcher
    """
    launcher = find_mpiexec()
    return launcher is not None and _is_open_mpi(launcher)


#: The line of dashes above and below each of Open MPI's boxed reports.
_RULE = "-" * 74
#: A line of Open MPI's run-time (PMIx) that says nothing of the job itself.
_PMIX_NOTE = re.compile(r"^\[[^\]]*:[0-9]+\] PMIX ERROR: ")


def without_launcher_report(stderr: str) -> str:
    """``stderr`` of a job without what Open MPI's launcher itself says of it: its
    reports boxed between two of its lines of dashes (a rank that exited with a
    non-zero status, an MPI abort) and its PMIx run time's notes.  Only a whole
    box goes: a rank's own line of dashes, or a box with no closing line, stays
    with what follows it.

    Example::

        lines = without_launcher_report(result.stderr).splitlines()
    """
    lines = stderr.splitlines(keepends=True)
    rules = [i for i, line in enumerate(lines) if line.rstrip("\r\n") == _RULE]
    dropped = set()
    for start, end in zip(rules[::2], rules[1::2]):
        dropped.update(range(start, end + 1))
        if end + 1 < len(lines) and not lines[end + 1].strip():
            dropped.add(end + 1)      # (prterun ends some reports with a blank line)
    return "".join(line for i, line in enumerate(lines)
                   if i not in dropped and not _PMIX_NOTE.match(line))


def _launcher_args(launcher: str) -> list[str]:
    # Open MPI refuses more ranks than cores without this; MPICH needs nothing.
    return ["--oversubscribe"] if _is_open_mpi(launcher) else []


def _child_env(env: Optional[Mapping[str, str]]) -> dict[str, str]:
    child = dict(os.environ)
    # Ranks share a few cores: one BLAS thread each (a caller's env may override).
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        child.setdefault(name, "1")
    # Workers import the same mpitrain as the test run, installed or not.
    package_root = str(Path(__file__).resolve().parents[2])
    paths = [package_root] + [p for p in child.get("PYTHONPATH", "").split(os.pathsep) if p]
    child["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    child.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    child.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    if env:
        child.update(env)
    return child


def _skip_reason(stdout: str) -> str:
    for line in stdout.splitlines():
        if line.startswith(SKIP_MARKER):
            return line[len(SKIP_MARKER):].strip()
    return "worker asked to be skipped"


def run_mpi(np: int, args: Sequence[str], *, timeout: float = 120,
            env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None,
            skip_on_code: bool = True) -> subprocess.CompletedProcess:
    """Run ``mpiexec -n np <python> *args`` (in ``cwd``) and return its result (text output).

    Skips the calling test when no launcher exists or a worker exits with
    :data:`SKIP_EXIT_CODE`.  Past ``timeout`` seconds the whole process
    group is killed and :class:`MpiTimeoutError` names the command.  The
    result's ``stderr`` is the ranks' own (see :func:`without_launcher_report`);
    ``full_stderr`` holds the launcher's reports too.

    Example::

        result = run_mpi(4, ["-m", "mpitrain.bench.collectives", "--repeats", "3"])
    """
    if np < 1:
        raise ValueError(f"run_mpi: np must be >= 1, got {np}")
    launcher = find_mpiexec()
    if launcher is None:
        import pytest
        pytest.skip("no MPI launcher: set $MPIEXEC or `pip install mpich` into the venv")
    command = [launcher, *_launcher_args(launcher), "-n", str(np), sys.executable, *args]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, encoding="utf-8", errors="replace",
                               env=_child_env(env), cwd=cwd,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # The launcher's own children (the ranks) share its new session's group.
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        stdout, stderr = process.communicate()
        raise MpiTimeoutError(
            f"`{' '.join(command)}` did not finish within {timeout:g} s and was killed "
            f"(a rank hangs?)\n--- stdout ---\n{stdout[-4000:]}\n"
            f"--- stderr ---\n{stderr[-4000:]}") from None
    # a test reads what the ranks said: Open MPI's launcher adds its own report
    # of a rank's non-zero status or abort; MPICH's text is kept as it came
    said = without_launcher_report(stderr) if _is_open_mpi(launcher) else stderr
    result = subprocess.CompletedProcess(command, process.returncode, stdout, said)
    result.full_stderr = stderr
    if skip_on_code and result.returncode == SKIP_EXIT_CODE:
        import pytest
        pytest.skip(_skip_reason(stdout))
    return result


def skip_worker(reason: str) -> None:
    """From a worker (on every rank): report a skip to :func:`run_mpi` and exit.

    Example::

        if not backend.gpu_available():
            skip_worker("no CUDA device")
    """
    print(f"{SKIP_MARKER} {reason}", flush=True)
    sys.stderr.flush()
    raise SystemExit(SKIP_EXIT_CODE)
