"""Export: a trained model writes Kaldi log-likelihoods that turn back into posteriors."""

import os

import numpy as np
import pytest

from mpitrain.cli import main
from mpitrain.data.corpus import load_manifest
from mpitrain.nn.model_file import load_model

from .helpers import train_in_process


@pytest.mark.slow
def test_export_writes_kaldi_loglikes(small_corpus, tmp_path):
    import kaldiio
    from mpitrain.data.shards import ShardReader
    run = tmp_path / "run"
    train_in_process(run, small_corpus, ["training.max_steps=30", "model.hidden_dim=32"])
    dev = load_manifest(os.path.join(small_corpus, "dev"))
    with ShardReader(dev.shard_path(0)) as shard:
        feats, _, offsets = shard.read(0, 3)
        ids = shard.utt_ids[:3]
    kaldiio.save_ark(str(tmp_path / "feats.ark"),
                     {u: feats[offsets[i]:offsets[i + 1]] for i, u in enumerate(ids)},
                     scp=str(tmp_path / "feats.scp"))
    out = tmp_path / "loglikes.ark"
    assert main(["export", str(run / "final.h5"), "--feats", f"scp:{tmp_path / 'feats.scp'}",
                 "--out", f"ark:{out}"]) == 0
    loglikes = dict(kaldiio.load_ark(str(out)))
    assert list(loglikes) == list(ids)
    net, priors = load_model(run / "final.h5")
    first = loglikes[ids[0]]
    assert first.shape == (offsets[1] - offsets[0], net.num_classes)
    # adding back the log priors gives log posteriors: each row sums to 1
    post = np.exp(first + np.log(priors)[None, :])
    np.testing.assert_allclose(post.sum(axis=1), 1.0, rtol=1e-4)


# ---------------------------------------------------------------- fast: priors and streams

def _small_model(path, priors):
    from mpitrain.nn.affine import Affine
    from mpitrain.nn.model_file import save_model
    from mpitrain.nn.network import Network
    from mpitrain.nn.nonlinear import ReLU
    net = Network([Affine(4 * 3, 8), ReLU(8), Affine(8, len(priors))],
                  feat_dim=4, left_context=1, right_context=1)
    net.init_params(seed=1)
    save_model(path, net, class_priors=np.asarray(priors, dtype=np.float64))
    return path


@pytest.fixture
def tiny(tmp_path):
    """A 3-class model whose third pdf was never seen (prior floored to 1e-8), and feats."""
    import kaldiio
    model = _small_model(tmp_path / "model.h5", [0.75, 0.25 - 1e-8, 1e-8])
    rng = np.random.default_rng(0)
    feats = {f"utt{i}": rng.normal(size=(5 + i, 4)).astype(np.float32) for i in range(3)}
    kaldiio.save_ark(str(tmp_path / "feats.ark"), feats)
    return tmp_path, model, feats


def _export(tiny, *extra):
    import kaldiio
    d, model, _ = tiny
    out = d / f"ll{len(os.listdir(d))}.ark"
    assert main(["export", str(model), "--feats", f"ark:{d}/feats.ark", "--out", f"ark:{out}",
                 *extra]) == 0
    return dict(kaldiio.load_ark(str(out)))


def test_scp_entries_that_are_commands_run_with_scp_commands(tiny, capsys):
    # the check that --out is not one of the inputs read the scp too, and refused
    # its commands even with --scp-commands
    import kaldiio
    d, model, feats = tiny
    for key, matrix in feats.items():
        kaldiio.save_mat(str(d / f"{key}.mat"), matrix)
    (d / "cmd.scp").write_text("".join(f"{k} cat {d}/{k}.mat |\n" for k in feats))
    argv = ["export", str(model), "--feats", f"scp:{d}/cmd.scp", "--out", f"ark:{d}/c.ark"]
    assert main(argv) == 2
    assert "run only with --scp-commands" in capsys.readouterr().err
    assert main(argv + ["--scp-commands"]) == 0
    got = dict(kaldiio.load_ark(str(d / "c.ark")))
    want = _export(tiny)
    assert list(got) == list(feats) and all(np.array_equal(got[k], want[k]) for k in feats)


