"""Run directories are never mixed, and nothing is written before a run is valid.

Each case runs ``mpitrain train`` in this process on the small corpus with a
tiny model and checks the exit status, that the one-line message names the
run directory (or checkpoint) and the setting, and that no file was written
or changed when the run was refused.
"""

import hashlib
import json
import os
import re

import numpy as np
import pytest

from mpitrain.cli import main
from mpitrain.train.checkpoint import list_checkpoints

from ..helpers import QUICKSTART, small_overrides

TINY = ["model.hidden_dim=32", "model.hidden_layers=2", "training.log_interval=5",
        "training.max_steps=20", "training.checkpoint_interval=10"]


def _train(run_dir, corpus, settings=(), flags=()):
    argv = ["train", QUICKSTART, "--run-dir", str(run_dir), *flags]
    for item in small_overrides(corpus) + TINY + list(settings):
        argv += ["--set", item]
    return main(argv)


def _snapshot(directory):
    """Every file's name and content digest, to prove nothing changed."""
    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, directory)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def _one_line(err):
    assert err.startswith("mpitrain train: ") and err.count("\n") == 1, err
    return err


@pytest.fixture
def finished_run(small_corpus, tmp_path_factory):
    run = tmp_path_factory.mktemp("runs") / "run"
    assert _train(run, small_corpus) == 0
    return run


def test_reusing_a_run_directory_is_refused_and_changes_nothing(finished_run, small_corpus,
                                                                capsys):
    before = _snapshot(finished_run)
    capsys.readouterr()
    assert _train(finished_run, small_corpus) == 2
    err = _one_line(capsys.readouterr().err)
    assert str(finished_run) in err and "--resume" in err and "--overwrite" in err
    assert _snapshot(finished_run) == before


def test_a_run_written_after_a_new_run_checked_its_directory_is_kept(finished_run, small_corpus,
                                                                     tmp_path, monkeypatch,
                                                                     capsys):
    # two jobs started on one new directory, the first of them short: it ended before
    # the second, which had found the directory empty, took the lock; the second
    # then wrote over the first's run (config.yaml, metrics.jsonl, checkpoints, final.h5)
    import shutil
    from mpitrain.train.run_dir import RunDirLock
    run = tmp_path / "run"
    real = RunDirLock.acquire

    def the_other_job_ran_meanwhile(self):
        for name in os.listdir(finished_run):
            shutil.copy(finished_run / name, run / name)
        return real(self)

    monkeypatch.setattr(RunDirLock, "acquire", the_other_job_ran_meanwhile)
    capsys.readouterr()
    assert _train(run, small_corpus, ["training.seed=7"]) == 2
    err = _one_line(capsys.readouterr().err)
    assert f"{run}: holds another run" in err, err
    assert _snapshot(run) == _snapshot(finished_run)


def test_overwrite_replaces_the_previous_run(finished_run, small_corpus, capsys):
    (finished_run / "ckpt-00099999.h5").write_bytes(b"from an older run")
    (finished_run / "notes.txt").write_text("the user's own file")
    assert _train(finished_run, small_corpus, ["training.max_steps=15"],
                  flags=["--overwrite"]) == 0
    assert "removed the previous run's" in capsys.readouterr().out
    assert [os.path.basename(p) for p in list_checkpoints(finished_run)] == \
        ["ckpt-00000010.h5", "ckpt-00000015.h5"]
    with open(finished_run / "metrics.jsonl") as fh:
        starts = [r for r in map(json.loads, fh) if r["type"] == "start"]
    assert len(starts) == 1                      # the old run's log is gone
    assert (finished_run / "notes.txt").read_text() == "the user's own file"


