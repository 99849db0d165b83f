"""Inputs from users are data: crafted arks, models, checkpoints and shards are refused.

Each crafted file either carries code (a pickled Kaldi record whose unpickling
would create a marker file) or declares sizes far beyond the bytes it holds.
The huge-size cases run in a child process whose address space is capped at
2 GiB, so an attempted huge allocation surfaces as a MemoryError instead of
passing unnoticed on a large machine.
"""

import json
import os
import resource
import struct
import subprocess
import sys

import h5py
import kaldiio
import numpy as np
import pytest

import mpitrain
from mpitrain.cli import main
from mpitrain.data.check import check_corpus
from mpitrain.data.corpus import CorpusError
from mpitrain.data.writer import CorpusWriter
from mpitrain.h5io import write_checksums
from mpitrain.data.kaldi import import_kaldi, read_alignments, read_feature_matrices
from mpitrain.data.shards import ShardReader, write_shard
from mpitrain.nn.affine import Affine
from mpitrain.nn.model_file import load_model, save_model
from mpitrain.nn.network import Network
from mpitrain.nn.nonlinear import ReLU
from mpitrain.train.checkpoint import load_checkpoint, save_checkpoint

MEMORY_LIMIT = 2 << 30
REPO = os.path.dirname(os.path.dirname(os.path.abspath(mpitrain.__file__)))
FEAT_DIM, NUM_CLASSES = 4, 3


# ---------------------------------------------------------------- helpers

def pickled_record(marker) -> bytes:
    """A Kaldi ark record flagged as a Python object whose unpickling calls
    ``open(marker, "w")``: code run by merely loading data.  Written out in
    pickle's protocol 0 (global, argument tuple, call) rather than produced by
    the pickle module."""
    path = str(marker).encode("raw_unicode_escape")
    return b"PKL" + b"cbuiltins\nopen\n(V" + path + b"\nVw\ntR."


def run_limited(args, *, cwd, timeout=300):
    """Run ``python ARGS`` with the address space capped at MEMORY_LIMIT."""
    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, preexec_fn=cap, timeout=timeout)


# Loads a file in the capped child: exit 3 with the message when it is refused.
LOADER = """
import sys
from {module} import {func}
try:
    {call}
except ValueError as exc:
    print(exc)
    sys.exit(3)
print("loaded")
"""


def load_limited(tmp_path, module, func, call, path):
    code = LOADER.format(module=module, func=func, call=call)
    return run_limited(["-c", code, str(path)], cwd=tmp_path)


def assert_refused(result, *parts):
    """Exit 3 (or the CLI's 2) with one line naming every part; no MemoryError."""
    out = (result.stdout + result.stderr).strip()
    assert "MemoryError" not in out and "Traceback" not in out, out
    assert result.returncode in (2, 3), out
    assert len(out.splitlines()) == 1, out
    for part in parts:
        assert part in out, (part, out)


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def small_network():
    net = Network([Affine(FEAT_DIM * 3, 8), ReLU(8), Affine(8, NUM_CLASSES)],
                  feat_dim=FEAT_DIM, left_context=1, right_context=1)
    net.init_params(seed=1)
    return net


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "model.h5"
    save_model(path, small_network(), class_priors=np.full(NUM_CLASSES, 1 / NUM_CLASSES))
    return path


def feats_and_ali(n=3, seed=0):
    rng = np.random.default_rng(seed)
    feats = {f"utt{i}": rng.normal(size=(int(rng.integers(3, 9)), FEAT_DIM)).astype(np.float32)
             for i in range(n)}
    ali = {k: rng.integers(0, NUM_CLASSES, v.shape[0]).astype(np.int32) for k, v in feats.items()}
    return feats, ali


def write_text_ali(path, ali):
    with open(path, "w") as f:
        for k, v in ali.items():
            f.write(k + " " + " ".join(map(str, v)) + "\n")


def listing(directory):
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


# ---------------------------------------------------------------- the memory cap works

def test_the_memory_cap_turns_a_huge_allocation_into_memory_error(tmp_path):
    # Without this, the capped runs below could not tell a refusal from an allocation.
    result = run_limited(["-c", "import numpy; numpy.ones(4 << 30, numpy.uint8)"], cwd=tmp_path)
    assert result.returncode != 0 and "MemoryError" in result.stderr


# ---------------------------------------------------------------- pickled records

@pytest.fixture
def evil(tmp_path):
    """An ark whose second record is a pickle, an scp into it, and matching alignments."""
    feats, ali = feats_and_ali(2)
    marker = tmp_path / "MARKER"
    ark = tmp_path / "evil.ark"
    kaldiio.save_ark(str(ark), {"utt0": feats["utt0"]})
    offset = os.path.getsize(ark) + len(b"utt1 ")
    with open(ark, "ab") as f:
        f.write(b"utt1 " + pickled_record(marker))
    (tmp_path / "evil.scp").write_text(f"utt1 {ark}:{offset}\n")
    write_text_ali(tmp_path / "ali.txt", ali)
    return tmp_path, marker


def test_the_crafted_record_is_a_live_payload(evil):
    """Control: kaldiio's own loader does run it, so the refusals below are real."""
    d, marker = evil
    for _ in kaldiio.load_ark(str(d / "evil.ark")):
        pass
    assert marker.exists()


