"""run_mpi, the launcher of the MPI tests: a hung job is killed, a worker's skip code
becomes a pytest skip."""

import time

import pytest

from mpitrain.testing.mpirun import MpiTimeoutError, run_mpi

pytestmark = pytest.mark.mpi


def test_hung_job_is_killed_with_a_clear_error():
    start = time.monotonic()
    with pytest.raises(MpiTimeoutError, match=r"did not finish within 3 s"):
        run_mpi(2, ["-c", "import time; time.sleep(60)"], timeout=3)
    assert time.monotonic() - start < 20


def test_worker_skip_code_becomes_pytest_skip():
    code = ("from mpitrain.testing.mpirun import skip_worker; "
            "skip_worker('nothing to do here')")
    with pytest.raises(pytest.skip.Exception, match="nothing to do here"):
        run_mpi(2, ["-c", code], timeout=60)


def test_open_mpi_is_told_by_the_launchers_version_line(tmp_path, monkeypatch):
    from mpitrain.testing.mpirun import launcher_is_open_mpi
    for name, line, expected in [("ompi", "mpirun (Open MPI) 5.0.11", True),
                                 ("hydra", "HYDRA build details:", False)]:
        fake = tmp_path / name
        fake.write_text(f"#!/bin/sh\necho '{line}'\n", encoding="utf-8")
        fake.chmod(0o755)
        monkeypatch.setenv("MPIEXEC", str(fake))
        assert launcher_is_open_mpi() is expected


def test_the_launchers_own_report_is_taken_out_of_a_jobs_stderr():
    from mpitrain.testing.mpirun import without_launcher_report
    said = "mpitrain train: error: training diverged\n"
    rule = "-" * 74 + "\n"
    open_mpi = (said + "[vm:16198] PMIX ERROR: PMIX_ERR_UNREACH in file pmix_server.c at "
                "line 3146\n" + rule + "prterun detected that one or more processes exited "
                "with non-zero status,\n\n   Exit code:    2\n" + rule)
    assert without_launcher_report(open_mpi) == said
    assert without_launcher_report(said + "warning: a -- b\n") == said + "warning: a -- b\n"
    # two reports in a row, a rank's line between them, prterun's blank line after
    abort = rule + "MPI_ABORT was invoked on rank 0\n" + rule
    assert without_launcher_report(abort + said + abort + " \n") == said


def test_a_ranks_own_lines_of_dashes_are_kept_with_what_follows():
    from mpitrain.testing.mpirun import without_launcher_report
    table = "step  loss\n" + "-" * 30 + "\n1     0.5\n" + "-" * 30 + "\n"
    assert without_launcher_report(table) == table
    # a lone line of Open MPI's width, no box closed: nothing is taken out
    lone = "-" * 74 + "\nmpitrain train: error: training diverged\n"
    assert without_launcher_report(lone) == lone


def test_a_jobs_stderr_is_what_its_ranks_said():
    # (Open MPI's launcher reports the status 2 in its own box of lines)
    code = ("import sys; from mpitrain.comm import rank_from_env\n"
            "if rank_from_env() == 0: sys.stderr.write('said\\n'); sys.exit(2)")
    result = run_mpi(2, ["-c", code], timeout=60)
    assert result.returncode != 0
    assert result.stderr == "said\n", result.full_stderr


def test_a_ranks_line_of_dashes_does_not_hide_what_the_ranks_say_after_it():
    code = ("import sys; from mpitrain.comm import rank_from_env\n"
            "if rank_from_env() == 0: sys.stderr.write('-' * 74 + '\\nsaid\\n')")
    result = run_mpi(2, ["-c", code], timeout=60)
    assert result.returncode == 0, result.full_stderr
    assert result.stderr == "-" * 74 + "\nsaid\n", result.full_stderr
