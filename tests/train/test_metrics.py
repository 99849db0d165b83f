"""metrics.jsonl's companions: TensorBoard event files and the terminal progress bar."""

import io
import json
import os
import sys

import pytest

from mpitrain.cli import main
from mpitrain.train.metrics import MetricsLog, progress_bar
from tests.helpers import QUICKSTART, small_overrides


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_is_a_bar_on_a_terminal_and_plain_lines_elsewhere(tmp_path):
    assert progress_bar(1, 4) == "[#####...............]  25%"
    assert progress_bar(9, 0).endswith("100%")
    plain = io.StringIO()
    log = MetricsLog(tmp_path / "a", stream=plain)
    log.progress(1, 4, "step 1/4 xent 1.0")
    log.progress(2, 4, "step 2/4 xent 0.9")
    log.say("held-out: acc 0.5")
    assert plain.getvalue() == "step 1/4 xent 1.0\nstep 2/4 xent 0.9\nheld-out: acc 0.5\n"
    term = _Terminal()
    log = MetricsLog(tmp_path / "b", stream=term)
    log.progress(1, 4, "step 1/4 xent 1.0")
    log.progress(2, 4, "step 2/4 xent 0.9")
    log.say("held-out: acc 0.5")          # ends the bar's line first
    log.close()
    assert term.getvalue() == ("\r[#####...............]  25% step 1/4 xent 1.0\x1b[K"
                               "\r[##########..........]  50% step 2/4 xent 0.9\x1b[K"
                               "\nheld-out: acc 0.5\n")


def test_a_terminal_that_is_not_the_controlling_one_gets_plain_lines(tmp_path):
    # Open MPI's mpirun gives each rank's output a terminal of its own even when its
    # output goes to a file: the log got "\r" and "\x1b[K" and no line ends
    import tty
    master, slave = os.openpty()            # (not this process's controlling terminal)
    try:
        tty.setraw(slave)                   # (the bytes as written, no "\r\n")
        with os.fdopen(os.dup(slave), "w") as stream:
            assert stream.isatty()
            log = MetricsLog(tmp_path / "a", stream=stream)
            log.progress(1, 4, "step 1/4 xent 1.0")
            log.progress(2, 4, "step 2/4 xent 0.9")
            log.close()
        assert os.read(master, 4096) == b"step 1/4 xent 1.0\nstep 2/4 xent 0.9\n"
    finally:
        os.close(master)
        os.close(slave)