@pytest.mark.parametrize("feats", ["ark:{d}/evil.ark", "scp:{d}/evil.scp"])
def test_export_refuses_a_pickled_record_and_leaves_no_output(evil, model, feats, capsys):
    d, marker = evil
    out = d / "out"
    out.mkdir()
    code = main(["export", str(model), "--feats", feats.format(d=d),
                 "--out", f"ark,scp:{out}/ll.ark,{out}/ll.scp"])
    err = one_line_error(capsys)
    assert code != 0
    assert "evil.ark" in err and "'utt1'" in err and "pickled" in err
    assert "expected a Kaldi float matrix" in err
    assert not marker.exists()
    assert listing(out) == []


@pytest.mark.parametrize("feats", ["ark:{d}/evil.ark", "scp:{d}/evil.scp"])
def test_prepare_refuses_a_pickled_record_and_leaves_no_output(evil, feats, capsys):
    d, marker = evil
    code = main(["prepare", "--feats", feats.format(d=d), "--ali", f"ark,t:{d}/ali.txt",
                 "--out", str(d / "corpus")])
    err = one_line_error(capsys)
    assert code != 0
    assert "evil.ark" in err and "'utt1'" in err and "pickled" in err
    assert not marker.exists()
    assert listing(d / "corpus") == []


def test_prepare_refuses_a_pickled_alignment(tmp_path, capsys):
    feats, ali = feats_and_ali(2)
    marker = tmp_path / "MARKER"
    kaldiio.save_ark(str(tmp_path / "feats.ark"), feats)
    kaldiio.save_ark(str(tmp_path / "ali.ark"), {"utt0": ali["utt0"]})
    with open(tmp_path / "ali.ark", "ab") as f:
        f.write(b"utt1 " + pickled_record(marker))
    code = main(["prepare", "--feats", f"ark:{tmp_path}/feats.ark",
                 "--ali", f"ark:{tmp_path}/ali.ark", "--out", str(tmp_path / "corpus")])
    err = one_line_error(capsys)
    assert code != 0
    assert "ali.ark" in err and "'utt1'" in err and "pickled" in err
    assert "expected a binary int32 vector" in err
    assert not marker.exists() and listing(tmp_path / "corpus") == []
    # The same record as the whole of a text alignment file: not a pdf id either.
    (tmp_path / "ali.txt").write_bytes(b"utt1 " + pickled_record(marker) + b"\n")
    with pytest.raises(CorpusError, match=r"ali.txt:1: utterance 'utt1': expected integer"):
        read_alignments(f"ark,t:{tmp_path}/ali.txt")
    assert not marker.exists()


@pytest.mark.parametrize("payload,named", [
    (b"NPY", "NumPy"), (b"RIFF\0\0\0\0WAVE", "WAV audio"), (b"fLaC", "FLAC audio"),
    (b"AUDIO", "audio"), (b"\0BXM \4\1\0\0\0", "binary object of type 'XM'"),
    (b"\0B\4\1\0\0\0\4\7\0\0\0", "binary int32 vector"), (b"hello", "unknown record"),
])
def test_other_kaldiio_payloads_are_refused_by_key(tmp_path, payload, named):
    (tmp_path / "x.ark").write_bytes(b"uttA " + payload + b"\0" * 16)
    with pytest.raises(CorpusError) as err:
        list(read_feature_matrices(f"ark:{tmp_path}/x.ark"))
    message = str(err.value)
    assert "x.ark: entry 'uttA' holds" in message and named in message
    assert "\n" not in message


def test_the_refusal_happens_before_kaldiio_parses(tmp_path, monkeypatch):
    # kaldiio's own dispatcher (which unpickles) is never reached, even for good records.
    import kaldiio.matio

    def forbidden(*args, **kwargs):
        raise AssertionError("kaldiio's read_kaldi dispatcher was called")

    monkeypatch.setattr(kaldiio.matio, "read_kaldi", forbidden)
    monkeypatch.setattr(kaldiio.matio, "load_mat", forbidden)
    feats, _ = feats_and_ali(2)
    kaldiio.save_ark(str(tmp_path / "f.ark"), feats, scp=str(tmp_path / "f.scp"))
    got = dict(read_feature_matrices(f"scp:{tmp_path}/f.scp"))
    np.testing.assert_array_equal(got["utt1"], feats["utt1"])
    (tmp_path / "p.ark").write_bytes(b"utt1 " + pickled_record(tmp_path / "MARKER"))
    with pytest.raises(CorpusError, match="pickled"):
        list(read_feature_matrices(f"ark:{tmp_path}/p.ark"))
    assert not (tmp_path / "MARKER").exists()


# ---------------------------------------------------------------- Kaldi headers claiming too much

def _fm_header(kind, rows, cols):
    return b"\0B" + kind + b" \4" + struct.pack("<i", rows) + b"\4" + struct.pack("<i", cols)


def _cm_header(kind, rows, cols):
    return b"\0B" + kind + b" " + struct.pack("<ffii", 0.0, 1.0, rows, cols)


