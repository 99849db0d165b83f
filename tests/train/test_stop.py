"""Stopping a run on a signal (train/stop.py): what Slurm sends on preemption and
ahead of the time limit.

In this process: the handlers only set a flag and are restored after the run.
Under `mpiexec` (marked mpi): a signal on one rank or on all stops every rank
at the same step with a checkpoint and exit status 75, and the resumed run
equals the one never stopped; asynchronous ADPSGD, the parameter server and
pretraining stop with a checkpoint that `--resume` continues from.
"""

import os
import signal

import numpy as np
import pytest

from mpitrain.testing.mpirun import run_mpi
from mpitrain.train.stop import (EXIT_STOPPED, STOP_SIGNALS, requested, signal_name,
                                  stop_on_signals)

from ..helpers import (QUICKSTART, REPO, WORKERS, mpi_output, records, small_overrides,
                       train_on_ranks)

TINY = ["model.hidden_dim=32", "model.hidden_layers=2"]


def test_a_signal_only_sets_the_flag_and_the_handlers_come_back():
    before = {number: signal.getsignal(number) for number in STOP_SIGNALS}
    with stop_on_signals():
        assert not requested.code()
        os.kill(os.getpid(), signal.SIGUSR1)        # default action: end the process
        os.kill(os.getpid(), signal.SIGTERM)        # a second one: the first counts
        assert requested.signum == signal.SIGUSR1 and requested.code() == 2
    assert not requested.code()
    assert {number: signal.getsignal(number) for number in STOP_SIGNALS} == before


def test_sighup_is_a_stop_signal_unless_nohup_ignored_it():
    before = []                 # (a handler of its own, not the default: end this process)
    previous = signal.signal(signal.SIGHUP, lambda *_: before.append(True))
    try:
        with stop_on_signals():
            os.kill(os.getpid(), signal.SIGHUP)
            assert requested.signum == signal.SIGHUP and not before
            assert signal_name(requested.code()) == "SIGHUP"
        signal.signal(signal.SIGHUP, signal.SIG_IGN)    # nohup: the run goes on
        with stop_on_signals():
            os.kill(os.getpid(), signal.SIGHUP)
            assert not requested.code()
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_a_later_run_in_the_process_still_stops_on_sighup(monkeypatch):
    # the end of a run ignores the stop signals to the process's end (MPI's
    # finalize); a second run in the same process (the Python entry point called
    # again) took the ignored SIGHUP for nohup's and went on through it
    from mpitrain.train import stop
    monkeypatch.setattr(stop, "_run_complete", False)
    monkeypatch.setattr(stop, "_ignored_at_the_end", set(), raising=False)
    before = {number: signal.getsignal(number) for number in STOP_SIGNALS}
    signal.signal(signal.SIGHUP, signal.SIG_DFL)        # (not nohup, whatever ran the tests)
    try:
        with stop_on_signals():
            stop.ignore_from_now_on()
        assert all(signal.getsignal(number) == signal.SIG_IGN for number in STOP_SIGNALS)
        with stop_on_signals():
            os.kill(os.getpid(), signal.SIGHUP)
            assert requested.signum == signal.SIGHUP
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        signal.signal(signal.SIGHUP, signal.SIG_IGN)     # nohup itself still goes on
        stop._ignored_at_the_end.clear()
        with stop_on_signals():
            os.kill(os.getpid(), signal.SIGHUP)
            assert not requested.code()
    finally:
        for number, handler in before.items():
            signal.signal(number, handler)


# Runs COMMAND as the session leader of a new terminal (a pty), as a login
# shell's job: when the terminal closes, it gets SIGHUP and its console is gone.
_ON_A_TERMINAL = """
import fcntl, os, signal, sys, termios
os.setsid()
fcntl.ioctl(0, termios.TIOCSCTTY, 0)
signal.signal(signal.SIGHUP, signal.SIG_DFL)     # (not nohup, whatever ran the tests)
os.execv(sys.executable, [sys.executable, "-m", "mpitrain", *sys.argv[1:]])
"""


