"""Importing Kaldi features and alignments written with kaldiio."""

import os
import re

import kaldiio
import numpy as np
import pytest
import yaml

from mpitrain.cli import main
from mpitrain.data.corpus import CorpusError, load_manifest
from mpitrain.data.kaldi import import_kaldi, read_alignments
from mpitrain.data.shards import ShardReader


@pytest.fixture
def kaldi_dir(tmp_path):
    """feats.ark/.scp for 6 utterances; alignments for 4 of them match, 1 is too short,
    1 is missing, and 1 alignment has no features."""
    rng = np.random.default_rng(0)
    feats = {f"spk1-utt{i}": rng.normal(size=(int(rng.integers(5, 20)), 13)).astype(np.float32)
             for i in range(6)}
    ali = {k: rng.integers(0, 9, v.shape[0]).astype(np.int32) for k, v in feats.items()}
    ali["spk1-utt3"] = ali["spk1-utt3"][:-2]              # length mismatch
    del ali["spk1-utt5"]                                  # missing alignment
    ali["spk9-orphan"] = np.array([1, 2, 3], np.int32)    # alignment without features
    ali["spk1-utt0"][0] = 11                              # the largest pdf id
    kaldiio.save_ark(str(tmp_path / "feats.ark"), feats, scp=str(tmp_path / "feats.scp"))
    kaldiio.save_ark(str(tmp_path / "ali.ark"), ali)
    with open(tmp_path / "ali.txt", "w") as f:            # the format of ali-to-pdf ark,t:
        for k, v in ali.items():
            f.write(k + " " + " ".join(map(str, v)) + "\n")
    return tmp_path, feats, ali


def read_corpus(out):
    manifest = load_manifest(str(out))
    data = {}
    for i in range(len(manifest.shards)):
        with ShardReader(manifest.shard_path(i)) as shard:
            f, l, o = shard.read(0, shard.num_utterances)
            for k, utt in enumerate(shard.utt_ids):
                data[utt] = (f[o[k]:o[k + 1]], l[o[k]:o[k + 1]])
    return manifest, data


@pytest.mark.parametrize("feats_spec,ali_spec", [
    ("scp:{d}/feats.scp", "ark:{d}/ali.ark"),
    ("ark:{d}/feats.ark", "ark,t:{d}/ali.txt"),
    ("{d}/feats.scp", "{d}/ali.txt"),
])
def test_import_reads_back_exactly_and_counts_skips(kaldi_dir, feats_spec, ali_spec):
    d, feats, ali = kaldi_dir
    out = d / "corpus"
    report = import_kaldi(feats_spec.format(d=d), ali_spec.format(d=d), str(out), shards=2)
    good = ["spk1-utt0", "spk1-utt1", "spk1-utt2", "spk1-utt4"]
    assert report.imported == 4
    assert report.frames == sum(feats[k].shape[0] for k in good)
    assert report.missing_alignment == ["spk1-utt5"]
    assert report.length_mismatch == [("spk1-utt3", feats["spk1-utt3"].shape[0],
                                       feats["spk1-utt3"].shape[0] - 2)]
    assert report.alignments_without_features == 1
    assert report.num_classes == 12 and report.feat_dim == 13
    assert "imported 4 utterances" in report.summary()

    manifest, data = read_corpus(out)
    assert manifest.num_classes == 12 and manifest.feat_dim == 13
    assert manifest.source["kind"] == "kaldi"
    assert sorted(data) == good
    for k in good:
        np.testing.assert_array_equal(data[k][0], feats[k])
        np.testing.assert_array_equal(data[k][1], ali[k])

    with open(out / "import-report.yaml") as f:
        saved = yaml.safe_load(f)
    assert saved["imported"] == 4 and saved["missing_alignment"] == ["spk1-utt5"]
    assert saved["length_mismatch"][0]["utt"] == "spk1-utt3"


def test_binary_and_text_alignments_agree(kaldi_dir):
    d, _, ali = kaldi_dir
    kaldiio.save_ark(str(d / "ali-bracketed.txt"), ali, text=True)
    binary = read_alignments(f"ark:{d}/ali.ark")
    for other in (read_alignments(f"ark,t:{d}/ali.txt"),
                  read_alignments(f"ark,t:{d}/ali-bracketed.txt")):
        assert sorted(binary) == sorted(other) == sorted(ali)
        for k in ali:
            np.testing.assert_array_equal(binary[k], other[k])
            np.testing.assert_array_equal(binary[k], ali[k])