def test_partial_archives_of_a_killed_export_do_not_pile_up(tiny):
    """An export killed mid-write and run again: the partial copies of its --out files
    go; those of other outputs in the directory (other jobs') stay."""
    from mpitrain.files import temporary_path
    d, model, _ = tiny
    (d / "out").mkdir()
    for pid in (11, 12):
        for name in ("ll.ark", "ll.scp", "ll.2.ark"):
            stale = temporary_path(d / "out" / name).replace(f"-{os.getpid()}", f"-{pid}")
            (d / "out" / os.path.basename(stale)).write_bytes(b"x" * 100)
    assert main(["export", str(model), "--feats", f"ark:{d}/feats.ark",
                 "--out", f"ark,scp:{d}/out/ll.ark,{d}/out/ll.scp"]) == 0
    assert sorted(os.listdir(d / "out")) == [".ll.2.ark.tmp-11", ".ll.2.ark.tmp-12", "ll.ark",
                                             "ll.scp"]


def test_an_out_of_250_bytes_is_written_and_its_stale_partial_copy_removed(tiny):
    # the hidden temporary (.NAME.tmp-PID) of a 250-byte name passed NAME_MAX
    import kaldiio
    from mpitrain.files import temporary_path
    d, model, feats = tiny
    (d / "out").mkdir()
    ark, scp = d / "out" / ("l" * 246 + ".ark"), d / "out" / ("l" * 246 + ".scp")
    stale = temporary_path(ark).replace(f"-{os.getpid()}", "-11")
    (d / "out" / os.path.basename(stale)).write_bytes(b"x" * 100)
    assert main(["export", str(model), "--feats", f"ark:{d}/feats.ark",
                 "--out", f"ark,scp:{ark},{scp}"]) == 0
    assert sorted(os.listdir(d / "out")) == [ark.name, scp.name]
    assert sorted(kaldiio.load_scp(str(scp))) == sorted(feats)


def test_an_export_of_the_same_out_at_the_same_time_is_named(tmp_path):
    from mpitrain.export import ArkWriter
    writer = ArkWriter(f"ark,scp:{tmp_path}/ll.ark,{tmp_path}/ll.scp")
    writer.write("u1", np.zeros((2, 3), np.float32))
    os.remove(writer._tmp[f"{tmp_path}/ll.ark"])        # as an export started later does
    with pytest.raises(OSError, match=r"another export wrote .*ll.ark at the same time"):
        with writer:
            pass
    assert os.listdir(tmp_path) == []

def test_an_out_that_is_one_of_the_inputs_is_refused_and_nothing_changes(tiny, capsys):
    """The finished output replaces its --out file: naming the features (or an ark an
    scp points into, a symlink to it, the model) there would have lost them."""
    import kaldiio
    d, model, feats = tiny
    kaldiio.save_ark(str(d / "scp.ark"), feats, scp=str(d / "feats.scp"))
    os.symlink(d / "scp.ark", d / "alias.ark")
    before = {name: (d / name).read_bytes() for name in ("feats.ark", "scp.ark", "feats.scp")}
    model_bytes = model.read_bytes()
    for feats_spec, out, named in [
            (f"ark:{d}/feats.ark", f"ark:{d}/feats.ark", "--feats"),
            (f"ark:{d}/feats.ark:0", f"ark:{d}/feats.ark", "--feats"),
            (f"scp:{d}/feats.scp", f"ark:{d}/scp.ark", f"--feats {d}/feats.scp"),
            (f"scp:{d}/feats.scp", f"ark,scp:{d}/new.ark,{d}/feats.scp", "--feats"),
            (f"scp:{d}/feats.scp", f"ark:{d}/alias.ark", f"--feats {d}/feats.scp"),
            (f"ark:{d}/feats.ark", f"ark:{model}", "model")]:
        assert main(["export", str(model), "--feats", feats_spec, "--out", out]) == 2
        err = capsys.readouterr().err.strip()
        assert f"({named}" in err and "would be replaced" in err and "\n" not in err, err
    assert {name: (d / name).read_bytes() for name in before} == before
    assert model.read_bytes() == model_bytes
    assert not (d / "new.ark").exists()


