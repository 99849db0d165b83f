"""Run directories: one run each, reuse only when asked, settings compared on resume."""

import os
import shutil

from mpitrain.config import RunConfig
from mpitrain.train.run_dir import changed_settings, clear_run, run_dir_problem, run_files

from ..helpers import QUICKSTART


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


def test_a_corpus_directory_is_refused_as_a_new_runs_directory(tmp_path, small_corpus):
    """`--run-dir data/train` wrote checkpoints and models among the shards."""
    from mpitrain.cli import main
    corpus = tmp_path / "train"
    shutil.copytree(os.path.join(small_corpus, "train"), corpus)
    for overwrite in (False, True):
        assert run_dir_problem(str(corpus), resume=False, overwrite=overwrite) == (
            f"{corpus}: a corpus directory (it holds corpus.yaml), not a place for a run; "
            "choose another --run-dir")
    before = sorted(os.listdir(corpus))
    assert main(["train", QUICKSTART, "--set",
                 f"data.train={corpus}", "--set", "data.dev=", "--run-dir", str(corpus)]) == 2
    assert sorted(os.listdir(corpus)) == before


def test_clear_run_removes_the_run_files_only(tmp_path):
    d = _run(tmp_path)
    removed = clear_run(str(d))
    assert len(removed) == 4 and run_files(str(d)) == []
    assert sorted(os.listdir(d)) == ["notes.txt"]


def test_clear_run_removes_the_tensorboard_event_files_of_the_run(tmp_path):
    # (--overwrite of a run that had training.tensorboard: true left its event
    # files, and TensorBoard drew the replaced run's curves as the new one's)
    d = _run(tmp_path)
    (d / "tensorboard").mkdir()
    (d / "tensorboard" / "events.out.tfevents.1.host.1.0").write_text("x")
    assert len(run_files(str(d))) == 5
    assert len(clear_run(str(d))) == 5
    assert sorted(os.listdir(d)) == ["notes.txt"]
    # a file of the user's there keeps the directory
    (d / "tensorboard").mkdir()
    (d / "tensorboard" / "events.out.tfevents.2.host.2.0").write_text("x")
    (d / "tensorboard" / "mine.txt").write_text("x")
    assert len(clear_run(str(d))) == 1
    assert os.listdir(d / "tensorboard") == ["mine.txt"]


def test_a_directory_named_like_a_checkpoint_is_not_a_run_file(tmp_path):
    # --overwrite removed the run's files with os.remove: it failed on the directory
    d = _run(tmp_path)
    (d / "ckpt-00000001.h5").mkdir()
    clear_run(str(d))
    assert sorted(os.listdir(d)) == ["ckpt-00000001.h5", "notes.txt"]


def test_changed_settings_lists_what_changes_the_result():
    old, new = RunConfig(), RunConfig()
    new.optimizer.initial_learning_rate = 0.004
    new.training.minibatch = 512
    new.training.log_interval = 7           # neutral
    new.device_transport = "nccl"           # neutral
    assert changed_settings(old, new) == [
        "optimizer.initial_learning_rate: 0.002 -> 0.004", "training.minibatch: 256 -> 512"]
    assert changed_settings(old, RunConfig()) == []


def test_settings_of_an_optimizer_neither_run_uses_are_no_change():
    """An SGD run saved when NG-SGD's defaults were others (or with its NG-SGD
    section edited since) resumes without a change; an NG-SGD run, or a switch
    to or from NG-SGD, still names them."""
    old, new = RunConfig(), RunConfig()
    old.optimizer.ngsgd.reset_on_average = True
    new.optimizer.ngsgd.rank_out = 40
    assert changed_settings(old, new) == []
    old.optimizer.name = "ngsgd"
    assert changed_settings(old, new) == [
        "optimizer.name: 'ngsgd' -> 'sgd'", "optimizer.ngsgd.rank_out: 80 -> 40",
        "optimizer.ngsgd.reset_on_average: True -> False"]
    new.optimizer.name = "ngsgd"
    assert changed_settings(old, new) == [
        "optimizer.ngsgd.rank_out: 80 -> 40", "optimizer.ngsgd.reset_on_average: True -> False"]


