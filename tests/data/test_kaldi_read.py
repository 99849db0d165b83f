"""One reader for every Kaldi rspecifier: files, scp offsets, pipes both in the
rspecifier and in scp entries, stdin, gzip'd arks through pipes, and failing
commands."""

import gzip
import os
import subprocess
import sys

import kaldiio
import numpy as np
import pytest

from mpitrain.cli import main
from mpitrain.data.corpus import CorpusError
from mpitrain.data.kaldi_read import read_alignments, read_feature_matrices, split_rspecifier


@pytest.fixture
def arks(tmp_path):
    rng = np.random.default_rng(5)
    feats = {f"utt{i}": rng.normal(size=(int(rng.integers(4, 9)), 3)).astype(np.float32)
             for i in range(4)}
    ali = {k: rng.integers(0, 5, v.shape[0]).astype(np.int32) for k, v in feats.items()}
    kaldiio.save_ark(str(tmp_path / "feats.ark"), feats, scp=str(tmp_path / "feats.scp"))
    kaldiio.save_ark(str(tmp_path / "ali.ark"), ali, scp=str(tmp_path / "ali.scp"))
    for name in ("feats.ark", "ali.ark"):
        with open(tmp_path / name, "rb") as src, gzip.open(tmp_path / (name + ".gz"), "wb") as gz:
            gz.write(src.read())
    with open(tmp_path / "ali.txt", "w") as f:
        for k, v in ali.items():
            f.write(k + " " + " ".join(map(str, v)) + "\n")
    return tmp_path, feats, ali


def _same(got, expected):
    assert list(got) == list(expected)
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key])


@pytest.mark.parametrize("spec", [
    "ark:{d}/feats.ark", "ark,s,cs:{d}/feats.ark", "scp:{d}/feats.scp", "scp,s,cs:{d}/feats.scp",
    "ark:cat {d}/feats.ark |", "ark,s,cs:gunzip -c {d}/feats.ark.gz |",
    "scp:cat {d}/feats.scp |", "{d}/feats.scp", "{d}/feats.ark",
])
def test_every_rspecifier_form_reads_the_same_features(arks, spec):
    d, feats, _ = arks
    _same(dict(read_feature_matrices(spec.format(d=d))), feats)


def test_scp_entries_that_are_pipes(arks):
    d, feats, _ = arks
    # as Kaldi writes them: each entry a command printing one bare matrix
    for key, matrix in feats.items():
        kaldiio.save_mat(str(d / f"{key}.mat"), matrix)
    (d / "pipes.scp").write_text("".join(f"{k} cat {d}/{k}.mat |\n" for k in feats))
    _same(dict(read_feature_matrices(f"scp:{d}/pipes.scp", scp_commands=True)), feats)


@pytest.mark.parametrize("what", ["feats", "ali", "cmvn"])
def test_commands_inside_an_scp_file_run_only_when_allowed(tmp_path, capsys, what):
    # an scp file is data: one from elsewhere must not run anything unless the user
    # says it may (prepare/export --scp-commands)
    from mpitrain.data.kaldi_read import read_cmvn_stats
    feats = {"u1": np.arange(8, dtype=np.float32).reshape(4, 2)}
    kaldiio.save_ark(str(tmp_path / "f.ark"), feats, scp=str(tmp_path / "f.scp"))
    (tmp_path / "ali.txt").write_text("u1 0 1 1 0\n")
    ran = tmp_path / "ran"
    (tmp_path / "evil.scp").write_text(f"u1 touch {ran}; cat {tmp_path}/f.ark |\n")
    readers = {"feats": read_feature_matrices, "ali": read_alignments, "cmvn": read_cmvn_stats}
    with pytest.raises(CorpusError, match=r"evil.scp:1: utterance 'u1': the entry is a command "
                                          r".*--scp-commands"):
        list(readers[what](f"scp:{tmp_path}/evil.scp"))
    assert not ran.exists()
    args = {"feats": f"scp:{tmp_path}/f.scp", "ali": f"ark,t:{tmp_path}/ali.txt", "cmvn": None}
    args[what] = f"scp:{tmp_path}/evil.scp"
    argv = ["prepare", "--feats", args["feats"], "--ali", args["ali"],
            "--out", str(tmp_path / "c")]
    if what == "cmvn":
        argv += ["--cmvn", args["cmvn"]]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--scp-commands" in err[0], err
    assert not ran.exists() and not (tmp_path / "c").exists()
    # allowed: it runs (CMVN stats from a features ark are the wrong shape, refused after)
    main(argv + ["--scp-commands"])
    assert ran.exists()