@pytest.mark.parametrize("record,declared", [
    (_fm_header(b"FM", 10 ** 9, 10 ** 9), "FM header declares 1000000000 x 1000000000"),
    (_fm_header(b"DM", 10 ** 9, 1), "DM header declares 1000000000 x 1"),
    # (it said "(0 bytes of data) but only 100 bytes follow", which contradicts itself)
    (_fm_header(b"FM", -5, 3), "FM header declares -5 x 3: a negative size"),
    (b"\0BFV \4" + struct.pack("<i", 2 ** 31 - 1), "FV header declares 2147483647 "),
    (_cm_header(b"CM", 2 ** 31 - 1, 2 ** 31 - 1), "CM header declares"),
    (_cm_header(b"CM2", 10 ** 9, 40), "CM2 header declares 1000000000 x 40"),
    (_cm_header(b"CM3", 10 ** 9, 40), "CM3 header declares 1000000000 x 40"),
])
def test_matrix_headers_beyond_the_file_are_refused_before_allocating(tmp_path, model, record,
                                                                      declared):
    (tmp_path / "big.ark").write_bytes(b"utt7 " + record + b"\0" * 100)
    _, ali = feats_and_ali(1)
    write_text_ali(tmp_path / "ali.txt", {"utt7": ali["utt0"]})
    prepare = run_limited(["-m", "mpitrain", "prepare", "--feats", "ark:big.ark",
                           "--ali", "ali.txt", "--out", "corpus"], cwd=tmp_path)
    assert_refused(prepare, "big.ark", "'utt7'", declared,
                   "" if "negative" in declared else "bytes follow in the file")
    export = run_limited(["-m", "mpitrain", "export", str(model), "--feats", "ark:big.ark",
                          "--out", "ark:ll.ark"], cwd=tmp_path)
    assert_refused(export, "big.ark", "'utt7'", declared)
    assert not (tmp_path / "ll.ark").exists() and listing(tmp_path / "corpus") == []


@pytest.mark.parametrize("record,declared", [
    (_fm_header(b"FM", 10 ** 9, 10 ** 9), "FM header declares 1000000000 x 1000000000"),
    (_cm_header(b"CM2", 10 ** 9, 40), "CM2 header declares 1000000000 x 40"),
])
def test_headers_through_a_pipe_are_refused_before_allocating(tmp_path, model, record, declared):
    # A pipe has no size to compare with: the payload is read in blocks, so memory
    # follows the bytes that arrive, not the header.
    (tmp_path / "big.ark").write_bytes(b"utt7 " + record + b"\0" * 100)
    _, ali = feats_and_ali(1)
    write_text_ali(tmp_path / "ali.txt", {"utt7": ali["utt0"]})
    prepare = run_limited(["-m", "mpitrain", "prepare", "--feats", "ark:cat big.ark |",
                           "--ali", "ark,t:cat ali.txt |", "--out", "corpus"], cwd=tmp_path)
    assert_refused(prepare, "cat big.ark |", "'utt7'", declared, "bytes follow in the stream")
    export = run_limited(["-m", "mpitrain", "export", str(model), "--feats",
                          "ark:gzip -c big.ark | gunzip -c |", "--out", "ark:ll.ark"],
                         cwd=tmp_path)
    assert_refused(export, "gunzip -c |", "'utt7'", declared)
    assert not (tmp_path / "ll.ark").exists() and listing(tmp_path / "corpus") == []


@pytest.mark.parametrize("feats", ["ark:cat {d}/evil.ark |", "scp:cat {d}/evil.scp |"])
def test_a_pickled_record_through_a_pipe_is_refused(evil, model, feats, capsys):
    d, marker = evil
    out = d / "out"
    out.mkdir()
    assert main(["export", str(model), "--feats", feats.format(d=d),
                 "--out", f"ark,scp:{out}/ll.ark,{out}/ll.scp"]) != 0
    err = one_line_error(capsys)
    assert "evil.ark" in err and "'utt1'" in err and "pickled" in err
    assert main(["prepare", "--feats", feats.format(d=d), "--ali", f"ark,t:cat {d}/ali.txt |",
                 "--out", str(d / "corpus")]) != 0
    err = one_line_error(capsys)
    assert "'utt1'" in err and "pickled" in err
    # an scp entry that is itself a pipe printing the pickle
    (d / "p.ark").write_bytes(b"utt1 " + pickled_record(marker))
    (d / "pipe.scp").write_text(f"utt1 cut -c 6- {d}/p.ark |\n")
    with pytest.raises(CorpusError, match=r"cut -c 6- .*p.ark \|: entry 'utt1' holds a pickled"):
        list(read_feature_matrices(f"scp:{d}/pipe.scp", scp_commands=True))
    assert not marker.exists() and listing(out) == [] and listing(d / "corpus") == []


def test_int_vector_header_beyond_the_file_is_refused_before_allocating(tmp_path):
    feats, _ = feats_and_ali(1)
    kaldiio.save_ark(str(tmp_path / "feats.ark"), feats)
    (tmp_path / "ali.ark").write_bytes(b"utt0 \0B\4" + struct.pack("<i", 2 ** 31 - 1)
                                       + b"\4\0\0\0\0" * 20)
    result = run_limited(["-m", "mpitrain", "prepare", "--feats", "ark:feats.ark",
                          "--ali", "ark:ali.ark", "--out", "corpus"], cwd=tmp_path)
    assert_refused(result, "ali.ark", "'utt0'", "declares 2147483647 elements")


