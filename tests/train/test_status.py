"""``mpitrain status`` (train/status.py): where runs stand, from their run
directories alone: ended, stopped by a signal, running or cut off."""

import json
import os
import subprocess
import sys

import pytest

from mpitrain.cli import main
from mpitrain.train.status import run_status

from ..helpers import QUICKSTART, small_overrides


def _write(run, records, lock=None):
    run.mkdir(parents=True, exist_ok=True)
    with open(run / "metrics.jsonl", "w", encoding="utf-8") as fh:
        for record in records:
            fh.write(json.dumps(record) + "\n")
    if lock is not None:
        (run / ".lock").write_text(lock + "\n", encoding="utf-8")


START = {"type": "start", "time": 0.0, "step": 0, "total_steps": 400}
TRAIN = {"type": "train", "time": 50.0, "step": 100, "epoch": 0, "seconds": 50.0,
         "xent": 1.5, "acc": 0.55, "frames_per_sec": 1234.0}
EVAL = {"type": "eval", "time": 51.0, "step": 100, "dev_acc": 0.5}
SELECTION = {"type": "selection", "time": 51.0, "step": 100, "best_step": 100,
             "best_value": 0.5}


def test_an_ended_run_names_its_model_and_held_out_figures(small_corpus, tmp_path, capsys):
    run = tmp_path / "run"
    argv = ["train", QUICKSTART, "--run-dir", str(run)]
    for item in small_overrides(small_corpus) + ["model.hidden_dim=16", "training.max_steps=20"]:
        argv += ["--set", item]
    assert main(argv) == 0
    capsys.readouterr()
    assert main(["status", str(run)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{run}: ended: 20 steps in ") \
        and lines[0].endswith(f"; {run}/final.h5"), lines
    assert lines[1].startswith("  held-out acc ") and "at step 20; best " in lines[1], lines
    assert len(lines) == 2


def test_a_run_without_its_model_files_and_a_benchmark_report_are_said_as_they_are(
        tmp_path, capsys):
    # a benchmark keeps each run's records but not its models: status named
    # RUN/final.h5 and best.h5 all the same, and `status runs/*` with the report
    # directory among the runs (bench's default --out is runs/bench-<config>) ended
    # in an error on its missing metrics.jsonl
    bench = tmp_path / "bench"
    run = bench / "runs" / "accuracy-sgd-n1"
    _write(run, [START, EVAL, SELECTION, {"type": "end", "time": 60.0, "steps": 400,
                                          "seconds": 60.0, "best_step": 100,
                                          "best_value": 0.5}])
    (bench / "bench.json").write_text("{}")
    (bench / "bench.md").write_text("")
    assert main(["status", str(bench), str(run)]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    lines = out.splitlines()
    assert lines[0] == (f"{bench}: a benchmark's report (bench.md, bench.json), not a run; "
                        f"its runs: status {bench}/runs/*"), lines
    assert lines[1] == f"{run}: ended: 400 steps in 1m00s; no final.h5 in {run}", lines
    assert lines[2].endswith("best 0.5000 at step 100 (no best.h5 here)"), lines


def test_a_stopped_run_names_the_checkpoint_to_resume_from(tmp_path):
    run = tmp_path / "run"
    _write(run, [START, TRAIN, {"type": "stop", "time": 52.0, "step": 104, "signal": "SIGTERM",
                                "ranks": 1, "checkpoint": f"{run}/ckpt-00000104.h5"}])
    assert run_status(run / "metrics.jsonl") == run_status(run)   # the file named
    lines = run_status(run)
    assert lines[0] == (f"{run}: stopped at step 104 on SIGTERM: checkpoint "
                        f"{run}/ckpt-00000104.h5; --resume continues from it")
    assert lines[1] == ("  step 100 of 400 (25%), epoch 0: xent 1.5000 acc 0.5500, "
                        "1,234 fr/s, about 2m30s left")


def test_a_stopped_run_moved_elsewhere_names_the_checkpoint_where_it_is_now(tmp_path):
    # the stop record names the path the run used; the directory was moved since
    run = tmp_path / "moved"
    _write(run, [START, TRAIN, {"type": "stop", "time": 52.0, "step": 104, "signal": "SIGTERM",
                                "ranks": 1, "checkpoint": "/scratch/old/ckpt-00000104.h5"}])
    assert run_status(run)[0] == (f"{run}: stopped at step 104 on SIGTERM: checkpoint "
                                  f"{run}/ckpt-00000104.h5; --resume continues from it")


def test_a_run_without_an_end_is_running_or_cut_off_as_its_rank_0_is(tmp_path):
    host = os.uname().nodename
    run = tmp_path / "run"
    _write(run, [START, TRAIN, EVAL, SELECTION], lock=f"pid {os.getpid()} on {host}")
    (run / "ckpt-00000100.h5").write_bytes(b"")
    (run / "best.h5").write_bytes(b"")          # (the selection wrote it)
    lines = run_status(run, now=os.path.getmtime(run / "metrics.jsonl") + 130)
    assert lines[0] == (f"{run}: running (rank 0 is pid {os.getpid()} on {host}; "
                        "metrics.jsonl written 2m10s ago)")
    assert lines[2:] == ["  held-out acc 0.5000 at step 100; best 0.5000 at step 100 (best.h5)",
                         "  newest checkpoint: ckpt-00000100.h5 (--resume continues from it)"]
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (run / ".lock").write_text(f"pid {gone} on {host}\n", encoding="utf-8")
    assert run_status(run)[0].startswith(f"{run}: cut off: rank 0 (pid {gone} on {host}) is "
                                         "gone without an end record")
    (run / ".lock").write_text("pid 12 on another-node\n", encoding="utf-8")
    assert run_status(run)[0].startswith(f"{run}: running, or cut off (no end record; ") \
        and run_status(run)[0].endswith("; rank 0 was pid 12 on another-node)")


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")
def test_a_rank_0_whose_process_id_another_process_took_is_gone(tmp_path):
    # process ids are reused: a run cut off long ago whose rank 0's number another
    # process holds now was "running (rank 0 is pid N ...)" for as long as that one ran
    host = os.uname().nodename
    run = tmp_path / "run"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _write(run, [START, TRAIN], lock=f"pid {other.pid} on {host}")
        an_hour_ago = os.path.getmtime(run / ".lock") - 3600
        os.utime(run / ".lock", (an_hour_ago, an_hour_ago))
        assert run_status(run)[0].startswith(f"{run}: cut off: rank 0 (pid {other.pid} on "
                                             f"{host}) is gone without an end record")
    finally:
        other.kill()
        other.wait()


@pytest.mark.parametrize("lock", [b"\xff\xfe\n", b"pid 0 on HOST\n",
                                  b"pid 2147483648 on HOST\n",
                                  b"pid 99999999999999999999999 on HOST\n"],
                         ids=["not-utf8", "pid-0", "beyond-pid_t", "beyond-c-long"])
def test_a_damaged_lock_file_names_no_rank_0(tmp_path, lock):
    """A .lock that is no text, or names no possible process, names no holder (it was a
    message naming nothing, an OverflowError traceback, or 'running' for pid 0)."""
    run = tmp_path / "run"
    _write(run, [START, TRAIN])
    (run / ".lock").write_bytes(lock.replace(b"HOST", os.uname().nodename.encode()))
    first = run_status(run)[0]
    assert first.startswith(f"{run}: running, or cut off (no end record; ") \
        and "rank 0" not in first, first


def test_the_newest_checkpoint_is_the_newest_training_not_the_highest_number(tmp_path):
    """Resumed on more ranks, a run numbers its steps lower: ckpt-50 holds more
    training than ckpt-80, and --resume continues from it."""
    import h5py
    run = tmp_path / "run"
    _write(run, [START, TRAIN])
    for step, frames in ((60, 15360), (80, 20480), (50, 25600)):
        with h5py.File(run / f"ckpt-{step:08d}.h5", "w") as f:
            f.attrs["frames_seen"] = frames
    assert run_status(run)[-1] == \
        "  newest checkpoint: ckpt-00000050.h5 (--resume continues from it)"


def test_an_earlier_attempts_end_does_not_count_after_a_resume(tmp_path):
    run = tmp_path / "run"
    ended = {"type": "end", "time": 60.0, "steps": 100, "seconds": 60.0}
    resumed = dict(START, time=0.0, step=100)
    _write(run, [START, TRAIN, ended, resumed])
    assert run_status(run)[0].startswith(f"{run}: running, or cut off (")


def test_status_of_several_runs_says_each_and_names_one_it_cannot_read(tmp_path, capsys):
    _write(tmp_path / "a", [START, TRAIN])
    assert main(["status", str(tmp_path / "a"), str(tmp_path / "missing"),
                 str(tmp_path / "a")]) == 2
    out, err = capsys.readouterr()
    assert out.count(f"{tmp_path / 'a'}: running, or cut off") == 2, out
    assert err.startswith(f"mpitrain status: error: {tmp_path / 'missing'}: "), err


def test_status_into_one_file_keeps_each_error_in_its_place(tmp_path):
    # `status runs/* > log 2>&1`: a run's lines waited in the output buffer, so every
    # error line came first, beside no run it belonged to
    _write(tmp_path / "a", [START, TRAIN])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    result = subprocess.run([sys.executable, "-m", "mpitrain", "status", str(tmp_path / "a"),
                             str(tmp_path / "missing"), str(tmp_path / "a")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=120, env=env)
    assert result.returncode == 2, result.stdout
    firsts = [line.split(":")[0] for line in result.stdout.splitlines()
              if not line.startswith(" ")]
    assert firsts == [str(tmp_path / "a"), "mpitrain status", str(tmp_path / "a")], \
        result.stdout


def test_records_of_another_shape_are_said_with_question_marks_not_a_crash(tmp_path):
    run = tmp_path / "run"
    _write(run, [dict(START, total_steps="many"), dict(TRAIN, step="x", xent=None, acc=[1]),
                 dict(EVAL, dev_acc="high"), dict(SELECTION, best_value=None)])
    (run / "best.h5").write_bytes(b"")
    lines = run_status(run)
    assert lines[1] == "  step ?, epoch 0: xent ? acc ?, 1,234 fr/s", lines
    assert lines[2] == "  held-out acc ? at step 100; best ? at step 100 (best.h5)", lines


@pytest.mark.parametrize("select_by,value,shown", [("xent", 4.30681, "best xent 4.3068"),
                                                    ("acc", 0.51, "best acc 0.5100")])
def test_the_best_is_named_by_the_figure_that_selects_it(tmp_path, select_by, value, shown):
    # a cross-entropy shown beside 'held-out acc' read as an accuracy
    run = tmp_path / "run"
    _write(run, [START, TRAIN, EVAL, dict(SELECTION, best_value=value, select_by=select_by)])
    lines = run_status(run)
    assert lines[2].startswith(f"  held-out acc 0.5000 at step 100; {shown} at step 100"), lines


def test_a_resumed_runs_time_left_and_time_taken_count_every_part(tmp_path):
    """The clocks of a resumed run's parts add up (read_metrics): the time left was
    that sum divided by this part's steps (five times too long), and the time an
    ended run took was its last part's."""
    run = tmp_path / "run"
    stop = {"type": "stop", "time": 52.0, "step": 100, "signal": "SIGTERM", "ranks": 1,
            "checkpoint": None}
    resumed = dict(START, time=0.0, step=100)
    later = dict(TRAIN, time=25.0, step=200, seconds=25.0)
    _write(run, [START, TRAIN, stop, resumed, later])
    # 50 s for steps 0-100, 25 s for 100-200: 0.25 s a step now, 200 steps left
    assert run_status(run)[1].endswith("about 0m50s left"), run_status(run)
    ended = {"type": "end", "time": 60.0, "steps": 400, "seconds": 60.0}
    _write(run, [START, TRAIN, stop, resumed, later, ended])
    assert run_status(run)[0].startswith(f"{run}: ended: 400 steps in 1m50s;"), \
        run_status(run)


def test_the_time_left_after_a_roll_back_counts_the_steps_trained(tmp_path):
    """A roll back to step 0 leaves the step count under the steps trained: 50 s
    over the 100 steps since the start gave 0.5 s a step, with 200 steps trained
    (100 of them abandoned) it is 0.25 s.  Logs without the count: as before."""
    run = tmp_path / "run"
    _write(run, [START, dict(TRAIN, steps_trained=200)])
    assert run_status(run)[1].endswith(", about 1m15s left"), run_status(run)
    _write(run, [START, TRAIN])
    assert run_status(run)[1].endswith(", about 2m30s left"), run_status(run)


def test_a_run_interrupted_by_ctrl_c_says_so(small_corpus, tmp_path, monkeypatch):
    # (it said "cut off: rank 0 (pid ...) is gone without an end record", as for a
    # lost node: nothing recorded the interrupt)
    from mpitrain.train.step import TrainingStep
    real = TrainingStep.run
    steps = {"n": 0}

    def interrupted_at_the_sixth(self, *args, **kwargs):
        steps["n"] += 1
        if steps["n"] == 6:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)
    monkeypatch.setattr(TrainingStep, "run", interrupted_at_the_sixth)
    run = tmp_path / "run"
    argv = ["train", QUICKSTART, "--run-dir", str(run)]
    for item in small_overrides(small_corpus) + ["model.hidden_dim=16",
                                                 "model.hidden_layers=1",
                                                 "training.checkpoint_interval=4"]:
        argv += ["--set", item]
    assert main(argv) == 130
    lines = run_status(run)
    assert lines[0] == f"{run}: interrupted (SIGINT, Ctrl-C) at step 5", lines
    assert any("newest checkpoint: ckpt-00000004.h5" in line for line in lines), lines


def test_a_running_pretraining_gives_its_layer_steps_and_time_left(tmp_path):
    """It gave the layer and step alone: no step total, no time left.  A resumed
    pretraining's pace is this part's: from its start at layer 2, step 20."""
    run = tmp_path / "run"
    start = {"type": "start", "time": 0.0, "mode": "pretrain", "layers": [40, 64, 64, 64],
             "layer_steps": [100, 50, 50], "layer": 2, "step": 20}
    window = {"type": "pretrain", "time": 30.0, "layer": 2, "step": 40, "recon_mse": 0.25,
              "frames_per_sec": 900.0}
    _write(run, [start, window])
    # 20 steps in 30 s: 1.5 s a step, 60 steps left (10 of layer 2, 50 of layer 3)
    assert run_status(run)[1] == ("  layer 2 of 3, step 40 of 50: recon mse 0.2500, "
                                  "900 fr/s, about 1m30s left"), run_status(run)
    _write(run, [start, dict(window, layer="two")])
    assert run_status(run)[1] == "  layer ? of 3, step 40: recon mse 0.2500, 900 fr/s"


def test_a_rank_error_file_names_the_failure_unless_the_run_said_how_it_ended(tmp_path):
    from mpitrain.train.errors import rank_error_path, write_rank_error
    run = tmp_path / "run"
    _write(run, [START, TRAIN], lock="pid 999999999 on elsewhere")
    write_rank_error(run, 3, {"step": 7, "error": "OSError", "message": "late"})
    os.utime(rank_error_path(run, 3), (1, 1))          # the first written
    write_rank_error(run, 1, {"step": 5, "error": "OSError", "message": "disk gone"})
    (run / "error-rank-00002.json").write_text("{not json")
    assert run_status(run)[0] == f"{run}: failed at step 7 on rank 3: late"
    os.remove(rank_error_path(run, 3))
    assert run_status(run)[0] == f"{run}: failed at step 5 on rank 1: disk gone"
    # what rank 0 wrote into metrics.jsonl comes first
    _write(run, [START, TRAIN, {"type": "stop", "time": 9.0, "step": 100, "signal": "SIGTERM"}])
    assert run_status(run)[0].startswith(f"{run}: stopped at step 100 on SIGTERM")


@pytest.mark.mpi
@pytest.mark.parametrize("command,where", [("train", "step"), ("pretrain", "layer 1, step")])
def test_a_failure_on_a_rank_other_than_0_is_named_by_status(mpiexec, small_corpus, tmp_path,
                                                             command, where):
    """A rank other than 0 that failed alone aborted the job with rank 0 waiting in a
    collective: nothing recorded the error, and status said the run was cut off."""
    import re
    from mpitrain.testing.mpirun import run_mpi
    from ..helpers import WORKERS, mpi_output
    run = tmp_path / "run"
    settings = small_overrides(small_corpus) + [
        "model.hidden_dim=16", "model.hidden_layers=1", "training.max_steps=40",
        "training.log_interval=4", "training.checkpoint_interval=4",
        "pretrain.epochs_gaussian=0.05", "pretrain.epochs_per_layer=0.05"]
    args = [str(WORKERS / "rank_failure_worker.py"), "1", "9", "--", command, QUICKSTART,
            "--run-dir", str(run)] + sum((["--set", s] for s in settings), [])
    result = run_mpi(2, args, timeout=120)
    assert result.returncode != 0, mpi_output(result)
    assert "rank 1: error: train/shard-00003.h5: cannot read" in result.stderr, \
        mpi_output(result)
    line = run_status(run)[0]
    assert re.fullmatch(rf"{re.escape(str(run))}: failed at {where} [0-9]+ on rank 1: "
                        r"train/shard-00003\.h5: cannot read: Input/output error", line), line
    if command == "train":
        # a resumed run is a new start: the old failure's file goes
        assert main(["train", QUICKSTART, "--run-dir", str(run), "--resume"]
                    + sum((["--set", s] for s in settings), [])) == 0
        assert not [n for n in os.listdir(run) if n.startswith("error-rank-")]
        assert run_status(run)[0].startswith(f"{run}: ended: 40 steps")


def test_a_benchmark_stopped_halfway_is_said_to_be_partial(tmp_path, capsys):
    # a benchmark stopped by a time limit or a signal keeps a partial report, or, before
    # its first size was done, only runs: status said "a benchmark's report" of the
    # first as of a finished one, and an error about a missing metrics.jsonl of the other
    partial = tmp_path / "partial"
    _write(partial / "runs" / "throughput-bmuf-n1", [START])
    (partial / "bench.json").write_text(json.dumps(
        {"partial": {"sizes_measured": [1, 2], "sizes_planned": [1, 2, 4]}}))
    (partial / "bench.md").write_text("")
    early = tmp_path / "early"
    _write(early / "runs" / "accuracy-model_averaging-n1", [START])
    assert main(["status", str(partial), str(early)]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    lines = out.splitlines()
    assert lines[0] == (f"{partial}: a benchmark's partial report (bench.md, bench.json: "
                        "group sizes 1, 2 of 1, 2, 4; it stopped before the rest, or is still "
                        f"running), not a run; its runs: status {partial}/runs/*"), lines
    assert lines[1] == (f"{early}: a benchmark without a report (it stopped before its first "
                        "group size was done, or is still running), not a run; its runs: "
                        f"status {early}/runs/*"), lines
    # a directory with neither is no benchmark: the error names what a run has
    (tmp_path / "other").mkdir()
    assert main(["status", str(tmp_path / "other")]) == 2
    assert "no metrics file" in capsys.readouterr().err
