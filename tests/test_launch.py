"""The ranks' agreement before any work: an error met by some ranks only, and
ranks started with different settings (mpitrain/launch.py)."""

import argparse
import os

import pytest

from mpitrain.config import load_config
from mpitrain.launch import _problems_line, rank_settings, settings_differences
from mpitrain.testing.mpirun import launcher_is_open_mpi

from .helpers import QUICKSTART, WORKERS


def _args(**options):
    base = dict(func=print, command="train", config="a.yaml", set=["x=1"], run_dir=None,
                resume=False, overwrite=False)
    base.update(options)
    return argparse.Namespace(**base)


def test_settings_hold_the_configuration_and_the_options_but_not_the_file_name():
    settings = rank_settings(load_config(QUICKSTART), _args(run_dir="runs/a"))
    assert settings["model.hidden_dim"] == 512
    assert settings["--run-dir"] == "runs/a" and settings["--resume"] is False
    assert not {"func", "--func", "--config", "--set", "--command"} & set(settings)


def test_only_settings_that_differ_are_named_with_rank_0s_value():
    rank0 = {"model.hidden_dim": 512, "training.seed": 1, "--resume": False}
    mine = {"model.hidden_dim": 256, "training.seed": 1, "--resume": True}
    assert settings_differences(rank0, mine, {}) == (
        ["--resume: True (rank 0: False)", "model.hidden_dim: 256 (rank 0: 512)"], [])
    assert settings_differences(rank0, dict(rank0), {}) == ([], [])


def test_a_path_spelt_otherwise_is_the_same_setting_when_it_names_the_same_place(tmp_path):
    rank0 = {"data.train": "data/train", "--run-dir": "runs/a"}
    places = {"data.train": os.path.realpath(tmp_path / "data/train"),
              "--run-dir": os.path.realpath(tmp_path / "runs/a")}
    same = {"data.train": str(tmp_path / "data/train"), "--run-dir": str(tmp_path / "runs/a")}
    assert settings_differences(rank0, same, places) == ([], [])
    # another corpus directory may be a copy (node-local disks): compared by content
    other = {"data.train": str(tmp_path / "data/other"), "--run-dir": str(tmp_path / "runs/a")}
    assert settings_differences(rank0, other, places) == ([], ["data.train"])
    # another run directory is another run
    elsewhere = {"data.train": "data/train", "--run-dir": str(tmp_path / "runs/b")}
    differences, _ = settings_differences(rank0, elsewhere, places)
    assert [d.split(":")[0] for d in differences] == ["--run-dir"]


def test_a_copy_is_told_from_another_corpus_by_its_manifests_bytes(small_corpus, tmp_path):
    import shutil

    from mpitrain.launch import copy_digest
    shutil.copytree(f"{small_corpus}/train", tmp_path / "copy")
    assert copy_digest("data.train", f"{small_corpus}/train") \
        == copy_digest("data.train", str(tmp_path / "copy"))
    assert copy_digest("data.train", f"{small_corpus}/dev") \
        != copy_digest("data.train", str(tmp_path / "copy"))
    assert copy_digest("data.train", str(tmp_path / "nothing")) is None


def test_an_error_every_rank_met_is_said_as_it_is():
    assert _problems_line(["bad value", "bad value", "bad value"]) == "bad value"


def test_errors_of_some_ranks_name_those_ranks_and_the_ranks_that_could_start():
    line = _problems_line([None, "no file", None, "no file", "bad value"])
    assert line == "ranks 1, 3: no file; rank 4: bad value (ranks 0, 2 could start)"


def test_many_distinct_errors_stay_one_short_line():
    line = _problems_line([f"error {r}" for r in range(10)])
    assert line.count("error ") == 3 and "and 7 other errors" in line and "\n" not in line


def _run(mpiexec, tmp_path, ranks, argv):
    from mpitrain.testing.mpirun import run_mpi
    status_dir = tmp_path / "status"
    status_dir.mkdir()
    result = run_mpi(ranks, [str(WORKERS / "cli_status_worker.py"), str(status_dir), *argv],
                     timeout=120)
    statuses = {p.name: p.read_text().strip() for p in status_dir.iterdir()}
    said = [text for text in result.stderr.splitlines() if "error:" in text]
    return result, statuses, said