def test_settings_of_a_method_or_schedule_neither_run_uses_are_no_change():
    """A model-averaging run with the exponential schedule resumes whatever the
    other methods' and schedules' settings say (a config shared by a sweep over
    methods); a run of that method or schedule, or a switch to it, names them."""
    old, new = RunConfig(), RunConfig()
    new.parallel.nesterov = False               # bmuf
    new.parallel.bucket_mb = 1.0                # allreduce
    new.parallel.num_jobs_final = 2             # kaldi
    new.parallel.topology = "random_ring"       # adpsgd
    new.parallel.average_eta = 0.5              # param_server
    new.optimizer.hand_factor = 0.5             # the hand schedule
    new.optimizer.search_factors = [0.5, 1.0]   # the search schedule
    new.model.pnorm_p = 3.0                     # p-norm units
    new.training.combine_models = 3             # the combination
    new.training.early_stop.min_delta = 0.1     # early stopping
    assert changed_settings(old, new) == []
    old.parallel.method = new.parallel.method = "bmuf"
    assert changed_settings(old, new) == ["parallel.nesterov: True -> False"]
    old.parallel.method = "model_averaging"
    new.optimizer.schedule = "hand"
    assert changed_settings(old, new) == [
        "optimizer.hand_factor: 0.999 -> 0.5", "optimizer.schedule: 'exponential' -> 'hand'",
        "parallel.method: 'model_averaging' -> 'bmuf'", "parallel.nesterov: True -> False"]


def test_run_directories_that_cannot_be_used_are_named(tmp_path, monkeypatch):
    import os
    from mpitrain.train.run_dir import run_dir_problem
    (tmp_path / "afile").write_text("x")
    assert "afile is not a directory" in run_dir_problem(
        str(tmp_path / "afile" / "sub"), resume=False, overwrite=False)
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    assert "symbolic link to" in run_dir_problem(str(tmp_path / "dangling"), resume=False,
                                                 overwrite=False)
    (tmp_path / "run").mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, *a, **k: False
                        if str(path).endswith("/run") else real_access(path, mode, *a, **k))
    assert "not writable (a resumed run writes there)" in run_dir_problem(
        str(tmp_path / "run"), resume=True, overwrite=False)


def test_the_lock_tells_when_its_directory_was_removed_or_moved(tmp_path):
    from mpitrain.train.run_dir import RunDirLock
    for how in ("moved", "removed"):
        d = tmp_path / how
        d.mkdir()
        lock = RunDirLock(str(d))
        assert lock.acquire() is None and lock.moved() is None
        if how == "moved":
            d.rename(tmp_path / "elsewhere")
        else:
            shutil.rmtree(d)
        d.mkdir()                   # what a later write would have made
        problem = lock.moved("final.h5")
        assert problem.startswith(f"{d}: the run directory (or its .lock) was removed") \
            and "final.h5" in problem, problem
        lock.release()


def test_a_held_lock_whose_file_is_not_text_is_refused_naming_the_directory(tmp_path):
    """The refusal quotes the holder from .lock: damaged bytes there gave a bare
    UnicodeDecodeError naming nothing."""
    import fcntl
    from mpitrain.train.run_dir import RunDirLock
    (tmp_path / ".lock").write_bytes(b"\xff\xfe" + b"x" * 100000)
    with open(tmp_path / ".lock", "rb") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        problem = RunDirLock(str(tmp_path)).acquire()
    assert problem.startswith(f"{tmp_path}: another run is using this directory (") \
        and len(problem) < 400, problem


def test_the_lock_never_writes_through_a_link_nor_into_what_is_no_file(tmp_path):
    import os
    from mpitrain.train.run_dir import RunDirLock
    target = tmp_path / "target"
    target.write_text("keep\n", encoding="utf-8")
    for name, make in (("link", lambda p: os.symlink(target, p)),
                       ("dangling", lambda p: os.symlink(tmp_path / "nowhere", p)),
                       ("fifo", os.mkfifo), ("dir", os.mkdir)):
        d = tmp_path / name
        d.mkdir()
        make(d / ".lock")
        lock = RunDirLock(str(d))
        problem = lock.acquire()
        assert problem is not None and problem.startswith(f"{d / '.lock'}: ") \
            and "\n" not in problem, (name, problem)
        lock.release()
    assert target.read_text(encoding="utf-8") == "keep\n"
    assert not (tmp_path / "nowhere").exists()


