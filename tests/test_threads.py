"""The BLAS thread policy."""

import os
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


# -- ranks bound to cores of their own ------------------------------------------------------

@pytest.mark.parametrize("mine,node,quota,expected", [
    (set(range(8)), [set(range(8))] * 4, None, 2),                 # unbound: shared by 4
    (set(range(8)), [set(range(8 * i, 8 * i + 8)) for i in range(4)], None, 8),   # srun binding
    ({0}, [{0}, {1}], None, 1),                                    # bound to a core each
    (set(range(16)), [set(range(16))] * 4 + [set(range(16, 32))] * 4, None, 4),  # per socket
    (set(range(8)), [set(range(8 * i, 8 * i + 8)) for i in range(4)], 8, 2),     # quota of 8
    (None, [None, None], None, 3),                                 # no affinity: cpu_count
])
def test_cores_per_rank_counts_only_the_ranks_sharing_them(monkeypatch, mine, node, quota,
                                                           expected):
    from mpitrain.threads import cores_per_rank
    monkeypatch.setattr("os.cpu_count", lambda: 6)
    assert cores_per_rank(mine, node, ranks_on_node=len(node), quota=quota) == expected


class _Comm:
    """A rank of a node whose other ranks report the given affinities."""

    def __init__(self, affinities):
        self.affinities, self.local_size = affinities, len(affinities)

    def allgather_obj(self, obj):
        host = obj[0]
        return [obj] + [[host, sorted(cpus)] for cpus in self.affinities[1:]]


def _limit(monkeypatch, affinities, environ):
    from mpitrain import cli, threads
    from mpitrain.config import RunConfig
    applied = []
    monkeypatch.setattr("threadpoolctl.threadpool_limits", applied.append)
    monkeypatch.setattr(threads, "cpu_affinity", lambda: set(affinities[0]))
    monkeypatch.setattr(threads, "cgroup_cpu_limit", lambda *a, **k: None)
    monkeypatch.setattr(threads, "available_cores", lambda: len(affinities[0]))
    for name in threads.BLAS_ENV:      # (set first so that the test's end restores them)
        monkeypatch.setenv(name, "0")
        monkeypatch.delenv(name)
    monkeypatch.setattr(threads, "_preset", {})
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    return applied, threads, cli, RunConfig()


def test_a_rank_bound_to_its_own_cores_uses_them_all(monkeypatch):
    # srun --cpus-per-task=8 with task binding, 4 ranks on a 32-core node: each
    # rank's affinity already is its share (8 cores, not 8 / 4)
    bound = [set(range(8 * i, 8 * i + 8)) for i in range(4)]
    applied, threads, cli, cfg = _limit(monkeypatch, bound, {"MPI_LOCALNRANKS": "4"})
    threads.preset_blas_env()           # the first guess, before the ranks compared
    assert threads._preset["OPENBLAS_NUM_THREADS"] == "2"
    cli._limit_blas_threads(cfg, _Comm(bound))
    assert applied == [8]


def test_ranks_sharing_their_cores_split_them(monkeypatch):
    shared = [set(range(8))] * 4
    applied, threads, cli, cfg = _limit(monkeypatch, shared, {})
    cli._limit_blas_threads(cfg, _Comm(shared))
    assert applied == [2]


def test_the_users_blas_variables_are_left_alone(monkeypatch):
    bound = [set(range(8 * i, 8 * i + 8)) for i in range(4)]
    applied, threads, cli, cfg = _limit(monkeypatch, bound, {"OMP_NUM_THREADS": "3"})
    threads.preset_blas_env()
    cli._limit_blas_threads(cfg, _Comm(bound))
    assert applied == []


@pytest.mark.parametrize("value", ["", "0", "-1", "abc", " ", "1.5"])
def test_a_blas_variable_that_gives_no_thread_count_is_no_choice(monkeypatch, value):
    # OMP_NUM_THREADS=$SLURM_CPUS_PER_TASK without --cpus-per-task is empty: it was
    # left alone as the user's choice, and OpenBLAS took it as every core, per rank
    bound = [set(range(8))] * 4
    applied, threads, cli, cfg = _limit(monkeypatch, bound, {"OMP_NUM_THREADS": value,
                                                             "MPI_LOCALNRANKS": "4"})
    threads.preset_blas_env()
    assert os.environ["OMP_NUM_THREADS"] == os.environ["OPENBLAS_NUM_THREADS"] == "2"
    cli._limit_blas_threads(cfg, _Comm(bound))
    assert applied == [2]


@pytest.mark.parametrize("value", ["3", " 3", "3,1"])
def test_a_thread_count_the_user_gave_is_kept(monkeypatch, value):
    bound = [set(range(8))] * 4
    applied, threads, cli, cfg = _limit(monkeypatch, bound, {"OMP_NUM_THREADS": value,
                                                             "MPI_LOCALNRANKS": "4"})
    threads.preset_blas_env()
    assert os.environ["OMP_NUM_THREADS"] == value
    cli._limit_blas_threads(cfg, _Comm(bound))
    assert applied == []


def test_current_blas_threads_follows_the_limit():
    from threadpoolctl import threadpool_limits
    from mpitrain.threads import current_blas_threads
    with threadpool_limits(1):
        assert current_blas_threads() == 1
    with threadpool_limits(2):
        assert current_blas_threads() == 2


def test_the_planned_threads_are_those_a_rank_applies(monkeypatch):
    """What a batch script's banner says: the user's BLAS variables on the CPU, one
    thread on a GPU whatever they say, blas_threads when set."""
    from mpitrain.threads import planned_blas_threads
    monkeypatch.setattr("mpitrain.threads.available_cores", lambda: 8)
    env = {"OMP_NUM_THREADS": "4", "OPENBLAS_NUM_THREADS": "4"}
    assert planned_blas_threads(0, device="cpu", env=env) == 4
    assert planned_blas_threads(0, device="gpu", env=env) == 1
    assert planned_blas_threads(3, device="gpu", env=env) == 3
    assert planned_blas_threads(0, device="cpu", ranks_on_node=2, env={}) == 4


def test_the_threads_query_reads_the_config_and_its_settings(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="4", OPENBLAS_NUM_THREADS="4",
               MKL_NUM_THREADS="4")
    config = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jobs",
                          "configs", "quickstart.yaml")

    def query(*args):
        return subprocess.run([sys.executable, "-m", "mpitrain.thread_plan", config, *args],
                              env=env, capture_output=True, text=True, timeout=60)
    assert query().stdout == "4\n"
    # (the other options of train are passed over)
    assert query("--run-dir", "runs/x", "--set", "device=gpu", "--resume").stdout == "1\n"
    bad = query("--set", "device=tpu")
    assert bad.returncode == 2 and bad.stdout == "" and "device" in bad.stderr, bad
