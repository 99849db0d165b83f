"""``mpitrain convert``: a trained model as ONNX or as a PyTorch module.

Both take one utterance's raw features (T, feat_dim) and return its log
posteriors (T, num_classes), with CMVN and splicing inside, exactly as
``export`` and :func:`mpitrain.load_model` compute them (context clipped at
the utterance's ends).  A model trained with per-speaker CMVN (its
``speaker_cmvn``) expects features that already had it; the outputs say so
(ONNX metadata ``speaker_cmvn``, the module's ``SPEAKER_CMVN``).  Pseudo
log-likelihoods are the log posteriors minus ``log p(s)``, with a pdf never
seen in training scored far below every other, as ``export`` does: the ONNX
metadata ``loglike_offsets`` holds what to add (prior scale 1), beside
``class_priors``; the module's ``loglikes(feats, prior_scale)`` computes them
from ``priors`` in the npz.

- ``onnx``: one file built with the ``onnx`` package (opset 17; an optional
  dependency: ``pip install onnx``), checked with ``onnx.checker``.
- ``torch``: a directory with ``model.py``, a self-contained module that
  imports only numpy and torch, and ``weights.npz``, which it reads with
  ``allow_pickle=False``.  Nothing is pickled (``torch.save`` would be), so
  loading it runs no code from the weights; writing it needs no torch.

Example::

    convert_model("runs/x/final.h5", "onnx", "model.onnx")
    convert_model("runs/x/final.h5", "torch", "model_torch")   # model.py + weights.npz
"""

from __future__ import annotations

import json
import os

import numpy as np

from .export import UNSEEN_PRIOR, UNSEEN_SCORE, prior_offsets
from .files import atomic_path, output_file_problem, removed_if_failed
from .nn.model_file import load_model

FORMATS = ("onnx", "torch")
OPSET = 17


class MissingPackage(RuntimeError):
    """An optional package the chosen format needs is not installed."""


def convert_model(model_path, fmt: str, out: str) -> str:
    """Write ``model_path`` in ``fmt`` ("onnx" or "torch") to ``out``; returns ``out``.

    Example::

        convert_model("final.h5", "onnx", "final.onnx")
    """
    if fmt not in FORMATS:
        raise ValueError(f"--to: expected one of {', '.join(FORMATS)}, got {fmt!r}")
    if not str(out).strip():
        raise ValueError("OUT is empty; name the file (onnx) or directory (torch) to write")
    if fmt == "onnx" and os.path.isdir(out):
        raise ValueError(f"{out}: is a directory; --to onnx writes one file (name it, "
                         f"e.g. {os.path.join(out, 'model.onnx')})")
    if fmt == "onnx" and os.path.exists(out) and os.path.samefile(out, model_path):
        raise ValueError(f"{out}: is the model being converted, which the ONNX file would "
                         "replace; write to another file")
    net, priors = load_model(model_path)
    model = _Parts(net, priors)
    if fmt == "onnx":
        _write_onnx(model, str(out))
    else:
        _write_torch(model, str(out))
    return str(out)


class _Parts:
    """What both formats need, as host arrays: layers, CMVN, context, priors."""

    def __init__(self, net, priors):
        self.specs = net.specs()
        self.feat_dim, self.left, self.right = net.feat_dim, net.left_context, net.right_context
        self.cmvn_mean = np.asarray(net.cmvn_mean, dtype=np.float32)
        self.cmvn_scale = np.asarray(net.cmvn_scale, dtype=np.float32)
        self.priors = None if priors is None else np.asarray(priors, dtype=np.float64)
        self.speaker_cmvn = net.speaker_cmvn
        self.affine = []           # (W (out, in), b (out,)) per affine component
        params, at = np.asarray(net.params, dtype=np.float32), 0
        for spec in self.specs:
            if spec["kind"] == "affine":
                rows, cols = spec["out_dim"], spec["in_dim"] + 1
                block = params[at:at + rows * cols].reshape(rows, cols)
                self.affine.append((block[:, :-1].copy(), block[:, -1].copy()))
                at += rows * cols


