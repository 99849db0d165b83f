"""Pseudo log-likelihoods for Kaldi's decoders.

For each utterance: per-speaker CMVN if the model was trained with it
(``--utt2spk``/``--cmvn``), CMVN and splicing as in training, forward pass, then
the pseudo log-likelihood of each pdf s,

    log p(x|s) = log p(s|x) - scale * log p(s)        (up to a constant)

with p(s) the pdf's prior (the training corpus' class frequencies) and
``scale`` the prior scale (1 by default; ``priors=False`` writes log
posteriors).  A pdf never seen in training has no usable prior: as in Kaldi,
it gets a very low score (``UNSEEN_SCORE`` below every other), so the decoder
never picks it, and one warning names how many there are; that holds at
``scale`` 0 too, which otherwise gives log posteriors.  Written as a
Kaldi matrix archive, so ``latgen-faster-mapped`` and friends read it
directly.

Features are read by :func:`mpitrain.data.kaldi_read.read_feature_matrices`,
the reader ``prepare`` uses (any rspecifier, pipes included), which accepts
only Kaldi matrices and refuses every other record (pickles above all) by key.  Output files are written under temporary names and renamed when every
utterance is done, so an error never leaves a partial archive behind; an scp
replaced with its archive goes before the archive is renamed, so a kill between
the two renames never leaves the old scp indexing the new archive.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import os
import sys

import numpy as np

from . import backend
from .files import (WriteError, commit, discard, disk_full_error, flush_to_disk,
                    remove_stale_temporaries, rename_target, temporary_path,
                    written_in_place)
from .data.cmvn import SpeakerCmvn
from .data.kaldi_read import (is_pipe, parse_scp, read_feature_matrices, split_offset,
                              split_rspecifier)
from .data.splice import frame_utterance_bounds, splice, splice_indices
from .nn.loss import log_softmax
from .nn.model_file import load_model

# A prior at or below this marks a pdf never seen in training: the corpus
# floors an unseen class' prior to 1e-8 (CorpusManifest.class_priors), and a
# pdf seen once in 50 million frames is rare enough to count as unseen.
UNSEEN_PRIOR = 2e-8
# Kaldi's score for such pdfs (nnet1's PdfPrior): log p(s) := sqrt(FLT_MAX),
# far below any real log-likelihood yet finite in float32.
UNSEEN_SCORE = -float(np.sqrt(np.finfo(np.float32).max))
# What Kaldi's MatrixBase::Write puts after the key for a 0 x 0 matrix in text mode.
EMPTY_TEXT_MATRIX = b" [ ]\n"
# An scp names the archive by the bytes of its path, which need not be UTF-8.
_TEXT = {"encoding": "utf-8", "errors": "surrogateescape"}


class ModelOverflow(ValueError):
    """Outputs that are not finite because of the model, not of the features: it
    overflows on inputs clipped to the training range too (weights no training
    gives, in a damaged or crafted file)."""


def utterance_loglikes(net, feats, offsets, *, batch: int = 4096) -> np.ndarray:
    """(T, num_classes) log posteriors of one utterance's raw features plus ``offsets``.

    ``offsets`` is ``-scale * log p(s)`` per class (:func:`prior_offsets`);
    zeros give log posteriors.  ValueError when an output is not finite (features
    far outside what the model was trained on; :class:`ModelOverflow` when the
    model overflows on inputs within that range too): NaN scores are never returned.
    """
    if isinstance(batch, bool) or not isinstance(batch, numbers.Real) \
            or int(batch) != batch or batch < 1:
        raise ValueError(f"batch must be an integer >= 1 (frames per forward pass), "
                         f"got {batch!r}")
    batch = int(batch)
    xp = net.xp
    frames = net.normalize_frames(backend.to_device(np.array(feats, dtype=np.float32), xp))
    n = frames.shape[0]
    start, end = frame_utterance_bounds(xp.asarray([0, n]))
    out = np.empty((n, net.num_classes), dtype=np.float32)
    for lo in range(0, n, batch):
        idx = xp.arange(lo, min(lo + batch, n))
        ctx = splice_indices(idx, start[idx], end[idx], net.left_context, net.right_context)
        # a batch shorter than ``batch`` has a length of its own: its buffers go;
        # a sigmoid's exp overflowing gives its exact limit, and a score that is not
        # finite is refused below: NumPy's warnings would only be noise to the caller
        with np.errstate(all="ignore"):
            logp = log_softmax(net.forward(splice(frames, ctx),
                                           keep_buffers=len(idx) == batch))
        out[lo:lo + len(idx)] = backend.to_host(logp) + offsets
    bad = ~np.isfinite(out).all(axis=1)
    if bad.any():
        first = int(np.argmax(bad))
        idx = xp.arange(first, first + 1)
        site = net.overflow_site(splice(frames, splice_indices(
            idx, start[idx], end[idx], net.left_context, net.right_context)))
        if site is not None:
            raise ModelOverflow(f"the model's outputs overflow (inf or NaN) at {site}, on "
                                f"frame {first} of {n} and on inputs within the range it "
                                "was trained on alike")
        raise ValueError(f"the model's output is not finite at frame {first} of {n}")
    return out


def prior_offsets(priors, *, scale: float = 1.0, unseen=None):
    """(offsets, number of unseen pdfs): what to add to log posteriors per class.

    ``offsets[s] = -scale * log p(s)``; a pdf in ``unseen`` (default: prior at
    or below ``UNSEEN_PRIOR``) gets ``UNSEEN_SCORE`` instead, whatever the scale.

    Example::

        offsets, n_unseen = prior_offsets([0.5, 0.5, 0.0])   # n_unseen == 1
    """
    priors = np.asarray(priors, dtype=np.float64)
    if unseen is None:
        unseen = priors <= UNSEEN_PRIOR
    unseen = np.asarray(unseen, dtype=bool)
    offsets = -scale * np.log(np.where(unseen, 1.0, priors))
    offsets[unseen] = UNSEEN_SCORE
    return offsets.astype(np.float32), int(unseen.sum())


def export_loglikes(model_path, feats_rspec: str, out_wspec: str, *, corpus_dir=None,
                    batch: int = 4096, prior_scale: float = 1.0, priors: bool = True,
                    warn=None, utt2spk: str | None = None, cmvn: str | None = None,
                    scp_commands: bool = False) -> int:
    """Write loglikes for every utterance of ``feats_rspec``; returns the count.

    ``log p(x|s) = log p(s|x) - prior_scale * log p(s)``; ``priors=False``
    writes log posteriors.  ``warn(message)`` hears about pdfs never seen in
    training (default: printed to stderr).  A model trained on a corpus that
    ``prepare`` gave per-speaker CMVN needs ``utt2spk`` (stats computed from
    ``feats_rspec``) or ``cmvn`` (Kaldi's stats) and applies it the same way.
    ``scp_commands``: run the entries of scp files that are commands
    (``utt cmd |``); off, such an entry is refused (an scp file is data).

    Example::

        export_loglikes("runs/x/final.h5", "scp:data/test/feats.scp", "ark:loglikes.ark")
    """
    parse_wspecifier(out_wspec)          # a bad --out is refused before any work
    _refuse_overwriting_inputs(out_wspec, [("model", model_path), ("--feats", feats_rspec),
                                           ("--cmvn", cmvn), ("--utt2spk", utt2spk)],
                               scp_commands=scp_commands)
    net, stored = load_model(model_path)
    speaker = _speaker_cmvn(net, model_path, feats_rspec, utt2spk, cmvn, scp_commands)
    offsets = np.zeros(net.num_classes, dtype=np.float32)
    if priors:
        offsets = _offsets(net, model_path, stored, corpus_dir, prior_scale, warn)
    count = 0
    with ArkWriter(out_wspec) as writer:
        for utt, feats in read_feature_matrices(feats_rspec, scp_commands=scp_commands):
            if feats.shape[0] == 0:
                # an utterance with no frames (Kaldi writes it 0 x 0): no rows out,
                # written 0 x 0 as Kaldi reads an empty matrix (ArkWriter)
                feats = np.zeros((0, net.feat_dim), dtype=np.float32)
            if feats.shape[1] != net.feat_dim:
                raise ValueError(f"{feats_rspec}: utterance {utt} has features of shape "
                                 f"{feats.shape}, the model expects dim {net.feat_dim}")
            if not np.isfinite(feats).all():
                raise ValueError(f"{feats_rspec}: utterance {utt} contains NaN or inf")
            if speaker is not None:
                feats = speaker.apply(utt, feats)
            try:
                loglikes = utterance_loglikes(net, feats, offsets, batch=batch)
            except ModelOverflow as exc:
                # the features are finite and not to blame: name the model file
                raise ValueError(f"{model_path}: {exc} (utterance {utt} of {feats_rspec}); "
                                 "the file holds weights no training gives") from None
            except ValueError as exc:
                # a decoder would read NaN scores: no output rather than a wrong one
                raise ValueError(
                    f"{feats_rspec}: utterance {utt}: {exc} (features up to "
                    f"{float(np.max(np.abs(feats))):.3g} in magnitude: far outside the "
                    "range it was trained on?)") from None
            writer.write(utt, loglikes)
            count += 1
    return count


def _refuse_overwriting_inputs(out_wspec: str, inputs, *, scp_commands: bool = False) -> None:
    """Refuse an ``--out`` file that this export also reads: the finished output
    would replace it (features, an ark an scp points into, CMVN stats, utt2spk,
    the model).  ``inputs``: (option, path or rspecifier or None) pairs;
    ``scp_commands`` as for the readers (a command entry reads no file here)."""
    _, ark, scp = parse_wspecifier(out_wspec)
    outputs = [p for p in (ark, scp) if p is not None and not _is_stream(p)]
    if not outputs:
        return
    read = []
    for option, spec in inputs:
        if not spec:
            continue
        if option in ("--feats", "--cmvn"):
            kind, target = split_rspecifier(spec, option[2:])
            if is_pipe(target) or target.strip() == "-":
                continue        # a stream is read once; nothing to compare
            read.append((option, split_offset(target)[0]))
            if kind == "scp":
                read += [(f"{option} {target}", location)
                         for location in dict.fromkeys(
                             loc for _, loc, *_ in parse_scp(target, commands=scp_commands)
                             if not is_pipe(loc))]
        else:
            read.append((option, spec))
    for out in outputs:
        for option, path in read:
            if _same_file(out, path):
                raise ValueError(f"--out {out_wspec}: {out} is read by this export "
                                 f"({option} {path}) and would be replaced; write to "
                                 "another file")


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:       # one of them does not exist (yet): compare the names
        return os.path.realpath(a) == os.path.realpath(b)


def _speaker_cmvn(net, model_path, feats_rspec, utt2spk, cmvn, scp_commands):
    """The per-speaker CMVN the model was trained with, or None; one-line refusals."""
    if net.speaker_cmvn is None:
        if utt2spk or cmvn:
            raise ValueError(f"{model_path}: the model was trained without per-speaker CMVN; "
                             "drop --utt2spk and --cmvn")
        return None
    norm_vars = bool(net.speaker_cmvn.get("norm_vars"))
    if not (utt2spk or cmvn):
        raise ValueError(f"{model_path}: the model was trained on features with per-speaker "
                         f"CMVN (norm_vars {str(norm_vars).lower()}); pass --utt2spk "
                         "(stats computed from --feats) or --cmvn scp:cmvn.scp")
    if not cmvn and split_rspecifier(feats_rspec, "feats")[1].strip() == "-":
        raise ValueError("--feats -: computing CMVN stats reads the features twice, which "
                         "stdin cannot give; pass --cmvn with Kaldi's stats")
    return SpeakerCmvn.load(utt2spk=utt2spk, cmvn=cmvn, feats=feats_rspec, norm_vars=norm_vars,
                            scp_commands=scp_commands)


def check_prior_scale(scale) -> None:
    """ValueError naming --prior-scale unless it is a finite number >= 0."""
    if not 0 <= scale < math.inf:
        raise ValueError(f"--prior-scale: expected a number >= 0, got {scale}")


def _offsets(net, model_path, priors, corpus_dir, scale, warn):
    """Per-class offsets from the model's priors or the corpus' counts, with the warning."""
    check_prior_scale(scale)
    unseen = None
    source = str(model_path)
    if corpus_dir is not None:
        from .data.corpus import load_manifest
        manifest = load_manifest(corpus_dir)
        priors = manifest.class_priors()
        unseen = np.asarray(manifest.class_counts) == 0
        source = f"{corpus_dir}/corpus.yaml"
    if priors is None:
        raise ValueError(f"{model_path}: the model stores no class priors; "
                         "pass --corpus with the training corpus, or --no-priors")
    priors = np.asarray(priors, dtype=np.float64)
    if priors.shape != (net.num_classes,):
        raise ValueError(f"{source}: priors have {priors.shape[0]} classes, the model "
                         f"{model_path} has {net.num_classes}")
    offsets, n_unseen = prior_offsets(priors, scale=scale, unseen=unseen)
    if n_unseen:
        message = (f"warning: {n_unseen} of {net.num_classes} pdfs were never seen in "
                   f"training ({source}); they get the score {UNSEEN_SCORE:.3g}")
        (warn or _to_stderr)(message)
    return offsets


class ArkWriter:
    """A Kaldi matrix archive (and optional scp) that appears only when complete.

    ``wspec`` is ``ark:out.ark``, ``ark,t:out.txt`` or ``ark,scp:out.ark,out.scp``.
    Files are written under temporary names and renamed on a clean exit from
    the ``with`` block; on an exception they are deleted.  A pipe (``ark:| cmd``)
    or stdout (``ark:-``) is written directly.

    Example::

        with ArkWriter("ark,scp:loglikes.ark,loglikes.scp") as writer:
            writer.write("utt1", np.zeros((5, 120), np.float32))
    """

    def __init__(self, wspec: str):
        self.text, self.ark, self.scp = parse_wspecifier(wspec)
        files = [p for p in (self.ark, self.scp) if p is not None and not _is_stream(p)]
        # ark:/dev/null or a named pipe is written as it is, like a stream
        self._in_place = {p for p in files if written_in_place(p)}
        self._targets = [p for p in files if p not in self._in_place]
        self._final = {p: rename_target(p) for p in self._targets}
        self._tmp = {p: temporary_path(self._final[p]) for p in self._targets}
        for target in self._final.values():
            # an export of this file killed before left its partial copy (only this
            # file's: other jobs may write beside it)
            with contextlib.suppress(OSError):
                remove_stale_temporaries(os.path.dirname(os.path.abspath(target)),
                                         of={os.path.basename(target)})
        self._files = []
        self._position = 0       # bytes written to the ark, for the scp offsets
        try:
            self._fark = self._open(self.ark, "wb")
            self._fscp = self._open(self.scp, "w") if self.scp is not None else None
        except BaseException:
            self.abort()
            raise

    def _open(self, name: str, mode: str):
        if _is_stream(name):
            if name.strip() == "-" and sys.stdout is None:
                raise OSError(f"--out {name}: standard output is closed; nothing can be "
                              "written to it")
            from kaldiio.utils import open_like_kaldi
            handle = open_like_kaldi(name, mode)
        elif name in self._in_place:
            try:
                handle = open(name, mode, **({} if "b" in mode else _TEXT))
            except OSError as exc:
                raise OSError(f"cannot write {name}: {exc.strerror}") from None
        else:
            try:
                handle = open(self._tmp[name], mode, **({} if "b" in mode else _TEXT))
            except OSError as exc:
                # the user named the target, not our temporary beside it
                raise OSError(f"cannot write {name}: {exc.strerror}") from None
        self._files.append(handle)
        return handle

    def write(self, key: str, matrix: np.ndarray) -> None:
        try:
            self._write(key, matrix)
        except BrokenPipeError:
            if self.ark.strip() == "-":
                raise           # our stdout's reader left: quiet, as any Unix tool
            raise OSError(self._why_the_reader_left()) from None
        except OSError as exc:                  # a full disk: name the archive
            full = disk_full_error(exc, self.ark.strip())
            if full is None:
                raise
            raise full from exc

    def _why_the_reader_left(self) -> str:
        """The ``--out`` command stopped reading: its exit status, for the message."""
        status = None
        files, self._files = self._files, []
        for handle in files:
            with contextlib.suppress(Exception):      # flushing into the pipe fails again
                handle.close()
            process = getattr(handle, "_proc", None)  # kaldiio's pipe wrapper
            if process is not None and status is None:
                with contextlib.suppress(Exception):
                    status = process.wait()
        target = self.ark.strip()
        if status:
            return f"--out {target}: the command failed with exit status {status}"
        if self.ark in self._in_place:
            return f"--out {target}: the pipe's reader stopped reading before the archive ended"
        return f"--out {target}: the command stopped reading before the archive ended"

    def _write(self, key: str, matrix: np.ndarray) -> None:
        from kaldiio.matio import write_array, write_array_ascii
        if matrix.size == 0:
            # Kaldi's matrix reader aborts the program on a 0 x N matrix (only 0 x 0
            # may be empty), which a decoder would read for an utterance of no frames
            matrix = np.zeros((0, 0), dtype=matrix.dtype)
        head = (key + " ").encode("utf-8")
        self._fark.write(head)
        self._position += len(head)
        if self._fscp is not None:
            # the archive's name as its bytes (written through _TEXT as they are): as
            # UTF-8 text, a Latin-1 locale's name became other bytes
            name = os.fsencode(self.ark).decode("utf-8", "surrogateescape")
            self._fscp.write(f"{key} {name}:{self._position}\n")
        if self.text and matrix.size == 0:
            # Kaldi's text form of an empty matrix; kaldiio writes "[]", which its
            # own reader cannot read back
            self._fark.write(EMPTY_TEXT_MATRIX)
            self._position += len(EMPTY_TEXT_MATRIX)
            return
        self._position += (write_array_ascii(self._fark, matrix) if self.text
                           else write_array(self._fark, matrix))

    def close(self) -> None:
        """Flush and rename the files into place (the ark before its scp)."""
        try:
            self._close_files()
        except BaseException:
            self.abort()
            raise
        for name in self._targets:
            if not os.path.exists(self._tmp[name]):
                # an export of the same --out started later took it as a killed one's
                self.abort()
                raise OSError(f"--out {self.ark.strip()}: another export wrote {name} at the "
                              "same time (the partial copy is gone); give each export an "
                              "--out of its own")
        for name in self._targets:
            try:
                flush_to_disk(self._tmp[name])
            except OSError as exc:
                # (a quota, or a network file system's full disk, is told at the flush)
                self.abort()
                raise disk_full_error(exc, name) or WriteError(
                    exc.errno, f"cannot write {name}: {exc.strerror or exc}") from exc
        if self.scp in self._final and self.ark in self._final:
            # the scp of an export before indexes the archive about to be replaced: it
            # goes first, so that a kill between the two renames leaves no scp whose
            # offsets point into an archive it does not index
            with contextlib.suppress(FileNotFoundError):
                os.remove(self._final[self.scp])
        for name in self._targets:
            commit(self._tmp[name], self._final[name])

    def _written_as(self, handle) -> str:
        """The --out file that ``handle`` writes (under its temporary name or not)."""
        written = getattr(handle, "name", None)
        for name, tmp in self._tmp.items():
            if tmp == written:
                return name
        return written if isinstance(written, str) else self.ark.strip()

    def abort(self) -> None:
        """Close and delete whatever was written to files."""
        with contextlib.suppress(Exception):
            self._close_files()
        for name in self._targets:
            discard(self._tmp[name])

    def _close_files(self) -> None:
        files, self._files = self._files, []
        for index, handle in enumerate(files):
            # a pipe's close waits for its command and returns its status
            try:
                status = handle.close()
            except BrokenPipeError:
                # the last buffered bytes met a command that had gone: as in write
                if self.ark.strip() == "-":
                    raise
                self._files = [handle]
                raise OSError(self._why_the_reader_left()) from None
            except OSError as exc:
                # the last buffered bytes met a full disk: name the file, not the errno
                self._files = files[index + 1:]
                if exc.errno is None:
                    raise
                name = self._written_as(handle)
                raise disk_full_error(exc, name) or WriteError(
                    exc.errno, f"cannot write {name}: {exc.strerror or exc}") from exc
            if status:
                raise OSError(f"--out {self.ark.strip()}: the command failed with exit "
                              f"status {status >> 8 or status}")

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abort()


def parse_wspecifier(wspec: str) -> tuple[bool, str, str | None]:
    """(text, ark, scp or None) of an output wspecifier; one-line refusals naming --out.

    Example::

        parse_wspecifier("ark,scp:ll.ark,ll.scp")     # (False, 'll.ark', 'll.scp')
    """
    from kaldiio.utils import parse_specifier
    try:
        spec = parse_specifier(_without_write_flags(wspec))
    except ValueError:        # kaldiio's message names neither the option nor the forms
        spec = {"ark": None}
    if spec["ark"] is None:
        raise ValueError(f"--out {wspec}: expected ark:PATH or ark,scp:ARK,SCP")
    if spec["scp"] is not None and _is_stream(spec["ark"]):
        raise ValueError(f"--out {wspec}: an scp needs the ark written to a file")
    if spec["scp"] is not None and _same_file(spec["ark"], spec["scp"]):
        raise ValueError(f"--out {wspec}: the ark and the scp are the same file; name two")
    for target in (spec["ark"], spec["scp"]):
        if target is not None and not _is_stream(target) and os.path.isdir(target):
            raise ValueError(f"--out {wspec}: {target} is a directory; name a file")
    return bool(spec["t"]), spec["ark"], spec["scp"]


def _without_write_flags(wspec: str) -> str:
    """Kaldi's wspecifier options that change nothing here dropped ('b' binary, the
    default; 'f'/'nf' flushing; 'p' permissive), so ``ark,b:x.ark`` is ``ark:x.ark``."""
    head, colon, rest = wspec.partition(":")
    if not colon:
        return wspec
    kept = [option for option in head.split(",") if option.strip() not in ("b", "f", "nf", "p")]
    return ",".join(kept) + colon + rest


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _is_stream(name: str) -> bool:
    return name.strip() == "-" or name.strip().startswith("|") or name.strip().endswith("|")