def test_resume_with_a_changed_learning_rate_is_refused_before_writing(finished_run,
                                                                       small_corpus, capsys):
    before = _snapshot(finished_run)
    capsys.readouterr()
    code = _train(finished_run, small_corpus, ["optimizer.initial_learning_rate=0.01",
                                               "training.minibatch=128",
                                               "training.max_steps=30"], flags=["--resume"])
    assert code == 2
    err = _one_line(capsys.readouterr().err)
    assert "ckpt-00000020.h5" in err and "--accept-changes" in err
    assert "optimizer.initial_learning_rate: 0.004 -> 0.01" in err
    assert "training.minibatch: 256 -> 128" in err
    assert "max_steps" not in err                     # extending a run changes no result
    assert _snapshot(finished_run) == before


def test_accept_changes_applies_and_logs_them(finished_run, small_corpus, capsys):
    assert _train(finished_run, small_corpus, ["optimizer.initial_learning_rate=0.001",
                                               "training.max_steps=30"],
                  flags=["--resume", "--accept-changes"]) == 0
    assert "settings changed (--accept-changes): optimizer.initial_learning_rate" in \
        capsys.readouterr().out
    with open(finished_run / "metrics.jsonl") as fh:
        records = list(map(json.loads, fh))
    change, = [r for r in records if r["type"] == "config_change"]
    assert change["changes"] == ["optimizer.initial_learning_rate: 0.004 -> 0.001"]
    assert "initial_learning_rate: 0.001" in (finished_run / "config.yaml").read_text()


def test_a_failed_start_leaves_no_run_directory(small_corpus, tmp_path, capsys):
    run = tmp_path / "run"
    code = _train(run, small_corpus, ["data.dev=" + str(tmp_path / "no-such-corpus")])
    assert code == 2
    err = _one_line(capsys.readouterr().err)
    assert "no-such-corpus" in err
    assert not run.exists()


def test_a_full_disk_at_the_lock_file_names_it_and_leaves_no_run_directory(small_corpus,
                                                                            tmp_path):
    # the lock file's pid line was the first write of a run; on a full disk (here a
    # file size limit of 0, which fails every write alike) the error named no file,
    # "[Errno 28] No space left on device", and the new directory stayed
    import subprocess
    import sys
    run = tmp_path / "run"
    argv = ["train", QUICKSTART, "--run-dir", str(run)]
    for item in small_overrides(small_corpus) + TINY:
        argv += ["--set", item]
    code = ("import resource, sys\n"
            "from mpitrain.cli import main\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))\n"
            "sys.exit(main(sys.argv[1:]))\n")
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, out.stderr
    assert _one_line(out.stderr) == (f"mpitrain train: error: cannot write {run}/.lock: "
                                     "File too large\n")
    assert not run.exists()


def test_a_full_disk_at_config_yaml_leaves_no_run_directory(small_corpus, tmp_path, capsys,
                                                            monkeypatch):
    from mpitrain.files import DiskFullError
    from mpitrain.train import run_dir as run_dir_module
    run = tmp_path / "run"

    def full(cfg, path):
        raise DiskFullError(28, f"no space left on device writing {path}")

    monkeypatch.setattr(run_dir_module, "dump_config", full)
    assert _train(run, small_corpus) == 2
    assert _one_line(capsys.readouterr().err).endswith(
        f"no space left on device writing {run}/config.yaml\n")
    assert not run.exists()
    kept = tmp_path / "kept"            # a directory that was there stays, with its files
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    assert _train(kept, small_corpus) == 2
    assert (kept / "notes.txt").read_text() == "mine"


def test_resume_without_a_run_directory_or_checkpoint(small_corpus, tmp_path, capsys):
    assert _train(tmp_path / "nothing", small_corpus, flags=["--resume"]) == 2
    assert "does not exist" in _one_line(capsys.readouterr().err)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _train(empty, small_corpus, flags=["--resume"]) == 2
    assert "no checkpoint" in _one_line(capsys.readouterr().err)
    assert os.listdir(empty) == []


def test_a_run_directory_that_is_a_file(small_corpus, tmp_path, capsys):
    run = tmp_path / "run"
    run.write_text("not a directory")
    assert _train(run, small_corpus) == 2
    assert "not a directory" in _one_line(capsys.readouterr().err)
    assert run.read_text() == "not a directory"


