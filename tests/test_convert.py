"""`mpitrain convert`: ONNX and PyTorch forms give what mpitrain computes."""

import os
import ast
import json
import sys

import numpy as np
import pytest

import mpitrain
from mpitrain.cli import main
from mpitrain.nn.affine import Affine
from mpitrain.nn.model_file import save_model
from mpitrain.nn.network import Network
from mpitrain.nn.nonlinear import Normalize, PNorm, ReLU, Sigmoid
from mpitrain.testing import standin_torch


def _model(path, layers, *, left=2, right=1, speaker_cmvn=None):
    net = Network(layers, feat_dim=4, left_context=left, right_context=right)
    net.init_params(seed=3)
    net.set_cmvn(np.linspace(-1, 1, 4), np.linspace(0.5, 2, 4))
    net.speaker_cmvn = speaker_cmvn
    save_model(path, net, class_priors=np.array([0.5, 0.3, 0.2]))
    return path


def _layers(kind):
    width = 4 * 4                        # feat_dim x (2 + 1 + 1) frames
    if kind == "relu":
        return [Affine(width, 8), ReLU(8), Affine(8, 3)]
    if kind == "sigmoid":
        return [Affine(width, 8), Sigmoid(8), Affine(8, 3)]
    if kind == "pnorm2":
        return [Affine(width, 12), PNorm(12, 4, p=2.0), Normalize(4), Affine(4, 3)]
    if kind == "pnorm100":               # |x|^100 alone overflows float32
        return [Affine(width, 12), PNorm(12, 3, p=100.0), Affine(3, 3)]
    return [Affine(width, 12), PNorm(12, 3, p=3.0), Normalize(3, target_rms=0.5),
            Affine(3, 3)]


@pytest.fixture
def torch():
    """PyTorch where it is installed, else the stand-in (mpitrain/testing/standin_torch.py),
    so that the converted module runs in every test run."""
    try:
        import torch as real
    except ImportError:
        real = None
    if real is not None:
        yield real
        return
    with standin_torch.installed() as standin:
        yield standin


def _load_module(out):
    """The converted PyTorch module in directory ``out``, loaded as its users do."""
    sys.path.insert(0, str(out))
    try:
        import model as converted
        return converted.load()
    finally:
        sys.path.remove(str(out))
        sys.modules.pop("model", None)


FEATS = {"long": np.random.default_rng(0).normal(size=(9, 4)).astype(np.float32),
         "one frame": np.random.default_rng(1).normal(size=(1, 4)).astype(np.float32),
         "loud": 30 * np.random.default_rng(2).normal(size=(5, 4)).astype(np.float32)}


@pytest.mark.parametrize("kind", ["relu", "sigmoid", "pnorm2", "pnorm3", "pnorm100"])
def test_onnx_output_equals_ours(tmp_path, kind):
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    model = _model(tmp_path / "m.h5", _layers(kind))
    assert main(["convert", str(model), "--to", "onnx", str(tmp_path / "m.onnx")]) == 0
    session = ort.InferenceSession(str(tmp_path / "m.onnx"))
    ours = mpitrain.load_model(model)
    for feats in FEATS.values():
        got = session.run(None, {"feats": feats})[0]
        np.testing.assert_allclose(got, ours.log_posteriors(feats), atol=1e-5, rtol=0)


def test_onnx_metadata_says_priors_and_speaker_cmvn(tmp_path):
    onnx = pytest.importorskip("onnx")
    model = _model(tmp_path / "m.h5", _layers("relu"), speaker_cmvn={"norm_vars": True})
    assert main(["convert", str(model), "--to", "onnx", str(tmp_path / "m.onnx")]) == 0
    meta = {p.key: p.value for p in onnx.load(str(tmp_path / "m.onnx")).metadata_props}
    assert json.loads(meta["speaker_cmvn"]) == {"norm_vars": True}
    assert json.loads(meta["class_priors"]) == pytest.approx([0.5, 0.3, 0.2])