@pytest.mark.mpi
def test_a_setting_that_differs_on_one_rank_ends_every_rank_with_one_line(mpiexec, tmp_path):
    # rank 2 alone trains a narrower model: averaging would mix unequal buffers
    argv = ["train", QUICKSTART, "--run-dir", str(tmp_path / "run"),
            "--set", "model.hidden_dim=6{rank}"]
    result, statuses, said = _run(mpiexec, tmp_path, 3, argv)
    assert result.returncode == 2, result.stderr
    assert len(said) == 1, result.stderr
    assert said[0].startswith("mpitrain train: error: the ranks were started with different "
                              "settings: rank 1 has model.hidden_dim: 61 (rank 0: 60); "
                              "ranks 1, 2 differ from rank 0;"), said
    assert statuses == {"rank-0": "2", "rank-1": "2", "rank-2": "2"}, statuses
    assert not (tmp_path / "run").exists()       # nothing was started


@pytest.mark.mpi
def test_a_configuration_missing_on_one_rank_is_said_by_rank_0_and_nobody_waits(
        mpiexec, tmp_path):
    # rank 1's node lacks the file (`run.yaml` copied to local disks but one)
    for rank in (0, 2):
        (tmp_path / f"run{rank}.yaml").write_text(open(QUICKSTART, encoding="utf-8").read(),
                                                  encoding="utf-8")
    argv = ["train", str(tmp_path / "run{rank}.yaml"), "--run-dir", str(tmp_path / "run")]
    result, statuses, said = _run(mpiexec, tmp_path, 3, argv)
    assert result.returncode == 2, result.stderr
    assert len(said) == 1, result.stderr
    assert said[0].startswith("mpitrain train: error: rank 1: "), said
    assert said[0].endswith("run1.yaml: config file not found (ranks 0, 2 could start)"), said
    assert statuses == {"rank-0": "2", "rank-1": "2", "rank-2": "2"}, statuses


@pytest.mark.mpi
def test_a_bench_option_that_differs_on_one_rank_is_named(mpiexec, tmp_path):
    argv = ["bench", QUICKSTART, "--out", str(tmp_path / "bench"), "--steps", "1{rank}"]
    result, statuses, said = _run(mpiexec, tmp_path, 2, argv)
    assert result.returncode == 2, result.stderr
    assert len(said) == 1 and "rank 1 has --steps: 11 (rank 0: 10)" in said[0], said
    assert statuses == {"rank-0": "2", "rank-1": "2"}, statuses


@pytest.mark.mpi
def test_a_bare_run_where_one_node_lacks_mpitrain_yaml_says_so_once(mpiexec, tmp_path,
                                                                    small_corpus):
    # `mpiexec -n 2 python -m mpitrain` trains ./mpitrain.yaml: rank 1 starts where
    # there is none
    from .helpers import small_overrides
    for rank in (0, 1):
        (tmp_path / f"r{rank}").mkdir()
    text = open(QUICKSTART, encoding="utf-8").read()
    for item in small_overrides(small_corpus):
        key, value = item.split("=", 1)
        section, name = key.split(".")
        text = text.replace(f"  {name}:", f"  {name}: {value} #", 1)
    (tmp_path / "r0" / "mpitrain.yaml").write_text(text, encoding="utf-8")
    result, statuses, said = _run(mpiexec, tmp_path, 2, ["--cd", str(tmp_path / "r{rank}")])
    assert result.returncode == 2, result.stderr
    assert said == ["mpitrain train: error: rank 1: mpitrain.yaml: config file not found "
                    "(rank 0 could start)"], result.stderr
    assert result.stderr.count("usage:") == 1, result.stderr
    assert statuses == {"rank-0": "2", "rank-1": "2"}, statuses