def test_a_run_directory_whose_files_could_not_be_named_is_refused_before_writing(tmp_path):
    """Near PATH_MAX a run trained, then failed at its first checkpoint (its temporary
    name too long), with config.yaml and metrics.jsonl written and nothing to resume."""
    import os
    from mpitrain.train.run_dir import run_dir_problem
    limit = os.pathconf(tmp_path, "PC_PATH_MAX")
    deep = str(tmp_path)
    while len(deep) < limit - 20:
        deep = os.path.join(deep, "d" * min(200, limit - 20 - len(deep)))
    problem = run_dir_problem(deep, resume=False, overwrite=False)
    assert problem and "choose a shorter --run-dir" in problem and f"limit of {limit}" in problem
    assert not (tmp_path / "d").exists()
    long_name = tmp_path / ("n" * 300)
    assert "a directory name of 300 bytes" in run_dir_problem(str(long_name), resume=False,
                                                               overwrite=False)
    assert run_dir_problem(str(tmp_path / "fine"), resume=False, overwrite=False) is None


def _latin1_name(directory, name: bytes) -> str:
    """``directory/name`` for a name whose bytes are not UTF-8 (Latin-1's 'é')."""
    import pytest
    path = os.fsdecode(os.path.join(os.fsencode(str(directory)), name))
    try:
        os.mkdir(path)
        os.rmdir(path)
    except (OSError, UnicodeError):
        pytest.skip("this file system takes only UTF-8 names")
    return path


def test_a_corpus_and_run_directory_named_in_latin1_checkpoint_and_resume(small_corpus,
                                                                          tmp_path):
    """Their paths, stored in the checkpoint, were refused by HDF5 (text must be UTF-8):
    the run trained to its first checkpoint and failed there, with nothing to resume."""
    from ..helpers import records, train_in_process
    corpus = _latin1_name(tmp_path, b"caf\xe9")
    shutil.copytree(small_corpus, corpus)
    run = _latin1_name(tmp_path, b"run-\xe9t\xe9")
    settings = ["model.hidden_dim=16", "model.hidden_layers=1"]
    train_in_process(run, corpus, settings + ["training.max_steps=4"])
    assert os.path.exists(os.path.join(run, "ckpt-00000004.h5"))
    train_in_process(run, corpus, settings + ["training.max_steps=8"], resume=True)
    assert records(run, "end")[-1]["steps"] == 8


def test_a_stack_that_cannot_be_read_has_no_identity(tmp_path):
    """The identity of model.init_from is read, unverified, from the stack's stored
    checksum; a path naming nothing, a directory or a file that is no HDF5 gives none
    (the path alone is then compared on resume, as before)."""
    from mpitrain.config import RunConfig
    from mpitrain.train.run_dir import init_from_identity
    (tmp_path / "text.h5").write_text("not HDF5\n", encoding="utf-8")
    for name in ("missing.h5", "text.h5", ""):
        cfg = RunConfig()
        cfg.model.init_from = str(tmp_path / name)
        assert init_from_identity(cfg) == {}, name


def test_rank_0_clears_the_directory_before_the_other_ranks_go_on(tmp_path):
    """Rank 0 removed stale temporaries after the other ranks had heard they may go
    on: a rank that failed at once lost the error record it was writing through its
    temporary (.error-rank-00001.json.tmp-PID)."""
    from mpitrain.comm.single import SingleCommunicator
    from mpitrain.train.errors import write_rank_error
    from mpitrain.train.run_dir import take_run_dir
    run = tmp_path / "run"
    run.mkdir()
    (run / ".ckpt-00000010.h5.tmp-1").write_text("interrupted")
    write_rank_error(run, 1, {"step": 3, "error": "OSError", "message": "an earlier start"})
    in_flight = run / ".error-rank-00001.json.tmp-2"

    class GoOn(SingleCommunicator):
        def bcast_obj(self, obj, root=0):
            # the other ranks go on from here: one fails and writes its record
            assert sorted(os.listdir(run)) == [".lock"]
            in_flight.write_text('{"type": "error"')
            return super().bcast_obj(obj, root=root)

    lock, lines = take_run_dir(GoOn(), str(run), RunConfig(), resume=True, overwrite=False)
    try:
        assert in_flight.exists()
        assert lines == ["removed 1 temporary file(s) left by an interrupted write: "
                         ".ckpt-00000010.h5.tmp-1"], lines
    finally:
        lock.release()