def test_without_onnx_the_error_is_one_line_naming_the_package(tmp_path, monkeypatch, capsys):
    model = _model(tmp_path / "m.h5", _layers("relu"))
    monkeypatch.setitem(sys.modules, "onnx", None)          # import onnx fails
    assert main(["convert", str(model), "--to", "onnx", str(tmp_path / "m.onnx")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("mpitrain convert: error: convert --to onnx needs the onnx package "
                   "(pip install onnx)")
    assert not (tmp_path / "m.onnx").exists()


def test_torch_form_is_a_module_and_npz_without_pickle(tmp_path, torch):
    model = _model(tmp_path / "m.h5", _layers("pnorm2"), speaker_cmvn={"norm_vars": False})
    out = tmp_path / "torch"
    assert main(["convert", str(model), "--to", "torch", str(out)]) == 0
    source = (out / "model.py").read_text()
    ast.parse(source)
    assert "pickle" not in source.replace("allow_pickle=False", "")
    assert "SPEAKER_CMVN = {'norm_vars': False}" in source
    with np.load(out / "weights.npz", allow_pickle=False) as data:
        assert sorted(data.files) == ["affine0_bias", "affine0_weight", "affine1_bias",
                                      "affine1_weight", "cmvn_mean", "cmvn_scale", "priors"]
        assert data["affine0_weight"].shape == (12, 16) and data["affine1_bias"].shape == (3,)
    net = _load_module(out)
    ours = mpitrain.load_model(model)
    for feats in FEATS.values():
        with torch.no_grad():
            got = net(torch.from_numpy(feats)).numpy()
        np.testing.assert_allclose(got, ours.log_posteriors(feats), atol=1e-5, rtol=0)


def test_torch_target_that_is_a_file_is_one_line(tmp_path, capsys):
    model = _model(tmp_path / "m.h5", _layers("relu"))
    (tmp_path / "file").write_text("x")
    assert main(["convert", str(model), "--to", "torch", str(tmp_path / "file")]) == 2
    assert "file: exists and is not a directory" in capsys.readouterr().err


def test_torch_target_under_a_file_or_empty_is_one_line_naming_it(tmp_path, capsys):
    # "[Errno 20] Not a directory: ..." and "[Errno 2] No such file or directory: ''"
    model = _model(tmp_path / "m.h5", _layers("relu"))
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "torch"
    assert main(["convert", str(model), "--to", "torch", str(out)]) == 2
    assert capsys.readouterr().err == (f"mpitrain convert: error: {out}: cannot make the "
                                       f"directory: {tmp_path / 'file'} is not a directory\n")
    assert main(["convert", str(model), "--to", "torch", ""]) == 2
    assert "error: OUT is empty; name the file (onnx) or directory (torch) to write" in \
        capsys.readouterr().err


def test_onnx_target_that_is_a_directory_is_one_line(tmp_path, capsys):
    # it failed at the end with the raw rename error, naming our temporary file
    model = _model(tmp_path / "m.h5", _layers("relu"))
    (tmp_path / "out").mkdir()
    assert main(["convert", str(model), "--to", "onnx", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "out: is a directory; --to onnx writes one file" in err
    assert os.listdir(tmp_path / "out") == [] and ".tmp" not in " ".join(os.listdir(tmp_path))


def test_onnx_target_that_is_the_model_itself_is_refused(tmp_path, capsys):
    # it wrote the ONNX file over the model and said so, exit status 0
    model = _model(tmp_path / "m.h5", _layers("relu"))
    before = model.read_bytes()
    assert main(["convert", str(model), "--to", "onnx", str(model)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is the model being converted" in err
    assert model.read_bytes() == before


@pytest.mark.parametrize("kind", ["relu", "pnorm100"])
def test_torch_form_takes_loud_frames_and_an_utterance_of_no_frames(tmp_path, kind, torch):
    # a large p overflowed (|x|^p); an empty utterance failed to reshape (-1 of 0)
    model = _model(tmp_path / "m.h5", _layers(kind))
    out = tmp_path / "torch"
    assert main(["convert", str(model), "--to", "torch", str(out)]) == 0
    net = _load_module(out)
    ours = mpitrain.load_model(model)
    with torch.no_grad():
        for feats in FEATS.values():
            got = net(torch.from_numpy(feats)).numpy()
            np.testing.assert_allclose(got, ours.log_posteriors(feats), atol=1e-5, rtol=0)
        assert net(torch.zeros(0, 4)).shape == (0, 3)


def test_converted_forms_score_an_unseen_pdf_as_export_does(tmp_path, torch):
    """A pdf never seen in training has its prior at the floor 1e-8: minus its log
    made it the best-scoring pdf of every frame in the converted forms (+18 here)
    while export scores it far below every other."""
    import kaldiio
    from mpitrain.nn.model_file import load_model
    net, _ = load_model(_model(tmp_path / "seen.h5", _layers("relu")))
    save_model(tmp_path / "m.h5", net, class_priors=np.array([0.7, 0.3 - 1e-8, 1e-8]))
    model = tmp_path / "m.h5"
    feats = FEATS["long"]
    kaldiio.save_ark(str(tmp_path / "f.ark"), {"u": feats})
    assert main(["export", str(model), "--feats", f"ark:{tmp_path}/f.ark",
                 "--out", f"ark:{tmp_path}/ll.ark"]) == 0
    want = dict(kaldiio.load_ark(str(tmp_path / "ll.ark")))["u"]
    assert (want[:, 2] < -1e18).all()
    logp = mpitrain.load_model(model).log_posteriors(feats)
    onnx = pytest.importorskip("onnx")
    assert main(["convert", str(model), "--to", "onnx", str(tmp_path / "m.onnx")]) == 0
    meta = {p.key: p.value for p in onnx.load(str(tmp_path / "m.onnx")).metadata_props}
    offsets = np.array(json.loads(meta["loglike_offsets"]), dtype=np.float32)
    np.testing.assert_allclose(logp + offsets, want, rtol=1e-6, atol=1e-5)
    out = tmp_path / "torch"
    assert main(["convert", str(model), "--to", "torch", str(out)]) == 0
    net = _load_module(out)
    with torch.no_grad():
        got = net.loglikes(torch.from_numpy(feats)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_torch_form_moved_to_a_gpu_gives_its_loglikes_there(tmp_path):
    """The priors are a plain attribute (no float16 cast of them with the module), so
    they stay on the CPU when the module moves: the offsets failed to add to log
    posteriors on the GPU (a device mismatch).  On the stand-in, "cuda" is a name."""
    model = _model(tmp_path / "m.h5", _layers("pnorm3"))
    out = tmp_path / "torch"
    assert main(["convert", str(model), "--to", "torch", str(out)]) == 0
    feats = FEATS["long"]
    with standin_torch.installed() as torch:
        net = _load_module(out)
        want = net.loglikes(torch.from_numpy(feats)).numpy()
        got = net.to("cuda").loglikes(torch.from_numpy(feats).to("cuda"))
        assert got.device == "cuda"
        np.testing.assert_array_equal(got.cpu().numpy(), want)
        with pytest.raises(RuntimeError, match="same device"):
            net(torch.from_numpy(feats))        # (the stand-in does check devices)
    ours = mpitrain.load_model(model).log_likelihoods(feats)
    np.testing.assert_allclose(want, ours, rtol=1e-5, atol=1e-4)


def test_onnx_target_in_folders_not_yet_made_is_written_there(tmp_path):
    # it failed naming its hidden temporary; --to torch made its folders already
    pytest.importorskip("onnx")
    model = _model(tmp_path / "m.h5", _layers("relu"))
    target = tmp_path / "new" / "deeper" / "m.onnx"
    assert main(["convert", str(model), "--to", "onnx", str(target)]) == 0
    assert target.is_file() and os.listdir(target.parent) == ["m.onnx"]


def test_torch_form_on_a_full_disk_is_one_line_naming_the_file_and_leaves_nothing(
        tmp_path, capsys, monkeypatch):
    # weights.npz was written through a temporary of its own, whose failure said
    # "[Errno 28] No space left on device" and left the directory made for it
    import errno
    model = _model(tmp_path / "m.h5", _layers("relu"))
    out = tmp_path / "torch"

    def full(fh, **arrays):
        fh.write(b"PK")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(np, "savez", full)
    assert main(["convert", str(model), "--to", "torch", str(out)]) == 2
    assert capsys.readouterr().err == ("mpitrain convert: error: no space left on device "
                                       f"writing {out / 'weights.npz'}\n")
    assert not out.exists()
    out.mkdir()                          # a directory that was there stays
    assert main(["convert", str(model), "--to", "torch", str(out)]) == 2
    assert os.listdir(out) == []


def test_torch_form_over_an_earlier_one_that_fails_at_model_py_keeps_the_earlier_pair(
        tmp_path, monkeypatch):
    # weights.npz was renamed into place before model.py was written: a failure
    # there left new weights beside the earlier conversion's module
    import errno

    from mpitrain import convert
    out = tmp_path / "torch"
    out.mkdir()
    (out / "weights.npz").write_bytes(b"earlier weights")
    (out / "model.py").write_text("earlier module\n")
    model = _model(tmp_path / "m.h5", _layers("relu"))

    def full(path, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.setattr(convert, "_atomic_bytes", full)
    assert main(["convert", str(model), "--to", "torch", str(out)]) == 2
    assert (out / "weights.npz").read_bytes() == b"earlier weights"
    assert (out / "model.py").read_text() == "earlier module\n"
    assert sorted(os.listdir(out)) == ["model.py", "weights.npz"]


def test_torch_form_over_an_earlier_one_that_fails_at_weights_npz_keeps_the_earlier_pair(
        tmp_path, monkeypatch, capsys):
    # model.py was renamed into place inside the weights' write, before weights.npz was
    # flushed and renamed: a failure there (a quota met at the flush) left the new
    # module beside the earlier conversion's weights
    import errno

    out = tmp_path / "torch"
    out.mkdir()
    (out / "weights.npz").write_bytes(b"earlier weights")
    (out / "model.py").write_text("earlier module\n")
    model = _model(tmp_path / "m.h5", _layers("relu"))
    real = os.fsync

    def full_at_weights(fd):
        if "weights.npz" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
        real(fd)

    monkeypatch.setattr(os, "fsync", full_at_weights)
    assert main(["convert", str(model), "--to", "torch", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(out / "weights.npz") in err, err
    assert (out / "weights.npz").read_bytes() == b"earlier weights"
    assert (out / "model.py").read_text() == "earlier module\n"
    assert sorted(os.listdir(out)) == ["model.py", "weights.npz"]