def test_text_matrix_without_closing_bracket_is_refused(tmp_path):
    (tmp_path / "t.ark").write_bytes(b"utt1  [\n  1 2 3\n  4 5 6\n")
    with pytest.raises(CorpusError, match=r"t.ark: entry 'utt1': text matrix has no closing"):
        list(read_feature_matrices(f"ark,t:{tmp_path}/t.ark"))
    (tmp_path / "r.ark").write_bytes(b"utt1  [\n  1 2 3\n  4 5 ]\n")
    with pytest.raises(CorpusError, match=r"r.ark: entry 'utt1': not a Kaldi text matrix"):
        list(read_feature_matrices(f"ark,t:{tmp_path}/r.ark"))


# ---------------------------------------------------------------- every accepted kind still works

@pytest.fixture
def every_kind(tmp_path):
    """One ark holding each accepted matrix kind, an scp into it, and alignments."""
    rng = np.random.default_rng(3)
    mats = {k: rng.normal(size=(int(rng.integers(9, 14)), FEAT_DIM)) for k in
            ("fm", "dm", "cm", "cm2", "cm3", "text")}
    ark, scp = str(tmp_path / "all.ark"), str(tmp_path / "all.scp")
    kaldiio.save_ark(ark, {"fm": mats["fm"].astype(np.float32)}, scp=scp)
    kaldiio.save_ark(ark, {"dm": mats["dm"]}, scp=scp, append=True)                # float64
    for key, method in (("cm", 2), ("cm2", 3), ("cm3", 5)):
        kaldiio.save_ark(ark, {key: mats[key].astype(np.float32)}, scp=scp, append=True,
                         compression_method=method)
    expected = dict(kaldiio.load_ark(ark))
    # Text as Kaldi writes it: ' [' and rows on their own lines, integral values bare.
    text = np.round(mats["text"], 4)
    text[0, 0] = 0.0
    with open(ark, "ab") as f:
        offset = f.tell() + len("text ")
        rows = "".join("\n  " + " ".join(f"{v:g}" for v in row) + " " for row in text)
        f.write(f"text  [{rows}]\n".encode())
    with open(scp, "a") as f:
        f.write(f"text {ark}:{offset}\n")
    expected["text"] = text
    ali = {k: rng.integers(0, NUM_CLASSES, v.shape[0]).astype(np.int32) for k, v in mats.items()}
    kaldiio.save_ark(str(tmp_path / "ali.ark"), ali)
    return tmp_path, expected, ali


@pytest.mark.parametrize("spec", ["ark:{d}/all.ark", "scp:{d}/all.scp"])
def test_every_accepted_record_kind_reads_as_kaldiio_decodes_it(every_kind, spec):
    d, expected, _ = every_kind
    got = dict(read_feature_matrices(spec.format(d=d)))
    assert list(got) == list(expected)
    for key, matrix in got.items():
        assert matrix.dtype == np.float32 and matrix.shape == expected[key].shape
        np.testing.assert_allclose(matrix, expected[key].astype(np.float32), rtol=1e-6,
                                   atol=1e-6, err_msg=key)


def test_every_accepted_record_kind_imports_and_exports(every_kind, model, capsys):
    d, expected, ali = every_kind
    report = import_kaldi(f"scp:{d}/all.scp", f"ark:{d}/ali.ark", str(d / "corpus"))
    assert report.imported == len(expected) and not report.skipped
    assert read_alignments(f"ark:{d}/ali.ark").keys() == ali.keys()
    assert main(["export", str(model), "--feats", f"ark:{d}/all.ark",
                 "--out", f"ark,scp:{d}/ll.ark,{d}/ll.scp"]) == 0
    capsys.readouterr()
    loglikes = dict(kaldiio.load_scp(str(d / "ll.scp")))
    assert list(loglikes) == list(expected)
    for key, values in loglikes.items():
        assert values.shape == (expected[key].shape[0], NUM_CLASSES)
    np.testing.assert_array_equal(dict(kaldiio.load_ark(str(d / "ll.ark")))["cm"], loglikes["cm"])
    assert sorted(os.listdir(d)) == sorted(["all.ark", "all.scp", "ali.ark", "corpus", "ll.ark",
                                            "ll.scp", "model.h5"])


# ---------------------------------------------------------------- model files

def _declare_unstored(group, name, shape, dtype="f4"):
    """A dataset of ``shape`` whose chunks were never written: it costs no bytes on disk."""
    if name in group:
        del group[name]
    group.create_dataset(name, shape=shape, dtype=dtype, chunks=(1024,) + (1,) * (len(shape) - 1),
                         maxshape=(None,) * len(shape))


def _set_components(f, specs):
    f.attrs["components"] = json.dumps(specs)


def _huge_layers(f):
    # 1.2e9 parameters, within the bound, with nothing stored: allocating them needs ~9 GiB.
    _set_components(f, [{"kind": "affine", "in_dim": FEAT_DIM * 3, "out_dim": 30000},
                        {"kind": "affine", "in_dim": 30000, "out_dim": 40000}])
    _declare_unstored(f, "params", (30000 * 13 + 40000 * 30001,))


