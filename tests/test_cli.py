"""The command line: help texts, exit codes and one-line errors."""

import json
import os
import signal
import subprocess
import sys

import pytest

from mpitrain.cli import build_parser, main

from .helpers import QUICKSTART

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMANDS = ["synth", "prepare", "check", "train", "eval", "export"]


def _run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "mpitrain", *args], capture_output=True,
                          text=True, timeout=120, cwd=REPO, env=env)


def test_help_lists_every_subcommand():
    out = _run("--help")
    assert out.returncode == 0
    for name in COMMANDS:
        assert name in out.stdout


@pytest.mark.parametrize("name", COMMANDS)
def test_each_subcommand_has_help(name, capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args([name, "--help"])
    assert info.value.code == 0
    assert "usage: mpitrain " + name in capsys.readouterr().out


@pytest.mark.parametrize("argv, usage", [
    (["train", "run.yaml", "--bogus", "x"], "usage: mpitrain train "),
    (["plot", "runs/a", "--dpi", "0"], "usage: mpitrain plot "),
], ids=["train", "plot"])
def test_an_unknown_option_is_named_by_its_command(capsys, argv, usage):
    # the top-level parser said it: "mpitrain: error: ..." under the usage of no command
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage), err
    assert err.splitlines()[-1] == (f"mpitrain {argv[0]}: error: unrecognized arguments: "
                                    f"{' '.join(argv[2:])}")