def test_a_command_that_fails_before_the_last_bytes_are_flushed_is_named(tmp_path):
    """The archive's last bytes, still buffered, met the command's closed pipe when the
    writer closed: a BrokenPipeError that the command line took for 'the reader of our
    stdout left' (exit 141, no message) one time in five."""
    from mpitrain.export import ArkWriter
    writer = ArkWriter("ark:| exit 3")
    writer.write("u1", np.zeros((2, 3), np.float32))   # small: it stays in the buffer
    # the command has exited (not reaped: close still reads its status); a fixed
    # sleep left it running on a loaded machine, and the flush met no closed pipe
    [process] = [handle._proc for handle in writer._files]
    os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT)
    with pytest.raises(OSError) as info:
        writer.close()
    assert not isinstance(info.value, BrokenPipeError)
    assert str(info.value) == "--out | exit 3: the command failed with exit status 3"


def test_an_ark_and_scp_of_the_same_name_are_refused_and_nothing_changes(tiny, capsys):
    # the scp replaced the ark: the file held an scp pointing into itself
    d, model, _ = tiny
    (d / "s.ark").write_text("old")
    assert main(["export", str(model), "--feats", f"ark:{d}/feats.ark",
                 "--out", f"ark,scp:{d}/s.ark,{d}/s.ark"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the ark and the scp are the same file" in err, err
    assert (d / "s.ark").read_text() == "old"
    assert not [p for p in os.listdir(d) if ".tmp" in p]


def test_an_scp_of_an_archive_on_standard_output_is_refused_and_nothing_written(tiny, capsys):
    d, model, _ = tiny
    before = sorted(os.listdir(d))
    assert main(["export", str(model), "--feats", f"ark:{d}/feats.ark",
                 "--out", f"ark,scp:-,{d}/s.scp"]) == 2
    captured = capsys.readouterr()
    assert captured.err == (f"mpitrain export: error: --out ark,scp:-,{d}/s.scp: an scp needs "
                            "the ark written to a file\n")
    assert captured.out == "" and sorted(os.listdir(d)) == before


def test_an_scp_names_an_archive_named_in_latin1_by_its_bytes(tiny):
    # the scp is text, and the archive's name could not be written into it
    from mpitrain.data.kaldi_read import read_feature_matrices
    d, model, _ = tiny
    ark = os.fsdecode(os.path.join(os.fsencode(str(d)), b"caf\xe9.ark"))
    try:
        open(ark, "wb").close()
    except (OSError, UnicodeError):
        pytest.skip("this file system takes only UTF-8 names")
    assert main(["export", str(model), "--feats", f"ark:{d}/feats.ark",
                 "--out", f"ark,scp:{ark},{d}/out.scp"]) == 0
    assert (d / "out.scp").read_bytes().split(b"\n")[0].split()[1].startswith(
        os.fsencode(ark) + b":")
    # and the scp reads back, as Kaldi's tools read it
    assert len(dict(read_feature_matrices(f"scp:{d}/out.scp"))) == 3


def test_an_out_that_is_a_directory_is_refused_before_any_work(tiny, capsys):
    d, model, _ = tiny
    (d / "outdir").mkdir()
    assert main(["export", str(model), "--feats", f"ark:{d}/feats.ark",
                 "--out", f"ark:{d}/outdir"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "outdir is a directory; name a file" in err, err
    assert os.listdir(d / "outdir") == []


def test_features_that_overflow_the_model_give_an_error_not_nan_scores(tiny, capsys):
    """A finite frame far outside the training range (3e38) made NaN log-likelihoods,
    written with exit status 0 for a decoder to read."""
    import kaldiio

    from mpitrain.nn.model_file import load_model, save_model
    d, model, feats = tiny
    net, stored = load_model(model)
    net.params[...] = np.random.default_rng(4).standard_normal(net.num_params)  # trained-like
    save_model(model, net, class_priors=stored)
    bad = dict(feats)
    bad["utt1"] = bad["utt1"].copy()
    bad["utt1"][2] = 3e38
    kaldiio.save_ark(str(d / "huge.ark"), bad)
    assert main(["export", str(model), "--feats", f"ark:{d}/huge.ark",
                 "--out", f"ark:{d}/ll.ark"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "utterance utt1: the model's output is not finite at frame" in err, err
    assert "features up to 3e+38 in magnitude" in err
    assert not (d / "ll.ark").exists()


def test_a_model_whose_weights_overflow_is_named_not_the_features(tiny, capsys):
    """A crafted model file (weights of 1e30, finite, checksummed) turned ordinary
    features into NaN scores, and the error blamed the features."""
    from mpitrain.inference import load_model as load_for_inference
    from mpitrain.nn.model_file import save_model
    d, model, feats = tiny
    net, stored = load_model(model)
    net.components[0].weight[...] = 1e30
    net.components[2].weight[...] = 1e30
    save_model(model, net, class_priors=stored)
    assert main(["export", str(model), "--feats", f"ark:{d}/feats.ark",
                 "--out", f"ark:{d}/ll.ark"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"mpitrain export: error: {model}: the model's outputs overflow "
                          "(inf or NaN) at component 3 of 3, Affine(8->3), parameters up to "
                          "1e+30 in magnitude, on frame 0 of 5"), err
    assert f"(utterance utt0 of ark:{d}/feats.ark)" in err and "features up to" not in err
    assert not (d / "ll.ark").exists()
    with pytest.raises(ValueError) as info:
        load_for_inference(str(model)).log_posteriors(feats["utt0"])
    assert str(info.value).startswith(f"{model}: the model's outputs overflow"), info.value


def test_the_scp_names_the_archive_by_its_bytes_under_a_latin1_locale(tiny):
    """The scp's archive path was written as UTF-8 text of the name Python held: under
    a Latin-1 locale a directory named in UTF-8 ('o\u00fct') became other bytes, and
    the scp named no archive."""
    import subprocess
    import sys

    import kaldiio
    from .helpers import locale_env
    d, model, feats = tiny
    env = locale_env(d, "latin-1")
    out = os.fsencode(d) + b"/o\xc3\xbct"
    os.mkdir(out)
    result = subprocess.run(
        [sys.executable, "-m", "mpitrain", "export", str(model), "--feats",
         f"ark:{d}/feats.ark", "--out", b"ark,scp:" + out + b"/ll.ark," + out + b"/ll.scp"],
        capture_output=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    scp = (d / "o\u00fct" / "ll.scp").read_bytes()
    assert scp.startswith(b"utt0 " + out + b"/ll.ark:"), scp
    loaded = dict(kaldiio.load_scp(str(d / "o\u00fct" / "ll.scp")))
    assert sorted(loaded) == sorted(feats)


def test_export_to_stdout_writes_only_the_archive(tiny):
    import io
    import subprocess
    import sys
    import kaldiio
    d, model, feats = tiny
    result = subprocess.run([sys.executable, "-m", "mpitrain", "export", str(model),
                             "--feats", f"ark:{d}/feats.ark", "--out", "ark:-"],
                            capture_output=True, cwd=d, timeout=120)
    assert result.returncode == 0, result.stderr
    got = dict(kaldiio.load_ark(io.BytesIO(result.stdout)))
    assert list(got) == list(feats)
    assert main(["export", str(model), "--feats", f"ark:{d}/feats.ark",
                 "--out", f"ark:{d}/file.ark"]) == 0
    assert result.stdout == (d / "file.ark").read_bytes()
    assert b"wrote pseudo log-likelihoods of 3 utterances to ark:-" in result.stderr
    assert b"1 of 3 pdfs were never seen" in result.stderr


def test_stdout_closed_by_its_reader_ends_quietly_as_a_unix_tool(tiny):
    # `export --out ark:- | head`: the reader of our stdout went away; as any
    # command whose output is cut short (docs/reliability.md): no message, status 141
    import subprocess
    import sys
    import kaldiio
    d, model, _ = tiny
    rng = np.random.default_rng(1)
    # far more than a pipe holds, so the writer meets the closed pipe
    kaldiio.save_ark(str(d / "big.ark"),
                     {f"u{i}": rng.standard_normal((400, 4)).astype(np.float32)
                      for i in range(100)})
    process = subprocess.Popen([sys.executable, "-m", "mpitrain", "export", str(model),
                                "--feats", f"ark:{d}/big.ark", "--out", "ark,t:-"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=d)
    process.stdout.read(10)
    process.stdout.close()
    _, err = process.communicate(timeout=120)
    assert process.returncode == 141, err
    assert b"error" not in err, err


def test_unseen_pdfs_get_a_very_low_score_and_one_warning(tiny, capsys):
    from mpitrain.export import UNSEEN_SCORE
    loglikes = _export(tiny)
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if "never seen" in line]
    assert len(warnings) == 1 and "1 of 3 pdfs" in warnings[0] and "model.h5" in warnings[0]
    for matrix in loglikes.values():
        assert (matrix[:, 2] < UNSEEN_SCORE / 2).all()         # about -1.8e19: never chosen
        assert np.isfinite(matrix).all()
        assert (matrix[:, :2] > -100).all()


def test_prior_scale_and_no_priors_follow_the_stated_convention(tiny, capsys):
    full = _export(tiny)
    half = _export(tiny, "--prior-scale", "0.5")
    post = _export(tiny, "--no-priors")
    capsys.readouterr()
    log_priors = np.log([0.75, 0.25 - 1e-8])
    for utt, logpost in post.items():
        # log posteriors: each row sums to 1
        np.testing.assert_allclose(np.exp(logpost).sum(axis=1), 1.0, rtol=1e-5)
        # log p(x|s) = log p(s|x) - scale * log p(s)
        np.testing.assert_allclose(full[utt][:, :2], logpost[:, :2] - log_priors, atol=1e-5)
        np.testing.assert_allclose(half[utt][:, :2], logpost[:, :2] - 0.5 * log_priors,
                                   atol=1e-5)
    assert main(["export", str(tiny[1]), "--feats", f"ark:{tiny[0]}/feats.ark",
                 "--out", f"ark:{tiny[0]}/x.ark", "--prior-scale", "-1"]) == 2
    assert "--prior-scale: expected a number >= 0" in capsys.readouterr().err
    # --no-priors writes log posteriors: a scale or corpus of priors beside it is refused
    for extra in (["--prior-scale", "0.5"], ["--corpus", str(tiny[0])]):
        assert main(["export", str(tiny[1]), "--feats", f"ark:{tiny[0]}/feats.ark",
                     "--out", f"ark:{tiny[0]}/y.ark", "--no-priors"] + extra) == 2
        err = capsys.readouterr().err
        assert f"{extra[0]}: gives the priors, which --no-priors leaves out" in err
        assert len(err.strip().splitlines()) == 1
    assert not os.path.exists(f"{tiny[0]}/y.ark")
    assert not (tiny[0] / "x.ark").exists()


def test_empty_utterances_give_empty_matrices_and_nan_is_refused(tiny, capsys):
    import kaldiio
    d, model, feats = tiny
    # Kaldi writes a 0-frame utterance as a 0 x 0 matrix
    kaldiio.save_ark(str(d / "feats.ark"), {**feats, "empty": np.zeros((0, 0), np.float32),
                                            "empty4": np.zeros((0, 4), np.float32)})
    loglikes = _export(tiny)
    # written 0 x 0: Kaldi's matrix reader aborts on 0 x N (its Matrix::Init asserts
    # rows == cols == 0 when either is 0), so a decoder would die at the record
    assert loglikes["empty"].shape == loglikes["empty4"].shape == (0, 0)
    assert loglikes["utt0"].shape == (5, 3)
    capsys.readouterr()
    bad = np.ones((3, 4), np.float32)
    bad[1, 2] = np.nan
    kaldiio.save_ark(str(d / "feats.ark"), {"utt0": feats["utt0"], "bad": bad})
    assert main(["export", str(model), "--feats", f"ark:{d}/feats.ark",
                 "--out", f"ark:{d}/nan.ark"]) == 2
    assert "utterance bad contains NaN or inf" in capsys.readouterr().err
    assert not (d / "nan.ark").exists()


def test_unseen_pdfs_from_the_corpus_counts(tmp_path):
    from mpitrain.export import UNSEEN_SCORE, prior_offsets
    offsets, unseen = prior_offsets([0.5, 0.5, 0.0])
    assert unseen == 1 and offsets[2] == np.float32(UNSEEN_SCORE)
    np.testing.assert_allclose(offsets[:2], -np.log(0.5))
    offsets, unseen = prior_offsets([0.5, 0.5, 1e-3], unseen=[False, False, True], scale=2)
    assert unseen == 1 and offsets[2] == np.float32(UNSEEN_SCORE)
    np.testing.assert_allclose(offsets[:2], -2 * np.log(0.5), rtol=1e-6)


# ---------------------------------------------------------------- per-speaker CMVN

def test_export_applies_the_per_speaker_cmvn_the_model_was_trained_with(tiny, capsys):
    import kaldiio
    from mpitrain.data.cmvn import accumulate_stats, apply_cmvn
    from mpitrain.nn.model_file import load_model, save_model
    d, model, feats = tiny
    net, priors = load_model(model)
    net.speaker_cmvn = {"norm_vars": True}
    save_model(d / "spk.h5", net, class_priors=priors)
    import mpitrain
    assert mpitrain.load_model(d / "spk.h5").speaker_cmvn == {"norm_vars": True}
    assert mpitrain.load_model(model).speaker_cmvn is None
    (d / "utt2spk").write_text("utt0 s1\nutt1 s1\nutt2 s2\n")
    stats = {"s1": accumulate_stats(feats["utt1"], accumulate_stats(feats["utt0"])),
             "s2": accumulate_stats(feats["utt2"])}
    speakers = {"utt0": "s1", "utt1": "s1", "utt2": "s2"}
    normalised = {u: apply_cmvn(m, stats[speakers[u]], norm_vars=True) for u, m in feats.items()}
    kaldiio.save_ark(str(d / "normalised.ark"), normalised)
    kaldiio.save_ark(str(d / "cmvn.ark"), stats, scp=str(d / "cmvn.scp"))
    # the plain model on features normalised by hand gives the reference
    assert main(["export", str(model), "--feats", f"ark:{d}/normalised.ark",
                 "--out", f"ark:{d}/want.ark"]) == 0
    want = dict(kaldiio.load_ark(str(d / "want.ark")))
    for extra in (["--utt2spk", str(d / "utt2spk")],
                  ["--utt2spk", str(d / "utt2spk"), "--cmvn", f"scp:{d}/cmvn.scp"]):
        out = d / f"got{len(extra)}.ark"
        assert main(["export", str(d / "spk.h5"), "--feats", f"ark:{d}/feats.ark",
                     "--out", f"ark:{out}", *extra]) == 0
        got = dict(kaldiio.load_ark(str(out)))
        for utt in feats:
            np.testing.assert_allclose(got[utt], want[utt], rtol=1e-5, atol=1e-5)
    # refused in one line: missing options for such a model, extra ones for a plain one
    capsys.readouterr()
    assert main(["export", str(d / "spk.h5"), "--feats", f"ark:{d}/feats.ark",
                 "--out", f"ark:{d}/x.ark"]) == 2
    err = capsys.readouterr().err.strip()
    assert "spk.h5: the model was trained on features with per-speaker CMVN (norm_vars " \
           "true); pass --utt2spk" in err and "\n" not in err
    assert main(["export", str(model), "--feats", f"ark:{d}/feats.ark",
                 "--out", f"ark:{d}/x.ark", "--utt2spk", str(d / "utt2spk")]) == 2
    assert "trained without per-speaker CMVN" in capsys.readouterr().err
    assert not (d / "x.ark").exists()


def test_a_speaker_with_only_an_empty_utterance_needs_no_cmvn_stats(tiny):
    # compute-cmvn-stats writes no stats for such a speaker (and ours count 0 frames):
    # its utterance has no frame to normalise and is written 0 x 0, the others scored;
    # an empty utterance (0 x 0, of no dimension) before a speaker's others changes nothing
    import kaldiio
    from mpitrain.data.cmvn import accumulate_stats, apply_cmvn
    from mpitrain.nn.model_file import load_model, save_model
    d, model, feats = tiny
    net, priors = load_model(model)
    net.speaker_cmvn = {"norm_vars": True}
    save_model(d / "spk.h5", net, class_priors=priors)
    kaldiio.save_ark(str(d / "feats.ark"), {"first": np.zeros((0, 0), np.float32), **feats,
                                            "empty": np.zeros((0, 0), np.float32)})
    (d / "utt2spk").write_text("first s1\nutt0 s1\nutt1 s1\nutt2 s2\nempty s3\n")
    stats = {"s1": accumulate_stats(feats["utt1"], accumulate_stats(feats["utt0"])),
             "s2": accumulate_stats(feats["utt2"])}
    kaldiio.save_ark(str(d / "cmvn.ark"), stats)
    kaldiio.save_ark(str(d / "normalised.ark"),
                     {"utt0": apply_cmvn(feats["utt0"], stats["s1"], norm_vars=True)})
    assert main(["export", str(model), "--feats", f"ark:{d}/normalised.ark",
                 "--out", f"ark:{d}/want.ark"]) == 0
    want = dict(kaldiio.load_ark(str(d / "want.ark")))
    for extra in (["--utt2spk", str(d / "utt2spk")],
                  ["--utt2spk", str(d / "utt2spk"), "--cmvn", f"ark:{d}/cmvn.ark"]):
        out = d / f"spk{len(extra)}.ark"
        assert main(["export", str(d / "spk.h5"), "--feats", f"ark:{d}/feats.ark",
                     "--out", f"ark:{out}", *extra]) == 0
        got = dict(kaldiio.load_ark(str(out)))
        assert got["empty"].shape == got["first"].shape == (0, 0)
        np.testing.assert_allclose(got["utt0"], want["utt0"], rtol=1e-5, atol=1e-5)


def test_an_empty_utterance_in_a_text_archive_is_written_as_kaldi_writes_it(tiny):
    import kaldiio
    d, model, feats = tiny
    kaldiio.save_ark(str(d / "feats.ark"), {"empty": np.zeros((0, 0), np.float32), **feats})
    assert main(["export", str(model), "--feats", f"ark:{d}/feats.ark",
                 "--out", f"ark,t,scp:{d}/ll.txt,{d}/ll.scp"]) == 0
    # Kaldi's text form of a 0 x 0 matrix is " [ ]" ("[]" stopped kaldiio's reader)
    assert (d / "ll.txt").read_bytes().startswith(b"empty  [ ]\nutt0  [\n")
    with pytest.warns(UserWarning):             # numpy's loadtxt on no numbers
        text = dict(kaldiio.load_ark(str(d / "ll.txt")))
    assert text["empty"].size == 0 and text["utt0"].shape == (5, 3)
    scp = kaldiio.load_scp(str(d / "ll.scp"))
    assert np.allclose(scp["utt2"], text["utt2"])


def test_an_out_that_is_a_named_pipe_or_a_link_is_written_through(tiny):
    import stat
    import subprocess
    import kaldiio
    d, model, _ = tiny
    plain = _export(tiny)
    # ark:/dev/null, or a pipe made with mkfifo: renamed over, /dev/null itself was
    # replaced by a file (as root) and a pipe's reader never saw a byte
    fifo = d / "fifo"
    os.mkfifo(fifo)
    reader = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE)
    try:
        assert main(["export", str(model), "--feats", f"ark:{d}/feats.ark",
                     "--out", f"ark:{fifo}"]) == 0
        archive, _ = reader.communicate(timeout=30)
    finally:
        reader.kill()
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    (d / "piped.ark").write_bytes(archive)
    assert list(dict(kaldiio.load_ark(str(d / "piped.ark")))) == list(plain)
    # a link is written through: it stays, and its target holds the archive
    (d / "real").mkdir()
    (d / "real" / "ll.ark").write_text("old")
    (d / "link.ark").symlink_to(d / "real" / "ll.ark")
    assert main(["export", str(model), "--feats", f"ark:{d}/feats.ark",
                 "--out", f"ark,scp:{d}/link.ark,{d}/link.scp"]) == 0
    assert (d / "link.ark").is_symlink() and os.listdir(d / "real") == ["ll.ark"]
    got = kaldiio.load_scp(str(d / "link.scp"))
    assert all(np.array_equal(got[key], plain[key]) for key in plain)


def test_kaldi_write_flags_that_change_nothing_are_accepted(tiny):
    d, model, _ = tiny
    plain = _export(tiny)
    for wspec in (f"ark,b:{d}/b.ark", f"ark,b,f:{d}/bf.ark"):
        assert main(["export", str(model), "--feats", f"ark:{d}/feats.ark",
                     "--out", wspec]) == 0
    import kaldiio
    for name in ("b.ark", "bf.ark"):
        got = dict(kaldiio.load_ark(str(d / name)))
        assert list(got) == list(plain)
        for key in plain:
            assert np.array_equal(got[key], plain[key])


@pytest.mark.parametrize("wspec", ["{d}/out.ark", "scp:{d}/out.scp"])
def test_an_out_that_is_no_wspecifier_is_one_line_naming_the_option(tiny, capsys, wspec):
    d = tiny[0]
    wspec = wspec.format(d=d)
    assert main(["export", str(tiny[1]), "--feats", f"ark:{d}/feats.ark",
                 "--out", wspec]) == 2
    err = capsys.readouterr().err
    assert err == (f"mpitrain export: error: --out {wspec}: expected ark:PATH or "
                   "ark,scp:ARK,SCP\n")
    assert not os.path.exists(d / "out.ark") and not os.path.exists(d / "out.scp")


def test_a_bad_option_is_said_before_the_model_of_a_run_directory_is_named(tiny, capsys):
    """`export RUN --prior-scale nan` and `eval RUN --max-frames -1` said `using
    RUN/final.h5 (...)` before the refusal: two lines for one error."""
    import shutil
    d, model, _ = tiny
    run = d / "run"
    run.mkdir()
    shutil.copy(model, run / "final.h5")
    capsys.readouterr()
    assert main(["export", str(run), "--feats", f"ark:{d}/feats.ark", "--out",
                 f"ark:{d}/x.ark", "--prior-scale", "nan"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--prior-scale: expected a number >= 0, got nan" in err, err
    assert main(["eval", str(run), str(d), "--max-frames", "-1"]) == 2
    captured = capsys.readouterr()
    assert "using" not in captured.out + captured.err
    assert captured.err.count("\n") == 1 and "--max-frames must be >= 0" in captured.err
    assert not (d / "x.ark").exists()


def test_an_export_killed_between_its_two_renames_leaves_no_scp_of_another_archive(
        tmp_path, monkeypatch):
    """Over the ark and scp of an export before: killed after the new archive took its
    place, the old scp (offsets into the old archive) must not be left beside it."""
    import kaldiio
    from mpitrain import export
    out = f"ark,scp:{tmp_path}/ll.ark,{tmp_path}/ll.scp"
    with export.ArkWriter(out) as writer:
        for i in range(3):
            writer.write(f"old{i}", np.ones((5 + i, 4), np.float32))
    renamed = []
    real_commit = export.commit

    def killed_before_the_scp(tmp, path):
        if str(path).endswith(".scp"):
            raise KeyboardInterrupt        # stands for SIGKILL: nothing after it runs
        real_commit(tmp, path)
        renamed.append(path)

    monkeypatch.setattr(export, "commit", killed_before_the_scp)
    writer = export.ArkWriter(out)
    writer.write("new0", np.full((2, 4), 7, np.float32))
    with pytest.raises(KeyboardInterrupt):
        writer.close()
    assert renamed == [f"{tmp_path}/ll.ark"]
    assert not os.path.exists(tmp_path / "ll.scp")
    assert list(kaldiio.load_ark(str(tmp_path / "ll.ark")))[0][0] == "new0"


@pytest.mark.parametrize("failing", [0, 1], ids=["ark", "scp"])
def test_a_full_disk_when_the_files_are_closed_names_the_file_and_leaves_no_temporary(
        tmp_path, failing):
    # the last buffered bytes are written when a file is closed: a disk that filled
    # then gave "[Errno 28] No space left on device" and left both temporaries
    import errno
    from mpitrain.export import ArkWriter
    from mpitrain.files import DiskFullError

    class LastBytesMeetAFullDisk:
        def __init__(self, fh):
            self.fh, self.name = fh, fh.name

        def close(self):
            self.fh.close()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    writer = ArkWriter(f"ark,scp:{tmp_path}/ll.ark,{tmp_path}/ll.scp")
    writer.write("u1", np.zeros((2, 3), np.float32))
    writer._files[failing] = LastBytesMeetAFullDisk(writer._files[failing])
    name = ["ll.ark", "ll.scp"][failing]
    with pytest.raises(DiskFullError, match=f"^no space left on device writing {tmp_path}/{name}$"):
        with writer:
            pass
    assert os.listdir(tmp_path) == []


def test_a_flush_that_fails_after_the_files_are_closed_names_the_file_and_leaves_no_temporary(
        tmp_path, monkeypatch):
    # a quota or a network file system's full disk is told at the flush to disk, after
    # the close: the error was a bare "[Errno 122] Disk quota exceeded" and both
    # temporaries stayed
    import errno
    from mpitrain.export import ArkWriter
    real = os.fsync

    def full(fd):
        if ".ll.ark" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
        real(fd)

    writer = ArkWriter(f"ark,scp:{tmp_path}/ll.ark,{tmp_path}/ll.scp")
    writer.write("utt1", np.zeros((3, 4), np.float32))
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as caught:
        writer.close()
    assert f"{tmp_path}/ll.ark" in str(caught.value), caught.value
    assert os.listdir(tmp_path) == []