def test_resume_and_overwrite_together_are_refused(finished_run, small_corpus, capsys):
    before = _snapshot(finished_run)
    capsys.readouterr()
    assert _train(finished_run, small_corpus, flags=["--resume", "--overwrite"]) == 2
    assert "exclude each other" in _one_line(capsys.readouterr().err)
    assert _snapshot(finished_run) == before


@pytest.mark.parametrize("change,part", [
    ("parallel.method=bmuf", "the parallel method's state"),
    ("optimizer.name=ngsgd", "the optimizer state"),
    ("optimizer.momentum=0.5", "the optimizer state"),
    ("optimizer.schedule=newbob", "the rate schedule"),
])
def test_accepted_changes_whose_saved_state_does_not_fit_start_that_part_afresh(
        finished_run, small_corpus, capsys, change, part):
    assert _train(finished_run, small_corpus, [change, "training.max_steps=30"],
                  flags=["--resume", "--accept-changes"]) == 0
    out = capsys.readouterr().out
    assert f"resume: {part} starts afresh" in out
    with open(finished_run / "metrics.jsonl") as fh:
        ends = [r for r in map(json.loads, fh) if r["type"] == "end"]
    assert ends[-1]["steps"] == 30 and ends[-1]["dev_xent"] < 6.0   # trained on, no blow-up


@pytest.mark.parametrize("settings", [
    ["parallel.method=bmuf", "parallel.average_every=8"],     # 20 steps: not a block end
    ["training.combine=true"],
    ["training.early_stop.patience=1", "training.early_stop.min_delta=0.5",
     "training.eval_interval=1280", "training.max_steps=200"],
], ids=["bmuf", "combine", "early-stop"])
def test_resuming_a_run_that_had_ended_leaves_its_results_alone(small_corpus, tmp_path, capsys,
                                                                settings):
    run = tmp_path / "run"
    assert _train(run, small_corpus, settings) == 0
    results = {name: (run / name).read_bytes() for name in ("final.h5", "best.h5")}
    ends = len([line for line in (run / "metrics.jsonl").read_text().splitlines()
                if '"type": "end"' in line])
    capsys.readouterr()
    assert _train(run, small_corpus, settings, flags=["--resume"]) == 0
    out = capsys.readouterr().out
    assert "the run had ended at step" in out
    # more epochs change the result: the line says they need --accept-changes
    assert "early_stop" in str(settings) or out.rstrip("\n").endswith("; nothing to train (raise training.epochs "
                                      "(--accept-changes) or training.max_steps to go on)")
    assert {name: (run / name).read_bytes() for name in results} == results
    # a final model lost after the final checkpoint is written again, the same
    (run / "final.h5").unlink()
    assert _train(run, small_corpus, settings, flags=["--resume"]) == 0
    from mpitrain.nn.model_file import load_model
    import numpy as np
    again, _ = load_model(run / "final.h5")
    (run / "lost.h5").write_bytes(results["final.h5"])
    before, _ = load_model(run / "lost.h5")
    assert np.array_equal(again.params, before.params)
    assert ends == 1