# ---------------------------------------------------------------- onnx

def _onnx():
    try:
        import onnx
        from onnx import helper, numpy_helper
    except ImportError:
        raise MissingPackage("convert --to onnx needs the onnx package "
                             "(pip install onnx)") from None
    return onnx, helper, numpy_helper


def _write_onnx(model: _Parts, out: str) -> None:
    onnx, helper, numpy_helper = _onnx()
    nodes, inits = [], []
    count = [0]

    def const(value, dtype=np.float32):
        count[0] += 1
        name = f"c{count[0]}"
        inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def node(op, inputs, **attrs):
        count[0] += 1
        name = f"t{count[0]}"
        nodes.append(helper.make_node(op, inputs, [name], **attrs))
        return name

    # CMVN, then the spliced context: rows clip(t + o, 0, T - 1) of each frame t
    y = node("Mul", [node("Sub", ["feats", const(model.cmvn_mean)]), const(model.cmvn_scale)])
    frames = node("Gather", [node("Shape", [y]), const(0, np.int64)], axis=0)
    t = node("Range", [const(0, np.int64), frames, const(1, np.int64)])
    offsets = const(np.arange(-model.left, model.right + 1, dtype=np.int64)[None, :], np.int64)
    rows = node("Add", [node("Unsqueeze", [t, const([1], np.int64)]), offsets])
    last = node("Sub", [frames, const(1, np.int64)])
    rows = node("Clip", [rows, const(0, np.int64), last])
    width = (model.left + 1 + model.right) * model.feat_dim
    h = node("Reshape", [node("Gather", [y, rows], axis=0), const([-1, width], np.int64)])
    weights = iter(model.affine)
    for spec in model.specs:
        kind = spec["kind"]
        if kind == "affine":
            w, b = next(weights)
            h = node("Gemm", [h, const(w), const(b)], transB=1)
        elif kind == "relu":
            h = node("Relu", [h])
        elif kind == "sigmoid":
            h = node("Sigmoid", [h])
        elif kind == "pnorm":
            group = spec["in_dim"] // spec["out_dim"]
            g = node("Reshape", [h, const([-1, spec["out_dim"], group], np.int64)])
            p = float(spec.get("p", 2.0))
            if p == 2.0:
                h = node("ReduceL2", [g], axes=[2], keepdims=0)
            else:
                # scaled by the group's largest |x|, as nn.nonlinear.PNorm (no overflow)
                from .nn.nonlinear import TINY
                magnitude = node("Abs", [g])
                scale = node("Max", [node("ReduceMax", [magnitude], axes=[2], keepdims=1),
                                     const(TINY)])
                s = node("ReduceSum", [node("Pow", [node("Div", [magnitude, scale]),
                                                    const(p)]),
                                       const([2], np.int64)], keepdims=0)
                h = node("Mul", [node("Squeeze", [scale, const([2], np.int64)]),
                                 node("Pow", [s, const(1.0 / p)])])
        elif kind == "normalize":
            from .nn.nonlinear import Normalize
            scale = spec["in_dim"] * float(spec.get("target_rms", 1.0)) ** 2
            power = node("Div", [node("ReduceSumSquare", [h], axes=[1], keepdims=1),
                                 const(scale)])
            factor = node("Pow", [node("Max", [power, const(Normalize.FLOOR)]), const(-0.5)])
            h = node("Mul", [h, factor])
        else:
            raise ValueError(f"convert: component kind {kind!r} has no ONNX form")
    nodes.append(helper.make_node("LogSoftmax", [h], ["log_posteriors"], axis=1))
    num_classes = model.specs[-1]["out_dim"]
    graph = helper.make_graph(
        nodes, "mpitrain",
        [helper.make_tensor_value_info("feats", onnx.TensorProto.FLOAT, ["T", model.feat_dim])],
        [helper.make_tensor_value_info("log_posteriors", onnx.TensorProto.FLOAT,
                                       ["T", num_classes])], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="mpitrain")
    meta = {"speaker_cmvn": json.dumps(model.speaker_cmvn),
            "left_context": str(model.left), "right_context": str(model.right)}
    if model.priors is not None:
        meta["class_priors"] = json.dumps(model.priors.tolist())
        # what export adds at prior scale 1: -log p(s), and for pdfs never seen in
        # training (prior at the floor) a score below every other, as in Kaldi
        meta["loglike_offsets"] = json.dumps(
            [float(v) for v in prior_offsets(model.priors, scale=1.0)[0]])
    helper.set_model_props(proto, meta)
    onnx.checker.check_model(proto)
    _atomic_bytes(out, proto.SerializeToString())