def _too_many_params(f):
    _set_components(f, [{"kind": "affine", "in_dim": FEAT_DIM * 3, "out_dim": 1 << 20},
                        {"kind": "affine", "in_dim": 1 << 20, "out_dim": 1 << 20}])


def _dims_beyond_bound(f):
    _set_components(f, [{"kind": "affine", "in_dim": FEAT_DIM * 3, "out_dim": 10 ** 12}])


def _params_length_mismatch(f):
    del f["params"]
    f["params"] = np.zeros(7, np.float32)


def _huge_feat_dim(f):
    f.attrs["feat_dim"] = 10 ** 12


def _huge_context(f):
    f.attrs["left_context"] = 10 ** 9


def _cmvn_unstored(f):
    _declare_unstored(f, "cmvn_mean", (FEAT_DIM,))


def _cmvn_wrong_length(f):
    del f["cmvn_scale"]
    f["cmvn_scale"] = np.ones(FEAT_DIM + 1, np.float32)


def _priors_wrong_length(f):
    del f["class_priors"]
    f["class_priors"] = np.ones(NUM_CLASSES + 2)


def _priors_unstored(f):
    _declare_unstored(f, "class_priors", (10 ** 10,), "f8")


def _params_external(f):
    del f["params"]
    f["params"] = h5py.ExternalLink("/etc/other.h5", "/params")


def _components_nested(f):
    f.attrs["components"] = "[" * 100000 + "]" * 100000


def _unknown_option(f):
    _set_components(f, [{"kind": "affine", "in_dim": FEAT_DIM * 3, "out_dim": NUM_CLASSES,
                         "init_scale": "__import__('os')"}])


def _elementwise_of_another_width(f):
    specs = json.loads(f.attrs["components"])
    specs[1]["out_dim"] = specs[1]["in_dim"] // 2
    _set_components(f, specs)


def _option_of_another_kind(f):
    specs = json.loads(f.attrs["components"])
    specs[1]["p"] = 2.0
    _set_components(f, specs)


def _normalize_target_beyond_float32(f):
    specs = json.loads(f.attrs["components"])
    specs[1] = {"kind": "normalize", "in_dim": 8, "out_dim": 8, "target_rms": 1e300}
    _set_components(f, specs)
    # summed again, as a file written that way would be: loaded, it overflowed
    # in the forward pass
    del f.attrs["checksum"]
    f.visititems(lambda _, obj: obj.attrs.pop("sha256", None))
    write_checksums(f, "model.h5", what="model")


def _option_beyond_a_float(f):
    specs = json.loads(f.attrs["components"])
    specs[1] = {"kind": "pnorm", "in_dim": 8, "out_dim": 8, "p": 10 ** 400}
    _set_components(f, specs)


def _priors_negative(f):
    f["class_priors"][...] = -np.abs(f["class_priors"][...]) - 0.01


def _scale_zero(f):
    f["cmvn_scale"][0] = 0.0


def _named_datatype(f):
    f["extra"] = np.dtype("f4")     # a committed type: neither a group nor a dataset


def _version_newer(f):
    f.attrs["version"] = 99


def _version_not_int(f):
    f.attrs["version"] = "1"


@pytest.mark.parametrize("craft,parts", [
    (_version_newer, ["model format version 99 is newer than this mpitrain reads (up to 1)"]),
    (_version_not_int, ["model attribute 'version': expected a positive int, got '1'"]),
    (_huge_layers, ["dataset 'params' declares shape (1200430000,)", "stores 0 bytes"]),
    (_too_many_params, ["model attribute 'components' declares", "parameters; at most"]),
    (_dims_beyond_bound, ["component 0 (affine): field 'out_dim'", "1000000000000"]),
    (_params_length_mismatch, ["dataset 'params' has shape (7,)", "need (131,) floats"]),
    (_huge_feat_dim, ["model attribute 'feat_dim'"]),
    (_huge_context, ["model attribute 'left_context'"]),
    (_cmvn_unstored, ["dataset 'cmvn_mean' declares"]),
    (_cmvn_wrong_length, ["dataset 'cmvn_scale' has shape (5,)", "expected 4 floats"]),
    (_priors_wrong_length, ["dataset 'class_priors' has shape (5,)", "expected 3 floats"]),
    (_priors_unstored, ["dataset 'class_priors' declares shape (10000000000,)"]),
    (_params_external, ["'params' is a link (ExternalLink)"]),
    (_components_nested, ["model attribute 'components' is not JSON"]),
    (_unknown_option, ["component 0 (affine): field 'init_scale': expected a finite number"]),
    (_elementwise_of_another_width, ["component 1: field 'out_dim' is 4, but relu keeps"]),
    (_option_of_another_kind, ["component 1: field 'p' is not an option of relu"]),
    # (an OverflowError traceback from the forward pass)
    (_normalize_target_beyond_float32, ["component 1: Normalize target_rms must be in (0, "]),
    # (an OverflowError traceback from the layer's constructor)
    (_option_beyond_a_float, ["component 1 (pnorm): field 'p': expected a finite number"]),
    # (export scored every class as never seen, -1.8e19, and exited 0)
    (_priors_negative, ["dataset 'class_priors' holds a negative value"]),
    # (an AttributeError traceback from the checksum's walk)
    (_named_datatype, ["'extra' is a named datatype; expected groups and datasets only"]),
    # (loaded: the dimension erased from every frame)
    (_scale_zero, ["dataset 'cmvn_scale' holds 0 at dimension 0; the scales are "
                   "1/sqrt(variance), in (0, 1e+30]"]),
])
def test_crafted_model_is_refused_naming_file_and_field(model, craft, parts):
    with h5py.File(model, "a") as f:
        craft(f)
    with pytest.raises(ValueError) as err:
        load_model(model)
    assert str(model) in str(err.value) and "\n" not in str(err.value)
    for part in parts:
        assert part in str(err.value)