def test_bad_config_is_one_line_and_exit_2(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("optimizer:\n  momentum: 2\n")
    out = _run("train", str(cfg), "--run-dir", str(tmp_path / "run"))
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert lines == [f"mpitrain train: error: {cfg}: optimizer.momentum: "
                     "expected a number in [0, 1), got 2"]


def test_missing_corpus_names_the_file(tmp_path, capsys):
    code = main(["train", os.path.join(REPO, "jobs", "configs", "quickstart.yaml"),
                 "--set", f"data.train={tmp_path}/nowhere", "--run-dir", str(tmp_path / "r")])
    assert code == 2
    err = capsys.readouterr().err
    assert "nowhere" in err and "corpus.yaml" in err


def test_a_corpus_path_naming_the_directory_of_train_and_dev_names_them(small_corpus, tmp_path,
                                                                        capsys):
    # data.train naming what synth wrote (train/ and dev/ inside) said only "not found"
    code = main(["train", os.path.join(REPO, "jobs", "configs", "quickstart.yaml"),
                 "--set", f"data.train={small_corpus}", "--run-dir", str(tmp_path / "r")])
    assert code == 2
    assert capsys.readouterr().err == (
        f"mpitrain train: error: {small_corpus}/corpus.yaml: not found; expected a corpus "
        f"directory ({small_corpus}) holding corpus.yaml, as `mpitrain synth`, `prepare` or "
        f"`merge` write; it holds the corpora {small_corpus}/dev, {small_corpus}/train: "
        "name one of them\n")
    assert not (tmp_path / "r").exists()


def test_gpu_without_cupy_or_device_is_a_clear_error(tmp_path, capsys):
    from mpitrain import backend
    if backend.gpu_available():
        pytest.skip("a GPU is present: the error path cannot be exercised")
    from mpitrain.data.synthetic import synthesize
    synthesize(str(tmp_path / "c"), hours=0.01, speakers=2, shards=1, dev_hours=0.01,
               dev_speakers=1)
    code = main(["train", os.path.join(REPO, "jobs", "configs", "quickstart.yaml"),
                 "--set", f"data.train={tmp_path}/c/train", "--set", "device=gpu",
                 "--run-dir", str(tmp_path / "r")])
    assert code == 2
    assert "device: gpu" in capsys.readouterr().err


def test_bf16_on_a_gpu_before_compute_capability_8_stops_every_rank_at_once(
        small_corpus, tmp_path, capsys, monkeypatch):
    """On the stand-in device, two ranks: the refusal names the file, the setting and
    the GPU, once, before the run directory is written."""
    from mpitrain.testing import standin_cupy
    from .helpers import small_overrides
    monkeypatch.setitem(standin_cupy.DEVICE, "compute_capability", "75")
    argv = ["train", QUICKSTART, "--virtual", "2", "--run-dir", str(tmp_path / "r")]
    for item in small_overrides(small_corpus) + ["device=gpu", "precision=bf16"]:
        argv += ["--set", item]
    with standin_cupy.installed():
        code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err == [f"mpitrain train: error: {QUICKSTART}: precision: bf16 needs a GPU of "
                   "compute capability 8.0 or newer (bf16 tensor cores); stand-in device "
                   "has 7.5: use fp32 there"], err
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_bf16_refused_by_one_ranks_gpu_stops_the_others_naming_it(monkeypatch):
    """Rank 0's GPU can, rank 1's cannot: rank 0 stops too, at the same point, and
    the reason names the rank."""
    from mpitrain import backend
    from mpitrain.comm.single import SingleCommunicator
    from mpitrain.config import RunConfig
    from mpitrain.testing import standin_cupy
    from mpitrain.train.errors import TrainingError
    from mpitrain.train.setup import select_device

    class TwoRanks(SingleCommunicator):
        size = 2

        def allgather_obj(self, obj):
            return [obj, ("precision: bf16 needs ...; T4 has 7.5: use fp32 there", True)]

    cfg = RunConfig()
    cfg.device, cfg.precision = "gpu", "bf16"
    with standin_cupy.installed():
        with pytest.raises(TrainingError) as stopped:
            select_device(cfg, TwoRanks())
        backend.set_precision(backend.select("gpu"), "fp32")
    assert stopped.value.agreed and stopped.value.setting
    assert str(stopped.value).endswith("use fp32 there (rank 1 of 2)")


@pytest.mark.mpi
def test_gpu_without_cupy_or_device_on_every_rank_is_said_once(mpiexec, small_corpus,
                                                               tmp_path):
    """Each rank printed its own line and the job was aborted."""
    from mpitrain import backend
    from mpitrain.testing.mpirun import run_mpi
    from .helpers import small_overrides
    if backend.gpu_available():
        pytest.skip("a GPU is present: the error path cannot be exercised")
    sets = [arg for item in small_overrides(small_corpus) + ["device=gpu"]
            for arg in ("--set", item)]
    # bench mode too: it looked for the GPUs' names on its own
    for command, out in (("train", ["--run-dir", str(tmp_path / "r")]),
                         ("bench", ["--out", str(tmp_path / "r"), "--sizes", "1,2"])):
        result = run_mpi(2, ["-m", "mpitrain", command, QUICKSTART, *out, *sets],
                         timeout=120, cwd=REPO)
        lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
        assert result.returncode == 2, result.stderr
        assert len(lines) == 1 and lines[0].startswith(f"mpitrain {command}: error: ") \
            and "device: gpu" in lines[0], result.stderr
        assert not (tmp_path / "r").exists()


def test_check_reports_problems_and_fails(tmp_path, capsys):
    import h5py
    from mpitrain.data.synthetic import synthesize
    synthesize(str(tmp_path / "c"), hours=0.01, speakers=2, shards=2, dev_hours=0.01,
               dev_speakers=1)
    assert main(["check", str(tmp_path / "c")]) == 0
    shard = tmp_path / "c" / "train" / "shard-00001.h5"
    with h5py.File(shard, "a") as f:
        labels = f["labels"][...]
        labels[3] = 10_000
        f["labels"][...] = labels
    assert main(["check", str(tmp_path / "c" / "train")]) == 1
    err = capsys.readouterr().err
    assert "shard-00001.h5" in err and "labels" in err


def test_eval_rejects_a_mismatched_corpus(tmp_path, capsys):
    import numpy as np
    from mpitrain.data.writer import CorpusWriter
    from mpitrain.nn.model_file import save_model
    from mpitrain.nn.network import build_network
    net = build_network(feat_dim=5, num_classes=3, left_context=1, right_context=1,
                        hidden_layers=1, hidden_dim=4)
    save_model(tmp_path / "m.h5", net)
    with CorpusWriter(str(tmp_path / "c"), feat_dim=6, num_classes=3, num_shards=1) as w:
        w.add("u1", np.zeros((10, 6), np.float32), np.zeros(10, np.int32))
    assert main(["eval", str(tmp_path / "m.h5"), str(tmp_path / "c")]) == 2
    assert "feat_dim 6" in capsys.readouterr().err



def test_eval_scores_several_corpora_one_line_each_after_checking_them_all(tmp_path, capsys):
    import numpy as np
    from mpitrain.data.writer import CorpusWriter
    from mpitrain.nn.model_file import save_model
    from mpitrain.nn.network import build_network
    net = build_network(feat_dim=5, num_classes=3, left_context=1, right_context=1,
                        hidden_layers=1, hidden_dim=4)
    net.init_params(seed=0)
    save_model(tmp_path / "m.h5", net)
    rng = np.random.default_rng(0)
    for name, frames in (("dev", 30), ("test", 50)):
        with CorpusWriter(str(tmp_path / name), feat_dim=5, num_classes=3, num_shards=1) as w:
            w.add("u1", rng.standard_normal((frames, 5)).astype(np.float32),
                  rng.integers(0, 3, frames).astype(np.int32))
    alone = []
    for name in ("dev", "test"):
        assert main(["eval", str(tmp_path / "m.h5"), str(tmp_path / name)]) == 0
        alone.append(capsys.readouterr().out.strip())
    assert alone[0].startswith("frames 30 xent ") and alone[1].startswith("frames 50 xent ")
    assert main(["eval", str(tmp_path / "m.h5"), str(tmp_path / "dev"),
                 str(tmp_path / "test")]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"{tmp_path / 'dev'}: {alone[0]}", f"{tmp_path / 'test'}: {alone[1]}"]
    # a corpus that does not fit is said before any is scored
    with CorpusWriter(str(tmp_path / "wide"), feat_dim=6, num_classes=3, num_shards=1) as w:
        w.add("u1", np.zeros((10, 6), np.float32), np.zeros(10, np.int32))
    assert main(["eval", str(tmp_path / "m.h5"), str(tmp_path / "dev"),
                 str(tmp_path / "wide")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "wide/corpus.yaml: feat_dim 6" in err, (out, err)


def test_eval_of_a_model_whose_weights_overflow_names_the_model_not_the_features(tmp_path,
                                                                               capsys):
    """A crafted model file (weights of 1e30, finite, checksummed) scored finite
    features to NaN, and eval blamed the features ('far outside the range it was
    trained on?')."""
    import numpy as np
    from mpitrain.data.writer import CorpusWriter
    from mpitrain.nn.model_file import save_model
    from mpitrain.nn.network import build_network
    net = build_network(feat_dim=5, num_classes=3, left_context=1, right_context=1,
                        hidden_layers=2, hidden_dim=4)
    net.init_params(seed=0)
    net.components[0].weight[...] = 1e30       # both hidden layers' affines
    net.components[2].weight[...] = 1e30
    model = tmp_path / "m.h5"
    save_model(model, net)
    rng = np.random.default_rng(0)
    with CorpusWriter(str(tmp_path / "c"), feat_dim=5, num_classes=3, num_shards=1) as w:
        w.add("u1", rng.standard_normal((30, 5)).astype(np.float32),
              rng.integers(0, 3, 30).astype(np.int32))
    assert main(["eval", str(model), str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        f"mpitrain eval: error: {model}: the model's outputs overflow (inf or NaN) at "
        "component 3 of 5, Affine(4->4), parameters up to 1e+30 in magnitude, on "
        f"{tmp_path / 'c'}'s finite features"), err
    assert "features far outside" not in err, err


def test_eval_reads_the_corpus_one_chunk_at_a_time(tmp_path, capsys, monkeypatch):
    """A test set of any size: the chunks scored before are gone when the next is read."""
    import weakref

    import numpy as np
    from mpitrain.data.writer import CorpusWriter
    from mpitrain.nn.model_file import save_model
    from mpitrain.nn.network import build_network
    from mpitrain.train import evaluate
    net = build_network(feat_dim=5, num_classes=3, left_context=1, right_context=1,
                        hidden_layers=1, hidden_dim=4)
    save_model(tmp_path / "m.h5", net)
    rng = np.random.default_rng(0)
    with CorpusWriter(str(tmp_path / "c"), feat_dim=5, num_classes=3, num_shards=6) as w:
        for u in range(6):                 # one utterance, so one chunk, per shard
            w.add(f"u{u}", rng.standard_normal((40, 5)).astype(np.float32),
                  rng.integers(0, 3, 40).astype(np.int32))
    read, held = evaluate.read_chunk, []

    def reading(*args):
        held.append(sum(ref() is not None for ref in refs))
        chunk = read(*args)
        refs.append(weakref.ref(chunk[0]))
        return chunk
    refs = []
    monkeypatch.setattr(evaluate, "read_chunk", reading)
    assert main(["eval", str(tmp_path / "m.h5"), str(tmp_path / "c")]) == 0
    assert "frames 240 " in capsys.readouterr().out
    assert len(held) == 6 and max(held) <= 1, held

# -- entry points: version, no command, init, synth under mpiexec ----------------------------

def test_help_never_doubles_a_default():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.choices and "train" in a.choices)
    for name, command in sub.choices.items():
        text = command.format_help()
        assert "(default: None)" not in text, name
        assert "default: runs/<config name> (default" not in text, name
    assert "(default: 1)" in sub.choices["bench"].format_help()


def test_every_option_and_argument_is_explained_in_help():
    # an option without help text shows no default either (prepare --shards: 1)
    parser = build_parser()
    sub = next(a for a in parser._actions if a.choices and "train" in a.choices)
    for name, command in sub.choices.items():
        for action in command._actions:
            if action.dest != "help":
                assert action.help, f"{name} {action.option_strings or action.dest}"
    assert "(default: 1)" in sub.choices["prepare"].format_help()


def test_version():
    import mpitrain
    result = _run("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"mpitrain {mpitrain.__version__}"


def test_no_command_without_a_config_prints_the_train_usage(tmp_path):
    result = subprocess.run([sys.executable, "-m", "mpitrain"], capture_output=True, text=True,
                            timeout=60, cwd=tmp_path, env=_env())
    assert result.returncode == 2 and result.stdout == ""
    assert "python -m mpitrain train CONFIG.yaml" in result.stderr
    assert len(result.stderr.splitlines()) <= 4


def test_no_command_trains_mpitrain_yaml_of_the_current_directory(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr("mpitrain.cli.cmd_train", lambda args: calls.append(args) or 0)
    monkeypatch.chdir(tmp_path)
    assert main([]) == 2 and not calls
    (tmp_path / "mpitrain.yaml").write_text("data: {}\n")
    assert main([]) == 0
    assert calls[0].command == "train" and calls[0].config == "mpitrain.yaml"


def test_no_command_with_options_names_the_train_command_to_use(tmp_path, monkeypatch, capsys):
    # argparse took the option's value for a command: "argument COMMAND: invalid choice"
    calls = []
    monkeypatch.setattr("mpitrain.cli.cmd_train", lambda args: calls.append(args) or 0)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mpitrain.yaml").write_text("data: {}\n")
    assert main(["--set", "training.epochs=1", "--run-dir", "a b"]) == 2 and not calls
    err = capsys.readouterr().err
    assert err == ("mpitrain: error: a bare `python -m mpitrain` takes no options (it trains "
                   "./mpitrain.yaml as it is); give them to train: python -m mpitrain train "
                   "mpitrain.yaml --set training.epochs=1 --run-dir 'a b'\n")
    # help and the version are still the bare form's own options
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("mpitrain ")
    for flag in ("-h", "--help", "--he"):
        with pytest.raises(SystemExit) as exit_:
            main([flag])
        assert exit_.value.code == 0 and "COMMAND" in capsys.readouterr().out
    # and their abbreviations, as argparse takes them
    with pytest.raises(SystemExit) as exit_:
        main(["--vers"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("mpitrain ")


def test_init_writes_a_starter_config_that_trains(small_corpus, tmp_path, capsys):
    from mpitrain.config import load_config
    exp = tmp_path / "exp"
    assert main(["init", str(exp), "--corpus", small_corpus]) == 0
    out = capsys.readouterr()
    assert "mpitrain.yaml" in out.out and out.err == ""
    cfg = load_config(str(exp / "mpitrain.yaml"), [])
    assert os.path.samefile(cfg.data.train, os.path.join(small_corpus, "train"))
    assert os.path.samefile(cfg.data.dev, os.path.join(small_corpus, "dev"))
    # a second init does not replace it, --overwrite does
    assert main(["init", str(exp), "--corpus", small_corpus, "--example", "ngsgd"]) == 2
    assert f"{exp / 'mpitrain.yaml'}: already exists" in capsys.readouterr().err
    assert main(["init", str(exp), "--corpus", small_corpus, "--example", "ngsgd",
                 "--overwrite"]) == 0
    assert "ngsgd" in (exp / "mpitrain.yaml").read_text()
    assert main(["init", str(tmp_path / "x"), "--example", "nope"]) == 2
    assert "--example: no example configuration 'nope'" in capsys.readouterr().err


def test_init_into_a_file_or_no_directory_is_one_line(small_corpus, tmp_path, capsys):
    # "[Errno 17] File exists: ..." after the corpus warnings, and "[Errno 2] ... ''"
    (tmp_path / "notes").write_text("x")
    assert main(["init", str(tmp_path / "notes"), "--corpus", small_corpus]) == 2
    assert capsys.readouterr().err == (
        f"mpitrain init: error: {tmp_path / 'notes' / 'mpitrain.yaml'}: cannot be written: "
        f"{tmp_path / 'notes'} is not a directory\n")
    assert main(["init", "", "--corpus", small_corpus]) == 2
    assert capsys.readouterr().err == ("mpitrain init: error: DIR is empty; name the "
                                       "directory to write mpitrain.yaml into (. for this "
                                       "one)\n")


def test_init_on_a_full_disk_leaves_no_directory(small_corpus, tmp_path, capsys, monkeypatch):
    # the directory made for mpitrain.yaml stayed, empty, after "no space left on device"
    import contextlib
    import errno
    from mpitrain import starter
    from mpitrain.files import DiskFullError

    @contextlib.contextmanager
    def full(path, mode="w"):
        raise DiskFullError(errno.ENOSPC, f"no space left on device writing {path}")
        yield

    monkeypatch.setattr(starter, "atomic_open", full)
    exp = tmp_path / "exp"
    assert main(["init", str(exp), "--corpus", small_corpus]) == 2
    assert capsys.readouterr().err == ("mpitrain init: error: no space left on device "
                                       f"writing {exp / 'mpitrain.yaml'}\n")
    assert not exp.exists()
    exp.mkdir()                          # a directory that was there stays
    assert main(["init", str(exp), "--corpus", small_corpus]) == 2
    assert exp.is_dir()


def test_an_empty_run_dir_or_set_key_is_one_line(tmp_path, capsys, monkeypatch):
    # --run-dir '' (an unset variable in a batch script) trained into runs/<config>;
    # --set =3 said ": unknown key"
    monkeypatch.chdir(tmp_path)
    for argv in (["train", QUICKSTART, "--run-dir", ""],
                 ["train", QUICKSTART, "--run-dir", " ", "--virtual", "2"],
                 ["pretrain", QUICKSTART, "--run-dir", ""]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--run-dir is empty" in err, err
    assert main(["train", QUICKSTART, "--set", "=3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--set =3: expected KEY=VALUE with a key" in err, err
    assert main(["train", QUICKSTART, "--set", "optimizer..momentum=0.5"]) == 2
    assert "empty part" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("argv", [
    ["train", QUICKSTART, "--run-dir=~/runs/x"], ["synth", "~/corpus"],
    ["bench", QUICKSTART, "--out=~/bench"], ["init", "~/exp"],
    ["plot", "runs/x", "--out", "~/curves.png"], ["eval", "~/runs/x", "data"],
])
def test_a_path_starting_with_a_tilde_is_refused_and_nothing_is_made(tmp_path, capsys,
                                                                     monkeypatch, argv):
    # the shell leaves ~ alone after --option= and in quotes: train made a directory
    # named ~ in the working directory (which `rm -r ~` then takes for the home)
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "starts with ~, which mpitrain does not expand" in err, err
    assert os.path.expanduser("~/") in err and "or ./~/" in err
    assert os.listdir(tmp_path) == []


def test_init_of_the_speech_example_holds_out_the_training_speakers_where_synth_wrote_them(
        tmp_path, capsys):
    """The speech recipe picks best.h5 and stops early on utterances of the training
    speakers (its data.dev, Kaldi's valid set); init gave it the unseen speakers of
    CORPUS/dev even where `synth --seen-dev-hours` had written CORPUS/dev_seen."""
    import yaml
    corpus = tmp_path / "corpus"
    for split in ("train", "dev", "dev_seen"):
        (corpus / split).mkdir(parents=True)
        (corpus / split / "corpus.yaml").write_text("feat_dim: 4\n")

    def dev_of(example, *extra):
        out = tmp_path / f"{example}{len(extra)}"
        assert main(["init", str(out), "--corpus", str(corpus), "--example", example,
                     *extra]) == 0
        capsys.readouterr()
        return yaml.safe_load((out / "mpitrain.yaml").read_text())["data"]["dev"]

    assert dev_of("speech") == str(corpus / "dev_seen")
    assert dev_of("quickstart") == str(corpus / "dev")          # the others: as before
    assert dev_of("speech", "--dev", str(corpus / "dev")) == str(corpus / "dev")
    (corpus / "dev_seen" / "corpus.yaml").unlink()              # none written: dev
    assert dev_of("speech", "--overwrite") == str(corpus / "dev")


def test_init_warns_of_a_corpus_not_written_yet(tmp_path, capsys):
    assert main(["init", str(tmp_path), "--train", str(tmp_path / "t"),
                 "--dev", str(tmp_path / "d")]) == 0
    err = capsys.readouterr().err
    assert f"{tmp_path / 't'}/corpus.yaml does not exist yet" in err


def test_init_corpus_naming_one_corpus_is_refused_saying_how_to_name_it(tmp_path, capsys):
    # (`init exp --corpus data/train` wrote data/train/train and data/train/dev into the
    # config, with a warning that they did not exist yet)
    corpus = tmp_path / "train"
    corpus.mkdir()
    (corpus / "corpus.yaml").write_text("feat_dim: 4\n")
    assert main(["init", str(tmp_path / "exp"), "--corpus", str(corpus)]) == 2
    assert capsys.readouterr().err == (
        f"mpitrain init: error: --corpus {corpus}: is a corpus itself (it holds corpus.yaml); "
        "--corpus names a directory holding train/ and dev/ corpora; give --train "
        f"{corpus} --dev DEV_CORPUS\n")
    assert not (tmp_path / "exp").exists()
    assert main(["init", str(tmp_path / "exp"), "--train", str(corpus),
                 "--dev", str(tmp_path / "dev")]) == 0


@pytest.mark.parametrize("given,missing", [("--train", "--dev"), ("--dev", "--train")])
def test_init_with_one_corpus_of_the_pair_named_is_refused(tmp_path, capsys, given, missing):
    # the other was taken from data/synth without a word: a pair of unrelated corpora
    assert main(["init", str(tmp_path / "exp"), given, str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{given} is given but not {missing}" in err
    assert not (tmp_path / "exp").exists()
    # with --corpus naming where the other one lives, it is fine
    assert main(["init", str(tmp_path / "exp"), "--corpus", str(tmp_path / "corpus"),
                 given, str(tmp_path / "c")]) == 0


@pytest.mark.parametrize("options, flag", [
    (["--train", "", "--dev", ""], "--train"),
    (["--corpus", " "], "--corpus"),
    (["--train", "c/train", "--dev", ""], "--dev"),
], ids=["train-and-dev", "corpus", "dev"])
def test_init_with_an_empty_corpus_option_is_refused(tmp_path, capsys, options, flag):
    # (a variable left unset in a script) --train "" --dev "" wrote a config of the
    # built-in data/synth corpus without a word
    assert main(["init", str(tmp_path / "exp"), *options]) == 2
    assert capsys.readouterr().err == (f"mpitrain init: error: {flag} is empty; name a corpus "
                                       "directory, or leave the option out\n")
    assert not (tmp_path / "exp").exists()


@pytest.mark.parametrize("argv, said", [
    (["synth", ""], "OUT_DIR is empty; name the directory to write train/ and dev/ into "
                    "(. for this one)"),
    (["merge", "", "part"], "OUT_DIR is empty; name the merged corpus directory "
                            "(. for this one)"),
    (["prepare", "--feats", "ark:f.ark", "--ali", "ark:a.ark", "--out", " "],
     "--out is empty; name the corpus directory to write (. for this one)"),
    (["plot", "run", "--out", ""], "--out is empty; name the PNG file, or leave the option "
                                   "out for RUN_DIR/curves.png"),
], ids=["synth", "merge", "prepare", "plot"])
def test_an_empty_output_path_is_refused_not_the_working_directory(tmp_path, monkeypatch,
                                                                  capsys, argv, said):
    # (a variable left unset in a script) synth "" wrote train/ and dev/ here, merge ""
    # wrote corpus.yaml here, plot --out "" drew RUN_DIR/curves.png
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    assert capsys.readouterr().err == f"mpitrain {argv[0]}: error: {said}\n"
    assert os.listdir(tmp_path) == []


def test_example_configs_are_shipped_with_the_package():
    from mpitrain.starter import example_configs
    names = set(example_configs())
    assert {"quickstart", "ngsgd", "bench"} <= names


def test_init_says_how_to_run_each_example_and_keeps_none_of_its_source_tree_lines(
        tmp_path, capsys):
    """The example's own run comment was left behind from its second line on (the
    pretrain and ngsgd examples named jobs/configs/...), and the bench and pretrain
    examples were said to run as `mpiexec -n N python -m mpitrain`, which trains."""
    from mpitrain.config import load_config
    from mpitrain.starter import example_configs
    wanted = {"bench": "python -m mpitrain bench mpitrain.yaml --target-accuracy",
              "pretrain": "python -m mpitrain pretrain mpitrain.yaml --run-dir runs/pre"}
    for example in example_configs():
        out = tmp_path / example
        assert main(["init", str(out), "--example", example, "--corpus",
                     str(tmp_path / "corpus")]) == 0
        said = capsys.readouterr().out
        text = (out / "mpitrain.yaml").read_text(encoding="utf-8")
        assert "jobs/configs/" not in text, (example, text)
        run_line = text.splitlines()[1]
        assert run_line.startswith("# Run it from this directory: mpiexec -n N "), run_line
        if example in wanted:
            assert wanted[example] in run_line and wanted[example] in said, (run_line, said)
        else:
            assert run_line.endswith("python -m mpitrain"), run_line
        load_config(str(out / "mpitrain.yaml"), [])


@pytest.mark.mpi
def test_synth_under_mpiexec_writes_once(mpiexec, tmp_path):
    from mpitrain.testing.mpirun import run_mpi
    result = run_mpi(2, ["-m", "mpitrain", "synth", str(tmp_path / "synth"), "--hours", "0.01",
                         "--speakers", "4", "--dev-hours", "0.01", "--dev-speakers", "2",
                         "--shards", "1"], timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert [ln.startswith("train: ") for ln in result.stdout.splitlines()].count(True) == 1
    from mpitrain.data.check import check_corpus
    assert check_corpus(str(tmp_path / "synth" / "train")) == []
    # a failure on rank 0 stops every rank with one line
    again = run_mpi(2, ["-m", "mpitrain", "synth", str(tmp_path / "synth"), "--hours", "0.01"],
                    timeout=120, cwd=REPO)
    assert again.returncode == 2
    assert len([ln for ln in again.stderr.splitlines() if "mpitrain synth" in ln]) == 1


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get(
        "PYTHONPATH")])), OPENBLAS_NUM_THREADS="1")


@pytest.mark.mpi
def test_mpirun_python_dash_m_mpitrain_trains_mpitrain_yaml_of_the_directory(small_corpus,
                                                                            tmp_path):
    # the design card's launch line, with no command: `mpirun -np 2 python -m mpitrain`
    from mpitrain.config import dump_config, load_config
    from mpitrain.testing.mpirun import run_mpi
    assert main(["init", str(tmp_path), "--corpus", small_corpus]) == 0
    # the starter config, made tiny
    cfg = load_config(str(tmp_path / "mpitrain.yaml"), [
        "model.hidden_dim=16", "model.hidden_layers=1", "training.max_steps=6",
        "training.log_interval=3", "data.chunk_frames=20000"])
    dump_config(cfg, str(tmp_path / "mpitrain.yaml"))
    result = run_mpi(2, ["-m", "mpitrain"], cwd=str(tmp_path), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 rank(s)" in result.stdout
    assert (tmp_path / "runs" / "mpitrain" / "final.h5").exists()


@pytest.mark.parametrize("argv,message", [
    (["train", "CONFIG", "--slowdown", "1=2"], "--slowdown and --jitter slow virtual ranks"),
    (["bench", "CONFIG", "--jitter", "0.1"], "--slowdown and --jitter slow virtual ranks"),
    (["bench", "CONFIG", "--virtual", "1,2", "--slowdown", "5=3"],
     "--slowdown: rank 5 is not one of the 2 virtual ranks"),
    (["train", "CONFIG", "--virtual", "4", "--slowdown", "4=2"],
     "--slowdown: rank 4 is not one of the 4 virtual ranks"),
    (["train", "CONFIG", "--virtual", "2", "--slowdown", "0=nan"],
     "mpitrain train: error: --slowdown: expected a factor in (0, 1e+06] for rank 0, got 0=nan"),
    (["bench", "CONFIG", "--virtual", "1,2", "--slowdown", "1=-2"],
     "mpitrain bench: error: --slowdown: expected a factor in (0, 1e+06] for rank 1, got 1=-2"),
    (["train", "CONFIG", "--virtual", "2", "--jitter", "-1"],
     "mpitrain train: error: --jitter: expected a number in [0, 10], got -1"),
    (["bench", "CONFIG", "--virtual", "1,2", "--jitter", "11"],
     "mpitrain bench: error: --jitter: expected a number in [0, 10], got 11"),
    (["bench", "CONFIG", "--virtual", "1,2", "--methods", "param_server"],
     "param_server: ranks that do not step together are not benchmarked"),
    (["bench", "CONFIG", "--virtual", "2,4"], "--virtual: must include 1"),
    (["bench", "CONFIG", "--virtual", "1,2", "--sizes", "1,4"],
     "--sizes and --virtual both give the group sizes"),
])
def test_options_that_cannot_apply_are_refused_in_one_line(small_corpus, tmp_path, capsys,
                                                           argv, message):
    from .helpers import QUICKSTART
    argv = [QUICKSTART if a == "CONFIG" else a for a in argv]
    argv += ["--set", f"data.train={small_corpus}/train"]
    if argv[0] == "train":
        argv += ["--run-dir", str(tmp_path / "run")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


def test_output_into_a_closed_pipe_ends_quietly(tmp_path):
    process = subprocess.Popen([sys.executable, "-m", "mpitrain", "synth", str(tmp_path / "c"),
                                "--hours", "0.002", "--dev-hours", "0.001", "--shards", "1"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    process.stdout.close()          # the reader is gone before anything is written
    _, err = process.communicate(timeout=120)
    # as a Unix tool that SIGPIPE ends: quiet, status 141 (or 0 if all was written)
    assert process.returncode in (0, 141), err
    assert err == b"", err


@pytest.mark.mpi
@pytest.mark.parametrize("options,line", [
    (["--sizes", "1,4"], "mpitrain bench: error: --sizes: 4 ranks asked for, but the job has 2 "
                         "(mpiexec -n 4 or more)"),
    (["--methods", "nosuch"], "mpitrain bench: error: --methods: unknown nosuch; expected some of "
                              "model_averaging, allreduce, kaldi, bmuf, adpsgd"),
    (["--sizes", "1,x"], "mpitrain bench: error: --sizes: expected comma-separated numbers, e.g. "
                         "1,2,4; got '1,x'"),
], ids=["sizes-beyond-the-job", "unknown-method", "sizes-not-numbers"])
def test_a_bench_option_error_under_mpiexec_is_said_once(mpiexec, small_corpus, options, line):
    from mpitrain.testing.mpirun import run_mpi
    from .helpers import QUICKSTART
    result = run_mpi(2, ["-m", "mpitrain", "bench", QUICKSTART, *options,
                         "--set", f"data.train={small_corpus}/train"], timeout=120)
    assert result.returncode == 2, result.stderr
    said = [text for text in result.stderr.splitlines() if text.startswith("mpitrain bench:")]
    assert said == [line], result.stderr


@pytest.mark.parametrize("sizes", ["", ",", " "])
def test_bench_virtual_without_sizes_is_refused_not_run_on_real_ranks(tmp_path, capsys, sizes):
    # an empty --virtual (a variable left unset in a script) ran the benchmark on
    # this process's one real rank instead, into the same --out
    from .helpers import QUICKSTART
    out = tmp_path / "out"
    assert main(["bench", QUICKSTART, "--virtual", sizes, "--out", str(out)]) == 2
    assert capsys.readouterr().err == ("mpitrain bench: error: --virtual: expected group "
                                       f"sizes, e.g. 1,2,4; got {sizes!r}\n")
    assert not out.exists()


@pytest.mark.parametrize("options, said", [
    (["--dpi", "0"], "--dpi must be a positive resolution, got 0"),
    (["--sizes", "1,-2"], "--sizes: expected positive integers, got [1, -2]"),
    (["--virtual", "0,1"], "--virtual: expected positive integers, got [0, 1]"),
    (["--phases", "nope"], "--phases: expected some of throughput, accuracy, got ['nope']"),
    (["--project-to", "0,4"], "--project-to: expected integers >= 2, got [0, 4]"),
], ids=["dpi", "sizes", "virtual", "phases", "project-to"])
def test_bench_options_out_of_range_are_one_line_before_anything_is_written(tmp_path, capsys,
                                                                          options, said):
    from .helpers import QUICKSTART
    out = tmp_path / "out"
    assert main(["bench", QUICKSTART, *options, "--out", str(out)]) == 2
    assert capsys.readouterr().err == f"mpitrain bench: error: {said}\n"
    assert not out.exists()


def test_bench_refuses_an_out_whose_runs_is_a_file(small_corpus, tmp_path, capsys):
    from .helpers import QUICKSTART
    out = tmp_path / "out"
    out.mkdir()
    (out / "runs").write_text("")
    assert main(["bench", QUICKSTART, "--out", str(out), "--virtual", "1",
                 "--set", f"data.train={small_corpus}/train"]) == 2
    assert capsys.readouterr().err == (f"mpitrain bench: error: {out / 'runs'}: exists and is "
                                       "not a directory\n")
    assert sorted(os.listdir(out)) == ["runs"]


@pytest.mark.parametrize("virtual", [True, False], ids=["virtual", "one-rank"])
def test_bench_refuses_an_out_holding_an_earlier_benchmark(small_corpus, tmp_path, capsys,
                                                           virtual):
    from .helpers import QUICKSTART
    out = tmp_path / "out"
    (out / "runs" / "accuracy-bmuf-n2").mkdir(parents=True)
    (out / "bench.json").write_text("{}")
    argv = ["bench", QUICKSTART, "--out", str(out), "--set", f"data.train={small_corpus}/train",
            "--set", f"data.dev={small_corpus}/dev", *(["--virtual", "1"] if virtual else [])]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == (f"mpitrain bench: error: {out}: holds an earlier benchmark (bench.json, 1 run(s) "
                   "in runs/); replace it with --overwrite, or choose another --out\n")
    assert (out / "bench.json").read_text() == "{}"
    (tmp_path / "file").write_text("")
    assert main(argv[:2] + ["--out", str(tmp_path / "file")] + argv[4:]) == 2
    assert "file: --out exists and is not a directory" in capsys.readouterr().err


def test_init_keeps_corpus_paths_with_yaml_characters_whole(tmp_path, capsys):
    from mpitrain.config import load_config
    corpus = tmp_path / "has #hash: and colon"
    out = tmp_path / "exp dir"
    assert main(["init", str(out), "--corpus", str(corpus)]) == 0
    cfg = load_config(str(out / "mpitrain.yaml"))
    assert cfg.data.train == str(corpus / "train") and cfg.data.dev == str(corpus / "dev")
    assert f"cd '{out}'" in capsys.readouterr().out


def test_init_writes_letters_outside_ascii_as_they_are(tmp_path, capsys):
    # "caf\u00e9 \u65e5\u672c" was written as its \\u escapes; a name that is not
    # UTF-8, or a line break YAML would fold, is escaped and reads back the same
    from mpitrain.config import load_config
    odd = os.fsdecode(b"odd-\xe9") + "\u2028\x85"
    for name in ("caf\u00e9 \u65e5\u672c \"q\" back\\slash", odd):
        corpus = tmp_path / name
        for split in ("train", "dev"):     # (no warning of a corpus not written yet)
            (corpus / split).mkdir(parents=True)
            (corpus / split / "corpus.yaml").write_text("")
        out = tmp_path / "exp"
        assert main(["init", str(out), "--corpus", str(corpus), "--overwrite"]) == 0
        text = (out / "mpitrain.yaml").read_text(encoding="utf-8")
        assert ("caf\u00e9 \u65e5\u672c" in text) == (name != odd)
        cfg = load_config(str(out / "mpitrain.yaml"))
        assert cfg.data.train == str(corpus / "train") and cfg.data.dev == str(corpus / "dev")
    capsys.readouterr()


def test_init_writes_a_letter_beyond_the_basic_plane_that_is_escaped_whole(tmp_path, capsys):
    # a tag letter (as in the flag of Scotland) is not printable, so it is escaped:
    # as its JSON surrogate pair, which YAML reads as two lone surrogates, the
    # path read back named another directory
    from mpitrain.config import load_config
    corpus = tmp_path / "flag-\U0001F3F4\U000E0067\U000E0062\U000E0073\U000E0063\U000E0074\U000E007F"
    for split in ("train", "dev"):
        (corpus / split).mkdir(parents=True)
        (corpus / split / "corpus.yaml").write_text("")
    assert main(["init", str(tmp_path / "exp"), "--corpus", str(corpus)]) == 0
    cfg = load_config(str(tmp_path / "exp" / "mpitrain.yaml"))
    assert cfg.data.train == str(corpus / "train") and cfg.data.dev == str(corpus / "dev")
    capsys.readouterr()


@pytest.mark.mpi
@pytest.mark.parametrize("method", ["allreduce", "model_averaging"])
def test_the_log_names_each_ranks_host_and_the_rank_the_others_wait_for(small_corpus,
                                                                       tmp_path, method):
    # a slow node is found from metrics.jsonl: the start record maps hosts to ranks,
    # each train record names the slowest rank (the one longest on its own steps) and
    # its host.  Averaging every 6 steps with a record every 3, half the windows hold
    # no average: the others waited for rank 1 only at the record's sum, and those
    # windows named no rank (none had communicated before it)
    import socket
    from mpitrain.testing.mpirun import run_mpi
    from .helpers import QUICKSTART, WORKERS
    overrides = ["model.hidden_dim=16", "model.hidden_layers=1", "training.max_steps=12",
                 "training.log_interval=3", "data.chunk_frames=20000",
                 f"parallel.method={method}", "parallel.average_every=6",
                 "parallel.straggler.ranks=[1]",
                 f"data.train={small_corpus}/train", f"data.dev={small_corpus}/dev"]
    # rank 1 sleeps 80 ms a step: 20x a millisecond's compute led by a few tens of
    # milliseconds a step, what a loaded machine's scheduler may take from rank 0
    # and rank 0 takes a second over the start record, as a loaded machine may: rank 1
    # waited for it in its first collective, and the first window named rank 0
    argv = [str(WORKERS / "fixed_straggler_worker.py"), "0.08", "1.0", "--", "train",
            QUICKSTART, "--run-dir", str(tmp_path / "run")]
    for item in overrides:
        argv += ["--set", item]
    result = run_mpi(2, argv, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    start = next(r for r in records if r["type"] == "start")
    host = socket.gethostname()
    assert start["hosts"] == {host: [0, 1]} and start["gpus"] is None
    assert isinstance(start["blas_threads"], int) and start["blas_threads"] >= 1
    train = [r for r in records if r["type"] == "train"]
    assert len(train) == 4 and all(r["slowest_host"] == host for r in train), train
    assert [r["slowest_rank"] for r in train] == [1, 1, 1, 1], train


@pytest.mark.mpi
@pytest.mark.parametrize("argv,line", [
    (["train", "{bad}"], "mpitrain train: error: {bad}: model.hiden_dim: unknown key; "),
    (["pretrain", "{bad}"], "mpitrain pretrain: error: {bad}: model.hiden_dim: unknown key; "),
    (["bench", "{bad}"], "mpitrain bench: error: {bad}: model.hiden_dim: unknown key; "),
    (["train", "{good}", "--set", "training.epochs=-1"],
     "mpitrain train: error: {good}: training.epochs: expected a number in (0, 1e+06], got -1"),
    (["train", "{good}", "--slowdown", "1=2"], "mpitrain train: error: --slowdown and --jitter "),
    (["train", "{good}", "--no-such-option"],
     "mpitrain train: error: unrecognized arguments: --no-such-option"),
    (["train", "{good}", "--virtual", "2"],
     "mpitrain train: error: --virtual simulates every rank in this one process; run it "
     "without mpiexec or srun (this is one of 3 processes)"),
    (["bench", "{good}", "--virtual", "1,2"], "mpitrain bench: error: --virtual simulates "),
], ids=["train", "pretrain", "bench", "value-out-of-range", "option", "command-line",
        "train-virtual", "bench-virtual"])
def test_an_error_before_mpi_starts_is_said_once_and_every_rank_exits_2(mpiexec, tmp_path,
                                                                         argv, line):
    from mpitrain.testing.mpirun import launcher_is_open_mpi, run_mpi
    from .helpers import QUICKSTART, WORKERS
    bad = tmp_path / "bad.yaml"
    with open(QUICKSTART, encoding="utf-8") as fh:
        bad.write_text(fh.read().replace("hidden_dim:", "hiden_dim:"), encoding="utf-8")
    argv = [a.format(bad=bad, good=QUICKSTART) for a in argv]
    line = line.format(bad=bad, good=QUICKSTART)
    status_dir = tmp_path / "status"
    status_dir.mkdir()
    result = run_mpi(3, [str(WORKERS / "cli_status_worker.py"), str(status_dir), *argv],
                     timeout=120)
    assert result.returncode == 2, result.stderr
    said = [text for text in result.stderr.splitlines() if "error:" in text]
    assert len(said) == 1 and said[0].startswith(line), result.stderr
    statuses = {p.name: p.read_text().strip() for p in status_dir.iterdir()}
    if launcher_is_open_mpi() and "--virtual" in argv:
        # refused before MPI starts: rank 0 says the line and exits at once, and Open
        # MPI's launcher ends the others while they wait for that line to come first
        assert statuses["rank-0"] == "2" and set(statuses.values()) == {"2"}, statuses
    else:
        assert statuses == {"rank-0": "2", "rank-1": "2", "rank-2": "2"}, statuses


@pytest.mark.mpi
@pytest.mark.parametrize("where,interrupted", [("config", 1), ("settings", 1), ("synth", 0)])
def test_an_interrupt_on_one_rank_while_the_ranks_start_ends_the_job(mpiexec, small_corpus,
                                                                      tmp_path, where,
                                                                      interrupted):
    # rank 1 interrupted before MPI starts, or after it but before the run's own
    # guard; rank 0 interrupted while `synth` writes: it returned 130 and the
    # others waited for it in MPI forever
    from mpitrain.testing.mpirun import MpiTimeoutError, run_mpi
    from .helpers import WORKERS
    try:
        result = run_mpi(2, [str(WORKERS / "start_interrupt_worker.py"), where, small_corpus,
                             str(tmp_path / "run")], timeout=60)
    except MpiTimeoutError as exc:
        pytest.fail(f"the job hung instead of ending: {exc}")
    assert result.returncode != 0, result.stderr
    command = "synth" if where == "synth" else "train"
    assert f"mpitrain {command}: rank {interrupted}: interrupted" in result.stderr, \
        result.stderr
    assert "MPI_Abort(MPI_COMM_WORLD, 130)" in result.stderr or result.returncode == 130, \
        result.stderr
    assert not (tmp_path / "run").exists()


_INTERRUPTED_WHILE_NUMPY_LOADS = """
import os, signal, sys
class Interrupt:
    def find_spec(self, name, path=None, target=None):
        if name == "numpy":
            os.kill(os.getpid(), signal.SIGINT)        # Ctrl-C while numpy loads
        return None
sys.meta_path.insert(0, Interrupt())
from mpitrain.cli import main
sys.argv = ["mpitrain", *sys.argv[1:]]
sys.exit(main())
"""


def test_an_interrupt_while_the_modules_load_is_one_line(tmp_path):
    # Ctrl-C in the first second of a command, while Python loads numpy: a
    # KeyboardInterrupt traceback (or numpy's "Importing the numpy C-extensions
    # failed", blaming the installation); under mpiexec every rank printed one
    done = subprocess.run([sys.executable, "-c", _INTERRUPTED_WHILE_NUMPY_LOADS, "status",
                           str(tmp_path)], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO))
    assert done.stderr == "mpitrain status: interrupted\n", done.stderr
    # ended by the signal, as an interrupted program does (a shell shows 130)
    assert done.returncode == -signal.SIGINT, done.returncode


def test_an_interrupt_before_the_command_runs_is_said_in_process(monkeypatch, capsys):
    from mpitrain import cli
    monkeypatch.setattr(cli, "build_parser", lambda **_: (_ for _ in ()).throw(
        KeyboardInterrupt))
    assert main(["status", "x"]) == 130
    assert capsys.readouterr().err == "mpitrain status: interrupted\n"


@pytest.mark.mpi
def test_no_command_without_a_config_under_mpiexec_prints_the_usage_once(mpiexec, tmp_path):
    from mpitrain.testing.mpirun import run_mpi
    result = run_mpi(2, ["-m", "mpitrain"], cwd=str(tmp_path), timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("usage:") == 1, result.stderr


def test_status_into_a_closed_pipe_ends_quietly(tmp_path):
    # `mpitrain status runs/* | head -1`: each run after the first printed
    # "mpitrain status: error: [Errno 32] Broken pipe", exit status 2
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"type": "start", "step": 0}\n'
                                       '{"type": "end", "steps": 4, "seconds": 1.0}\n')
    process = subprocess.Popen([sys.executable, "-m", "mpitrain", "status", str(run), str(run),
                                str(run)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               cwd=REPO)
    process.stdout.close()          # the reader is gone before anything is written
    _, err = process.communicate(timeout=120)
    assert process.returncode == 141 and err == b"", (process.returncode, err)


def _started_without(fd, args):
    """`python -m mpitrain ARGS` started with descriptor ``fd`` closed (`0<&-`, `>&-`)."""
    # (the child closes it after the pipes are in place, before it runs Python)
    return subprocess.run([sys.executable, "-m", "mpitrain", *args], cwd=REPO,
                          preexec_fn=lambda: os.close(fd), stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=120)


def test_closed_standard_streams_are_no_bug(tmp_path, small_corpus):
    # `train ... >&-` trained, then failed flushing standard output: a traceback and
    # "internal error ... a bug", status 1; `prepare --feats ark:-` with standard input
    # closed and `export --out ark:-` with standard output closed were tracebacks too
    from .helpers import QUICKSTART
    run = tmp_path / "run"
    done = _started_without(1, ["train", QUICKSTART, "--run-dir", str(run), "--set",
                                f"data.train={small_corpus}/train", "--set",
                                f"data.dev={small_corpus}/dev", "--set",
                                "model.hidden_dim=16", "--set", "training.max_steps=4"])
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert (run / "final.h5").exists()
    feats = tmp_path / "feats.txt"
    feats.write_text("u1  [\n 1 2\n 3 4 ]\n")
    (tmp_path / "ali.txt").write_text("u1 0 1\n")
    done = _started_without(0, ["prepare", "--feats", "ark,t:-", "--ali",
                                f"ark,t:{tmp_path / 'ali.txt'}", "--out", str(tmp_path / "c")])
    assert done.returncode == 2 and done.stderr.splitlines() == [
        "mpitrain prepare: error: -: standard input is closed; there is no ark to read "
        "from it"], done.stderr
    assert not (tmp_path / "c").exists()
    done = _started_without(1, ["export", str(run / "final.h5"), "--feats",
                                f"ark,t:{feats}", "--out", "ark,t:-"])
    assert done.returncode == 2 and done.stderr.splitlines()[-1] == (
        "mpitrain export: error: --out -: standard output is closed; nothing can be "
        "written to it"), done.stderr


def _assert_refused_naming_the_config(argv, settings, words, capsys):
    """train refuses the settings in one line that names the config file and says
    ``words``."""
    for setting in settings:
        argv += ["--set", setting]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mpitrain train: error: {QUICKSTART}: ") and words in err, err
    assert err.count("\n") == 1


def test_a_setting_this_job_cannot_run_names_the_config_file(small_corpus, tmp_path, capsys):
    # (the key alone was named: "parallel.num_jobs_initial/final must be in [1, 1] ...")
    data = ["--set", f"data.train={small_corpus}/train", "--set", f"data.dev={small_corpus}/dev"]
    for settings, words in ((["parallel.method=kaldi", "parallel.num_jobs_final=2"],
                             "parallel.num_jobs_initial/final must be in [1, 1]"),
                            (["parallel.method=param_server"], "needs at least 2 ranks")):
        argv = ["train", QUICKSTART, "--run-dir", str(tmp_path / "run"), "--dry-run"] + data
        _assert_refused_naming_the_config(argv, settings, words, capsys)


@pytest.mark.parametrize("dry_run", [False, True], ids=["run", "dry-run"])
def test_a_setting_virtual_ranks_cannot_run_names_the_config_file(small_corpus, tmp_path,
                                                                  capsys, dry_run):
    # as on real ranks (the key alone was named with --virtual)
    data = ["--set", f"data.train={small_corpus}/train", "--set", f"data.dev={small_corpus}/dev"]
    for settings, words in ((["parallel.method=kaldi", "parallel.num_jobs_final=3"],
                             "parallel.num_jobs_initial/final must be in [1, 2]"),
                            (["parallel.straggler.ranks=[2]"], "parallel.straggler.ranks: rank 2"),
                            (["parallel.method=param_server", "parallel.servers=2"],
                             "needs at least 3 ranks")):
        argv = ["train", QUICKSTART, "--run-dir", str(tmp_path / "run"), "--virtual", "2",
                "--compute-ms", "1"] + data + ["--dry-run"] * dry_run
        _assert_refused_naming_the_config(argv, settings, words, capsys)
        assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("encoding", ["ascii", "latin-1"])
def test_output_the_locale_cannot_spell_is_escaped_not_an_error(tmp_path, encoding):
    """prepare wrote its corpus, then failed (exit 2, "'latin-1' codec can't encode
    characters") printing an utterance named in Japanese under a Latin-1 locale."""
    import kaldiio
    import numpy as np
    from .helpers import locale_env
    env = locale_env(tmp_path, encoding)
    feats = {f"\u65e5\u672c{i}": np.zeros((5, 2), np.float32) for i in range(2)}
    kaldiio.save_ark(str(tmp_path / "feats.ark"), feats)
    kaldiio.save_ark(str(tmp_path / "ali.ark"), {"\u65e5\u672c0": np.zeros(5, np.int32)})
    result = subprocess.run([sys.executable, "-m", "mpitrain", "prepare", "--feats",
                             "ark:feats.ark", "--ali", "ark:ali.ark", "--out", "corpus",
                             "--num-classes", "2"], capture_output=True, cwd=tmp_path,
                            env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert b"  no alignment: \\u65e5\\u672c1\n" in result.stdout, result.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("method", [["parallel.method=adpsgd", "parallel.topology=random_ring",
                                     "parallel.delay_by_one=true"],
                                    ["parallel.method=model_averaging"]])
def test_a_dry_run_on_ranks_leaves_mpi_nothing_to_complain_of(small_corpus, tmp_path, method):
    # the strategy's split-off communicators were freed only after a run: MPI's
    # finalize said "Builtin communicator ... has pending 2 references" on every rank
    from mpitrain.testing.mpirun import run_mpi
    argv = ["-m", "mpitrain", "train", QUICKSTART, "--dry-run", "--run-dir",
            str(tmp_path / "run")]
    for item in [f"data.train={small_corpus}/train", "data.dev=", "model.hidden_dim=16",
                 *method]:
        argv += ["--set", item]
    result = run_mpi(2, argv, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "dry run: the configuration" in result.stdout
    assert result.stderr == "", result.stderr


def test_settings_the_run_does_not_read_are_noted_at_its_start(small_corpus, tmp_path,
                                                                capsys):
    # (a config written for one method, run with another: bit for bit as without them)
    argv = ["train", QUICKSTART, "--run-dir", str(tmp_path / "run"), "--dry-run",
            "--set", f"data.train={small_corpus}/train", "--set", f"data.dev={small_corpus}/dev"]
    assert main(argv) == 0
    assert "config:" not in capsys.readouterr().out
    extra = ["parallel.delay_by_one=true", "optimizer.ngsgd.rank_in=10",
             "parallel.block_momentum=0.5", "parallel.average_every=4",
             "parallel.average_momentum=true", "parallel.method=bmuf"]
    assert main(argv + [word for item in extra for word in ("--set", item)]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines()
             if line.startswith("config:")]
    assert notes == ["config: optimizer.ngsgd.rank_in=10, parallel.average_momentum=true, "
                     "parallel.delay_by_one=true: set, but not read with this run's other "
                     "settings (parallel.method bmuf, optimizer.name sgd, optimizer.schedule "
                     "exponential, model.nonlinearity relu)"]


def test_an_l2_strong_enough_to_wear_the_model_down_is_noted_at_the_start(small_corpus,
                                                                          tmp_path, capsys):
    # accepted (below the bound of 1 a step), it ended runs at chance without a word
    argv = ["train", QUICKSTART, "--run-dir", str(tmp_path / "run"), "--dry-run",
            "--set", f"data.train={small_corpus}/train", "--set", f"data.dev={small_corpus}/dev",
            "--set", "optimizer.initial_learning_rate=0.004", "--set", "training.minibatch=250"]
    assert main(argv + ["--set", "optimizer.l2_regularize=1e-3"]) == 0
    assert "config:" not in capsys.readouterr().out
    assert main(argv + ["--set", "optimizer.l2_regularize=0.1"]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines()
             if line.startswith("config:")]
    assert notes == ["config: optimizer.l2_regularize=0.1 takes 0.2 of the weights off them "
                     "a step at the largest rate (2 x rate x L2 x training.minibatch); from "
                     "0.1 the model wears down towards chance (Kaldi's values, 1e-5 to 1e-3, "
                     "take well under 0.001)"], notes


def test_a_config_through_a_pipe_is_refused_under_a_launcher(tmp_path, monkeypatch):
    # `mpiexec -n 2 python -m mpitrain train <(sed ... cfg.yaml)`: every rank reads the
    # config itself, one took the pipe's text and the other read nothing, said as
    # "data.train: no training corpus given"
    import argparse
    from types import SimpleNamespace

    from mpitrain import cli, launch
    monkeypatch.setattr(launch, "several_ranks", lambda: True)
    # (a stand-in: prepare on this rank, then the one line rank 0 would say)
    prepared = []
    monkeypatch.setattr(launch, "start_ranks", lambda prepare, **_: (
        prepared.append(prepare()), SimpleNamespace(rank=0), None, "prepared")[1:])
    config = open(QUICKSTART, "rb").read()
    read_end, write_end = os.pipe()
    os.write(write_end, config)
    os.close(write_end)
    try:
        args = argparse.Namespace(config=f"/dev/fd/{read_end}", set=[], command="train",
                                  run_dir=str(tmp_path / "run"), resume=False,
                                  overwrite=False)
        with pytest.raises(cli.UsageError, match=rf"^/dev/fd/{read_end}: not a regular file "
                                                 r"\(a pipe or a device\), and under an MPI "
                                                 r"launcher every rank reads the config "
                                                 r"itself: write it to a file"):
            cli._start_ranks(args)
        assert os.read(read_end, len(config) + 1) == config       # (left unread)
        assert not prepared
    finally:
        os.close(read_end)
    # a file, or a link to one, is read as ever
    (tmp_path / "link.yaml").symlink_to(QUICKSTART)
    for path in (QUICKSTART, str(tmp_path / "link.yaml")):
        args.config = path
        with pytest.raises(cli.UsageError, match="^prepared$"):
            cli._start_ranks(args)
    assert len(prepared) == 2


@pytest.mark.parametrize("argv", [
    ["export", "model.h5", "--feats", "f.scp", "--out", "o.ark", "--prior-scale", "x" * 10 ** 6],
    ["train", "y" * 10 ** 6],
], ids=["argparse", "config-path"])
def test_a_huge_command_line_value_is_cut_short_in_the_error(argv, capsys):
    try:
        assert main(argv) == 2
    except SystemExit as end:           # (argparse's own error)
        assert end.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"mpitrain {argv[0]}: error: ") and len(last) < 1500
    assert "(1000" in last and "characters)" in last


def test_a_stray_long_path_is_named_whole_in_a_command_line_error(capsys):
    # cut at 60 characters, the error hid the path's end: the file name passed
    path = "/scratch/users/someone/experiments/2024/a-run-with-a-rather-long-name/" \
        "ckpt-00000120.h5"
    with pytest.raises(SystemExit) as end:
        main(["train", "run.yaml", path])
    assert end.value.code == 2
    assert f"unrecognized arguments: {path}" in capsys.readouterr().err


@pytest.mark.mpi
def test_a_program_started_by_a_script_that_began_mpi_alone_runs_as_one_process(tmp_path):
    # a script that imports mpi4py (MPI started without a launcher) and then runs
    # `mpitrain status`: Open MPI 4 had put PMIX_RANK into the script's environment,
    # and the command took itself for one of several ranks ("status runs as one
    # process; start it without mpiexec or srun"), status 2
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"type": "start", "step": 0}\n'
                                       '{"type": "end", "steps": 4, "seconds": 1.0}\n')
    script = ("import subprocess, sys\n"
              "from mpi4py import MPI\n"
              "MPI.COMM_WORLD.Barrier()\n"
              "done = subprocess.run([sys.executable, '-m', 'mpitrain', 'status', sys.argv[1]])\n"
              "raise SystemExit(done.returncode)\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE",
                        "MPI_LOCALNRANKS", "HYDI_CONTROL_FD", "SLURM_PROCID")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", script, str(run)], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "runs as one process" not in done.stderr, done.stderr