# ---------------------------------------------------------------- torch

_MODULE = '''"""An mpitrain acoustic model for PyTorch (written by `mpitrain convert --to torch`).

Loads weights.npz beside this file with numpy (allow_pickle=False: no code in
the weights).  forward(feats): one utterance's raw features (T, FEAT_DIM),
float32, to log posteriors (T, NUM_CLASSES), CMVN and splicing inside.
SPEAKER_CMVN not None: the features must already have per-speaker CMVN.

Example::

    import model
    net = model.load()                       # or model.load("path/to/weights.npz")
    logp = net(torch.from_numpy(feats))
"""

import os

import numpy as np
import torch

SPECS = {specs}
FEAT_DIM, LEFT, RIGHT = {feat_dim}, {left}, {right}
NUM_CLASSES = {num_classes}
SPEAKER_CMVN = {speaker_cmvn}
NORMALIZE_FLOOR = {floor!r}
PNORM_TINY = {pnorm_tiny!r}
# a prior at or below UNSEEN_PRIOR: a pdf never seen in training, scored UNSEEN_SCORE
UNSEEN_PRIOR, UNSEEN_SCORE = {unseen_prior!r}, {unseen_score!r}


class AcousticModel(torch.nn.Module):
    def __init__(self, weights):
        super().__init__()
        self.register_buffer("cmvn_mean", torch.from_numpy(weights["cmvn_mean"]))
        self.register_buffer("cmvn_scale", torch.from_numpy(weights["cmvn_scale"]))
        self.priors = torch.from_numpy(weights["priors"]) if "priors" in weights else None
        self.affine = torch.nn.ModuleList()
        for i in range(sum(s["kind"] == "affine" for s in SPECS)):
            w = torch.from_numpy(weights[f"affine{{i}}_weight"])
            layer = torch.nn.Linear(w.shape[1], w.shape[0])
            with torch.no_grad():
                layer.weight.copy_(w)
                layer.bias.copy_(torch.from_numpy(weights[f"affine{{i}}_bias"]))
            self.affine.append(layer)

    def forward(self, feats):
        y = (feats - self.cmvn_mean) * self.cmvn_scale
        t = torch.arange(y.shape[0], device=y.device)
        rows = (t[:, None] + torch.arange(-LEFT, RIGHT + 1, device=y.device)[None, :])
        # explicit widths: an utterance of no frames has no -1 to infer
        h = y[rows.clamp(0, y.shape[0] - 1)].reshape(y.shape[0], FEAT_DIM * (LEFT + 1 + RIGHT))
        layers = iter(self.affine)
        for spec in SPECS:
            kind = spec["kind"]
            if kind == "affine":
                h = next(layers)(h)
            elif kind == "relu":
                h = torch.relu(h)
            elif kind == "sigmoid":
                h = torch.sigmoid(h)
            elif kind == "pnorm":
                p = spec.get("p", 2.0)
                g = h.reshape(h.shape[0], spec["out_dim"],
                              spec["in_dim"] // spec["out_dim"]).abs()
                # scaled by the group's largest |x|: |x|^p alone overflows for large p
                scale = g.amax(dim=2, keepdim=True).clamp_min(PNORM_TINY)
                h = scale[:, :, 0] * (g / scale).pow(p).sum(dim=2).pow(1.0 / p)
            elif kind == "normalize":
                scale = spec["in_dim"] * spec.get("target_rms", 1.0) ** 2
                power = (h * h).sum(dim=1, keepdim=True) / scale
                h = h * power.clamp_min(NORMALIZE_FLOOR).pow(-0.5)
        return torch.log_softmax(h, dim=1)

    def loglikes(self, feats, prior_scale=1.0):
        """Pseudo log-likelihoods, as `mpitrain export` writes them: log posteriors
        minus prior_scale * log p(s), pdfs never seen in training at UNSEEN_SCORE."""
        if self.priors is None:
            raise ValueError("this model was saved without class priors")
        offsets = -prior_scale * torch.log(self.priors)
        offsets[self.priors <= UNSEEN_PRIOR] = UNSEEN_SCORE
        logp = self.forward(feats)
        # the priors stay on the CPU in float64 when the module moves (a plain
        # attribute): the offsets go where the log posteriors are
        return logp + offsets.to(device=logp.device, dtype=logp.dtype)


def load(path=None):
    """The model with weights from ``path`` (default: weights.npz beside this file)."""
    path = path or os.path.join(os.path.dirname(os.path.abspath(__file__)), "weights.npz")
    with np.load(path, allow_pickle=False) as data:
        weights = {{k: np.array(data[k]) for k in data.files}}
    return AcousticModel(weights).eval()
'''