def _killed_holder(run_dir):
    """A process that took ``run_dir``'s lock and was killed (SIGKILL) holding it."""
    import subprocess
    import sys
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from mpitrain.train.run_dir import "
         "RunDirLock; assert RunDirLock(sys.argv[1]).acquire() is None; print(flush=True); "
         "time.sleep(600)", str(run_dir)], stdout=subprocess.PIPE)
    child.stdout.readline()           # (it holds the lock now)
    child.kill()
    child.wait()
    return child.pid


def test_a_lock_left_by_a_killed_run_is_taken_over_with_a_note(tmp_path):
    from mpitrain.train.run_dir import RunDirLock
    pid = _killed_holder(tmp_path)
    lock = RunDirLock(str(tmp_path))
    assert lock.acquire() is None
    note = lock.left_by()
    assert note.startswith(f"took over the lock of pid {pid} on {os.uname().nodename} since ") \
        and "killed" in note, note
    lock.in_use = True
    lock.release()
    # a run that released the lock leaves nothing to take over
    assert (tmp_path / ".lock").read_text() == ""
    lock = RunDirLock(str(tmp_path))
    assert lock.acquire() is None and lock.left_by() is None
    lock.release()


def test_a_lock_left_on_another_host_is_taken_over_without_judging_its_pid(tmp_path):
    """No process id of another host is looked up here (a pid that does not exist on
    this host may run there): the lock alone, which the file server holds for that
    host's process, says whether the directory is in use."""
    from mpitrain.train.run_dir import RunDirLock
    (tmp_path / ".lock").write_text("pid 4 on other-node since 2025-01-02 03:04:05 +0000\n")
    lock = RunDirLock(str(tmp_path))
    assert lock.acquire() is None
    note = lock.left_by()
    assert note.startswith("took over the lock of pid 4 on other-node since 2025-01-02 ") \
        and "its node lost" in note and "does not share locks between hosts" in note, note
    lock.release()


def test_a_start_refused_after_taking_the_lock_leaves_the_killed_runs_line(tmp_path):
    # (`status` names the rank 0 of a run cut off by that line)
    from mpitrain.train.run_dir import RunDirLock
    line = "pid 4 on other-node since 2025-01-02 03:04:05 +0000"
    (tmp_path / ".lock").write_text(line + "\n")
    lock = RunDirLock(str(tmp_path))
    assert lock.acquire() is None
    assert (tmp_path / ".lock").read_text().startswith(f"pid {os.getpid()} on ")
    lock.release()
    assert (tmp_path / ".lock").read_text() == line + "\n"


def test_a_held_lock_is_refused_naming_its_holder_and_when_it_took_it(tmp_path):
    from mpitrain.train.run_dir import RunDirLock, lock_a_used_run_dir
    assert lock_a_used_run_dir(str(tmp_path)) == (None, None)     # (no run used it)
    assert not (tmp_path / ".lock").exists()
    holder = RunDirLock(str(tmp_path))
    assert holder.acquire() is None
    try:
        lock, problem = lock_a_used_run_dir(str(tmp_path))
        assert lock is None and problem.startswith(
            f"{tmp_path}: another run is using this directory (pid {os.getpid()} on "
            f"{os.uname().nodename} since "), problem
    finally:
        holder.release()
    lock, problem = lock_a_used_run_dir(str(tmp_path))
    assert problem is None and lock is not None
    lock.release()


def test_a_lock_line_of_a_process_still_running_is_said_as_a_copy(tmp_path):
    """A directory copied while its run goes on holds that run's lock line, but not
    its lock: the take-over said the run was killed, while it trained on beside the
    copy from the same checkpoint."""
    from mpitrain.train.run_dir import RunDirLock
    since = "2026-01-02 03:04:05 +0000"
    (tmp_path / ".lock").write_text(f"pid {os.getpid()} on {os.uname().nodename} since {since}\n")
    lock = RunDirLock(str(tmp_path))
    assert lock.acquire() is None
    note = lock.left_by()
    assert note.startswith(f"took over the lock of pid {os.getpid()} ") and "still runs" in note \
        and "copy" in note and "killed" not in note, note
    lock.release()