@pytest.mark.parametrize("spec", ["ark:{d}/ali.ark", "ark:gunzip -c {d}/ali.ark.gz |",
                                  "ark,t:cat {d}/ali.txt |", "{d}/ali.txt", "scp:{d}/ali.scp"])
def test_alignments_through_every_form(arks, spec):
    d, _, ali = arks
    _same(read_alignments(spec.format(d=d)), ali)


def test_alignments_through_an_scp_refuse_what_is_no_int_vector(arks):
    d, _, _ = arks
    # an scp naming feature matrices where alignments are expected
    with pytest.raises(CorpusError, match="feats.ark.*utt0"):
        read_alignments(f"scp:{d}/feats.scp")
    (d / "twice.scp").write_text((d / "ali.scp").read_text() * 2)
    with pytest.raises(CorpusError, match="twice.scp: utterance 'utt0' appears twice"):
        read_alignments(f"scp:{d}/twice.scp")


def test_stdin_is_read_as_an_ark(arks):
    d, feats, _ = arks
    code = ("import sys; from mpitrain.data.kaldi_read import read_feature_matrices as r; "
            "print(sorted(k for k, _ in r('ark:-')))")
    with open(d / "feats.ark", "rb") as stdin:
        result = subprocess.run([sys.executable, "-c", code], stdin=stdin, capture_output=True,
                                text=True, timeout=60)
    assert result.stdout.strip() == str(sorted(feats)), result.stderr


def test_an_ark_from_a_byte_offset_is_read_from_that_record_on(arks, tmp_path, capsys):
    """Kaldi's rxfilenames take 'file.ark:1234' anywhere, 'ark:' rspecifiers too."""
    d, feats, _ = arks
    offsets = {k: int(v.rsplit(":", 1)[1]) - len(k) - 1
               for k, v in (line.split() for line in (d / "feats.scp").read_text().splitlines())}
    keys = list(feats)
    _same(dict(read_feature_matrices(f"ark:{d}/feats.ark:{offsets[keys[2]]}")),
          {k: feats[k] for k in keys[2:]})
    _same(dict(read_feature_matrices(f"ark:{d}/feats.ark:0")), feats)
    with pytest.raises(CorpusError, match=r"feats.ark:99999: offset 99999 is at or past the end "
                                          r"of .*feats.ark' \(\d+ bytes\)$"):
        list(read_feature_matrices(f"ark:{d}/feats.ark:99999"))
    # a file whose own name ends in ':digits' is that file
    os.rename(d / "feats.ark", d / "feats.ark:7")
    _same(dict(read_feature_matrices(f"ark:{d}/feats.ark:7")), feats)


def test_split_rspecifier():
    assert split_rspecifier("ark,t:a b.txt", "x") == ("text", "a b.txt")
    assert split_rspecifier("ark,s,cs:gunzip -c a.gz |", "x") == ("ark", "gunzip -c a.gz |")
    assert split_rspecifier("scp,p:a.scp", "x") == ("scp", "a.scp")
    assert split_rspecifier("dir:with:colons.scp", "x") == ("scp", "dir:with:colons.scp")
    with pytest.raises(ValueError, match="not both"):
        split_rspecifier("ark,scp:a.ark,a.scp", "feats")


def test_prepare_and_export_read_pipes_like_files(arks, tmp_path, capsys):
    d, feats, ali = arks
    assert main(["prepare", "--feats", f"ark:gunzip -c {d}/feats.ark.gz |",
                 "--ali", f"ark:gunzip -c {d}/ali.ark.gz |", "--out", str(d / "c1")]) == 0
    assert main(["prepare", "--feats", f"ark:{d}/feats.ark", "--ali", f"ark:{d}/ali.ark",
                 "--out", str(d / "c2")]) == 0
    assert "imported 4 utterances" in capsys.readouterr().out
    for name in ("shard-00000.h5",):
        with open(d / "c1" / name, "rb") as a, open(d / "c2" / name, "rb") as b:
            assert a.read() == b.read()
    from .tiny_models import tiny_model
    model = tiny_model(d / "model.h5", feat_dim=3, num_classes=5)
    assert main(["export", str(model), "--feats", f"ark:cat {d}/feats.ark |",
                 "--out", f"ark:{d}/pipe.ark"]) == 0
    assert main(["export", str(model), "--feats", f"scp:{d}/feats.scp",
                 "--out", f"ark:{d}/file.ark"]) == 0
    assert (d / "pipe.ark").read_bytes() == (d / "file.ark").read_bytes()
    captured = capsys.readouterr()
    assert "pseudo log-likelihoods of 4 utterances" in captured.out + captured.err