def _write_torch(model: _Parts, out: str) -> None:
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"{out}: exists and is not a directory (convert --to torch writes "
                         "a directory: model.py and weights.npz)")
    # the directory this conversion made goes with a failure: nothing half-written
    with removed_if_failed(out, expected=("weights.npz", "model.py")):
        try:
            os.makedirs(out, exist_ok=True)
        except OSError as exc:
            # (makedirs names no more than the path, e.g. "[Errno 20] Not a directory")
            problem = output_file_problem(os.path.join(out, "weights.npz")) or exc.strerror
            raise ValueError(f"{out}: cannot make the directory: {problem}") from None
        _write_torch_files(model, out)


def _write_torch_files(model: _Parts, out: str) -> None:
    from .nn.nonlinear import TINY, Normalize
    arrays = {"cmvn_mean": model.cmvn_mean, "cmvn_scale": model.cmvn_scale}
    for i, (w, b) in enumerate(model.affine):
        arrays[f"affine{i}_weight"], arrays[f"affine{i}_bias"] = w, b
    if model.priors is not None:
        arrays["priors"] = model.priors
    source = _MODULE.format(specs=repr(model.specs), feat_dim=model.feat_dim,
                            left=model.left, right=model.right,
                            num_classes=model.specs[-1]["out_dim"],
                            speaker_cmvn=repr(model.speaker_cmvn), floor=Normalize.FLOOR,
                            pnorm_tiny=TINY, unseen_prior=UNSEEN_PRIOR,
                            unseen_score=UNSEEN_SCORE)
    # (atomic_path: a failed write, a full disk above all, names the file) both
    # files are written before either is renamed into place: a failed model.py
    # left new weights beside an earlier conversion's module
    with atomic_path(os.path.join(out, "weights.npz")) as tmp:
        with open(tmp, "wb") as fh:
            np.savez(fh, **arrays)
            # flushed here, before model.py is renamed: a flush that fails (a quota
            # met only then) would otherwise leave the new module beside old weights
            fh.flush()
            os.fsync(fh.fileno())
        _atomic_bytes(os.path.join(out, "model.py"), source.encode("utf-8"))


def _atomic_bytes(path: str, data: bytes) -> None:
    # the file is written under a hidden name and renamed into place: failures name
    # the file asked for (and missing folders are made, as --to torch makes its own)
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as fh:
            fh.write(data)
