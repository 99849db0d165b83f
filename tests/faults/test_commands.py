"""Every command answers bad input with one line, exit status 2, and no output left.

Each case runs the command through ``mpitrain.cli.main`` in this process and
checks the exit status, that stderr is one line prefixed with the command and
naming the file, and that nothing was written (or that what existed is
unchanged).  An unexpected internal error is reported as a bug, with its
traceback.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

from mpitrain import cli
from mpitrain.cli import main

from ..helpers import QUICKSTART, small_overrides


def _one_line(capsys, command):
    err = capsys.readouterr().err
    assert err.startswith(f"mpitrain {command}: ") and err.count("\n") == 1, err
    return err


@pytest.fixture(scope="module")
def model(small_corpus, tmp_path_factory):
    """A trained model file (a few steps of a tiny network)."""
    run = tmp_path_factory.mktemp("model") / "run"
    argv = ["train", QUICKSTART, "--run-dir", str(run)]
    for item in small_overrides(small_corpus) + ["model.hidden_dim=16", "model.hidden_layers=1",
                                                 "training.max_steps=5"]:
        argv += ["--set", item]
    assert main(argv) == 0
    return run / "final.h5"


@pytest.fixture
def feats_scp(tmp_path):
    import kaldiio
    rng = np.random.default_rng(0)
    kaldiio.save_ark(str(tmp_path / "feats.ark"),
                     {f"u{i}": rng.standard_normal((30, 40)).astype(np.float32)
                      for i in range(3)}, scp=str(tmp_path / "feats.scp"))
    return f"scp:{tmp_path / 'feats.scp'}"


# -- train: the configuration file ------------------------------------------------------

@pytest.mark.parametrize("make,message", [
    (lambda p: p.mkdir(), "is a directory"),
    (lambda p: p.write_text("- a\n- b\n"), "top level"),
    (lambda p: p.write_bytes(b"training:\n  seed: \xff\xfe\n"), "UTF-8"),
    (lambda p: None, "not found"),
], ids=["directory", "list", "not-utf8", "missing"])
def test_config_that_is_not_a_mapping_file(tmp_path, capsys, make, message):
    path = tmp_path / "run.yaml"
    make(path)
    assert main(["train", str(path), "--run-dir", str(tmp_path / "run")]) == 2
    err = _one_line(capsys, "train")
    assert str(path) in err and message in err
    assert not (tmp_path / "run").exists()


def test_set_without_equals_sign(tmp_path, capsys):
    assert main(["train", QUICKSTART, "--set", "training.seed", "--run-dir",
                 str(tmp_path / "run")]) == 2
    assert "training.seed" in _one_line(capsys, "train")
    assert not (tmp_path / "run").exists()


# -- export --------------------------------------------------------------------------------

@pytest.mark.parametrize("target", ["afile/x.ark", "nodir/x.ark"])
def test_export_to_a_place_that_cannot_be_written(model, feats_scp, tmp_path, capsys, target):
    (tmp_path / "afile").write_text("a file, not a directory")
    before = sorted(os.listdir(tmp_path))
    out = tmp_path / target
    assert main(["export", str(model), "--feats", feats_scp, "--out", f"ark:{out}"]) == 2
    err = _one_line(capsys, "export")
    assert f"cannot write {out}" in err
    assert sorted(os.listdir(tmp_path)) == before


def test_export_with_features_of_the_wrong_dimension_writes_nothing(model, tmp_path, capsys):
    import kaldiio
    kaldiio.save_ark(str(tmp_path / "f.ark"), {"u1": np.zeros((20, 13), np.float32)},
                     scp=str(tmp_path / "f.scp"))
    out = tmp_path / "out.ark"
    assert main(["export", str(model), "--feats", f"scp:{tmp_path / 'f.scp'}",
                 "--out", f"ark:{out}"]) == 2
    err = _one_line(capsys, "export")
    assert "u1" in err and "13" in err and "40" in err
    assert not out.exists() and not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


def test_export_of_a_missing_model(feats_scp, tmp_path, capsys):
    assert main(["export", str(tmp_path / "none.h5"), "--feats", feats_scp,
                 "--out", f"ark:{tmp_path / 'o.ark'}"]) == 2
    assert "none.h5" in _one_line(capsys, "export")
    assert not (tmp_path / "o.ark").exists()


def test_export_of_a_file_that_is_not_a_model(feats_scp, tmp_path, capsys):
    bogus = tmp_path / "model.h5"
    bogus.write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 100)
    assert main(["export", str(bogus), "--feats", feats_scp,
                 "--out", f"ark:{tmp_path / 'o.ark'}"]) == 2
    assert "model.h5" in _one_line(capsys, "export")


# -- prepare, eval, merge ---------------------------------------------------------------

def test_a_failed_prepare_leaves_no_directory(feats_scp, tmp_path, capsys):
    out = tmp_path / "corpus"
    assert main(["prepare", "--feats", feats_scp, "--ali", f"ark:{tmp_path / 'none.ark'}",
                 "--out", str(out)]) == 2
    assert "none.ark" in _one_line(capsys, "prepare")
    assert not out.exists()


_GOOD_UTTERANCE = "u1 [\n 1 2 3\n 4 5 6 ]\n"


@pytest.mark.parametrize("second, said", [
    ("u1 [\n 1 2 3 ]\n", "utterance 'u1' appears twice"),
    ("u2 [\n 1 2 ]\n", "utterance 'u2' has feature dimension 2, expected 3"),
    ("u2 [\n 1 nan 3 ]\n", "utterance 'u2' contains NaN or inf"),
    ("u2 [\n 1 inf 3 ]\n", "utterance 'u2' contains NaN or inf"),
], ids=["duplicate", "dimension", "nan", "inf"])
def test_prepare_refuses_a_bad_utterance_after_good_ones(tmp_path, capsys, second, said):
    """An utterance that would make a wrong corpus, found after the shards were
    begun: one line naming the file and the utterance, no corpus left."""
    (tmp_path / "feats.txt").write_text(_GOOD_UTTERANCE + second)
    (tmp_path / "ali.txt").write_text("u1 0 1\nu2 1\n")
    out = tmp_path / "corpus"
    assert main(["prepare", "--feats", f"ark,t:{tmp_path / 'feats.txt'}",
                 "--ali", f"ark,t:{tmp_path / 'ali.txt'}", "--out", str(out)]) == 2
    err = _one_line(capsys, "prepare")
    assert f"feats.txt: {said}" in err, err
    assert not out.exists()


def test_prepare_of_alignments_holding_none(feats_scp, tmp_path, capsys):
    (tmp_path / "ali.txt").write_text("")
    out = tmp_path / "corpus"
    assert main(["prepare", "--feats", feats_scp, "--ali", f"ark,t:{tmp_path / 'ali.txt'}",
                 "--out", str(out)]) == 2
    assert "ali.txt: no alignments found" in _one_line(capsys, "prepare")
    assert not out.exists()


def test_prepare_refuses_an_existing_corpus_without_overwrite(small_corpus, feats_scp,
                                                             tmp_path, capsys):
    import kaldiio
    kaldiio.save_ark(str(tmp_path / "ali.ark"),
                     {f"u{i}": np.zeros(30, dtype=np.int32) for i in range(3)})
    target = os.path.join(small_corpus, "dev")
    before = sorted(os.listdir(target))
    assert main(["prepare", "--feats", feats_scp, "--ali", f"ark:{tmp_path / 'ali.ark'}",
                 "--out", target]) == 2
    err = _one_line(capsys, "prepare")
    assert target in err
    assert sorted(os.listdir(target)) == before


def test_eval_of_a_missing_model_and_of_a_missing_corpus(model, small_corpus, tmp_path, capsys):
    assert main(["eval", str(tmp_path / "nope.h5"), os.path.join(small_corpus, "dev")]) == 2
    assert "nope.h5" in _one_line(capsys, "eval")
    assert main(["eval", str(model), str(tmp_path / "nocorpus")]) == 2
    assert "nocorpus" in _one_line(capsys, "eval")


def test_merge_of_a_part_that_is_not_a_corpus(tmp_path, capsys):
    (tmp_path / "out" / "part").mkdir(parents=True)
    assert main(["merge", str(tmp_path / "out"), str(tmp_path / "out" / "part")]) == 2
    assert "part" in _one_line(capsys, "merge")
    assert not (tmp_path / "out" / "corpus.yaml").exists()


@pytest.mark.parametrize("batch", ["0", "-5"])
def test_export_batch_below_one_is_refused(model, feats_scp, tmp_path, capsys, batch):
    assert main(["export", str(model), "--feats", feats_scp, "--out",
                 f"ark:{tmp_path / 'o.ark'}", "--batch", batch]) == 2
    assert "--batch" in _one_line(capsys, "export")
    assert not (tmp_path / "o.ark").exists()


@pytest.mark.parametrize("command,message", [
    ("| false", "the command failed with exit status 1"),
    ("| head -c 10 > /dev/null", "the command stopped reading before the archive ended"),
])
def test_an_output_command_that_stops_early_is_named(model, tmp_path, capsys, command,
                                                     message):
    import kaldiio
    rng = np.random.default_rng(1)
    # far more than a pipe holds, so the writer meets the closed pipe
    kaldiio.save_ark(str(tmp_path / "big.ark"),
                     {f"u{i}": rng.standard_normal((200, 40)).astype(np.float32)
                      for i in range(20)}, scp=str(tmp_path / "big.scp"))
    assert main(["export", str(model), "--feats", f"scp:{tmp_path / 'big.scp'}",
                 "--out", f"ark:{command}"]) == 2
    assert f"--out {command}: {message}" in _one_line(capsys, "export")


def test_eval_max_frames_below_zero_is_refused(model, small_corpus, capsys):
    assert main(["eval", str(model), os.path.join(small_corpus, "dev"),
                 "--max-frames", "-1"]) == 2
    assert "--max-frames" in _one_line(capsys, "eval")


def _damaged_copy(corpus_dir, out, damage):
    """A copy of a corpus whose first shard ``damage(h5file)`` changed in place."""
    import shutil

    import h5py
    shutil.copytree(corpus_dir, out)
    with h5py.File(os.path.join(out, "shard-00000.h5"), "r+") as f:
        damage(f)
    return str(out)


def _nan_frame(f):
    f["feats"][7, 3] = np.nan


def _label_beyond_the_classes(f):
    f["labels"][5] = 100_000


def _wider_features(f):
    feats = f["feats"][()]
    del f["feats"]
    f.create_dataset("feats", data=np.concatenate([feats, feats[:, :2]], axis=1))


@pytest.mark.parametrize("damage,message", [
    (_nan_frame, "dataset 'feats': 1 frame(s) contain NaN or inf, the first at frame 7"),
    (_label_beyond_the_classes, "dataset 'labels': 1 label(s) outside [0, "),
    (_wider_features, "dataset 'feats' has 42 columns; expected feat_dim = 40"),
], ids=["nan", "label", "width"])
def test_eval_refuses_bad_frames_naming_the_shard(model, small_corpus, tmp_path, capsys,
                                                  damage, message):
    # eval scored NaN features as 'xent nan' with exit status 0, failed on a label
    # beyond the model's classes with an IndexError, and on wider features with a
    # numpy broadcast error naming no file
    dev = _damaged_copy(os.path.join(small_corpus, "dev"), tmp_path / "dev", damage)
    assert main(["eval", str(model), dev]) == 2
    err = _one_line(capsys, "eval")
    assert os.path.join(dev, "shard-00000.h5") in err and message in err, err


def _normalised_per_speaker(corpus_dir, out):
    """A copy of a corpus whose manifest says prepare applied per-speaker CMVN."""
    import shutil
    from mpitrain.files import read_yaml, write_yaml
    shutil.copytree(corpus_dir, out)
    manifest = read_yaml(os.path.join(out, "corpus.yaml"), what="corpus manifest")
    manifest["source"] = dict(manifest.get("source") or {},
                              speaker_cmvn={"norm_vars": True})
    write_yaml(os.path.join(out, "corpus.yaml"), manifest)
    return str(out)


def test_eval_and_train_refuse_held_out_features_normalised_otherwise(model, small_corpus,
                                                                      tmp_path, capsys):
    dev = _normalised_per_speaker(os.path.join(small_corpus, "dev"), tmp_path / "dev")
    assert main(["eval", str(model), dev]) == 2
    err = _one_line(capsys, "eval")
    assert "per-speaker CMVN, norm_vars true" in err and "no per-speaker CMVN" in err
    argv = ["train", QUICKSTART, "--run-dir", str(tmp_path / "run")]
    for item in small_overrides(small_corpus, **{"data.dev": dev, "training.max_steps": 2}):
        argv += ["--set", item]
    assert main(argv) == 2
    err = _one_line(capsys, "train")
    assert f"{dev}/corpus.yaml: per-speaker CMVN, norm_vars true" in err
    assert not (tmp_path / "run").exists()


# -- the last line of defence -------------------------------------------------------------

def test_an_internal_error_is_reported_as_a_bug_with_its_traceback(monkeypatch, capsys):
    def broken(args):
        raise KeyError("a bug")
    monkeypatch.setattr(cli, "cmd_check", broken)
    parser = cli.build_parser
    monkeypatch.setattr(cli, "build_parser", lambda **kw: _with_check(parser(**kw), broken))
    assert main(["check", "anything"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "KeyError" in err
    assert err.strip().splitlines()[-1].startswith("mpitrain check: internal error: this is a bug")


def _with_check(parser, func):
    sub = next(a for a in parser._actions if a.dest == "command")
    sub.choices["check"].set_defaults(func=func)
    return parser


def test_numpy_warnings_never_reach_the_user(tmp_path):
    # in a fresh interpreter: pytest would catch the warnings itself
    script = tmp_path / "noisy.py"
    script.write_text(
        "import numpy as np\n"
        "from mpitrain import cli\n"
        "def noisy(args):\n"
        "    np.log(np.zeros(3))\n"
        "    np.float32(1e38) * np.float32(10)\n"
        "    return 0\n"
        "parser = cli.build_parser\n"
        "def patched(**kw):\n"
        "    p = parser(**kw)\n"
        "    sub = next(a for a in p._actions if a.dest == 'command')\n"
        "    sub.choices['check'].set_defaults(func=noisy)\n"
        "    return p\n"
        "cli.build_parser = patched\n"
        "raise SystemExit(cli.main(['check', 'anything']))\n")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=60, env={**os.environ, "PYTHONWARNINGS": "default"})
    assert result.returncode == 0 and result.stderr == "", result.stderr


class _FullStream:
    """A console stream on a full disk (as /dev/full): every write fails."""

    encoding = "utf-8"

    def write(self, text):
        import errno
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self):
        pass

    def isatty(self):
        return False


def test_output_on_a_full_disk_is_named_and_a_full_stderr_keeps_the_status(
        model, small_corpus, tmp_path, monkeypatch, capsys):
    """Standard output on a full disk said a bare "[Errno 28] No space left on device"
    (status read it as a run it could not read); with standard error full, an error
    line that could not be written turned exit status 2 into 1."""
    monkeypatch.setattr(sys, "stdout", _FullStream())
    run = os.path.dirname(model)
    train = ["train", QUICKSTART, "--run-dir", str(tmp_path / "run")]
    for item in small_overrides(small_corpus) + ["model.hidden_dim=16", "model.hidden_layers=1"]:
        train += ["--set", item]
    for argv in (["status", run], ["eval", str(model), os.path.join(small_corpus, "dev")],
                 train):
        assert main(argv) == 2
        err = _one_line(capsys, argv[0])
        assert err.endswith(": error: cannot write standard output: No space left on device\n")
    monkeypatch.undo()
    monkeypatch.setattr(sys, "stderr", _FullStream())
    assert main(["eval", str(model) + "-missing", small_corpus]) == 2
    assert main(["train", QUICKSTART, "--set", "training.nosuch=1"]) == 2