@pytest.mark.parametrize("craft", [_huge_layers, _priors_unstored, _huge_feat_dim])
def test_crafted_model_is_refused_without_allocating(model, tmp_path, craft):
    with h5py.File(model, "a") as f:
        craft(f)
    assert_refused(load_limited(tmp_path, "mpitrain.nn.model_file", "load_model",
                                "load_model(sys.argv[1])", model), str(model))
    kaldiio.save_ark(str(tmp_path / "f.ark"), feats_and_ali(1)[0])
    for command in (["export", str(model), "--feats", "ark:f.ark", "--out", "ark:ll.ark"],
                    ["eval", str(model), str(tmp_path)]):
        assert_refused(run_limited(["-m", "mpitrain", *command], cwd=tmp_path), str(model))
    assert not (tmp_path / "ll.ark").exists()


def test_a_text_attribute_whose_datatype_turned_into_a_sequence_is_refused(model, tmp_path):
    """One byte of a text attribute's datatype message (a variable-length string's
    kind) set to an unknown sequence kind: HDF5 crashed the process (SIGSEGV) on
    reading the value, so a damaged model, or checkpoint, was no one-line error
    and a resume did not fall back to the previous checkpoint."""
    data = bytearray(model.read_bytes())
    where = data.index(b"\x19\x01")      # the first variable-length string type: 'format'
    data[where + 1] = 0x05
    model.write_bytes(bytes(data))
    result = load_limited(tmp_path, "mpitrain.nn.model_file", "load_model",
                          "load_model(sys.argv[1])", model)
    assert result.returncode != -11, "crashed"
    assert_refused(result, str(model), "attribute 'format' has a variable-length sequence type")


def _empty_heap_entry(path):
    """The free-space entry of the file's first global heap collection (where HDF5
    keeps text) declaring 0 bytes."""
    data = bytearray(path.read_bytes())
    at = data.index(b"GCOL")
    p = at + 16
    while struct.unpack_from("<H", data, p)[0] != 0:
        p += 16 + (struct.unpack_from("<Q", data, p + 8)[0] + 7) // 8 * 8
    struct.pack_into("<Q", data, p + 8, 0)
    path.write_bytes(bytes(data))


def test_a_global_heap_that_hdf5_would_read_for_ever_is_refused(model, corpus, tmp_path):
    """HDF5 walks a heap collection by its entries' sizes: an entry of 0 bytes never
    moves it on, and loading the model (or checking the shard) hung for ever, deaf
    to every signal but SIGKILL."""
    _, shard = corpus
    for path, code in ((model, "from mpitrain.nn.model_file import load_model as load"),
                       (shard, "from mpitrain.data.check import check_corpus\n"
                               "def load(path):\n"
                               "    raise ValueError(check_corpus(path.rsplit('/', 1)[0])[0])")):
        _empty_heap_entry(path)
        script = f"import sys\n{code}\ntry:\n    load(sys.argv[1])\nexcept ValueError as exc:\n" \
                 "    print(exc)\n    sys.exit(3)\n"
        try:
            result = run_limited(["-c", script, str(path)], cwd=tmp_path, timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"reading {path} did not end")
        assert_refused(result, str(path), "its global heap collection at byte",
                       "is damaged: an empty entry at byte")


def test_a_sound_model_still_loads(model):
    net, priors = load_model(model)
    assert net.num_params == small_network().num_params and priors.shape == (NUM_CLASSES,)
    np.testing.assert_array_equal(net.params, small_network().params)


# ---------------------------------------------------------------- checkpoints

@pytest.fixture
def checkpoint(tmp_path):
    net = small_network()
    path = tmp_path / "ckpt-00000005.h5"
    reader = {"epoch": 0, "chunk_pos": 1, "batch_pos": 2, "steps_in_epoch": 3}
    ranks = [{"optimizer": {"num_steps": 5, "delta": np.zeros(net.num_params, np.float32),
                            "preconditioners": {"affine0": {"W": np.ones((2, 13), np.float32)}}},
              "reader": dict(reader)} for _ in range(2)]
    save_checkpoint(path, net=net, step=5, frames_seen=100, config_yaml="a: 1\n",
                    rank_states=ranks, strategy_state={"global_model": np.array(net.params)},
                    class_priors=np.full(NUM_CLASSES, 1 / NUM_CLASSES))
    return path


def _delta_unstored(f):
    _declare_unstored(f["ranks/00001/optimizer"], "delta", (10 ** 10,))


