"""Paths and helpers shared by test files in different folders."""

import json
import os
from pathlib import Path

from mpitrain.cli import main

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = str(REPO / "jobs" / "configs" / "quickstart.yaml")
#: The scripts the ``mpi`` tests launch under mpiexec.
WORKERS = REPO / "tests" / "workers"


def small_overrides(corpus, **extra):
    """--set values that point the quickstart config at the small corpus."""
    values = {"data.train": os.path.join(corpus, "train"), "data.dev": os.path.join(corpus, "dev"),
              "data.chunk_frames": 20000, "training.log_interval": 50}
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


def train_in_process(run_dir, corpus, extra=(), resume=False):
    """`mpitrain train` of the quickstart config on ``corpus``, in this process."""
    argv = ["train", QUICKSTART, "--run-dir", str(run_dir)]
    for item in small_overrides(corpus) + list(extra):
        argv += ["--set", item]
    if resume:
        argv.append("--resume")
    assert main(argv) == 0


def train_straight_and_resumed(tmp_path, corpus, settings, *, steps, half=None):
    """Run directories of one run trained straight through `steps` and one stopped
    at `half` (default steps // 2) and resumed to `steps`, both in this process."""
    half = steps // 2 if half is None else half
    straight, split = tmp_path / "straight", tmp_path / "split"
    train_in_process(straight, corpus, list(settings) + [f"training.max_steps={steps}"])
    train_in_process(split, corpus, list(settings) + [f"training.max_steps={half}"])
    train_in_process(split, corpus, list(settings) + [f"training.max_steps={steps}"],
                     resume=True)
    return straight, split


def write_run(run_dir, *, acc_at_end, steps=5):
    """A run directory with a metrics file like the trainer's: start, train, eval, end."""
    os.makedirs(run_dir, exist_ok=True)
    lines = [{"type": "start", "time": 0.0, "step": 0, "ranks": 1}]
    for i in range(1, steps + 1):
        acc = acc_at_end * i / steps
        lines.append({"type": "train", "time": 1.5 * i, "step": 10 * i, "frames": 2560 * i,
                      "xent": 3.0 - 2 * acc, "acc": acc})
        lines.append({"type": "eval", "time": 1.5 * i + 0.1, "step": 10 * i,
                      "frames": 2560 * i, "dev_xent": 3.2 - 2 * acc, "dev_acc": acc - 0.02,
                      "dev_frames": 1000})
    lines.append({"type": "end", "time": 9.0, "steps": 10 * steps, "frames": 2560 * steps,
                  "dev_acc": acc_at_end - 0.02, "dev_xent": 3.2 - 2 * acc_at_end})
    with open(os.path.join(run_dir, "metrics.jsonl"), "w", encoding="utf-8") as fh:
        fh.write("\n".join(json.dumps(line) for line in lines) + "\n")


def resume_without_a_checkpoint_is_advised(main, argv, run, capsys, nothing: str) -> None:
    """``--resume`` in an empty run directory ends with ``nothing`` (no checkpoint, start
    without --resume); with a run begun and stopped before its first checkpoint
    (config.yaml and metrics.jsonl there), one line names --overwrite."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(nothing), err
    (run / "config.yaml").write_text("data: {}\n")
    (run / "metrics.jsonl").write_text("")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(run) in err, err
    assert err.endswith("start it afresh with --overwrite"), err


def records(run_dir, kind):
    """The ``kind`` records of a run's metrics.jsonl, in order."""
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as fh:
        return [r for r in map(json.loads, fh) if r["type"] == kind]


def mpi_output(result):
    """The tail of an mpiexec run's output, for assertion messages."""
    stderr = getattr(result, "full_stderr", result.stderr)      # (with the launcher's reports)
    return f"--- stdout ---\n{result.stdout[-6000:]}\n--- stderr ---\n{stderr[-6000:]}"


def train_on_ranks(nranks, run_dir, corpus, settings=(), *, resume=False, timeout=120):
    """`mpiexec -n nranks python -m mpitrain train quickstart.yaml` on ``corpus``;
    ``settings`` ("key=value") override the small-corpus defaults."""
    from mpitrain.testing.mpirun import run_mpi
    values = {"data.train": os.path.join(corpus, "train"), "data.dev": os.path.join(corpus, "dev"),
              "data.chunk_frames": 20000, "training.log_interval": 50}
    values.update(item.split("=", 1) for item in settings)
    args = ["-m", "mpitrain", "train", QUICKSTART, "--run-dir", str(run_dir)]
    for key, value in values.items():
        args += ["--set", f"{key}={value}"]
    if resume:
        args.append("--resume")
    return run_mpi(nranks, args, timeout=timeout)


def without_module(monkeypatch, prefix: str) -> None:
    """Make ``import prefix...`` fail for the rest of the test, as when the package is
    not installed."""
    import builtins
    real_import = builtins.__import__

    def refusing(name, *args, **kwargs):
        if name == prefix or name.startswith(prefix + "."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", refusing)


def locale_env(tmp_path, encoding: str) -> dict:
    """Environment of a child ``python -m mpitrain`` (or ``-c``) under a locale that
    is not UTF-8: ``"ascii"`` (LC_ALL=C with Python's UTF-8 mode off) or
    ``"latin-1"`` (en_US.ISO-8859-1, compiled under ``tmp_path`` by localedef; the
    test is skipped where it cannot be)."""
    import subprocess
    import pytest
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LC_", "LANG"))}
    env.pop("PYTHONIOENCODING", None)
    env.update(PYTHONUTF8="0", PYTHONPATH=str(REPO), OPENBLAS_NUM_THREADS="1")
    if encoding == "ascii":
        return dict(env, LC_ALL="C")
    where = tmp_path / "locales"
    where.mkdir(exist_ok=True)
    try:
        made = subprocess.run(["localedef", "-i", "en_US", "-f", "ISO-8859-1",
                               str(where / "en_US.ISO-8859-1")], capture_output=True,
                              timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        made = False
    if not made:
        pytest.skip("no Latin-1 locale: localedef cannot compile en_US.ISO-8859-1 here")
    return dict(env, LOCPATH=str(where), LC_ALL="en_US.ISO-8859-1")


def drain_queued_steps_at_the_read(monkeypatch, trainer_class, seconds: float) -> None:
    """Make each read of a window's sums by ``trainer_class``'s training steps take
    ``seconds`` of simulated time first: on a GPU a window's steps are queued, and
    that read waits for them (virtual ranks only: the communicator's clock)."""
    real = trainer_class._new_training_step

    def queued(self):
        step = real(self)
        take = step.take_sums

        def drained():
            self.comm.advance(seconds)
            return take()
        step.take_sums = drained
        return step

    monkeypatch.setattr(trainer_class, "_new_training_step", queued)