@pytest.mark.parametrize("settings, why", [
    # stops at step 10 of a cap of 20
    (["training.early_stop.patience=1", "training.early_stop.min_delta=0.5",
      "training.eval_interval=1280"], "training.early_stop had stopped it"),
    # stops after 3 of 4 epochs (630 steps), under a cap of 700
    (["optimizer.schedule=newbob", "optimizer.newbob_start_halving=1",
      "optimizer.newbob_stop=1", "training.epochs=4", "training.max_steps=700"],
     "the newbob schedule had stopped it"),
], ids=["early-stop", "newbob"])
def test_a_run_that_stopped_early_under_max_steps_stays_ended_when_it_is_raised(
        small_corpus, tmp_path, capsys, settings, why):
    """A run that stopped at a held-out evaluation before its training.max_steps
    ended there: raising the cap on --resume trains nothing (it trained on past
    the early stop, as if the cap had ended the run)."""
    run = tmp_path / "run"
    assert _train(run, small_corpus, settings) == 0
    stopped_at = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
                  if r["type"] == "end"][-1]["steps"]
    before = {name: (run / name).read_bytes() for name in ("final.h5", "best.h5")}
    capsys.readouterr()
    assert _train(run, small_corpus, settings + ["training.max_steps=0"],
                  flags=["--resume"]) == 0
    out = capsys.readouterr().out
    assert f"the run had ended at step {stopped_at}; nothing to train ({why}" in out
    assert {name: (run / name).read_bytes() for name in before} == before
    ends = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if r["type"] == "end"]
    assert len(ends) == 1


def test_pretraining_settings_are_no_change_to_a_resumed_training(finished_run, small_corpus,
                                                                  capsys):
    """train never reads the pretrain section: a config shared with `pretrain` whose
    pretraining settings changed since resumes (it was refused as a changed setting)."""
    capsys.readouterr()
    assert _train(finished_run, small_corpus, ["pretrain.minibatch=10",
                                               "pretrain.learning_rate=0.1"],
                  flags=["--resume"]) == 0
    assert "the run had ended at step" in capsys.readouterr().out


def test_a_run_that_had_ended_goes_on_when_asked_for_more_steps(finished_run, small_corpus,
                                                               capsys):
    capsys.readouterr()
    assert _train(finished_run, small_corpus, ["training.max_steps=30"],
                  flags=["--resume"]) == 0
    assert "the run had ended" not in capsys.readouterr().out
    with open(finished_run / "metrics.jsonl") as fh:
        ends = [r for r in map(json.loads, fh) if r["type"] == "end"]
    assert ends[-1]["steps"] == 30


def test_resume_compares_corpora_by_the_directory_their_paths_name(small_corpus, tmp_path,
                                                                  monkeypatch, capsys):
    import shutil
    here, there = tmp_path / "here", tmp_path / "there"
    for base in (here, there):
        base.mkdir()
    shutil.copytree(small_corpus, here / "corpus")
    from mpitrain.data.synthetic import synthesize
    synthesize(str(there / "corpus"), hours=0.02, speakers=4, shards=1, dev_hours=0.01,
               dev_speakers=2, seed=9)
    run = tmp_path / "run"
    relative = ["data.train=corpus/train", "data.dev=corpus/dev"]
    monkeypatch.chdir(here)
    assert _train(run, small_corpus, relative) == 0
    capsys.readouterr()
    # the same relative path from another directory names another corpus: refused
    monkeypatch.chdir(there)
    assert _train(run, small_corpus, relative + ["training.max_steps=30"],
                  flags=["--resume"]) == 2
    err = capsys.readouterr().err
    assert "data.train: 'corpus/train' (that is" in err and str(there) in err, err
    # the same corpus spelt as an absolute path is the same run
    absolute = [f"data.train={here / 'corpus' / 'train'}", f"data.dev={here / 'corpus' / 'dev'}"]
    assert _train(run, small_corpus, absolute + ["training.max_steps=30"],
                  flags=["--resume"]) == 0