@pytest.mark.parametrize("command", ["train", "pretrain"])
def test_a_closed_terminal_stops_the_run_with_a_checkpoint(small_corpus, tmp_path, command):
    # the terminal closed under a run started without nohup: it died of SIGHUP with
    # nothing since its last checkpoint kept (and a stop on SIGHUP alone ended in an
    # error: its lines to the closed terminal failed)
    import pty
    import subprocess
    import sys
    import time
    run = tmp_path / "run"
    argv = [command, QUICKSTART, "--run-dir", str(run)]
    for item in TINY + small_overrides(small_corpus) + [
            "training.max_steps=100000", "training.log_interval=1",
            "training.checkpoint_interval=100000", "pretrain.epochs_gaussian=1000",
            "pretrain.epochs_per_layer=1000"]:
        argv += ["--set", item]
    master, slave = pty.openpty()
    child = subprocess.Popen([sys.executable, "-c", _ON_A_TERMINAL, *argv], stdin=slave,
                             stdout=slave, stderr=slave, close_fds=True,
                             env=dict(os.environ, PYTHONPATH=str(REPO)))
    os.close(slave)
    seen, deadline = b"", time.monotonic() + 120
    try:
        while b"step" not in seen.split(b"\n", 1)[-1] and time.monotonic() < deadline:
            try:
                seen += os.read(master, 4096)       # the banner, then a progress line
            except OSError:
                break
        assert b"step" in seen, seen.decode(errors="replace")
    finally:
        os.close(master)                            # the terminal hangs up
    assert child.wait(timeout=120) == EXIT_STOPPED, seen.decode(errors="replace")
    [stop] = records(run, "stop")
    assert stop["signal"] == "SIGHUP"
    assert _checkpoint_steps(run), os.listdir(run)
    assert not records(run, "error")


def _signalled(nranks, run_dir, corpus, settings, *, sig, ranks, after, command="train",
               poll_seconds=None):
    """`mpitrain COMMAND` under mpiexec with RANKS sending themselves SIG while they
    read their AFTER-th minibatch (tests/workers/signal_worker.py); the ranks
    tell each other at log lines only, or also every ``poll_seconds``."""
    values = {"data.train": os.path.join(corpus, "train"), "data.dev": os.path.join(corpus, "dev"),
              "data.chunk_frames": 20000}
    values.update(item.split("=", 1) for item in settings)
    args = [str(WORKERS / "signal_worker.py"), sig, ranks, str(after)] \
        + ([] if poll_seconds is None else [str(poll_seconds)]) \
        + ["--", command, QUICKSTART, "--run-dir", str(run_dir)]
    for key, value in values.items():
        args += ["--set", f"{key}={value}"]
    return run_mpi(nranks, args, timeout=120)