def _delta_wrong_shape(f):
    del f["ranks/00000/optimizer/delta"]
    f["ranks/00000/optimizer/delta"] = np.zeros(7, np.float32)


def _precond_unstored(f):
    del f["ranks/00001/optimizer/preconditioners/affine0/W"]
    f["ranks/00001/optimizer/preconditioners/affine0"].create_dataset(
        "W", shape=(10 ** 6, 10 ** 5), dtype="f4", chunks=(16, 16), maxshape=(None, None))


def _strategy_wrong_shape(f):
    del f["strategy/global_model"]
    f["strategy/global_model"] = np.zeros((3, 3), np.float32)


def _model_params_unstored(f):
    _declare_unstored(f["model"], "params", (10 ** 10,))


def _num_ranks_huge(f):
    f.attrs["num_ranks"] = 10 ** 12


def _rank_missing(f):
    del f["ranks/00001"]


def _reader_negative(f):
    f["ranks/00000/reader"].attrs["chunk_pos"] = -4


def _state_nested_deep(f):
    group = f["ranks/00000/optimizer"]
    for i in range(40):
        group = group.create_group(f"g{i}")


def _state_soft_link_cycle(f):
    f["ranks/00000/optimizer/loop"] = h5py.SoftLink("/ranks/00000")


def _window_scalar(f):
    f["ranks/00001/window"] = np.float64(1.0)


def _window_counts_negative(f):
    f["ranks/00000/window"] = np.array([1.0, 2.0, -5.0, 0.0])


def _optimizer_count_array(f):
    f["ranks/00001/optimizer"].attrs["num_steps"] = np.array([5, 6])


def _own_model_of_one_rank(f):
    f["ranks/00000"].create_group("strategy")["params"] = np.zeros(131, np.float32)


def _trainer_count_as_text(f):
    trainer = f.create_group("trainer")
    trainer.attrs["place_data.train"] = "/data/train"
    trainer.attrs["rollbacks"] = "x"


def _step_not_int(f):
    f.attrs["step"] = "five"


@pytest.mark.parametrize("craft,parts", [
    (_delta_unstored, ["dataset 'ranks/00001/optimizer/delta' declares shape (10000000000,)"]),
    (_delta_wrong_shape, ["dataset 'ranks/00000/optimizer/delta' has shape (7,)",
                          "expected (131,) floats"]),
    (_precond_unstored, ["dataset 'ranks/00001/optimizer/preconditioners/affine0/W' declares"]),
    (_strategy_wrong_shape, ["dataset 'strategy/global_model' has shape (3, 3)"]),
    (_model_params_unstored, ["dataset 'model/params' declares"]),
    (_num_ranks_huge, ["checkpoint attribute 'num_ranks'"]),
    (_rank_missing, ["group 'ranks' holds 1 entries", "'num_ranks' is 2"]),
    (_reader_negative, ["field 'ranks/00000/reader/chunk_pos'"]),
    (_state_nested_deep, ["is nested more than 16 deep"]),
    (_state_soft_link_cycle, ["'ranks/00000/optimizer/loop' is a link (SoftLink)"]),
    (_step_not_int, ["checkpoint attribute 'step'"]),
    (_named_datatype, ["'extra' is a named datatype; expected groups and datasets only"]),
    # (an IndexError or a TypeError traceback on resume)
    (_window_scalar, ["'ranks/00001/window' has shape () and dtype float64; expected the "
                      "log window's 4 float sums"]),
    (_window_counts_negative, ["'ranks/00000/window' has shape (4,)"]),
    # (restored on one rank, which restarted its ADPSGD exchange: the job hung)
    (_own_model_of_one_rank, ["'ranks/00000/strategy/params' (a rank's own model) is stored "
                              "for 1 of 2 ranks, not for rank 1"]),
    # ("invalid literal for int() with base 10: 'x'" on resume, naming nothing)
    (_trainer_count_as_text, ["field 'trainer/rollbacks': expected a number, got 'x'"]),
    (_optimizer_count_array, ["attribute 'ranks/00001/optimizer/num_steps': expected a "
                              "number or text, got an array of shape (2,)"]),
    (lambda f: _named_datatype(f["ranks/00000/optimizer"]),
     ["'ranks/00000/optimizer/extra' is a named datatype, expected a dataset"]),
])
def test_crafted_checkpoint_is_refused_naming_file_and_field(checkpoint, craft, parts):
    with h5py.File(checkpoint, "a") as f:
        craft(f)
    with pytest.raises(ValueError) as err:
        load_checkpoint(checkpoint)
    assert str(checkpoint) in str(err.value) and "\n" not in str(err.value)
    for part in parts:
        assert part in str(err.value)


@pytest.mark.parametrize("craft", [_delta_unstored, _precond_unstored, _model_params_unstored])
def test_crafted_checkpoint_is_refused_without_allocating(checkpoint, tmp_path, craft):
    with h5py.File(checkpoint, "a") as f:
        craft(f)
    for call in ("load_checkpoint(sys.argv[1])", "load_checkpoint(sys.argv[1], ranks=[1])"):
        assert_refused(load_limited(tmp_path, "mpitrain.train.checkpoint", "load_checkpoint",
                                    call, checkpoint), str(checkpoint))