@pytest.mark.parametrize("command", [
    "gunzip -c {d}/missing.ark.gz",                       # fails before writing anything
    "sh -c 'cat {d}/feats.ark; echo giving up >&2; exit 3'",  # fails after every record
])
def test_a_failing_pipe_is_one_line_naming_the_command_and_leaves_nothing(arks, command,
                                                                          capsys):
    d, _, _ = arks
    from .tiny_models import tiny_model
    model = tiny_model(d / "model.h5", feat_dim=3, num_classes=5)
    command = command.format(d=d)
    out = d / "out"
    out.mkdir()
    assert main(["export", str(model), "--feats", f"ark:{command} |",
                 "--out", f"ark,scp:{out}/ll.ark,{out}/ll.scp"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"{command} |: the command failed with exit status" in err
    assert os.listdir(out) == []
    assert main(["prepare", "--feats", f"ark:{command} |", "--ali", f"ark:{d}/ali.ark",
                 "--out", str(d / "corpus")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{command} |: the command failed" in err, err
    assert not (d / "corpus").exists() or os.listdir(d / "corpus") == []


def test_a_failing_output_pipe_is_an_error(arks, capsys):
    d, _, _ = arks
    from .tiny_models import tiny_model
    model = tiny_model(d / "model.h5", feat_dim=3, num_classes=5)
    assert main(["export", str(model), "--feats", f"ark:{d}/feats.ark",
                 "--out", "ark:| sh -c 'cat > /dev/null; exit 4'"]) == 2
    err = capsys.readouterr().err.strip()
    assert "failed with exit status 4" in err and len(err.splitlines()) == 1, err


def test_a_truncated_record_from_a_pipe_names_the_command(arks):
    d, _, _ = arks
    data = (d / "feats.ark").read_bytes()
    (d / "cut.ark").write_bytes(data[:len(data) - 10])
    with pytest.raises(CorpusError, match=r"cat .*cut.ark \|: entry 'utt3': FM header declares "
                                          r".* but only \d+ bytes follow in the stream"):
        list(read_feature_matrices(f"ark:cat {d}/cut.ark |"))


@pytest.mark.parametrize("spec", ["ark,t:{d}/ali.ark", "ark,t:cat {d}/ali.ark |"])
def test_binary_alignments_are_read_whatever_the_t_option_says(arks, spec):
    # Kaldi tells binary from text by each record's "\0B", not by the rspecifier's 't'
    d, _, ali = arks
    _same(read_alignments(spec.format(d=d)), ali)


@pytest.mark.parametrize("spec,what,hint", [
    ("ark:{d}/ali.ark.gz", "alignment", r"read it through gunzip, e\.g\. 'ark:gunzip -c "
                                        r".*ali\.ark\.gz \|'"),
    ("{d}/ali.ark.gz", "alignment", r"read it through gunzip, e\.g\. 'ark:gunzip -c "
                                    r".*ali\.ark\.gz \|'"),
    ("ark:cat {d}/ali.ark.gz |", "alignment", "decompress it with gunzip -c first"),
])
def test_gzipped_alignments_given_as_they_are_say_so(arks, spec, what, hint):
    d, _, _ = arks
    with pytest.raises(CorpusError, match=rf"ali\.ark\.gz.*: gzip-compressed data, not a Kaldi "
                                          rf"{what}; {hint}") as info:
        read_alignments(spec.format(d=d))
    assert "\n" not in str(info.value) and "\\x" not in str(info.value)


def test_gzipped_features_given_as_they_are_say_so(arks):
    d, _, _ = arks
    with pytest.raises(CorpusError, match=r"feats\.ark\.gz: gzip-compressed data, not a Kaldi "
                                          r"ark; read it through gunzip, e\.g\. 'ark:gunzip -c "):
        dict(read_feature_matrices(f"ark:{d}/feats.ark.gz"))
    with gzip.open(d / "feats.scp.gz", "wb") as gz:
        gz.write((d / "feats.scp").read_bytes())
    with pytest.raises(CorpusError, match=r"feats\.scp\.gz: gzip-compressed data, not a Kaldi "
                                          r"scp; read it through gunzip, e\.g\. 'scp:gunzip -c "):
        dict(read_feature_matrices(f"scp:{d}/feats.scp.gz"))


@pytest.mark.parametrize("spec", ["{d}/utt2spk", "ark:{d}/utt2spk", "ark,t:{d}/utt2spk",
                                  "ark:cat {d}/utt2spk |"])
def test_utt2spk_as_a_path_or_a_kaldi_rspecifier(tmp_path, spec):
    from mpitrain.data.kaldi_read import read_utt2spk
    (tmp_path / "utt2spk").write_text("s1-u1 s1\ns1-u2 s1\ns2-u1 s2\n")
    assert read_utt2spk(spec.format(d=tmp_path)) == {"s1-u1": "s1", "s1-u2": "s1",
                                                     "s2-u1": "s2"}
    with pytest.raises(ValueError, match=r"utt2spk: 'scp:.*': an utt2spk is a text file"):
        read_utt2spk(f"scp:{tmp_path}/utt2spk")


@pytest.mark.parametrize("through", ["{f}", "cat {f} |"])
def test_a_last_line_without_a_line_break_is_read(arks, through):
    # the bytes of a last line with no line break were dropped: the last utterance
    # of an scp or a text alignment went missing without a word (Kaldi reads it)
    from mpitrain.data.kaldi_read import read_utt2spk
    d, feats, ali = arks
    for name in ("feats.scp", "ali.txt"):
        (d / ("cut-" + name)).write_bytes((d / name).read_bytes().rstrip(b"\n"))
    (d / "cut-utt2spk").write_text("utt0 s1\nutt3 s2")
    cut = {name: through.format(f=d / ("cut-" + name)) for name in ("feats.scp", "ali.txt",
                                                                     "utt2spk")}
    _same(dict(read_feature_matrices("scp:" + cut["feats.scp"])), feats)
    _same(read_alignments("ark,t:" + cut["ali.txt"]), ali)
    assert read_utt2spk("ark:" + cut["utt2spk"]) == {"utt0": "s1", "utt3": "s2"}


def test_ids_that_are_not_utf8_say_how_to_convert_them(tmp_path):
    # a Latin-1 corpus: Kaldi takes any bytes as ids, the corpus stores text
    latin = "spk\xdc-utt1".encode("latin-1")
    (tmp_path / "feats.ark").write_bytes(latin + b" \0BFM \4\1\0\0\0\4\1\0\0\0" + b"\0" * 4)
    with pytest.raises(CorpusError, match=r"feats.ark: utterance id b'spk\\xdc-utt1' is not "
                                          r"UTF-8: ids in another encoding \(e.g. Latin-1\) must "
                                          r"be converted to UTF-8 first"):
        list(read_feature_matrices(f"ark:{tmp_path}/feats.ark"))
    (tmp_path / "utt2spk").write_bytes(latin + b" spk\xdc\n")
    from mpitrain.data.kaldi_read import read_utt2spk
    with pytest.raises(CorpusError, match=r"utt2spk:1: not UTF-8 text: ids in another encoding"):
        read_utt2spk(str(tmp_path / "utt2spk"))


@pytest.mark.parametrize("label", ["99999999999999999999", "-99999999999999999999"])
def test_a_text_label_beyond_int64_is_one_line_naming_the_utterance(tmp_path, label):
    # a damaged text alignment: the number overflowed numpy's int64 (a traceback)
    (tmp_path / "ali.txt").write_text(f"u1 0 1\nu2 1 {label} 0\n")
    with pytest.raises(CorpusError, match=r"ali.txt:2: utterance 'u2': pdf id -?9{20} is not "
                                          r"a valid class index"):
        read_alignments(f"ark,t:{tmp_path}/ali.txt")


def test_doubles_beyond_float32_are_named_not_called_nan(tmp_path, capsys):
    # a finite DM value beyond float32 became inf when stored, and prepare said
    # the utterance 'contains NaN or inf', which the archive did not
    feats = np.ones((5, 3))
    feats[2, 1] = -1e300
    kaldiio.save_ark(str(tmp_path / "f.ark"), {"a": np.ones((4, 3)), "b": feats})
    kaldiio.save_ark(str(tmp_path / "ali.ark"), {"a": np.zeros(4, np.int32),
                                                 "b": np.zeros(5, np.int32)})
    with pytest.raises(CorpusError) as err:
        list(read_feature_matrices(f"ark:{tmp_path / 'f.ark'}"))
    assert str(err.value) == (f"{tmp_path / 'f.ark'}: utterance 'b': 1 value(s) beyond the "
                              "float32 range features are stored in, the first -1e+300 at "
                              "frame 2, dimension 1")
    assert main(["prepare", "--feats", f"ark:{tmp_path / 'f.ark'}", "--ali",
                 f"ark:{tmp_path / 'ali.ark'}", "--out", str(tmp_path / "c")]) == 2
    assert "beyond the float32 range" in capsys.readouterr().err
    # in a text archive too (it was parsed straight to float32, making inf)
    kaldiio.save_ark(str(tmp_path / "t.ark"), {"b": feats}, text=True)
    with pytest.raises(CorpusError, match="'b': 1 value.* the first -1e\\+300 at frame 2"):
        list(read_feature_matrices(f"ark,t:{tmp_path / 't.ark'}"))
    assert not (tmp_path / "c").exists() or os.listdir(tmp_path / "c") == []
    # doubles within the range are read as float32
    key, read = next(iter(read_feature_matrices(f"ark:{tmp_path / 'f.ark'}")))
    assert key == "a" and read.dtype == np.float32 and (read == 1).all()


def test_ids_end_at_a_tab_or_a_line_break_and_rows_at_a_semicolon(tmp_path):
    """Kaldi's table reader ends an id at a space, a tab or a line break (a tab was
    read into the id, and the utterance went missing); its text matrices also end
    rows at ';'."""
    text = tmp_path / "feats.txt"
    text.write_text("u1\t[ 1 2 ; 3 4 ]\nu2 [\n 5 6\n 7 8 ]\nu3\n[ 9 10 ]\n")
    got = dict(read_feature_matrices(f"ark,t:{text}"))
    assert list(got) == ["u1", "u2", "u3"]
    assert got["u1"].tolist() == [[1, 2], [3, 4]] and got["u2"].tolist() == [[5, 6], [7, 8]]
    assert got["u3"].tolist() == [[9, 10]]
    binary = tmp_path / "feats.ark"
    matrix = np.arange(6, dtype=np.float32).reshape(3, 2)
    record = b"\0BFM \x04" + (3).to_bytes(4, "little") + b"\x04" + (2).to_bytes(4, "little")
    binary.write_bytes(b"a1\t" + record + matrix.tobytes())
    (key, value), = read_feature_matrices(f"ark:{binary}")
    assert key == "a1" and np.array_equal(value, matrix)


def test_scp_ranges_cut_rows_and_columns_as_kaldi_does(tmp_path):
    """Segment-style scp entries, ``file.ark:12[a:b]`` and ``[a:b,c:d]`` (inclusive;
    ':' for all; the last row may lie up to two past the end, read to the last
    row, as Kaldi's ParseMatrixRangeSpecifier): they were refused."""
    rng = np.random.default_rng(0)
    whole = rng.standard_normal((10, 6)).astype(np.float32)
    kaldiio.save_ark(str(tmp_path / "f.ark"), {"rec": whole},
                     scp=str(tmp_path / "whole.scp"))
    location = (tmp_path / "whole.scp").read_text().split()[1]
    (tmp_path / "seg.scp").write_text(
        f"s1 {location}[2:5]\ns2 {location}[0:9,1:3]\ns3 {location}[:,4:5]\n"
        f"s4 {location}[7:11]\n")
    got = dict(read_feature_matrices(f"scp:{tmp_path}/seg.scp"))
    assert np.array_equal(got["s1"], whole[2:6])
    assert np.array_equal(got["s2"], whole[:, 1:4])
    assert np.array_equal(got["s3"], whole[:, 4:6])
    assert np.array_equal(got["s4"], whole[7:])            # two rows past the end
    for bad, says in (("[2:13]", "lies outside its 10 x 6 matrix"),
                      ("[5:2]", "lies outside"), ("[0:1,0:6]", "lies outside"),
                      ("[a:b]", "is not Kaldi's 'r1:r2'"), ("[1:2,]", "is not Kaldi's"),
                      ("[3]", "is not Kaldi's"), ("[]", "is not Kaldi's"),
                      ("[0:1_0]", "is not Kaldi's"), ("[0:\u0669]", "is not Kaldi's"),
                      ("[10:11]", "lies outside")):
        (tmp_path / "bad.scp").write_text(f"s {location}{bad}\n")
        with pytest.raises(CorpusError) as err:
            list(read_feature_matrices(f"scp:{tmp_path}/bad.scp"))
        assert says in str(err.value) and "utterance 's'" in str(err.value), err.value
    # alignments are vectors: a range on one is refused by name
    kaldiio.save_ark(str(tmp_path / "ali.ark"), {"rec": np.arange(5, dtype=np.int32)},
                     scp=str(tmp_path / "ali.scp"))
    ali_location = (tmp_path / "ali.scp").read_text().split()[1]
    (tmp_path / "ali_seg.scp").write_text(f"s1 {ali_location}[0:2]\n")
    with pytest.raises(CorpusError, match="ranges cut matrices only"):
        dict(read_alignments(f"scp:{tmp_path}/ali_seg.scp"))


def test_numbers_are_ascii_digits_as_kaldi_reads_them(tmp_path):
    """Python's int() and float() take '1_0' as 10 and other scripts' digits
    ('\u0663', fullwidth '\uff13') as digits, and isdigit() superscripts: a text
    alignment's pdf id, a text matrix's value or an scp offset so written was
    read as a number (or an scp offset '\u00b2' failed naming no file).  Kaldi
    refuses them; so does the reader, naming the file and the utterance."""
    (tmp_path / "ok.txt").write_text("u 3 +3 0\n")
    assert read_alignments(f"ark,t:{tmp_path}/ok.txt")["u"].tolist() == [3, 3, 0]
    for token in ("0_3", "\u0663", "\uff13"):
        (tmp_path / "ali.txt").write_text(f"u 1 {token} 2\n", encoding="utf-8")
        with pytest.raises(CorpusError) as err:
            read_alignments(f"ark,t:{tmp_path}/ali.txt")
        assert f"ali.txt:1: utterance 'u': expected integer pdf ids, got {token!r}" \
            in str(err.value), err.value
    (tmp_path / "m.ark").write_bytes(b"u  [\n  1 2\n  1_0 4 ]\n")
    with pytest.raises(CorpusError, match="entry 'u': not a Kaldi text matrix .*'1_0'"):
        list(read_feature_matrices(f"ark:{tmp_path}/m.ark"))
    kaldiio.save_ark(str(tmp_path / "f.ark"), {"u": np.ones((2, 3), np.float32)},
                     scp=str(tmp_path / "f.scp"))
    ark = (tmp_path / "f.scp").read_text().split()[1].rsplit(":", 1)[0]
    for tail in ("\u00b2", "\u0663"):
        (tmp_path / "bad.scp").write_text(f"u {ark}:{tail}\n", encoding="utf-8")
        with pytest.raises(CorpusError, match="bad.scp: utterance 'u' points to .*not a "
                                              "readable file"):
            list(read_feature_matrices(f"scp:{tmp_path}/bad.scp"))


def _kaldi_copy_to_mat(data: bytes) -> np.ndarray:
    """Kaldi's CompressedMatrix::CopyToMat, one element at a time, each C++
    operation in its own type (float32, or float64 where a double constant enters),
    as an independent reference for the decoder."""
    import struct
    f32 = np.float32
    token = data[2:].split(b" ", 1)[0]            # after the binary marker "\0B"
    rest = data[2 + len(token) + 1:]
    low, span = (f32(v) for v in struct.unpack("<ff", rest[:8]))
    rows, cols = struct.unpack("<ii", rest[8:16])
    body = rest[16:]
    out = np.zeros((rows, cols), dtype=f32)
    if token in (b"CM2", b"CM3"):
        step = f32(float(span) * (1.0 / (65535.0 if token == b"CM2" else 255.0)))
        width = 2 if token == b"CM2" else 1
        for i in range(rows):
            for j in range(cols):
                k = (i * cols + j) * width
                code = int.from_bytes(body[k:k + width], "little")
                out[i, j] = low + f32(code) * step
        return out
    step = f32(1.52590218966964e-05)
    for j in range(cols):
        p0, p25, p75, p100 = (low + span * step * f32(q) for q in
                              struct.unpack("<4H", body[8 * j:8 * j + 8]))
        for i in range(rows):
            code = body[8 * cols + j * rows + i]
            if code <= 64:
                value = float(p0) + float((p25 - p0) * f32(code)) * (1 / 64.0)
            elif code <= 192:
                value = float(p25) + float((p75 - p25) * f32(code - 64)) * (1 / 128.0)
            else:
                value = float(p75) + float((p100 - p75) * f32(code - 192)) * (1 / 63.0)
            out[i, j] = f32(value)
    return out


@pytest.mark.parametrize("method,token", [(2, b"CM "), (3, b"CM2 "), (5, b"CM3 ")])
def test_compressed_matrices_decode_as_kaldis_copy_to_mat_bit_for_bit(tmp_path, method,
                                                                      token):
    """kaldiio's decoding rounds otherwise than Kaldi's (up to 4 ulp of the largest
    value apart); the reader decodes as Kaldi does."""
    rng = np.random.default_rng(method)
    matrix = (rng.standard_normal((41, 13)) * 4 + rng.uniform(-3, 3, 13)).astype(np.float32)
    kaldiio.save_ark(str(tmp_path / "c.ark"), {"u": matrix}, compression_method=method)
    data = (tmp_path / "c.ark").read_bytes()[2:]           # past "u "
    assert data[2:2 + len(token)] == token
    (key, got), = read_feature_matrices(f"ark:{tmp_path}/c.ark")
    assert got.dtype == np.float32 and got.shape == matrix.shape
    assert np.array_equal(got, _kaldi_copy_to_mat(data))
    # and within a few ulp of kaldiio's, within the compression's error of the input
    theirs = kaldiio.load_mat(f"{tmp_path}/c.ark:2")
    np.testing.assert_allclose(got, theirs, rtol=0, atol=4 * np.spacing(np.abs(theirs).max()))
    assert np.abs(got - matrix).max() < 0.1 * np.abs(matrix).max()


@pytest.mark.parametrize("token", [b"CM ", b"CM2 ", b"CM3 "])
def test_a_compressed_matrix_of_rows_without_columns_is_refused_as_an_fm_one(tmp_path,
                                                                            token):
    """A compressed header declaring 20 x 0 was read as Kaldi's empty 0 x 0 matrix:
    `export` wrote the utterance as one of no frames and `prepare` skipped it,
    where the same shape as a float matrix (FM) is refused; Kaldi aborts on both."""
    import struct
    header = struct.pack("<ffii", 0.0, 1.0, 20, 0)
    (tmp_path / "c.ark").write_bytes(b"u \0B" + token + header)
    with pytest.raises(CorpusError, match="utterance 'u': feature matrix has 20 rows and "
                                          "no columns"):
        list(read_feature_matrices(f"ark:{tmp_path}/c.ark"))


@pytest.mark.parametrize("encoding", ["ascii", "latin-1"])
def test_an_scp_names_its_archives_by_their_bytes_under_any_locale(tmp_path, encoding):
    """The location in an scp was decoded as UTF-8: under a Latin-1 (or ASCII) locale
    an archive in a directory named in UTF-8 ('f\u00ebats') was opened under other
    bytes and said to be no readable file."""
    from ..helpers import locale_env
    env = locale_env(tmp_path, encoding)
    os.makedirs(os.fsencode(tmp_path) + b"/f\xc3\xabats")
    feats = {f"u{i}": np.full((3 + i, 2), i, dtype=np.float32) for i in range(3)}
    kaldiio.save_ark(str(tmp_path / "f\u00ebats" / "feats.ark"), feats,
                     scp=str(tmp_path / "feats.scp"))
    assert b"f\xc3\xabats/feats.ark:" in (tmp_path / "feats.scp").read_bytes()
    script = ("from mpitrain.data.kaldi_read import read_feature_matrices\n"
              "print([(k, m.shape[0]) for k, m in read_feature_matrices('scp:feats.scp')])")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            encoding="utf-8", errors="replace", cwd=tmp_path, env=env,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[('u0', 3), ('u1', 4), ('u2', 5)]", result.stdout