def _straight_and_stopped(nranks, tmp_path, corpus, common, **signal):
    """A run never stopped, and the same run stopped by a signal (``signal``: as
    for :func:`_signalled`): ``(straight, split, the stopped run's result)``."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    result = train_on_ranks(nranks, straight, corpus, common)
    assert result.returncode == 0, mpi_output(result)
    result = _signalled(nranks, split, corpus, common, **signal)
    assert result.returncode == EXIT_STOPPED, mpi_output(result)
    return straight, split, result


def _resumed_is_straight(nranks, straight, split, corpus, common):
    """``--resume`` of the stopped run ends with the model of the run never
    stopped, bit for bit."""
    from mpitrain.nn.model_file import load_model
    result = train_on_ranks(nranks, split, corpus, common, resume=True)
    assert result.returncode == 0, mpi_output(result)
    a, _ = load_model(straight / "final.h5")
    b, _ = load_model(split / "final.h5")
    assert np.array_equal(a.params, b.params), np.abs(a.params - b.params).max()


def _checkpoint_steps(run_dir):
    return sorted(int(name[5:13]) for name in os.listdir(run_dir) if name.startswith("ckpt-"))


@pytest.mark.mpi
@pytest.mark.parametrize("method,sig,ranks", [
    ("model_averaging", "SIGTERM", "1"),      # one rank: the others hear it at a log line
    ("allreduce", "SIGUSR1", "all"),
], ids=["model_averaging-one-rank", "allreduce-every-rank"])
def test_a_stopped_run_resumes_as_the_run_never_stopped(small_corpus, tmp_path, method, sig,
                                                        ranks):
    common = TINY + ["optimizer.momentum=0.5", f"parallel.method={method}",
                     "parallel.average_every=8", "training.checkpoint_interval=1000",
                     "training.max_steps=48", "training.log_interval=4"]
    # the signal during step 13: the ranks agree at the log line of step 16, which
    # is an averaging point of model_averaging (every 8) only at 16
    straight, split, result = _straight_and_stopped(2, tmp_path, small_corpus, common, sig=sig,
                                                    ranks=ranks, after=13)
    received = 2 if ranks == "all" else 1
    assert f"stopped at step 16 of 48 on {sig} (received by {received} of 2 rank(s)): " \
           f"checkpoint {split}/ckpt-00000016.h5" in result.stdout, mpi_output(result)
    assert _checkpoint_steps(split) == [16]
    assert not (split / "final.h5").exists()
    [stop] = records(split, "stop")
    assert (stop["step"], stop["signal"], stop["ranks"]) == (16, sig, received)
    _resumed_is_straight(2, straight, split, small_corpus, common)
    assert [r["step"] for r in records(split, "start")] == [0, 16]


@pytest.mark.mpi
@pytest.mark.parametrize("command,where", [("train", "step 16 of 48"),
                                           ("pretrain", "layer 1, step 16")])
def test_sighup_on_one_rank_stops_the_job_with_a_checkpoint(small_corpus, tmp_path, command,
                                                           where):
    # SIGHUP (a terminal closed under a rank started without nohup) ended the rank and,
    # with it, the job, without a checkpoint
    run = tmp_path / "run"
    common = TINY + ["parallel.method=model_averaging", "parallel.average_every=8",
                     "training.checkpoint_interval=1000", "training.max_steps=48",
                     "training.log_interval=4", "pretrain.epochs_gaussian=0.1",
                     "pretrain.epochs_per_layer=0.1", "pretrain.average_every_frames=800"]
    result = _signalled(2, run, small_corpus, common, sig="SIGHUP", ranks="1", after=13,
                        command=command)
    assert result.returncode == EXIT_STOPPED, mpi_output(result)
    assert f"stopped at {where} on SIGHUP (received by 1 of 2 rank(s))" in result.stdout, \
        mpi_output(result)
    [stop] = records(run, "stop")
    assert (stop["signal"], stop["ranks"]) == ("SIGHUP", 1)
    assert _checkpoint_steps(run) == [16]


@pytest.mark.mpi
def test_log_lines_far_apart_do_not_delay_the_stop(small_corpus, tmp_path):
    # no log line until the end: the ranks tell each other in polls of their own
    # (here after every step), so the signal of step 13 stops them at the
    # averaging point of step 16, and the resumed run is the one never stopped
    common = TINY + ["parallel.method=model_averaging", "parallel.average_every=8",
                     "training.checkpoint_interval=1000", "training.max_steps=48",
                     "training.log_interval=1000"]
    straight, split, result = _straight_and_stopped(2, tmp_path, small_corpus, common,
                                                    sig="SIGTERM", ranks="1", after=13,
                                                    poll_seconds=0)
    assert "stopped at step 16 of 48 on SIGTERM (received by 1 of 2 rank(s))" \
        in result.stdout, mpi_output(result)
    assert _checkpoint_steps(split) == [16]
    _resumed_is_straight(2, straight, split, small_corpus, common)


@pytest.mark.mpi
def test_a_signal_as_the_job_starts_stops_the_run_at_its_first_checkpoint(small_corpus,
                                                                          tmp_path):
    # SIGTERM while a rank reads the configuration, before MPI starts (a job preempted
    # as it starts): the process ended with the signal's status (143), which the batch
    # script does not requeue; now the run stops at its first averaging point
    common = TINY + ["parallel.method=model_averaging", "parallel.average_every=8",
                     "training.checkpoint_interval=1000", "training.max_steps=48",
                     "training.log_interval=4"]
    straight, split, result = _straight_and_stopped(2, tmp_path, small_corpus, common,
                                                    sig="SIGTERM", ranks="1", after=0)
    assert "stopped at step 8 of 48 on SIGTERM (received by 1 of 2 rank(s))" \
        in result.stdout, mpi_output(result)
    assert _checkpoint_steps(split) == [8]
    _resumed_is_straight(2, straight, split, small_corpus, common)


@pytest.mark.mpi
@pytest.mark.parametrize("after", [-1, -2], ids=["after-mpi-starts", "while-mpi-starts"])
def test_sighup_just_after_mpi_starts_is_kept_too(small_corpus, tmp_path, after):
    # MPI's start (UCX) put its own SIGHUP handler, which only raises its log level,
    # in place of the one that keeps a stop signal: a SIGHUP between MPI's start
    # and the run's own handlers went unseen and the run trained on to its end (-2:
    # one that came while MPI started, as soon as UCX had put its handler)
    common = TINY + ["parallel.method=model_averaging", "parallel.average_every=8",
                     "training.checkpoint_interval=1000", "training.max_steps=48",
                     "training.log_interval=4"]
    result = _signalled(2, tmp_path / "run", small_corpus, common, sig="SIGHUP", ranks="1",
                        after=after)
    assert result.returncode == EXIT_STOPPED, mpi_output(result)
    assert "stopped at step 8 of 48 on SIGHUP (received by 1 of 2 rank(s))" \
        in result.stdout, mpi_output(result)
    assert _checkpoint_steps(tmp_path / "run") == [8]


_SIGNALLED_WHILE_NUMPY_LOADS = """
import os, signal, sys
class Term:
    def find_spec(self, name, path=None, target=None):
        if name == "numpy":
            os.kill(os.getpid(), signal.SIGTERM)        # preempted as Python starts
        return None
