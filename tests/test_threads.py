"""The BLAS thread policy."""

import shutil
import subprocess
import sys

import pytest

from mpitrain.threads import blas_threads, preset_blas_env, ranks_on_node_from_env


@pytest.mark.parametrize("requested,device,ranks,cores,expected", [
    (0, "cpu", 1, 16, 16), (0, "cpu", 2, 16, 8), (0, "cpu", 32, 16, 1),
    (0, "gpu", 1, 16, 1), (3, "cpu", 2, 16, 3), (3, "gpu", 1, 16, 3),
])
def test_blas_threads(requested, device, ranks, cores, expected):
    assert blas_threads(requested, device=device, ranks_on_node=ranks, cores=cores) == expected


def test_ranks_on_node_from_launcher_variables():
    assert ranks_on_node_from_env({"MPI_LOCALNRANKS": "4", "PMI_SIZE": "8"}) == 4
    assert ranks_on_node_from_env({"SLURM_NTASKS_PER_NODE": "2(x3)"}) == 2
    assert ranks_on_node_from_env({}) is None


def test_preset_gives_each_rank_its_share_unless_the_user_chose(monkeypatch):
    monkeypatch.setattr("mpitrain.threads.available_cores", lambda: 8)
    env = {"OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    preset_blas_env(env)
    assert env["OPENBLAS_NUM_THREADS"] == env["OMP_NUM_THREADS"] == "2"
    env = {"OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OPENBLAS_NUM_THREADS": "3"}
    preset_blas_env(env)
    assert env["OPENBLAS_NUM_THREADS"] == "3"
    env = {}
    preset_blas_env(env)
    assert env == {}


# -- the cores this process may use -------------------------------------------------------

def _cgroup(tmp_path, files, proc="0::/job\n"):
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (tmp_path / "proc_cgroup").write_text(proc)
    return dict(cgroup_root=str(root), proc_cgroup=str(tmp_path / "proc_cgroup"))


def test_affinity_not_cpu_count_gives_the_cores(tmp_path, monkeypatch):
    from mpitrain.threads import available_cores
    monkeypatch.setattr("os.cpu_count", lambda: 64)
    fake = _cgroup(tmp_path, {})
    assert available_cores(affinity=lambda: {0, 1, 2, 3}, **fake) == 4
    # and the thread policy divides those among the node's ranks
    monkeypatch.setattr("mpitrain.threads.available_cores", lambda: 4)
    assert blas_threads(0, ranks_on_node=2) == 2


@pytest.mark.parametrize("files,proc,expected", [
    ({"job/cpu.max": "200000 100000\n"}, "0::/job\n", 2),               # v2: 2 CPUs
    ({"job/cpu.max": "150000 100000\n"}, "0::/job\n", 2),               # 1.5 rounds up
    ({"job/cpu.max": "max 100000\n"}, "0::/job\n", 8),                  # no limit
    ({"cpu.max": "100000 100000\n", "job/cpu.max": "max 100000\n"}, "0::/job\n", 1),  # parent
    ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"},
     "4:cpu,cpuacct:/\n", 3),                                           # v1
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"},
     "4:cpu,cpuacct:/\n", 8),                                           # v1, no quota
    ({"cpu,cpuacct/slurm/cpu.cfs_quota_us": "50000\n",
      "cpu,cpuacct/slurm/cpu.cfs_period_us": "100000\n"}, "4:cpu,cpuacct:/slurm\n", 1),
    ({"job/cpu.max": "garbage\n"}, "0::/job\n", 8),                     # unreadable: ignored
])
def test_cgroup_quota_caps_the_cores(tmp_path, files, proc, expected):
    from mpitrain.threads import available_cores
    fake = _cgroup(tmp_path, files, proc)
    assert available_cores(affinity=lambda: set(range(8)), **fake) == expected


def test_no_cgroup_files_and_no_affinity_fall_back_to_cpu_count(tmp_path, monkeypatch):
    from mpitrain.threads import available_cores

    def refused():
        raise OSError("no affinity here")
    monkeypatch.setattr("os.cpu_count", lambda: 6)
    assert available_cores(affinity=refused, cgroup_root=str(tmp_path / "none"),
                           proc_cgroup=str(tmp_path / "none")) == 6


@pytest.mark.skipif(shutil.which("taskset") is None, reason="no taskset")
def test_under_taskset_to_one_core_the_policy_gives_one_thread():
    # a real affinity mask, not a fake: what `taskset -c 0 mpitrain ...` sees
    code = ("from mpitrain.threads import available_cores, blas_threads; "
            "print(available_cores(), blas_threads(0, ranks_on_node=1))")
    result = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", code],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "1"]
