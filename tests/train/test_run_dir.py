"""Run directories: one run each, reuse only when asked, settings compared on resume."""

import os

from mpitrain.config import RunConfig
from mpitrain.train.run_dir import changed_settings, clear_run, run_dir_problem, run_files


def _run(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    for name in ("config.yaml", "metrics.jsonl", "ckpt-00000010.h5", "final.h5"):
        (d / name).write_text("x")
    (d / "notes.txt").write_text("mine")
    return d


def test_fresh_and_missing_directories_are_fine(tmp_path):
    assert run_dir_problem(str(tmp_path / "new"), resume=False, overwrite=False) is None
    (tmp_path / "empty").mkdir()
    assert run_dir_problem(str(tmp_path / "empty"), resume=False, overwrite=False) is None


def test_a_directory_holding_a_run_is_refused_without_resume_or_overwrite(tmp_path):
    d = _run(tmp_path)
    problem = run_dir_problem(str(d), resume=False, overwrite=False)
    assert str(d) in problem and "--resume" in problem and "--overwrite" in problem
    assert run_dir_problem(str(d), resume=True, overwrite=False) is None
    assert run_dir_problem(str(d), resume=False, overwrite=True) is None
    assert "exclude" in run_dir_problem(str(d), resume=True, overwrite=True)


def test_a_file_and_a_missing_resume_directory_are_refused(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    assert "not a directory" in run_dir_problem(str(f), resume=False, overwrite=False)
    assert "does not exist" in run_dir_problem(str(tmp_path / "nope"), resume=True,
                                               overwrite=False)


def test_clear_run_removes_the_run_files_only(tmp_path):
    d = _run(tmp_path)
    removed = clear_run(str(d))
    assert len(removed) == 4 and run_files(str(d)) == []
    assert sorted(os.listdir(d)) == ["notes.txt"]


def test_changed_settings_lists_what_changes_the_result():
    old, new = RunConfig(), RunConfig()
    new.optimizer.initial_learning_rate = 0.004
    new.training.minibatch = 512
    new.training.log_interval = 7           # neutral
    new.device_transport = "nccl"           # neutral
    assert changed_settings(old, new) == [
        "optimizer.initial_learning_rate: 0.002 -> 0.004", "training.minibatch: 256 -> 512"]
    assert changed_settings(old, RunConfig()) == []