sys.meta_path.insert(0, Term())
from mpitrain.cli import main
sys.argv = ["mpitrain", *sys.argv[1:]]
sys.exit(main())
"""


def test_a_signal_while_python_loads_the_modules_is_kept_too(small_corpus, tmp_path):
    # SIGTERM in the first second of the process, before the command line was read:
    # it ended with the signal's status (143), which the batch script does not requeue
    import subprocess
    import sys
    argv = ["train", QUICKSTART, "--run-dir", str(tmp_path / "run")]
    for item in TINY + small_overrides(small_corpus) + ["training.max_steps=8",
                        "training.checkpoint_interval=1000"]:
        argv += ["--set", item]
    done = subprocess.run([sys.executable, "-c", _SIGNALLED_WHILE_NUMPY_LOADS, *argv],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert done.returncode == EXIT_STOPPED, (done.returncode, done.stderr)
    assert "stopped at step 1 of 8 on SIGTERM" in done.stdout, done.stdout
    assert (tmp_path / "run" / "ckpt-00000001.h5").exists()


_SIGNALLED_WHILE_THE_CLI_LOADS = """
import os, signal, sys
class Term:
    def find_spec(self, name, path=None, target=None):
        if name == "mpitrain.cli":
            os.kill(os.getpid(), signal.SIGTERM)        # preempted as the rank starts
        return None