def test_the_controlling_terminal_gets_the_bar(tmp_path):
    # a process of its own session whose first terminal opened becomes its
    # controlling one, as a shell's for the commands it starts
    import subprocess
    import tty
    master, slave = os.openpty()
    try:
        tty.setraw(slave)
        child = ("import os, sys\n"
                 "from mpitrain.train.metrics import MetricsLog\n"
                 "fd = os.open(sys.argv[1], os.O_RDWR)\n"
                 "with os.fdopen(fd, 'w') as stream:\n"
                 "    log = MetricsLog(sys.argv[2], stream=stream)\n"
                 "    log.progress(1, 4, 'step 1/4 xent 1.0')\n"
                 "    log.close()\n")
        subprocess.run([sys.executable, "-c", child, os.ttyname(slave), str(tmp_path / "a")],
                       check=True, start_new_session=True, timeout=60,
                       env=dict(os.environ, COLUMNS="80"),
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
        assert os.read(master, 4096) == (b"\r[#####...............]  25% step 1/4 xent 1.0"
                                         b"\x1b[K\n")
    finally:
        os.close(master)
        os.close(slave)


def test_on_a_narrow_terminal_the_progress_line_keeps_the_step_before_the_bar(tmp_path,
                                                                              monkeypatch):
    # COLUMNS=10 showed "[###....." and nothing of the step or the figures
    term = _Terminal()
    log = MetricsLog(tmp_path / "a", stream=term)
    monkeypatch.setenv("COLUMNS", "30")
    log.progress(1, 4, "step 1/4 xent 1.0")
    monkeypatch.setenv("COLUMNS", "10")
    log.progress(2, 4, "step 2/4 xent 0.9")
    monkeypatch.setenv("COLUMNS", "1")
    log.progress(3, 4, "step 3/4 xent 0.8")
    log.close()
    assert term.getvalue() == "\rstep 1/4 xent 1.0\x1b[K\rstep 2/4 \x1b[K\r\x1b[K\n"


def test_tensorboard_events_hold_the_train_and_eval_scalars(small_corpus, tmp_path, capsys):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run = tmp_path / "run"
    argv = ["train", QUICKSTART, "--run-dir", str(run)]
    for item in small_overrides(small_corpus, **{"training.tensorboard": "true",
                                                 "training.max_steps": 60,
                                                 "training.log_interval": 20}):
        argv += ["--set", item]
    assert main(argv) == 0
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    records = [json.loads(line) for line in open(run / "metrics.jsonl")]
    train = [r for r in records if r["type"] == "train"]
    got = events.Scalars("train/xent")
    assert [e.step for e in got] == [r["step"] for r in train]
    assert [e.value for e in got] == pytest.approx([r["xent"] for r in train], rel=1e-6)
    assert events.Scalars("eval/dev_acc")[-1].value == pytest.approx(
        [r for r in records if r["type"] == "eval"][-1]["dev_acc"], rel=1e-6)


def test_tensorboard_without_the_package_is_one_line(small_corpus, tmp_path, monkeypatch,
                                                     capsys):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    argv = ["train", QUICKSTART, "--run-dir", str(tmp_path / "run")]
    for item in small_overrides(small_corpus, **{"training.tensorboard": "true"}):
        argv += ["--set", item]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == (f"mpitrain train: error: {QUICKSTART}: training.tensorboard: true needs the "
                   "tensorboard package (pip install tensorboard)\n")
    assert not os.path.exists(tmp_path / "run")


def test_plot_without_matplotlib_is_one_line_naming_the_config(small_corpus, tmp_path,
                                                               monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    argv = ["train", QUICKSTART, "--run-dir", str(tmp_path / "run")]
    for item in small_overrides(small_corpus, **{"training.plot": "true"}):
        argv += ["--set", item]
    assert main(argv) == 2
    assert capsys.readouterr().err == (f"mpitrain train: error: {QUICKSTART}: training.plot: "
                                       "true needs matplotlib; pip install matplotlib (or the "
                                       "[plot] extra)\n")
    assert not os.path.exists(tmp_path / "run")


def test_appending_drops_a_last_line_cut_short(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"type": "start", "step": 0}\n{"type": "train", "st')
    log = MetricsLog(str(tmp_path), append=True)
    log.write("start", step=5)
    lines = path.read_text().splitlines()
    assert [json.loads(line)["type"] for line in lines] == ["start", "start"]
    # a file that ends cleanly is left as it is
    log = MetricsLog(str(tmp_path), append=True)
    log.write("end", step=6)
    assert len(path.read_text().splitlines()) == 3


def test_record_times_ignore_steps_of_the_system_clock(tmp_path, monkeypatch):
    # the seconds since the start (plot --x time) were the system clock's: an NTP
    # or administrator's step back by an hour gave a record at -3600 s
    import time
    system = [time.time()]
    monkeypatch.setattr(time, "time", lambda: system[0])
    log = MetricsLog(str(tmp_path))
    log.write("train", step=1)
    system[0] -= 3600.0
    log.write("train", step=2)
    system[0] += 7200.0
    log.write("train", step=3)
    log.close()
    times = [json.loads(line)["time"] for line in (tmp_path / "metrics.jsonl").open()]
    assert times == sorted(times) and 0 <= times[0] and times[-1] < 60, times


def test_a_full_disk_while_logging_names_the_metrics_file(tmp_path):
    import errno

    class Full:
        name = str(tmp_path / "metrics.jsonl")

        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    log = MetricsLog(str(tmp_path))
    log._fh = Full()
    with pytest.raises(OSError, match="no space left on device writing .*metrics.jsonl"):
        log.write("train", step=1)


def test_closing_the_log_after_a_failed_write_keeps_the_error_naming_the_file(tmp_path):
    # the record that failed stays in the file object's buffer, and closing it tried to
    # write it again: "[Errno 28] No space left on device", naming nothing, replaced
    # the one-line error (a real full disk at the start record; here a size limit)
    import subprocess
    import sys
    code = ("import resource, sys\n"
            "from mpitrain.train.metrics import MetricsLog\n"
            "log = MetricsLog(sys.argv[1])\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))\n"
            "try:\n"
            "    try:\n"
            "        log.write('start', step=0)\n"
            "    finally:\n"
            "        log.close()\n"
            "except OSError as exc:\n"
            "    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                         text=True, timeout=60)
    assert out.stdout == f"cannot write {tmp_path}/metrics.jsonl: File too large\n", out.stderr


def test_a_console_that_cannot_be_written_is_named(tmp_path, monkeypatch):
    # `train > log.txt` with log.txt's disk full stopped with "[Errno 28] No space left
    # on device", naming nothing; a reader that left (`| head`) stays a quiet SIGPIPE
    import errno
    import sys

    class Console:
        def __init__(self, exc):
            self.exc = exc

        def write(self, text):
            raise self.exc

        def flush(self):
            pass

    full = Console(OSError(errno.ENOSPC, "No space left on device"))
    monkeypatch.setattr(sys, "stdout", full)
    log = MetricsLog(str(tmp_path))
    for say in (lambda: log.say("resumed"), lambda: log.progress(1, 2, "step 1/2")):
        with pytest.raises(OSError) as err:
            say()
        assert str(err.value) == "cannot write standard output: No space left on device"
    log.stream = Console(BrokenPipeError(errno.EPIPE, "Broken pipe"))
    with pytest.raises(BrokenPipeError):
        log.say("resumed")
    log.close()


def test_every_kind_of_record_is_named_in_the_user_guide():
    # the records were described only feature by feature, and `selection` and
    # `checkpoint` nowhere: a script reading metrics.jsonl had to read the code
    import re
    from tests.helpers import REPO
    kinds = set()
    for path in (REPO / "mpitrain").rglob("*.py"):
        kinds.update(re.findall(r'(?:log\.write|_record)\(\s*"([a-z_]+)"', path.read_text()))
    assert {"start", "train", "eval", "selection", "checkpoint", "end"} <= kinds, kinds
    guide = (REPO / "docs" / "user-guide.md").read_text()
    section = guide[guide.index("### What `metrics.jsonl` holds"):guide.index("### Threads")]
    missing = sorted(kind for kind in kinds if f"`{kind}`" not in section)
    assert not missing, missing
