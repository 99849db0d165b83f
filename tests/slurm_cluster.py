"""A throw-away one-node Slurm cluster on loopback, for testing the batch scripts.

munged, slurmctld and slurmd run in the foreground as children of the test,
with every file (munge key and socket, slurm.conf, state, spool, logs) in one
temporary directory; nothing system-wide is configured.  Clients find the
cluster through ``SLURM_CONF`` in :attr:`LocalSlurm.env`.

Example::

    with LocalSlurm.start(cpus=2) as cluster:
        job = cluster.sbatch(["--wrap", "hostname"])
        assert cluster.wait(job, timeout=60)["JobState"] == "COMPLETED"
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from typing import Mapping, Optional, Sequence

#: Debian packages that provide the daemons and clients.
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "srun")
FINISHED_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                   "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
# Variables of an enclosing job or MPI launcher that would leak into the test's jobs.
_FOREIGN_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "PMI_", "PMIX_", "OMPI_",
                     "MPI_LOCAL", "HYDI_", "MUNGE_")


class SlurmUnavailable(RuntimeError):
    """Slurm cannot be brought up here; the message says why."""


def missing_programs() -> list[str]:
    """The daemons and clients that are not on PATH (or in /usr/sbin)."""
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin" + os.pathsep + "/sbin"
    return [name for name in DAEMONS if shutil.which(name, path=path) is None]


def install_packages(timeout: float = 300) -> None:
    """``apt-get install`` the Slurm and munge packages; SlurmUnavailable on failure."""
    if os.geteuid() != 0:
        raise SlurmUnavailable("Slurm is not installed and installing it needs root")
    if shutil.which("apt-get") is None:
        raise SlurmUnavailable("Slurm is not installed and there is no apt-get to install it")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    deadline = time.monotonic() + timeout
    for cmd in (["apt-get", "update", "-q"],
                ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]):
        left = deadline - time.monotonic()
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                  timeout=max(left, 1))
        except subprocess.TimeoutExpired:
            raise SlurmUnavailable(f"{' '.join(cmd)} took more than {timeout:.0f} s") from None
        if done.returncode != 0:
            tail = (done.stdout + done.stderr).strip().splitlines()[-5:]
            raise SlurmUnavailable(f"{' '.join(cmd)} failed: " + " | ".join(tail))


def _free_ports(count: int) -> list[int]:
    sockets, ports = [], []
    for _ in range(count):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind(("127.0.0.1", 0))
        sockets.append(s)
        ports.append(s.getsockname()[1])
    for s in sockets:
        s.close()
    return ports


def _make_fake_gpus(directory: str, count: int) -> list[str]:
    """Character devices (copies of /dev/null) that Slurm's gres/gpu accepts as GPUs."""
    paths = []
    for i in range(count):
        path = os.path.join(directory, f"fakegpu{i}")
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
        paths.append(path)
    return paths