sys.meta_path.insert(0, Term())
"""


def _console_script_code():
    """What the installed ``mpitrain`` command runs: pip's script imports the entry
    point pyproject.toml names and calls it."""
    import tomllib
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        entry = tomllib.load(f)["project"]["scripts"]["mpitrain"]
    module, function = entry.split(":")
    return f"import sys; from {module} import {function}; sys.exit({function}())"


@pytest.mark.parametrize("launch", ["python -m mpitrain", "mpitrain"])
def test_a_signal_while_the_command_line_loads_is_kept(launch, small_corpus, tmp_path):
    """`python -m mpitrain train` (train.sbatch's command) and the `mpitrain` command:
    SIGTERM while they imported the command line's modules, before those installed
    the handlers (about a tenth of a second of every rank's start, more on a loaded
    node), ended the rank with status 143, which train.sbatch does not requeue."""
    import subprocess
    import sys
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(_SIGNALLED_WHILE_THE_CLI_LOADS)
    argv = ["train", QUICKSTART, "--run-dir", str(tmp_path / "run")]
    for item in TINY + small_overrides(small_corpus) + ["training.max_steps=8",
                                                        "training.checkpoint_interval=1000"]:
        argv += ["--set", item]
    start = ["-m", "mpitrain"] if launch == "python -m mpitrain" else \
        ["-c", _console_script_code()]
    done = subprocess.run([sys.executable, *start, *argv], capture_output=True,
                          text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=f"{hooks}{os.pathsep}{REPO}"))
    assert done.returncode == EXIT_STOPPED, (done.returncode, done.stderr)
    assert "stopped at step 1 of 8 on SIGTERM" in done.stdout, done.stdout
    assert (tmp_path / "run" / "ckpt-00000001.h5").exists()


def test_the_poll_comes_about_every_poll_seconds_and_never_after_the_log_line():
    # rank 0 sets the steps between polls from its own step time at each poll
    from mpitrain.train.stop import StopPoll

    class Clock:
        size, rank, now = 2, 0, 0.0

        def wtime(self):
            return self.now

        def allreduce_(self, buf, op):
            assert op == "sum"

    comm = Clock()
    poll = StopPoll(comm, max_every=100, seconds=2.0)
    poll.start(0)
    assert not poll.due(0) and poll.due(1)
    comm.now = 0.5                       # 0.5 s per step: every 4 steps
    flags, timed = poll.exchange(1, rank0_flag=True)
    assert not flags.any() and timed and poll.every == 4
    assert [s for s in range(2, 12) if poll.due(s)][0] == 5
    comm.now = 0.5 + 4 * 0.001           # 1 ms per step: the log interval bounds it
    poll.exchange(5)
    assert poll.every == 100
    poll.heard(50)                       # a log line told the flags: count from there
    assert not poll.due(149) and poll.due(150)
    comm.size = 1                        # one rank needs nobody's word
    assert not poll.due(10 ** 6)


@pytest.mark.mpi
def test_one_bmuf_rank_stops_at_its_block_end_and_resumes_exactly(small_corpus, tmp_path):
    # one rank needs no agreement, but a BMUF checkpoint inside a block would lose
    # the block's steps on resume: the stop waits for the block's end
    common = TINY + ["parallel.method=bmuf", "parallel.average_every=8",
                     "training.checkpoint_interval=1000", "training.max_steps=32",
                     "training.log_interval=4"]
    straight, split, result = _straight_and_stopped(1, tmp_path, small_corpus, common,
                                                    sig="SIGTERM", ranks="0", after=11)
    assert _checkpoint_steps(split) == [16], mpi_output(result)
    _resumed_is_straight(1, straight, split, small_corpus, common)


@pytest.mark.mpi
@pytest.mark.parametrize("nranks,method", [
    (2, ["parallel.method=adpsgd", "parallel.asynchronous=true"]),
    (3, ["parallel.method=param_server"]),
    # rank 1 is the second server: only server 0 writes checkpoints and ends the
    # job, and the signal was ignored (the run went on to its end)
    (3, ["parallel.method=param_server", "parallel.servers=2"]),
], ids=["async-adpsgd", "param_server", "param_server-second-server"])
def test_an_asynchronous_run_stops_with_a_checkpoint_to_resume(small_corpus, tmp_path, nranks,
                                                               method):
    run = tmp_path / "run"
    common = TINY + method + ["training.max_steps=40", "training.log_interval=4",
                              "training.checkpoint_interval=1000"]
    result = _signalled(nranks, run, small_corpus, common, sig="SIGTERM", ranks="1", after=5)
    assert result.returncode == EXIT_STOPPED, mpi_output(result)
    [stop] = records(run, "stop")
    assert stop["signal"] == "SIGTERM" and stop["ranks"] == 1
    assert _checkpoint_steps(run) == [stop["step"]]
    assert f"checkpoint {run}/ckpt-{stop['step']:08d}.h5" in result.stdout
    assert not (run / "final.h5").exists()
    result = train_on_ranks(nranks, run, small_corpus, common, resume=True)
    assert result.returncode == 0, mpi_output(result)
    assert records(run, "start")[1]["step"] == stop["step"] > 0
    assert (run / "final.h5").exists()


@pytest.mark.mpi
def test_pretraining_stops_at_an_averaging_point_and_resumes(small_corpus, tmp_path):
    from mpitrain.nn.rbm_file import load_rbm_stack
    common = TINY + ["training.log_interval=4", "pretrain.epochs_gaussian=0.1",
                     "pretrain.epochs_per_layer=0.1", "pretrain.average_every_frames=2048"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    result = _signalled(2, straight, small_corpus, common, sig="SIGTERM", ranks="",
                        after=1, command="pretrain")
    assert result.returncode == 0, mpi_output(result)
    # the signal on rank 0 in step 13: agreed at step 16, stopped at the average of 20
    result = _signalled(2, split, small_corpus, common, sig="SIGUSR2", ranks="0", after=13,
                        command="pretrain")
    assert result.returncode == EXIT_STOPPED, mpi_output(result)
    assert "stopped at layer 1, step 20 on SIGUSR2 (received by 1 of 2 rank(s))" \
        in result.stdout, mpi_output(result)
    assert _checkpoint_steps(split) == [20]
    result = run_mpi(2, ["-m", "mpitrain", "pretrain", QUICKSTART, "--run-dir", str(split),
                         "--resume"] + sum((["--set", s] for s in common + [
                             f"data.train={small_corpus}/train",
                             f"data.dev={small_corpus}/dev", "data.chunk_frames=20000"]), []),
                     timeout=120)
    assert result.returncode == 0, mpi_output(result)
    a = load_rbm_stack(str(straight / "pretrain.h5"))
    b = load_rbm_stack(str(split / "pretrain.h5"))
    for x, y in zip(a.rbms, b.rbms):
        assert np.array_equal(x.params, y.params)


@pytest.mark.mpi
@pytest.mark.parametrize("command,result", [("train", "final.h5"),
                                            ("pretrain", "pretrain.h5")])
def test_a_signal_while_rank_0_writes_the_result_ends_the_job_complete(small_corpus, tmp_path,
                                                                      command, result):
    """A stop signal on every rank as a run ends: rank 1, its run over and its
    handlers gone, waited in MPI's finalize for rank 0 and died of it; the launcher
    then ended rank 0 before it had written the result (status 143 or 15, no
    final.h5, no final checkpoint, nothing a batch script requeues)."""
    run = tmp_path / "run"
    args = [str(WORKERS / "late_signal_worker.py"), "2", "--", command, QUICKSTART,
            "--run-dir", str(run)]
    for item in [f"data.train={small_corpus}/train", f"data.dev={small_corpus}/dev",
                 "data.chunk_frames=20000", "model.hidden_layers=1", "model.hidden_dim=16",
                 "training.max_steps=8", "training.log_interval=4",
                 "pretrain.epochs_gaussian=0.02", "model.nonlinearity=sigmoid"]:
        args += ["--set", item]
    done = run_mpi(2, args, timeout=120)
    assert done.returncode == 0, mpi_output(done)
    assert (run / result).exists()


@pytest.mark.mpi
@pytest.mark.parametrize("command,sig", [("train", "SIGTERM"), ("pretrain", "SIGUSR1")])
def test_a_signal_after_the_run_ended_leaves_the_job_complete(small_corpus, tmp_path, command,
                                                              sig):
    """A stop signal on a rank whose run had ended (its `done:` said), while it
    waited in MPI's finalize for rank 0: the rank died of it and the launcher
    failed the finished job (status 15 or 143); now it is ignored there."""
    run = tmp_path / "run"
    args = [str(WORKERS / "finalize_signal_worker.py"), sig, "3", "--", command, QUICKSTART,
            "--run-dir", str(run)]
    for item in [f"data.train={small_corpus}/train", f"data.dev={small_corpus}/dev",
                 "data.chunk_frames=20000", "model.hidden_layers=1", "model.hidden_dim=16",
                 "training.max_steps=8", "training.log_interval=4",
                 "pretrain.epochs_gaussian=0.02", "model.nonlinearity=sigmoid"]:
        args += ["--set", item]
    done = run_mpi(2, args, timeout=120)
    assert done.returncode == 0, mpi_output(done)
    assert (run / ("final.h5" if command == "train" else "pretrain.h5")).exists()
    assert not records(run, "stop")


@pytest.mark.mpi
def test_a_signal_after_an_error_every_rank_reached_keeps_the_jobs_status(small_corpus,
                                                                            tmp_path):
    """A stop signal on a rank that had stopped with the others at an error (a
    divergence), while it waited in MPI's finalize for rank 0: it died of the
    signal and the job's status 2 became the signal's (143)."""
    run = tmp_path / "run"
    args = [str(WORKERS / "finalize_signal_worker.py"), "SIGTERM", "3", "--", "pretrain",
            QUICKSTART, "--run-dir", str(run)]
    for item in [f"data.train={small_corpus}/train", f"data.dev={small_corpus}/dev",
                 "data.chunk_frames=20000", "model.hidden_layers=1", "model.hidden_dim=16",
                 "training.log_interval=4", "pretrain.epochs_gaussian=0.05",
                 "model.nonlinearity=sigmoid", "pretrain.learning_rate_gaussian=5",
                 "pretrain.divergence_factor=1.2"]:
        args += ["--set", item]
    done = run_mpi(2, args, timeout=120)
    assert "error:" in done.stderr, mpi_output(done)
    assert done.returncode == 2, mpi_output(done)


@pytest.mark.mpi
@pytest.mark.parametrize("problem", ["refused-setting", "resume-without-checkpoint"])
def test_a_signal_after_the_ranks_refused_to_start_keeps_the_jobs_status(small_corpus,
                                                                       tmp_path, problem):
    """A stop signal on a rank that had ended with the others at a refused setting
    or an unusable run directory (rank 0 says it), while it waited for rank 0: it
    died of the signal and the job's status 2 became the signal's (15)."""
    run = tmp_path / "run"
    args = [str(WORKERS / "finalize_signal_worker.py"), "SIGTERM", "6", "--", "train",
            QUICKSTART, "--run-dir", str(run), "--set", f"data.train={small_corpus}/train"]
    if problem == "refused-setting":
        args += ["--set", "parallel.method=param_server", "--set", "training.combine=true"]
    else:
        args.append("--resume")
    done = run_mpi(2, args, timeout=120)
    assert done.stderr.count("error:") == 1, mpi_output(done)
    assert done.returncode == 2, mpi_output(done)


@pytest.mark.mpi
@pytest.mark.parametrize("command", ["train", "pretrain"])
def test_a_signal_after_a_single_rank_command_returned_leaves_its_status(small_corpus,
                                                                         tmp_path, command):
    """A stop signal after a one-rank run's `done:`, before its process ended (the
    interpreter's exit, MPI's finalize): the default action was back, and the
    finished job ended with the signal's status."""
    run = tmp_path / "run"
    code = ("import os, signal, sys, time\n"
            "from mpitrain.__main__ import main\n"
            "status = main(sys.argv[1:])\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "time.sleep(0.2)\n"
            "sys.exit(status)\n")
    args = ["-c", code, command, QUICKSTART, "--run-dir", str(run)]
    for item in small_overrides(small_corpus, **{
            "model.hidden_layers": 1, "model.hidden_dim": 16, "training.max_steps": 8,
            "pretrain.epochs_gaussian": 0.02, "model.nonlinearity": "sigmoid"}):
        args += ["--set", item]
    done = run_mpi(1, args, timeout=120)
    assert done.returncode == 0, mpi_output(done)
    assert (run / ("final.h5" if command == "train" else "pretrain.h5")).exists()
