"""The BLAS thread policy."""

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
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    env = {"OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    preset_blas_env(env)
    assert env["OPENBLAS_NUM_THREADS"] == env["OMP_NUM_THREADS"] == "2"
    env = {"OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OPENBLAS_NUM_THREADS": "3"}
    preset_blas_env(env)
    assert env["OPENBLAS_NUM_THREADS"] == "3"
    env = {}
    preset_blas_env(env)
    assert env == {}