@pytest.mark.mpi
def test_a_dry_run_on_two_ranks_plans_once_and_every_rank_exits_0(mpiexec, tmp_path,
                                                                  small_corpus):
    from .helpers import small_overrides
    argv = ["train", QUICKSTART, "--run-dir", str(tmp_path / "run"), "--dry-run"]
    for item in small_overrides(small_corpus):
        argv += ["--set", item]
    result, statuses, said = _run(mpiexec, tmp_path, 2, argv)
    assert result.returncode == 0 and not said, result.stderr
    assert result.stdout.count("mpitrain: 2 rank(s)") == 1, result.stdout
    assert result.stdout.count("dry run: ") == 1, result.stdout
    assert statuses == {"rank-0": "0", "rank-1": "0"}, statuses
    assert not (tmp_path / "run").exists()


@pytest.mark.mpi
def test_a_corpus_staged_to_each_nodes_disk_is_the_same_corpus_another_is_not(
        mpiexec, tmp_path, small_corpus):
    # `--set data.train=/local/$(hostname)/corpus/train`: each rank its own copy
    import shutil
    from .helpers import small_overrides
    for rank in (0, 1):
        shutil.copytree(small_corpus, tmp_path / f"node{rank}")
    argv = ["train", QUICKSTART, "--run-dir", str(tmp_path / "run"), "--dry-run"]
    for item in small_overrides(str(tmp_path / "node{rank}")):
        argv += ["--set", item]
    result, statuses, said = _run(mpiexec, tmp_path, 2, argv)
    assert result.returncode == 0 and not said, result.stderr
    # node 1's copy holds another corpus: named, nobody trains
    from mpitrain.data.synthetic import synthesize
    shutil.rmtree(tmp_path / "node1")
    synthesize(str(tmp_path / "node1"), hours=0.02, speakers=4, shards=1, dev_hours=0.01,
               dev_speakers=2, seed=9)
    shutil.rmtree(tmp_path / "status")
    result, statuses, said = _run(mpiexec, tmp_path, 2, argv)
    assert result.returncode == 2 and len(said) == 1, result.stderr
    assert f"rank 1 has data.dev: '{tmp_path}/node1/dev' (rank 0: '{tmp_path}/node0/dev'), " \
           "which holds other content; data.train: " in said[0], said


@pytest.mark.mpi
def test_a_command_line_wrong_on_one_rank_only_is_said_by_rank_0(mpiexec, tmp_path):
    # rank 1's batch script line carries an option this version does not know
    argv = ["train", QUICKSTART, "--run-dir", str(tmp_path / "run"), "--dry-run",
            "{rank=1}--no-such-option"]
    result, statuses, said = _run(mpiexec, tmp_path, 3, argv)
    assert result.returncode == 2, result.stderr
    assert said == ["mpitrain train: error: rank 1: mpitrain train: unrecognized arguments: "
                    "--no-such-option (ranks 0, 2 could start)"], result.stderr
    assert statuses == {"rank-0": "2", "rank-1": "2", "rank-2": "2"}, statuses


@pytest.mark.mpi
@pytest.mark.parametrize("command", ["check", "eval", "export"])
def test_a_one_process_command_under_mpiexec_is_refused_once(mpiexec, tmp_path, small_corpus,
                                                             command):
    # `mpiexec -n 3 python -m mpitrain export ...`: every process would do the
    # whole work and write the same output at once
    argv = {"check": ["check", small_corpus],
            "eval": ["eval", str(tmp_path / "m.h5"), f"{small_corpus}/dev"],
            "export": ["export", str(tmp_path / "m.h5"), "--feats", "scp:feats.scp",
                       "--out", f"ark:{tmp_path}/out.ark"]}[command]
    result, statuses, said = _run(mpiexec, tmp_path, 3, argv)
    assert result.returncode == 2, result.stderr
    assert said == [f"mpitrain {command}: error: {command} runs as one process; start it "
                    "without mpiexec or srun (this is one of 3 processes)"], result.stderr
    if launcher_is_open_mpi():
        # MPI never starts: rank 0 says the line and exits at once, and Open MPI's
        # launcher ends the others while they wait for that line to come first
        assert statuses["rank-0"] == "2" and set(statuses.values()) == {"2"}, statuses
    else:
        assert statuses == {"rank-0": "2", "rank-1": "2", "rank-2": "2"}, statuses
    assert not (tmp_path / "out.ark").exists()