class LocalSlurm:
    """One node named ``localhost`` with ``cpus`` CPUs and, where possible, fake GPUs.

    ``gpus`` is how many GPUs the node advertises (0 when device nodes cannot
    be made): jobs that ask for GPUs get them, with ``CUDA_VISIBLE_DEVICES``
    set by Slurm, though no CUDA device is behind them.

    Example::

        cluster = LocalSlurm.start(cpus=2)
        try:
            print(cluster.run(["sinfo"]).stdout)
        finally:
            cluster.stop()
    """

    def __init__(self, root: str, *, cpus: int):
        if cpus < 1:
            raise ValueError(f"cpus must be a positive int, got {cpus!r}")
        self.root = root
        self.cpus = cpus
        self.gpus = 0
        self.conf = os.path.join(root, "slurm.conf")
        self.logs = os.path.join(root, "log")
        self._procs: list[subprocess.Popen] = []
        env = {k: v for k, v in os.environ.items() if not k.startswith(_FOREIGN_PREFIXES)}
        env["SLURM_CONF"] = self.conf
        env["PATH"] = env.get("PATH", "") + os.pathsep + "/usr/sbin"
        self.env = env

    # -- bring up and down ------------------------------------------------------------
    @classmethod
    def start(cls, *, cpus: int, gpus: int = 2, timeout: float = 60) -> "LocalSlurm":
        """Write the configuration, start the daemons, wait until the node is idle."""
        missing = missing_programs()
        if missing:
            raise SlurmUnavailable("not installed: " + ", ".join(missing))
        # munged insists that every directory above its socket is searchable by all,
        # so the cluster lives in a 0755 directory of its own (not pytest's 0700 tmp).
        root = tempfile.mkdtemp(prefix="mpitrain-slurm-")
        os.chmod(root, 0o755)
        cluster = cls(root, cpus=cpus)
        try:
            cluster._start(gpus, timeout)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _start(self, gpus: int, timeout: float) -> None:
        for sub in ("munge", "state", "spool", "log"):
            os.makedirs(os.path.join(self.root, sub))
        os.chmod(os.path.join(self.root, "munge"), 0o755)
        key = os.path.join(self.root, "munge", "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o600)
        munge_socket = os.path.join(self.root, "munge", "munge.sock")
        self._spawn("munged", ["munged", "--foreground", f"--key-file={key}",
                               f"--socket={munge_socket}",
                               f"--pid-file={self.root}/munge/munged.pid",
                               f"--seed-file={self.root}/munge/munged.seed",
                               f"--log-file={self.logs}/munged.log"])
        self._wait_for(lambda: os.path.exists(munge_socket), "munged's socket", timeout)

        try:
            devices = _make_fake_gpus(self.root, gpus) if gpus else []
        except OSError:
            devices = []            # no mknod here: a node without GPUs
        self.gpus = len(devices)
        self._write_config(munge_socket, devices)
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", self.conf])
        self._spawn("slurmd", ["slurmd", "-D", "-N", "localhost", "-f", self.conf])

        def node_idle():
            out = self.run(["sinfo", "-h", "-N", "-o", "%T"], check=False).stdout.strip()
            return out.rstrip("*") == "idle"
        self._wait_for(node_idle, "the node to become idle", timeout)

    def _write_config(self, munge_socket: str, devices: Sequence[str]) -> None:
        ctld_port, slurmd_port = _free_ports(2)
        memory = 1024
        try:
            with open("/proc/meminfo") as f:
                memory = int(f.readline().split()[1]) // 1024 // 2
        except (OSError, ValueError, IndexError):
            pass
        gres = f" Gres=gpu:{len(devices)}" if devices else ""
        lines = [
            "ClusterName=mpitraintest",
            "SlurmctldHost=localhost",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={munge_socket}",
            f"StateSaveLocation={self.root}/state",
            f"SlurmdSpoolDir={self.root}/spool",
            f"SlurmctldPidFile={self.root}/slurmctld.pid",
            f"SlurmdPidFile={self.root}/slurmd.pid",
            f"SlurmctldLogFile={self.logs}/slurmctld.log",
            f"SlurmdLogFile={self.logs}/slurmd.log",
            f"PlugStackConfig={self.root}/plugstack.conf",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "MpiDefault=none",
            "SchedulerType=sched/backfill",
            "ReturnToService=2",
            "MinJobAge=600",
            "KillWait=5",
            "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
        ]
        if devices:
            lines.append("GresTypes=gpu")
        lines += [f"NodeName=localhost CPUs={self.cpus} RealMemory={memory}{gres} State=UNKNOWN",
                  "PartitionName=test Nodes=localhost Default=YES MaxTime=INFINITE State=UP"]
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(os.path.join(self.root, "plugstack.conf"), "w"):
            pass                    # no SPANK plugins from the system's plugstack.conf
        with open(os.path.join(self.root, "gres.conf"), "w") as f:
            for i, device in enumerate(devices):
                f.write(f"NodeName=localhost Name=gpu File={device}\n")

    def _spawn(self, name: str, argv: Sequence[str]) -> None:
        out = open(os.path.join(self.logs, f"{name}.stdout"), "wb")
        try:
            proc = subprocess.Popen(argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            out.close()
        self._procs.append(proc)

    def _wait_for(self, ready, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for proc in self._procs:
                if proc.poll() is not None:
                    raise SlurmUnavailable(f"{proc.args[0]} exited with status "
                                           f"{proc.returncode} while waiting for {what}\n"
                                           + self.log_tail())
            if ready():
                return
            time.sleep(0.3)
        raise SlurmUnavailable(f"timed out after {timeout:.0f} s waiting for {what}\n"
                               + self.log_tail())

    def stop(self) -> None:
        """Cancel every job, stop the daemons (newest first), delete the directory."""
        if any(p.poll() is None for p in self._procs) and os.path.exists(self.conf):
            self.run(["scancel", "--user", str(os.geteuid())], check=False, timeout=20)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and self.run(
                    ["squeue", "-h", "-o", "%i"], check=False, timeout=10).stdout.strip():
                time.sleep(0.5)
        for proc in reversed(self._procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)
        self._procs.clear()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    # -- using it -----------------------------------------------------------------------
    def run(self, argv: Sequence[str], *, check: bool = True, timeout: float = 30,
            env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None):
        """Run a Slurm client command against this cluster; returns CompletedProcess."""
        try:
            done = subprocess.run(list(argv), env={**self.env, **(env or {})}, cwd=cwd,
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            if check:
                raise RuntimeError(f"{' '.join(argv)} took more than {timeout} s") from exc
            return subprocess.CompletedProcess(argv, 124, "", "")
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): "
                               f"{done.stdout}{done.stderr}")
        return done

    def sbatch(self, argv: Sequence[str], *, env: Optional[Mapping[str, str]] = None,
               cwd: Optional[str] = None) -> str:
        """Submit a job; returns its id."""
        out = self.run(["sbatch", "--parsable", *argv], env=env, cwd=cwd).stdout.strip()
        return out.split(";")[0]

    def job(self, job_id: str) -> dict:
        """``scontrol show job`` of one job as {field: value} (JobState, ExitCode, ...)."""
        out = self.run(["scontrol", "show", "job", "-o", str(job_id)]).stdout
        return parse_fields(out.splitlines()[0])

    def jobs(self) -> list[dict]:
        """Every job the controller still remembers."""
        out = self.run(["scontrol", "show", "job", "-o"], check=False).stdout
        return [parse_fields(line) for line in out.splitlines() if line.startswith("JobId=")]

    def wait(self, job_id: str, *, timeout: float, until=None) -> dict:
        """Poll a job until it finished (or ``until(info)`` holds); TimeoutError names it."""
        until = until or (lambda info: info["JobState"] in FINISHED_STATES)
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if until(info):
                return info
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {info['JobState']} after {timeout} s "
                                   f"({info.get('Reason')})")
            time.sleep(0.5)

    def log_tail(self, lines: int = 15) -> str:
        """The last lines of every daemon log, for failure messages."""
        parts = []
        for name in sorted(os.listdir(self.logs)) if os.path.isdir(self.logs) else []:
            with open(os.path.join(self.logs, name), errors="replace") as f:
                tail = f.read().splitlines()[-lines:]
            if tail:
                parts.append(f"--- {name}\n" + "\n".join(tail))
        return "\n".join(parts)


def parse_fields(line: str) -> dict:
    """'JobId=5 JobName=x JobState=COMPLETED ...' as a dict (values without spaces).

    Example::

        parse_fields("JobId=5 JobState=COMPLETED ExitCode=0:0")["ExitCode"]   # '0:0'
    """
    fields = {}
    for item in line.split():
        key, sep, value = item.partition("=")
        if sep and key not in fields:
            fields[key] = value
    return fields
