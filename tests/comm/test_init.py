"""The communicator factory (mpitrain/comm/__init__.py): launcher detection from the
environment, and one rank never starting MPI."""

import subprocess
import sys
import textwrap

import pytest

from mpitrain.comm import (create_communicator, launched_by_mpi, local_rank_from_env,
                           rank_from_env, world_size_from_env)
from mpitrain.comm.single import SingleCommunicator


LAUNCHER_VARS = ["PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE",
                 "MPI_LOCALNRANKS", "HYDI_CONTROL_FD", "MV2_COMM_WORLD_SIZE", "PALS_RANKID",
                 "SLURM_PROCID", "SLURM_STEP_NUM_TASKS"]


def test_create_communicator_without_launcher_is_single(monkeypatch):
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    assert isinstance(create_communicator(), SingleCommunicator)
    assert isinstance(create_communicator("single"), SingleCommunicator)
    with pytest.raises(ValueError, match="kind must be one of"):
        create_communicator("nccl")


def test_launcher_detection_from_environment():
    assert not launched_by_mpi({})
    assert launched_by_mpi({"PMI_RANK": "0", "PMI_SIZE": "2"})
    assert launched_by_mpi({"OMPI_COMM_WORLD_SIZE": "4"})
    # A batch script has SLURM variables but a one-task step: not an MPI launch.
    assert not launched_by_mpi({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"})
    assert launched_by_mpi({"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "8"})
    # started by a process that began Open MPI 4 on its own (a singleton): its
    # environment, PMIX_RANK with it, is inherited, no launcher set it
    singleton = {"OMPI_MCA_ess": "singleton", "PMIX_RANK": "0", "PMIX_NAMESPACE": "1265303553",
                 "OMPI_MCA_orte_ess_num_procs": "1"}
    assert not launched_by_mpi(singleton)
    assert launched_by_mpi({"OMPI_MCA_ess": "^singleton", "PMIX_RANK": "0",
                            "OMPI_COMM_WORLD_SIZE": "2"})       # mpirun's rank
    assert launched_by_mpi(dict(singleton, SLURM_PROCID="1", SLURM_STEP_NUM_TASKS="2"))
    assert world_size_from_env({"PMI_SIZE": "6"}) == 6
    assert world_size_from_env({"HYDI_CONTROL_FD": "7"}) is None
    assert local_rank_from_env({"OMPI_COMM_WORLD_LOCAL_RANK": "2"}) == 2
    assert local_rank_from_env({"MPI_LOCALRANKID": "1", "SLURM_LOCALID": "5"}) == 1
    assert local_rank_from_env({}) == 0


def test_rank_from_environment_of_each_launcher():
    assert rank_from_env({}) == 0
    assert rank_from_env({"PMI_RANK": "3", "MPI_LOCALRANKID": "1"}) == 3     # MPICH, Intel MPI
    assert rank_from_env({"OMPI_COMM_WORLD_RANK": "2"}) == 2                   # Open MPI
    assert rank_from_env({"PMIX_RANK": "5"}) == 5                              # PRRTE, srun pmix
    assert rank_from_env({"SLURM_PROCID": "7", "SLURM_STEP_NUM_TASKS": "8"}) == 7   # srun
    # mpiexec inside a batch script: every rank inherits the script's SLURM_PROCID=0
    assert rank_from_env({"SLURM_PROCID": "0", "PMI_RANK": "1"}) == 1
    assert rank_from_env({"SLURM_PROCID": "0", "OMPI_COMM_WORLD_RANK": "1"}) == 1


def test_launcher_of_one_rank_gives_single_without_mpi():
    # `mpiexec -n 1` announces size 1: no reason to start MPI.
    env_code = textwrap.dedent("""
        import os, sys
        os.environ.update(PMI_RANK="0", PMI_SIZE="1")
        from mpitrain.comm import create_communicator
        comm = create_communicator("auto")
        assert comm.name == "single", comm.name
        assert "mpi4py" not in sys.modules
    """)
    subprocess.run([sys.executable, "-c", env_code], check=True, timeout=60)


def test_importing_mpitrain_does_not_start_mpi():
    code = textwrap.dedent("""
        import os, sys
        for name in %r:
            os.environ.pop(name, None)
        import mpitrain, mpitrain.comm, mpitrain.comm.abort, mpitrain.testing
        assert "mpi4py" not in sys.modules, "import started mpi4py"
        comm = mpitrain.comm.create_communicator("auto")
        assert comm.name == "single"
        assert "mpi4py" not in sys.modules, "single communicator imported mpi4py"
        print("clean")
    """ % (LAUNCHER_VARS,))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "clean"


def test_launcher_announcing_many_tasks_but_world_of_one_is_an_error(tmp_path):
    # A 2-task launcher whose tasks each see an MPI world of 1 must not train
    # silently as independent single ranks.
    import subprocess
    import sys
    code = ("from mpitrain.comm import create_communicator\n"
            "try:\n    create_communicator()\nexcept RuntimeError as e:\n    print(e)\n")
    env = {k: v for k, v in __import__("os").environ.items()
           if not k.startswith(("PMI_", "OMPI_", "MPI_LOCAL", "HYD", "SLURM_", "PMIX_"))}
    env.update({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2"})
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=60)
    if "MPI sees a world of 1" not in out.stdout and "MPI_INIT failed" in out.stderr:
        # e.g. Open MPI 4 in a container without ssh cannot start a singleton at all
        pytest.skip("this MPI library cannot start a process without a launcher here")
    assert "MPI sees a world of 1" in out.stdout, out.stdout + out.stderr


def test_the_library_version_is_text_without_open_mpis_nul():
    from mpitrain.comm.info import library_version_text
    assert library_version_text("Open MPI v5.0.11, rev: v5.0.11rc1\x00") \
        == "Open MPI v5.0.11, rev: v5.0.11rc1"
    assert library_version_text("MPICH Version:      5.0.0\n") == "MPICH Version:      5.0.0"