def test_a_corpus_copied_elsewhere_resumes_as_the_same_corpus(small_corpus, tmp_path, capsys):
    # a requeued job staging its corpus to another disk: the same shards, frames,
    # classes and dimension at another place are the corpus the run trained on
    import shutil
    first, second = tmp_path / "scratch1" / "corpus", tmp_path / "scratch2" / "corpus"
    shutil.copytree(small_corpus, first)
    run = tmp_path / "run"
    assert _train(run, small_corpus, [f"data.train={first / 'train'}",
                                      f"data.dev={first / 'dev'}"]) == 0
    shutil.move(str(first), str(second))
    capsys.readouterr()
    assert _train(run, small_corpus, [f"data.train={second / 'train'}",
                                      f"data.dev={second / 'dev'}", "training.max_steps=30"],
                  flags=["--resume"]) == 0
    out = capsys.readouterr().out
    assert f"resume: data.train: the corpus this run trained on, moved from " \
           f"{first / 'train'} to {second / 'train'}" in out, out
    # another corpus written at the new place (where the newest checkpoint's
    # corpus was) is another corpus
    from mpitrain.data.synthetic import synthesize
    shutil.rmtree(second)
    synthesize(str(second), hours=0.02, speakers=4, shards=1, dev_hours=0.01, dev_speakers=2,
               seed=9)
    assert _train(run, small_corpus, [f"data.train={second / 'train'}",
                                      f"data.dev={second / 'dev'}", "training.max_steps=40"],
                  flags=["--resume"]) == 2
    err = capsys.readouterr().err
    assert "data.train: the corpus was written again since the checkpoint" in err, err


@pytest.mark.parametrize("change", ["labels", "features"])
def test_a_corpus_written_again_with_the_same_sizes_is_noticed_on_resume(tmp_path, capsys,
                                                                         change):
    # new alignments (or features of another front end) for the same utterances:
    # the same shards, frames and utterances, other frames per class (or other
    # feature statistics)
    from mpitrain.data.writer import CorpusWriter
    rng = np.random.default_rng(4)
    utterances = [(f"utt{i:03d}", rng.normal(size=(int(rng.integers(80, 160)), 40)),
                   int(rng.integers(0, 12))) for i in range(80)]

    def write(relabel, scale):
        with CorpusWriter(str(tmp_path / "corpus"), feat_dim=40, num_classes=12,
                          num_shards=2, overwrite=True) as writer:
            for utt_id, feats, label in utterances:
                labels = np.full(len(feats), (label + relabel) % 12)
                writer.add(utt_id, (feats * scale).astype(np.float32), labels)
    write(0, 1.0)
    corpus = [f"data.train={tmp_path / 'corpus'}", "data.dev=", "model.hidden_dim=16"]
    run = tmp_path / "run"
    assert _train(run, str(tmp_path), corpus) == 0
    write(1, 1.0) if change == "labels" else write(0, 1.5)
    capsys.readouterr()
    assert _train(run, str(tmp_path), corpus + ["training.max_steps=30"],
                  flags=["--resume"]) == 2
    err = capsys.readouterr().err
    assert "data.train: the corpus was written again since the checkpoint (the same shards " \
           "and sizes, other labels or features: the frames per class or the features' " \
           "mean and variance differ)" in err, err


@pytest.mark.parametrize("code", ["ENOLCK", "ENOSYS", "EOPNOTSUPP"])
def test_a_filesystem_that_cannot_lock_trains_unguarded_and_says_so(small_corpus, tmp_path,
                                                                     capsys, monkeypatch, code):
    # Lustre mounted without flock, an NFS without its lock daemon: the run is not
    # refused as if another held the directory
    import errno
    import fcntl

    def no_locks(fd, operation):
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))
    monkeypatch.setattr(fcntl, "flock", no_locks)
    run = tmp_path / "run"
    assert _train(run, small_corpus) == 0
    out = capsys.readouterr().out
    assert f"{run}: this filesystem does not lock files ({os.strerror(getattr(errno, code))}" \
        "); a second job started on this run directory would not be noticed" in out, out
    assert (run / "final.h5").exists()


def test_a_second_run_on_a_directory_in_use_is_refused(finished_run, small_corpus, capsys):
    from mpitrain.train.run_dir import RunDirLock
    holder = RunDirLock(str(finished_run))
    assert holder.acquire() is None          # as a run still going would hold it
    before = _snapshot(finished_run)
    try:
        for flags in (["--resume"], ["--overwrite"]):
            assert _train(finished_run, small_corpus, ["training.max_steps=30"],
                          flags=flags) == 2
            err = capsys.readouterr().err
            assert "another run is using this directory (pid" in err, err
        assert _snapshot(finished_run) == before
    finally:
        holder.release()
    assert _train(finished_run, small_corpus, ["training.max_steps=30"],
                  flags=["--resume"]) == 0