def test_explicit_num_classes_is_checked(kaldi_dir):
    d, _, _ = kaldi_dir
    report = import_kaldi(f"scp:{d}/feats.scp", f"ark:{d}/ali.ark", str(d / "c1"), num_classes=20)
    assert load_manifest(str(d / "c1")).num_classes == 20 == report.num_classes
    with pytest.raises(CorpusError, match=r"ali.ark: utterance 'spk1-utt0': pdf id 11 is outside"):
        import_kaldi(f"scp:{d}/feats.scp", f"ark:{d}/ali.ark", str(d / "c2"), num_classes=10)
    assert not os.path.exists(d / "c2" / "corpus.yaml")


def test_a_class_count_no_model_can_have_is_refused_before_writing(kaldi_dir):
    """One label of 2**31 - 1 (a corrupt alignment) or --num-classes 20000000: prepare
    allocated class counts that size, ran out of memory and left a partial shard."""
    d, _, ali = kaldi_dir
    with pytest.raises(ValueError, match=r"num_classes \(--num-classes\) 20000000: at most "
                                         r"1048576 classes"):
        import_kaldi(f"scp:{d}/feats.scp", f"ark:{d}/ali.ark", str(d / "c1"),
                     num_classes=20_000_000)
    huge = dict(ali)
    first = sorted(huge)[0]
    huge[first] = huge[first].copy()
    huge[first][0] = 2 ** 31 - 1
    kaldiio.save_ark(str(d / "huge.ark"), huge)
    with pytest.raises(CorpusError, match=rf"huge.ark: utterance '{first}': label 2147483647 "
                                          r"would make 2147483648 classes, more than the 1048576"):
        import_kaldi(f"scp:{d}/feats.scp", f"ark:{d}/huge.ark", str(d / "c2"))
    assert not os.path.exists(d / "c1") and not os.path.exists(d / "c2")


def test_a_corpus_yaml_with_more_classes_than_a_model_can_have_is_refused(kaldi_dir):
    import yaml
    d, _, _ = kaldi_dir
    import_kaldi(f"scp:{d}/feats.scp", f"ark:{d}/ali.ark", str(d / "c"))
    path = d / "c" / "corpus.yaml"
    data = yaml.safe_load(path.read_text())
    data["num_classes"] = 10 ** 12
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(CorpusError, match=r"num_classes.*at most 1048576"):
        load_manifest(str(d / "c"))


def test_errors_name_the_file(kaldi_dir):
    d, _, _ = kaldi_dir
    with pytest.raises(CorpusError, match=r"missing.scp: scp file not found"):
        import_kaldi(f"scp:{d}/missing.scp", f"ark:{d}/ali.ark", str(d / "c"))
    (d / "bad.txt").write_text("spk1-utt0 1 2 x 4\n")
    with pytest.raises(CorpusError, match=r"bad.txt:1: utterance 'spk1-utt0': expected integer "
                                          r"pdf ids, got 'x'"):
        read_alignments(f"ark,t:{d}/bad.txt")
    (d / "pipe.scp").write_text("spk1-utt0 no-such-kaldi-tool ark:x.ark ark:- |\n")
    with pytest.raises(CorpusError, match=r"no-such-kaldi-tool ark:x.ark ark:- \|: the command "
                                          r"failed with exit status 127: .*not found"):
        import_kaldi(f"scp:{d}/pipe.scp", f"ark:{d}/ali.ark", str(d / "c"), scp_commands=True)
    (d / "dangling.scp").write_text(f"spk1-utt0 {d}/nowhere.ark:3\n")
    with pytest.raises(CorpusError, match=r"dangling.scp: utterance 'spk1-utt0' points to"):
        import_kaldi(f"scp:{d}/dangling.scp", f"ark:{d}/ali.ark", str(d / "c"))


def test_pickled_records_are_refused(tmp_path):
    # A kaldiio ark may carry a pickle ("PKL" marker); loading it would run code.
    (tmp_path / "evil.ark").write_bytes(b"utt1 PKL\x80\x04N.")
    (tmp_path / "ali.txt").write_text("utt1 0 0\n")
    with pytest.raises(CorpusError, match="pickled"):
        import_kaldi(f"ark:{tmp_path}/evil.ark", f"ark,t:{tmp_path}/ali.txt", str(tmp_path / "c"))