def test_a_sound_checkpoint_still_loads(checkpoint):
    ckpt = load_checkpoint(checkpoint, ranks=[1])
    assert ckpt.step == 5 and ckpt.num_ranks == 2 and ckpt.frames_seen == 100
    assert ckpt.rank_state(1)["reader"]["batch_pos"] == 2
    assert ckpt.rank_state(1)["optimizer"]["preconditioners"]["affine0"]["W"].shape == (2, 13)
    np.testing.assert_array_equal(ckpt.strategy_state["global_model"], ckpt.net.params)


# ---------------------------------------------------------------- shards

@pytest.fixture
def corpus(tmp_path):
    feats, ali = feats_and_ali(5)
    out = tmp_path / "corpus"
    with CorpusWriter(str(out), feat_dim=FEAT_DIM, num_classes=NUM_CLASSES, num_shards=1) as w:
        for key in feats:
            w.add(key, feats[key], ali[key])
    return out, out / "shard-00000.h5"


def _frames_unstored(f):
    # One utterance of 10^9 frames, consistent in every declared shape, none of it stored.
    _declare_unstored(f, "feats", (10 ** 9, FEAT_DIM))
    _declare_unstored(f, "labels", (10 ** 9,), "i4")
    del f["utt_offsets"], f["utt_ids"]
    f["utt_offsets"] = np.array([0, 10 ** 9], np.int64)
    f.create_dataset("utt_ids", data=["utt0"], dtype=h5py.string_dtype())


def _offsets_unstored(f):
    _declare_unstored(f, "utt_offsets", (10 ** 10,), "i8")


def _ids_unstored(f):
    _declare_unstored(f, "utt_ids", (10 ** 9,), h5py.string_dtype())


def _columns_unstored(f):
    rows = f["labels"].shape[0]
    del f["feats"]
    f.create_dataset("feats", shape=(rows, 10 ** 8), dtype="f4", chunks=(1, 1024),
                     maxshape=(None, None))


def _offsets_too_many(f):
    del f["utt_offsets"]
    f["utt_offsets"] = np.arange(f["feats"].shape[0] + 5, dtype=np.int64)


@pytest.mark.parametrize("craft,parts", [
    (_frames_unstored, ["dataset 'feats' declares shape (1000000000, 4)", "stores 0 bytes"]),
    (_offsets_unstored, ["dataset 'utt_offsets' declares shape (10000000000,)"]),
    (_ids_unstored, ["dataset 'utt_ids' declares shape (1000000000,)"]),
    (_columns_unstored, ["dataset 'feats' declares"]),
    (_offsets_too_many, ["dataset 'utt_offsets' has", "entries; expected at most"]),
])
def test_crafted_shard_is_refused_naming_file_and_dataset(corpus, craft, parts):
    directory, shard = corpus
    with h5py.File(shard, "a") as f:
        craft(f)
    with pytest.raises(CorpusError) as err:
        ShardReader(str(shard))
    for part in [str(shard)] + parts:
        assert part in str(err.value)
    problems = check_corpus(str(directory))
    assert any(all(part in p for part in [str(shard)] + parts) for p in problems), problems


@pytest.mark.parametrize("craft", [_frames_unstored, _offsets_unstored, _ids_unstored,
                                   _columns_unstored])
def test_crafted_shard_is_refused_without_allocating(corpus, tmp_path, craft):
    directory, shard = corpus
    with h5py.File(shard, "a") as f:
        craft(f)
    reader = load_limited(tmp_path, "mpitrain.data.shards", "ShardReader",
                          "ShardReader(sys.argv[1]).read(0, 1)", shard)
    assert reader.returncode == 3, reader.stdout + reader.stderr
    # One line per dataset that declares more than the file stores.
    for line in reader.stdout.splitlines():
        assert line.startswith(f"{shard}: dataset '") and "declares" in line, line
    check = run_limited(["-m", "mpitrain", "check", str(directory)], cwd=tmp_path)
    out = check.stdout + check.stderr
    assert check.returncode != 0 and "declares" in out
    assert "MemoryError" not in out and "Traceback" not in out


def test_a_wide_stored_shard_is_refused(tmp_path):
    path = str(tmp_path / "wide.h5")
    write_shard(path, ["a"], [np.zeros((1, 70000), np.float32)], [np.zeros(1, np.int32)])
    with pytest.raises(CorpusError, match=r"wide.h5: dataset 'feats' has 70000 columns; at most"):
        ShardReader(path)


@pytest.mark.parametrize("name,value,part", [
    ("format", "x" * 10 ** 7, "attribute 'format' is 'xxxx"),
    ("step", "5" * 10 ** 7, "checkpoint attribute 'step': expected an int"),
])
def test_a_huge_checkpoint_attribute_is_shown_cut_short(checkpoint, name, value, part):
    # (the error held all 10 MB of it, checksum recomputed or not)
    with h5py.File(checkpoint, "a") as f:
        f.attrs[name] = value
        del f.attrs["checksum"]
        write_checksums(f, str(checkpoint), what="checkpoint")
    with pytest.raises(ValueError) as err:
        load_checkpoint(checkpoint)
    message = str(err.value)
    assert message.startswith(str(checkpoint)) and part in message
    assert "(10000000 characters)" in message and len(message) < len(str(checkpoint)) + 300