def test_a_directory_in_use_is_said_before_its_files_or_checkpoint_are_judged(
        finished_run, small_corpus, capsys):
    """A resume with changed settings into a directory another run holds was refused
    for the settings (and, once they were accepted, for the lock); a new run there
    was told to --resume it."""
    from mpitrain.train.run_dir import RunDirLock
    holder = RunDirLock(str(finished_run))
    assert holder.acquire() is None
    before = _snapshot(finished_run)
    capsys.readouterr()
    try:
        for settings, flags in ((["optimizer.initial_learning_rate=0.01"], ["--resume"]),
                                (["model.hidden_dim=16"], ["--resume", "--dry-run"]),
                                (["training.seed=3"], ["--resume", "--virtual", "2"]),
                                ([], [])):
            assert _train(finished_run, small_corpus, settings, flags=flags) == 2
            err = _one_line(capsys.readouterr().err)
            assert f"{finished_run}: another run is using this directory (pid {os.getpid()} " \
                   f"on {os.uname().nodename} since " in err, (flags, err)
        assert _snapshot(finished_run) == before
    finally:
        holder.release()


def test_a_run_killed_holding_the_lock_is_taken_over_with_a_note(finished_run, small_corpus,
                                                                 capsys):
    from ..train.test_run_dir import _killed_holder
    pid = _killed_holder(finished_run)
    capsys.readouterr()
    assert _train(finished_run, small_corpus, ["training.max_steps=30"],
                  flags=["--resume"]) == 0
    out = capsys.readouterr().out
    assert f"took over the lock of pid {pid} on {os.uname().nodename} since " in out, out
    assert (finished_run / ".lock").read_text() == ""        # released


def test_accept_changes_on_a_new_run_says_there_is_nothing_to_compare(small_corpus, tmp_path,
                                                                      capsys):
    """--accept-changes without --resume was dropped without a word; it is not refused
    either: a batch script passes the same options to a job's first start and to its
    requeues, which add --resume once there is a checkpoint."""
    from mpitrain.train.run_dir import ACCEPT_CHANGES_NEW_RUN
    run = tmp_path / "run"
    for flags in (["--accept-changes", "--dry-run"], ["--accept-changes"],
                  ["--accept-changes", "--overwrite"]):
        assert _train(run, small_corpus, flags=flags) == 0, flags
        out = capsys.readouterr().out
        assert out.count(ACCEPT_CHANGES_NEW_RUN) == 1, (flags, out)
    assert _train(run, small_corpus, ["training.max_steps=30"], flags=["--resume"]) == 0
    assert ACCEPT_CHANGES_NEW_RUN not in capsys.readouterr().out


def test_a_lock_file_that_is_a_symbolic_link_is_never_written_through(small_corpus, tmp_path,
                                                                       capsys):
    """Taking the lock wrote its pid line into whatever a .lock link named (a file
    of the user's anywhere), truncating it."""
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me\n", encoding="utf-8")
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(precious, run / ".lock")
    assert _train(run, small_corpus) == 2
    err = _one_line(capsys.readouterr().err)
    assert f"{run / '.lock'}: the run's lock file is a symbolic link (to {precious})" in err, err
    assert precious.read_text(encoding="utf-8") == "keep me\n"
    assert sorted(os.listdir(run)) == [".lock"]