def test_compressed_and_double_features_are_imported_as_float32(tmp_path):
    rng = np.random.default_rng(1)
    feats = {"a": rng.normal(size=(7, 5)), "b": rng.normal(size=(4, 5))}
    kaldiio.save_ark(str(tmp_path / "cm.ark"), {"a": feats["a"].astype(np.float32)},
                     compression_method=2)
    kaldiio.save_ark(str(tmp_path / "cm.ark"), {"b": feats["b"]}, append=True)   # float64
    (tmp_path / "ali.txt").write_text("a " + " ".join(["1"] * 7) + "\nb 0 0 0 0\n")
    import_kaldi(f"ark:{tmp_path}/cm.ark", f"{tmp_path}/ali.txt", str(tmp_path / "c"))
    _, data = read_corpus(tmp_path / "c")
    expected = dict(kaldiio.load_ark(str(tmp_path / "cm.ark")))
    assert data["a"][0].dtype == np.float32
    # decoded as Kaldi decodes (data/test_kaldi_read.py), a few ulp from kaldiio's
    np.testing.assert_allclose(data["a"][0], expected["a"], rtol=0,
                               atol=4 * np.spacing(np.abs(expected["a"]).max()))
    np.testing.assert_allclose(data["a"][0], feats["a"], atol=0.05)       # lossy compression
    np.testing.assert_array_equal(data["b"][0], feats["b"].astype(np.float32))


@pytest.mark.parametrize("tolerance,imported", [(1, False), (2, True), (5, True)])
def test_length_tolerance_cuts_both_to_the_shorter(kaldi_dir, tolerance, imported, capsys):
    d, feats, ali = kaldi_dir
    out = d / f"corpus-{tolerance}"
    long_ali = dict(ali, **{"spk1-utt4": np.append(ali["spk1-utt4"], np.int32(7)).astype(np.int32)})
    kaldiio.save_ark(str(d / "ali-long.ark"), long_ali)      # utt4: one label too many
    report = import_kaldi(f"scp:{d}/feats.scp", f"ark:{d}/ali-long.ark", str(out),
                          length_tolerance=tolerance)
    n3, n4 = feats["spk1-utt3"].shape[0], feats["spk1-utt4"].shape[0]
    assert ("spk1-utt4", n4, n4 + 1) in report.trimmed
    assert (("spk1-utt3", n3, n3 - 2) in report.trimmed) == imported
    assert (("spk1-utt3", n3, n3 - 2) in report.length_mismatch) == (not imported)
    _, data = read_corpus(out)
    np.testing.assert_array_equal(data["spk1-utt4"][0], feats["spk1-utt4"])
    np.testing.assert_array_equal(data["spk1-utt4"][1], ali["spk1-utt4"])
    if imported:     # the features' last two frames go: they have no labels
        np.testing.assert_array_equal(data["spk1-utt3"][0], feats["spk1-utt3"][:n3 - 2])
        np.testing.assert_array_equal(data["spk1-utt3"][1], ali["spk1-utt3"])
    else:
        assert "spk1-utt3" not in data
    assert "cut " in report.summary()
    with open(out / "import-report.yaml") as f:
        saved = yaml.safe_load(f)
    assert saved["length_tolerance"] == tolerance
    assert {"utt": "spk1-utt4", "feat_frames": n4, "ali_frames": n4 + 1} in saved["trimmed"]


def test_length_tolerance_from_the_command_line(kaldi_dir, capsys):
    d, feats, _ = kaldi_dir
    assert main(["prepare", "--feats", f"scp:{d}/feats.scp", "--ali", f"ark:{d}/ali.ark",
                 "--out", str(d / "c"), "--length-tolerance", "2"]) == 0
    assert "imported 5 utterances" in capsys.readouterr().out
    assert main(["prepare", "--feats", f"scp:{d}/feats.scp", "--ali", f"ark:{d}/ali.ark",
                 "--out", str(d / "c2"), "--length-tolerance", "-1"]) == 2
    assert "length tolerance must be a whole number of frames >= 0, got -1" \
        in capsys.readouterr().err
    assert not (d / "c2").exists()