def test_a_dry_run_checks_and_plans_but_trains_and_writes_nothing(small_corpus, tmp_path,
                                                                   capsys):
    run = tmp_path / "run"
    assert _train(run, small_corpus, flags=["--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("mpitrain: 1 rank(s), device cpu, strategy model_averaging") \
        and out[0].endswith(", 20 steps"), out
    assert out[-1] == ("dry run: the configuration, the corpus and the plan hold (a run "
                       f"would start as above); nothing was trained or written ({run})")
    assert not run.exists()
    # with --resume it reads and judges the checkpoint, and still writes nothing
    assert _train(run, small_corpus) == 0
    before = _snapshot(run)
    capsys.readouterr()
    assert _train(run, small_corpus, ["training.max_steps=30"],
                  flags=["--resume", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"resumed from {run}/ckpt-00000020.h5 at step 20" in out and ", 30 steps" in out, out
    assert _train(run, small_corpus, ["training.max_steps=30", "model.hidden_dim=24"],
                  flags=["--resume", "--dry-run"]) == 2
    assert "model.hidden_dim: 32 -> 24" in capsys.readouterr().err
    assert _snapshot(run) == before


def test_a_virtual_dry_run_gives_the_plan_of_that_many_ranks(small_corpus, tmp_path, capsys):
    run = tmp_path / "run"
    assert _train(run, small_corpus, flags=["--virtual", "4", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "mpitrain: 4 rank(s), device cpu" in out and "dry run: " in out, out
    assert not run.exists()
    # a plan that cannot work at that size is refused as the run would be
    assert _train(run, small_corpus, ["training.minibatch=30000"],
                  flags=["--virtual", "4", "--dry-run"]) == 2
    assert "has no complete minibatch of 30000 frames" in capsys.readouterr().err


def test_the_plan_of_an_asynchronous_method_says_whose_steps_it_counts(small_corpus, tmp_path,
                                                                     capsys):
    # a parameter server counted its clients' steps together "per rank"
    run = tmp_path / "run"
    assert _train(run, small_corpus, ["parallel.method=param_server"],
                  flags=["--virtual", "3", "--dry-run"]) == 0
    plan = capsys.readouterr().out.splitlines()[0]
    lock_step = re.search(r"; (\d+) steps/epoch of (\d+) frames per rank, (\d+) steps$", plan)
    assert lock_step is None, plan
    found = re.search(r"; (\d+) updates/epoch from 2 client\(s\) \((\d+)(?:-(\d+))? "
                      r"steps/epoch of \d+ frames each\), (\d+) updates$", plan)
    assert found, plan
    total, low, high = int(found[1]), int(found[2]), int(found[3] or found[2])
    assert low + high == total
    # asynchronous ADPSGD: each rank's own steps, and the budget of all ranks together
    assert _train(run, small_corpus, ["parallel.method=adpsgd", "parallel.asynchronous=true"],
                  flags=["--virtual", "3", "--dry-run"]) == 0
    plan = capsys.readouterr().out.splitlines()[0]
    assert re.search(r"; \d+(-\d+)? steps/epoch of \d+ frames per rank, \d+ steps of all "
                     r"ranks together \(about \d+ per rank\)$", plan), plan


@pytest.mark.parametrize("field,value,said", [
    ("chunk_pos", 10 ** 6, "field 'chunk_pos': 1000000 is out of range"),
    # (a KeyError traceback)
    ("steps_in_epoch", None, "field 'steps_in_epoch' is missing")])
def test_a_checkpoint_whose_reader_position_does_not_exist_is_refused(small_corpus, tmp_path,
                                                                       capsys, field, value,
                                                                       said):
    """A reader position past the rank's chunks, or without one of its fields (a
    damaged or hand-edited checkpoint, its checksum made to match): one line naming
    the file and the field."""
    import h5py

    from mpitrain.h5io import write_checksums
    run = tmp_path / "run"
    assert _train(run, small_corpus, ["training.max_steps=10"]) == 0
    ckpt = list_checkpoints(str(run))[-1]
    with h5py.File(ckpt, "r+") as f:
        if value is None:
            del f["ranks/00000/reader"].attrs[field]
        else:
            f["ranks/00000/reader"].attrs[field] = value
        write_checksums(f, ckpt, what="checkpoint")
    before = _snapshot(run)
    capsys.readouterr()
    assert _train(run, small_corpus, flags=["--resume"]) == 2
    err = _one_line(capsys.readouterr().err)
    assert f"{ckpt}: ranks/00000/reader: {said}" in err
    assert _snapshot(run) == before


@pytest.mark.parametrize("field,value", [("lr_scale", -1.0), ("exploded_total", -2)])
def test_a_checkpoint_whose_divergence_state_is_crafted_is_named_by_file_and_field(
        small_corpus, tmp_path, capsys, field, value):
    """The 'trainer' group's divergence counts out of range (its checksum made to
    match): one line naming the checkpoint and the field (it named no file and
    printed the whole group)."""
    import h5py

    from mpitrain.h5io import write_checksums
    run = tmp_path / "run"
    assert _train(run, small_corpus, ["training.max_steps=10"]) == 0
    ckpt = list_checkpoints(str(run))[-1]
    with h5py.File(ckpt, "r+") as f:
        f["trainer"].attrs[field] = value
        write_checksums(f, ckpt, what="checkpoint")
    before = _snapshot(run)
    capsys.readouterr()
    assert _train(run, small_corpus, ["training.max_steps=20"], flags=["--resume"]) == 2
    err = _one_line(capsys.readouterr().err)
    assert f"{ckpt}: checkpoint group 'trainer': field '{field}': expected " in err, err
    assert "corpus_data" not in err, err
    assert _snapshot(run) == before


def test_an_early_stopped_run_goes_on_as_its_resume_line_says(small_corpus, tmp_path, capsys):
    """The resume line of a run that early stopping ended said to raise
    training.epochs, which trained to the next evaluation and stopped there again
    (the count of evaluations without a gain is kept); more patience goes on."""
    run = tmp_path / "run"
    settings = ["training.early_stop.patience=1", "training.early_stop.min_delta=0.5",
                "training.eval_interval=1280"]
    assert _train(run, small_corpus, settings) == 0             # stops at step 10 of 20
    capsys.readouterr()
    assert _train(run, small_corpus, settings + ["training.max_steps=0"],
                  flags=["--resume"]) == 0
    advice = capsys.readouterr().out.split("nothing to train (")[1]
    assert "raise training.early_stop.patience (--accept-changes) to go on" in advice, advice
    assert _train(run, small_corpus, settings[1:] + ["training.early_stop.patience=100"],
                  flags=["--resume", "--accept-changes"]) == 0
    ends = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if r["type"] == "end"]
    assert ends[-1]["steps"] == 20, ends


def test_a_start_refused_by_a_job_that_made_the_run_directory_meanwhile_leaves_it_alone(
        tmp_path, monkeypatch):
    # two jobs started on one new run directory: the second found no directory, the
    # first made and locked it before the second's makedirs.  The second, refused,
    # took the directory for one it made itself and removed the first job's lock
    # file, then the directory: the first trained on unguarded, then failed at its
    # config.yaml
    from mpitrain.comm.single import SingleCommunicator
    from mpitrain.config import RunConfig
    from mpitrain.train import run_dir as run_dir_module
    from mpitrain.train.errors import TrainingError
    run = tmp_path / "run"
    first, _ = run_dir_module.take_run_dir(SingleCommunicator(), str(run), RunConfig(),
                                           resume=False, overwrite=False)
    (run / "config.yaml").unlink()      # the first job, between its lock and its config
    real = os.path.lexists
    monkeypatch.setattr(run_dir_module.os.path, "lexists",
                        lambda p: False if os.fspath(p) == str(run) else real(p))
    with pytest.raises(TrainingError, match="another run is using this directory"):
        run_dir_module.take_run_dir(SingleCommunicator(), str(run), RunConfig(),
                                    resume=False, overwrite=False)
    monkeypatch.undo()
    assert sorted(os.listdir(run)) == [".lock"]
    assert first.moved() is None
    first.release()