@pytest.mark.parametrize("option, value", [("--num-classes", "0"), ("--shards", "0"),
                                           ("--length-tolerance", "-1")])
def test_a_bad_option_is_named_before_the_inputs_are_read(kaldi_dir, capsys, option, value):
    """An alignment pipe over a whole corpus takes long: a bad option is said first."""
    d, _, _ = kaldi_dir
    ran = d / "ran"
    assert main(["prepare", "--feats", f"scp:{d}/feats.scp",
                 "--ali", f"ark:touch {ran}; cat {d}/ali.ark |", "--out", str(d / "c"),
                 option, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mpitrain prepare: error: {option} ") and err.count("\n") == 1, err
    assert not ran.exists() and not (d / "c").exists()


@pytest.mark.parametrize("options, said", [
    (["--num-classes", "20000000"], "num_classes (--num-classes) 20000000: at most "),
    (["--norm-vars"], "--norm-vars needs per-speaker CMVN"),
    (["--utt2spk", "utt2spk"], "--feats -: computing CMVN stats reads the features twice")])
def test_options_that_no_input_can_fit_are_named_before_the_inputs_are_read(
        kaldi_dir, capsys, options, said):
    # the whole alignment pipe ran before these were refused
    d, _, _ = kaldi_dir
    ran = d / "ran"
    feats = "ark:-" if "--utt2spk" in options else f"scp:{d}/feats.scp"
    assert main(["prepare", "--feats", feats, "--ali", f"ark:touch {ran}; cat {d}/ali.ark |",
                 "--out", str(d / "c"), *options]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mpitrain prepare: error: ") and said in err, err
    assert err.count("\n") == 1, err
    assert not ran.exists() and not (d / "c").exists()


def test_nothing_to_import_says_why(tmp_path):
    rng = np.random.default_rng(3)
    feats = {f"u{i}": rng.standard_normal((50, 4)).astype(np.float32) for i in range(3)}
    kaldiio.save_ark(str(tmp_path / "feats.ark"), feats)
    # every alignment one frame short: the ids match, the lengths do not
    kaldiio.save_ark(str(tmp_path / "short.ark"),
                     {k: np.zeros(49, dtype=np.int32) for k in feats})
    with pytest.raises(CorpusError, match=r"3 utterance\(s\) have alignments in .*short.ark of "
                                          r"another length .*u0: 50 frames, 49 labels.*"
                                          r"--length-tolerance 1 would cut them"):
        import_kaldi(f"ark:{tmp_path}/feats.ark", f"ark:{tmp_path}/short.ark",
                     str(tmp_path / "c1"))
    kaldiio.save_ark(str(tmp_path / "other.ark"), {"x": np.zeros(50, dtype=np.int32)})
    with pytest.raises(CorpusError, match=r"no utterance has an alignment in .*other.ark"):
        import_kaldi(f"ark:{tmp_path}/feats.ark", f"ark:{tmp_path}/other.ark",
                     str(tmp_path / "c2"))


def _features_with_alignments_at_a_third(tmp_path, count, *, whole=()):
    """feats.ark of ``count`` utterances u0, u1, ... of 50, 51, ... frames and ali.ark
    with a label every third frame, as a chain model's (those in ``whole``: a label
    for every frame but the last); returns the features."""
    rng = np.random.default_rng(3)
    feats = {f"u{i}": rng.standard_normal((50 + i, 4)).astype(np.float32)
             for i in range(count)}
    kaldiio.save_ark(str(tmp_path / "feats.ark"), feats)
    kaldiio.save_ark(str(tmp_path / "ali.ark"),
                     {k: np.zeros(len(v) - 1 if k in whole else -(-len(v) // 3),
                                  dtype=np.int32) for k, v in feats.items()})
    return feats


def test_nothing_to_import_of_subsampled_alignments_offers_no_tolerance(tmp_path):
    # a chain model's alignment has a label every third frame: --length-tolerance
    # would cut the features to the labels' count and pair labels with wrong frames
    _features_with_alignments_at_a_third(tmp_path, 3)
    with pytest.raises(CorpusError, match=r"u0: 50 frames, 17 labels; alignments at 1/3 of "
                                          r"the features' frame rate") as e:
        import_kaldi(f"ark:{tmp_path}/feats.ark", f"ark:{tmp_path}/ali.ark",
                     str(tmp_path / "c"))
    assert "--length-tolerance" not in str(e.value)


def test_a_tolerance_that_would_cut_to_subsampled_alignments_is_refused(tmp_path):
    # an explicit --length-tolerance as wide as the utterances imported them cut to a
    # third, each label on the wrong frame, without a word
    feats = _features_with_alignments_at_a_third(tmp_path, 3)
    with pytest.raises(CorpusError, match=r"--length-tolerance 200 would cut 3 utterances to "
                                          r"alignments in .* at 1/3 of the features' frame "
                                          r"rate \(e.g. u0: 50 frames, 17 labels\).*nothing "
                                          r"imported"):
        import_kaldi(f"ark:{tmp_path}/feats.ark", f"ark:{tmp_path}/ali.ark",
                     str(tmp_path / "c"), length_tolerance=200)
    assert not (tmp_path / "c").exists()
    # a tolerance of a few frames on whole utterances still imports
    kaldiio.save_ark(str(tmp_path / "ali.ark"),
                     {k: np.zeros(len(v) - 2, dtype=np.int32) for k, v in feats.items()})
    report = import_kaldi(f"ark:{tmp_path}/feats.ark", f"ark:{tmp_path}/ali.ark",
                          str(tmp_path / "c"), length_tolerance=2)
    assert report.imported == 3 and len(report.trimmed) == 3


def test_subsampled_alignments_are_named_when_the_first_one_is_not(tmp_path):
    # one alignment at the features' rate (a frame short) read first, eleven at a
    # third: the first alone gave the ratio, so the cut went through without a word
    # and the refusal offered --length-tolerance 1
    _features_with_alignments_at_a_third(tmp_path, 12, whole={"u0"})
    with pytest.raises(CorpusError, match=r"u1: 51 frames, 17 labels; alignments at 1/3 of "
                                          r"the features' frame rate") as e:
        import_kaldi(f"ark:{tmp_path}/feats.ark", f"ark:{tmp_path}/ali.ark",
                     str(tmp_path / "c"))
    assert "--length-tolerance" not in str(e.value)
    with pytest.raises(CorpusError, match=r"--length-tolerance 200 would cut 12 utterances "
                                          r"to alignments in .* at 1/3 of the features' frame "
                                          r"rate \(e.g. u1: 51 frames, 17 labels\)"):
        import_kaldi(f"ark:{tmp_path}/feats.ark", f"ark:{tmp_path}/ali.ark",
                     str(tmp_path / "c"), length_tolerance=200)
    assert not (tmp_path / "c").exists()


def test_nothing_to_import_of_empty_alignments_offers_no_tolerance(tmp_path):
    # it offered --length-tolerance 50, which imports nothing either: an empty
    # alignment is skipped whatever the tolerance
    rng = np.random.default_rng(3)
    feats = {f"u{i}": rng.standard_normal((50, 4)).astype(np.float32) for i in range(3)}
    kaldiio.save_ark(str(tmp_path / "feats.ark"), feats)
    (tmp_path / "ali.txt").write_text("".join(f"{k}\n" for k in feats))
    with pytest.raises(CorpusError, match=r"u0: 50 frames, 0 labels; every such alignment is "
                                          r"empty: align these utterances\) and none match") as e:
        import_kaldi(f"ark:{tmp_path}/feats.ark", f"ark,t:{tmp_path}/ali.txt",
                     str(tmp_path / "c"))
    assert "--length-tolerance" not in str(e.value)
    # one alignment that a tolerance would cut is the example given
    (tmp_path / "ali.txt").write_text("u0\nu1\nu2" + " 0" * 49 + "\n")
    with pytest.raises(CorpusError, match=r"u2: 50 frames, 49 labels.*--length-tolerance 1"):
        import_kaldi(f"ark:{tmp_path}/feats.ark", f"ark,t:{tmp_path}/ali.txt",
                     str(tmp_path / "c"))


@pytest.mark.parametrize("feats,ali", [("ark:-", "ark:-"), ("-", "ark,t:-")])
def test_features_and_alignments_both_from_stdin_are_refused_before_reading(tmp_path, feats,
                                                                              ali):
    # the alignments read the features' bytes and were refused as "holds a Kaldi FM
    # matrix or vector; expected a binary int32 vector"
    with pytest.raises(ValueError, match=r"--feats and --ali both read standard input"):
        import_kaldi(feats, ali, str(tmp_path / "c"))
    assert not (tmp_path / "c").exists()


def test_a_one_line_text_matrix_is_one_frame(tmp_path):
    (tmp_path / "feats.txt").write_text("a [ 1 2 3 ]\nb [\n 1 2 3\n 4 5 6 ]\n")
    (tmp_path / "ali.txt").write_text("a 0\nb 1 0\n")
    import_kaldi(f"ark,t:{tmp_path}/feats.txt", f"ark,t:{tmp_path}/ali.txt",
                 str(tmp_path / "c"), num_classes=2)
    assert load_manifest(str(tmp_path / "c")).num_frames == 3


def test_transition_ids_given_for_pdf_ids_are_pointed_out(kaldi_dir, capsys):
    # ali.*.gz holds transition ids (from 1 up); ali-to-pdf maps them to pdf ids (from 0)
    d, feats, _ = kaldi_dir
    tids = {k: np.full(v.shape[0], 1 + 2 * (i % 4), np.int32) for i, (k, v) in
            enumerate(feats.items())}
    kaldiio.save_ark(str(d / "tids.ark"), tids)
    report = import_kaldi(f"scp:{d}/feats.scp", f"ark:{d}/tids.ark", str(d / "c1"))
    assert len(report.warnings) == 1
    assert re.search(r"tids\.ark: no frame has label 0 \(labels 1\.\.7\): transition ids rather "
                     r"than pdf ids\? .*ali-to-pdf", report.warnings[0])
    assert main(["prepare", "--feats", f"scp:{d}/feats.scp", "--ali", f"ark:{d}/tids.ark",
                 "--out", str(d / "c2")]) == 0
    assert "mpitrain prepare: warning: " in capsys.readouterr().err
    with pytest.raises(CorpusError, match=r"pdf id 7 is outside \[0, 5\) \(num_classes=5; "
                                          r"transition ids from ali\.\*\.gz\? convert them with "
                                          r"ali-to-pdf\)"):
        import_kaldi(f"scp:{d}/feats.scp", f"ark:{d}/tids.ark", str(d / "c3"), num_classes=5)
    # pdf ids from 0 (the fixture's alignments) warn of nothing
    assert import_kaldi(f"scp:{d}/feats.scp", f"ark:{d}/ali.ark", str(d / "c4")).warnings == []


def test_length_tolerance_skips_an_utterance_it_would_cut_to_nothing(tmp_path):
    # an empty alignment within the tolerance of its features' length would leave no
    # frame: the utterance is skipped as a mismatch, not the whole import failed
    rng = np.random.default_rng(4)
    feats = {"u0": rng.standard_normal((30, 4)).astype(np.float32),
             "u1": rng.standard_normal((2, 4)).astype(np.float32)}
    kaldiio.save_ark(str(tmp_path / "feats.ark"), feats)
    kaldiio.save_ark(str(tmp_path / "ali.ark"), {"u0": np.ones(30, dtype=np.int32),
                                                  "u1": np.zeros(0, dtype=np.int32)})
    report = import_kaldi(f"ark:{tmp_path}/feats.ark", f"ark:{tmp_path}/ali.ark",
                          str(tmp_path / "c"), length_tolerance=2, num_classes=2)
    assert report.imported == 1
    assert ("u1", 2, 0) in report.length_mismatch and not report.trimmed
    _, data = read_corpus(tmp_path / "c")
    assert set(data) == {"u0"}


def test_more_shards_than_utterances_is_said(kaldi_dir, capsys):
    # every shard past the utterances was written empty without a word
    d, feats, _ = kaldi_dir
    many = len(feats) + 3
    assert main(["prepare", "--feats", f"scp:{d}/feats.scp", "--ali", f"ark:{d}/ali.ark",
                 "--out", str(d / "c"), "--shards", str(many)]) == 0
    imported = load_manifest(str(d / "c")).num_utterances
    err = capsys.readouterr().err
    assert f"mpitrain prepare: warning: {d / 'c'}: {many - imported} of {many} shards hold " \
           f"no utterance ({imported} imported); --shards {imported} or fewer leaves none " \
           "empty" in err
    assert import_kaldi(f"scp:{d}/feats.scp", f"ark:{d}/ali.ark", str(d / "c2"),
                        shards=imported).warnings == []
