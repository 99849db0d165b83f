"""RBM pretraining on many ranks (Su & Chen; Kaldi nnet1's pretrain_dbn.sh).

A stack of ``model.hidden_layers`` RBMs of ``model.hidden_dim`` units is
trained layer by layer with CD-1 (:mod:`mpitrain.nn.rbm`): the first layer is
Gaussian-Bernoulli on the spliced, CMVN-normalised features
(``pretrain.epochs_gaussian`` epochs at ``pretrain.learning_rate_gaussian``),
the others Bernoulli-Bernoulli on the hidden probabilities of the layers below
(``pretrain.epochs_per_layer`` at ``pretrain.learning_rate``), each visible
bias starting at the logit of the mean activation below.  Momentum ramps from
``momentum_initial`` to ``momentum_final`` in 40 equal steps over
``momentum_ramp_frames`` frames per rank.  On the Gaussian layer each rank
guards its own minibatches against weight explosion as Kaldi does
(:mod:`mpitrain.nn.rbm`, eqn:guard): a reconstruction more than twice as
spread as the data scales the RBM down, skips the step, resets the momentum
and cuts that rank's rate by 0.9, until the next step of the ramp (every
``momentum_ramp_frames / 40`` frames per rank, past the ramp's end too) sets
it afresh; the rate factor is part of each rank's checkpointed state.

Each rank trains on its own shards, read by the training data pipeline
(:mod:`mpitrain.data.batcher`, :mod:`mpitrain.data.splice`), and the ranks
average the RBM's flat parameter buffer every ``pretrain.average_every_frames``
frames with the supervised model-averaging strategy
(:class:`~mpitrain.parallel.model_averaging.ModelAveraging`), unchanged.

Every ``training.log_interval`` steps the reconstruction error, summed over
ranks, is logged; a non-finite error, or one over ``pretrain.divergence_factor``
times the layer's first window (the Gaussian layer's at most 1, the standardised
features' variance, or its error as initialised if larger; windows of fewer
than MIN_JUDGED_FRAMES frames pooled until they hold that many), stops the
run (every rank decides alike from the summed figures) naming the rate to
lower; so does a layer whose every hidden unit is constant over the data
(saturated) at a checkpoint or at its end.  Checkpoints
(``ckpt-NNNNNNNN.h5``, format ``mpitrain-pretrain-checkpoint``) are written at
averaging points after each ``training.checkpoint_interval`` steps (and
``training.checkpoint_minutes``) and at the end of each layer, the latter kept
out of ``training.keep_checkpoints``' rotation (``model.init_from`` takes one as
the stack up to that layer); ``--resume`` continues from the newest that verifies.  The
result is ``RUN_DIR/pretrain.h5`` (:mod:`mpitrain.nn.rbm_file`), which
``train`` reads with ``model.init_from``.
"""

from __future__ import annotations

import contextlib
import math
import os

import numpy as np

from .. import backend
from ..config import PretrainConfig, config_from_yaml, config_to_yaml
from ..data.batcher import MinibatchStream, plan_chunks, read_chunk
from ..data.corpus import CorpusError
from ..data.splice import splice_batch_
from ..data.validate import validate_slices
from ..h5io import (atomic_h5_file, h5_reader, open_h5_for_reading, read_state,
                    reading_errors, verify_file, write_state)
from ..nn.network import floored_variance
from ..nn.rbm import RBM, ContrastiveDivergence, RBMStack, valid_rate_factor
from ..nn.rbm_file import load_rbm_stack, read_stack_group, save_rbm_stack, write_stack_group
from ..parallel.model_averaging import ModelAveraging
from .checkpoint import FORMAT as TRAIN_CHECKPOINT_FORMAT
from .checkpoint import (MIN_KEEP, check_reader_state, checkpoint_path, gather_rank_states,
                         list_checkpoints, rotate_checkpoints)
from .checkpoint_clock import CheckpointClock
from .divergence import MIN_JUDGED_FRAMES
from .errors import TrainingError, error_record, record_failure_alone
from .metrics import MetricsLog, format_duration, resident_mb
from .run_dir import (ACCEPT_CHANGES_NEW_RUN, corpus_identity, corpus_places,
                      no_checkpoint_way, resume_changes, take_run_dir)
from .stop import STOP_SIGNALS, StopPoll, agreed_stop, requested, signal_name
from .setup import balanced_plan, load_manifests, no_minibatch_error, select_device
from ..state_fields import float32_buffer
from ..words import plural, shown

CHECKPOINT_FORMAT = "mpitrain-pretrain-checkpoint"
RESULT_NAME = "pretrain.h5"
#: Momentum rises in this many equal steps (Kaldi's --momentum-steps).
MOMENTUM_STEPS = 40
#: The settings a pretraining result depends on (others may change on --resume).
PRETRAIN_SETTINGS = ("pretrain.", "data.train", "data.left_context", "data.right_context",
                     "data.chunk_frames", "model.hidden_layers", "model.hidden_dim",
                     "training.seed", "parallel.average_momentum")
#: Frames per rank whose mean activation starts a Bernoulli layer's visible bias.
VISIBLE_BIAS_FRAMES = 10_000
#: Frames per rank on which a layer's hidden units are checked for a dead layer
#: (at each of its checkpoints and at its end).
ALIVE_FRAMES = 2_000
#: A layer none of whose hidden units varies more than this over those frames is
#: dead (saturated ones measured 1e-5 and less; a layer that learned, 0.1 and more).
DEAD_LAYER_STD = 1e-3
#: Frames per rank on which the Gaussian layer's error as initialised is measured.
UNTRAINED_FRAMES = 2_000


def reads_every_setting(settings: dict) -> tuple:
    """No setting of PRETRAIN_SETTINGS goes unread here, whatever parallel.method
    says: pretraining averages its models as model_averaging does, and reads
    parallel.average_momentum, which `train` reads with that method alone."""
    return ()


def layer_epochs(pretrain_cfg, layer: int) -> float:
    """The epochs that RBM ``layer`` (0-based) trains: the Gaussian one's, or each
    Bernoulli one's."""
    return pretrain_cfg.epochs_gaussian if layer == 0 else pretrain_cfg.epochs_per_layer


def ramp_step(frames: int, ramp_frames: int) -> int:
    """How many steps of ``ramp_frames / 40`` frames this rank's ``frames`` make
    (counted past the ramp's end too; 0 without a ramp).

    Example::

        ramp_step(1_000_000, 20_000_000)     # 2
    """
    return int(frames * MOMENTUM_STEPS // ramp_frames) if ramp_frames > 0 else 0


def momentum_at(frames: int, *, initial: float, final: float, ramp_frames: int) -> float:
    """The momentum after ``frames`` frames of this rank (40 equal steps up).

    Example::

        momentum_at(0, initial=0.5, final=0.9, ramp_frames=20_000_000)   # 0.5
    """
    if ramp_frames <= 0:
        return final
    steps = min(MOMENTUM_STEPS, ramp_step(frames, ramp_frames))
    return initial + (final - initial) * steps / MOMENTUM_STEPS


def _check_rank_state(state: dict, stack, layer: int, name: str, path) -> None:
    """A rank's part of a pretraining checkpoint, shaped as :meth:`Pretrainer._restore`
    uses it: reader positions that are non-negative ints, the momentum of the
    layer in training shaped like that layer's parameters, and its rate factor
    (eqn:guard; absent from older checkpoints) in (0, 1].  ValueError naming the
    file and the field (it was a line naming neither, after config.yaml was written)."""
    check_reader_state(state.get("reader"), name, path, complete=True)
    if "momentum" not in state or layer >= len(stack.rbms):
        return
    momentum = state["momentum"]
    delta = momentum.get("delta") if isinstance(momentum, dict) else None
    want = stack.rbms[layer].params.shape
    if not isinstance(delta, np.ndarray) or delta.shape != want or delta.dtype.kind != "f":
        got = (f"shape {delta.shape} and dtype {delta.dtype}" if isinstance(delta, np.ndarray)
               else "no dataset")
        raise ValueError(f"{path}: '{name}/momentum/delta' has {got}; expected {want} floats "
                         f"like layer {layer + 1}'s parameters")
    try:
        # (a float64 of 1e300 passes the file's finite check, and is infinite as float32)
        float32_buffer(delta, want, f"field '{name}/momentum/delta'")
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    factor = momentum.get("rate_factor", 1.0)
    if not valid_rate_factor(factor):
        raise ValueError(f"{path}: '{name}/momentum/rate_factor' is {factor!r}; expected a "
                         "number in (0, 1] (the rank's cut of the layer's rate)")


def _layers_at_end(path) -> int:
    """The RBMs of the pretraining checkpoint ``path`` when it was written at the end
    of a layer (all of them trained); 0 when it was not, or cannot be read."""
    try:
        with h5_reader(path) as f:
            layer, step = f.attrs.get("layer"), f.attrs.get("layer_step")
            if f.attrs.get("format") == CHECKPOINT_FORMAT \
                    and isinstance(layer, (int, np.integer)) and layer > 0 \
                    and isinstance(step, (int, np.integer)) and step == 0:
                return int(layer)
    except (OSError, ValueError, RuntimeError, TypeError, KeyError):
        pass
    return 0


def _at_layer_end(path) -> bool:
    """Whether the pretraining checkpoint ``path`` was written at the end of a layer
    (its RBMs all trained; False when it cannot be read)."""
    return _layers_at_end(path) > 0


class _NotPretraining(ValueError):
    """A file named like a checkpoint that is not a pretraining one (``format``: the
    format it says it is, e.g. a train run's)."""

    def __init__(self, path, fmt):
        super().__init__(f"{path}: not an mpitrain pretraining checkpoint (attribute "
                         f"'format' is {fmt!r})")
        self.format = fmt


def _read_judging(attrs, path):
    """A checkpoint's divergence yardstick inside a layer: (the layer's first
    window's error, None before one was judged; [pooled error sum, pooled
    frames]); None when it holds none (written at a layer's end, or by an older
    mpitrain)."""
    if "pool_frames" not in attrs:
        return None
    first, error, frames = (attrs.get(name, 0.0 if name == "window_first" else None)
                            for name in ("window_first", "pool_error", "pool_frames"))
    numbers = all(isinstance(x, (int, float, np.integer, np.floating))
                  and not isinstance(x, (bool, np.bool_)) for x in (first, error, frames))
    if not numbers or not all(math.isfinite(x) and x >= 0 for x in (first, error)) \
            or int(frames) != frames or not 0 <= frames < MIN_JUDGED_FRAMES:
        raise ValueError(f"{path}: checkpoint attributes 'window_first', 'pool_error', "
                         f"'pool_frames': expected an error >= 0, a finite sum >= 0 and "
                         f"frames in [0, {MIN_JUDGED_FRAMES}), got "
                         + ", ".join(repr(x.item() if isinstance(x, np.generic) else x)
                                     for x in (attrs.get("window_first"), error, frames)))
    first = float(first) if "window_first" in attrs else None
    return first, [float(error), int(frames)]


class Pretrainer:
    """Example::

        cfg = load_config("jobs/configs/pretrain.yaml")
        result = Pretrainer(cfg, run_dir="runs/pretrain", comm=create_communicator()).run()
        result["recon_mse"]       # the top layer's last reconstruction error per unit
    """

    def __init__(self, cfg, *, run_dir: str, comm, resume: bool = False,
                 overwrite: bool = False, accept_changes: bool = False, stream=None,
                 lock=None):
        self.cfg, self.run_dir, self.comm = cfg, run_dir, comm
        self.is_root = comm.rank == 0
        self.resuming, self.overwrite, self.accept_changes = resume, overwrite, accept_changes
        self._stream_out, self.log, self._pending = stream, None, []
        # rank 0's lock on the run directory, while it runs (``lock``: taken by the
        # command line before the run is judged, run_dir.lock_a_used_run_dir)
        self._lock = lock if comm.rank == 0 else None
        self._checkpoints_seen = None  # rank 0, resuming: the checkpoints there when it chose
        self.xp = select_device(cfg, comm)      # the same precision and kernels as `train`
        if not cfg.data.train:
            raise TrainingError("data.train: no training corpus given (set data.train "
                                "in the config or with --set data.train=DIR)", agreed=True)
        if cfg.model.hidden_layers < 1:
            raise TrainingError("model.hidden_layers: pretraining needs at least one hidden "
                                "layer, got 0", agreed=True, setting=True)  # (every rank's)
        self.manifest, _ = load_manifests(comm, cfg.data.train)
        m = self.manifest
        var = floored_variance(m.cmvn_mean, m.cmvn_var)
        self.cmvn = (np.asarray(m.cmvn_mean, dtype=np.float32),
                     (1.0 / np.sqrt(var)).astype(np.float32))
        self._build_data()
        p = cfg.pretrain
        self.every_steps = max(1, p.average_every_frames // p.minibatch)
        self.strategy = ModelAveraging(comm, every_steps=self.every_steps,
                                       average_momentum=cfg.parallel.average_momentum)
        dims = [m.feat_dim * (cfg.data.left_context + 1 + cfg.data.right_context)] \
            + [cfg.model.hidden_dim] * cfg.model.hidden_layers
        self.dims = dims
        self.layer_steps = [self._steps_for(layer_epochs(p, i)) for i in range(len(dims) - 1)]
        self.stack = RBMStack([], feat_dim=m.feat_dim, left_context=cfg.data.left_context,
                              right_context=cfg.data.right_context, cmvn_mean=self.cmvn[0],
                              cmvn_scale=self.cmvn[1], speaker_cmvn=m.speaker_cmvn)
        self.layer, self.layer_step, self.frames_seen = 0, 0, 0
        self.rbm = self.cd = None
        self._untrained = 1.0        # the Gaussian layer's error as initialised
        self._resume_state = None
        self._accepted = []          # resuming: the setting changes --accept-changes took
        self._stop = None            # (signal code, ranks that got it) once agreed (stop.py)
        if resume:
            self._resume()
        elif accept_changes:
            self._say(ACCEPT_CHANGES_NEW_RUN)
        self._window_first = None
        self._pool = [0.0, 0]        # small windows not judged yet: error sum, frames
        self._first_step = 0         # the global step this process began at (its ETA)

    # -- construction --------------------------------------------------------------
    def _build_data(self) -> None:
        cfg, comm = self.cfg, self.comm
        try:
            slices = balanced_plan(self.manifest, comm.size)[comm.rank]
        except CorpusError as exc:
            raise TrainingError(" ".join(str(exc).split()), agreed=True) from None
        problems = validate_slices(self.manifest, slices, num_classes=self.manifest.num_classes)
        total = int(comm.allreduce_scalar(len(problems), op="sum"))
        if total:
            firsts = comm.gather_obj(problems[:1], root=0)
            first = next((p for found in firsts for p in found), "") if self.is_root else ""
            raise TrainingError(first or "bad training data (reported by rank 0)", agreed=True)
        self.chunks = plan_chunks(self.manifest, slices, cfg.data.chunk_frames)
        batch = cfg.pretrain.minibatch
        steps = int(comm.allreduce_scalar(sum(c.frames // batch for c in self.chunks), op="min"))
        if steps == 0:
            local = sum(c.frames // batch for c in self.chunks)
            raise no_minibatch_error(self.manifest, comm, local, batch, "pretrain.minibatch")
        self.steps_per_epoch = steps
        self.stream = MinibatchStream(self.manifest, self.chunks, minibatch=batch,
                                      seed=cfg.training.seed, rank=comm.rank, cmvn=self.cmvn,
                                      xp=self.xp, steps_per_epoch=steps,
                                      prefetch=cfg.data.prefetch)
        width = cfg.data.left_context + 1 + cfg.data.right_context
        self.inputs = self.xp.empty((batch, self.manifest.feat_dim * width), dtype=np.float32)
        self.ctx = self.xp.empty((batch, width), dtype=np.int64)

    def _steps_for(self, epochs: float) -> int:
        return max(int(round(epochs * self.steps_per_epoch)), 1)

    def _new_layer(self, index: int) -> None:
        """The RBM of layer ``index``, initialised alike on every rank."""
        cfg = self.cfg
        visible = "gaussian" if index == 0 else "bernoulli"
        self.rbm = RBM(self.dims[index], self.dims[index + 1], visible=visible, xp=self.xp)
        self.rbm.init_params(seed=[cfg.training.seed, index])
        if visible == "bernoulli":
            self.rbm.init_visible_bias_from_mean(self._mean_activation(index))
        else:
            # how far the untrained layer errs: a first window above it has exploded
            self._untrained = self._untrained_error()
        self.cd = ContrastiveDivergence(self.rbm, weight_decay=cfg.pretrain.weight_decay)
        self.strategy.setup(self.rbm, self.cd)

    def _mean_activation(self, layers: int):
        """Mean hidden probabilities of the first ``layers`` RBMs over the start of
        every rank's data (the same on every rank: one Allreduce)."""
        return self._activation_moments(self.stack.rbms[:layers])[0]

    def _activation_moments(self, rbms, *, limit: int = VISIBLE_BIAS_FRAMES) -> tuple:
        """Mean and variance of the hidden probabilities of ``rbms`` (the stack's
        lowest ones) over the first ``limit`` frames of every rank's data, and
        those frames' count: the same on every rank (one Allreduce)."""
        xp = self.xp
        dim = rbms[-1].hidden_dim if rbms else self.dims[0]     # none: the features
        sums = np.zeros(2 * dim + 1, dtype=np.float64)
        for h in self._first_frames(limit):
            for rbm in rbms:
                h = rbm.hidden_probabilities(h)
            sums[:dim] += backend.to_host(h.sum(axis=0, dtype=xp.float64))
            sums[-1] += len(h)
            h = h.astype(xp.float64)
            sums[dim:-1] += backend.to_host((h * h).sum(axis=0))
        self.comm.allreduce_(sums, op="sum")
        count = max(sums[-1], 1.0)
        mean = sums[:dim] / count
        return mean, np.maximum(sums[dim:-1] / count - mean * mean, 0.0), int(sums[-1])

    def _first_frames(self, limit: int):
        """This rank's first ``limit`` frames, spliced, in minibatches."""
        cfg, xp, frames = self.cfg, self.xp, 0
        for spec in self.chunks:
            feats, _, start, end = read_chunk(self.manifest, spec, *self.cmvn)
            take = min(len(feats), limit - frames)
            for lo in range(0, take, cfg.pretrain.minibatch):
                idx = np.arange(lo, min(lo + cfg.pretrain.minibatch, take))
                yield self._splice(*(backend.to_device(a, xp) for a in (feats, idx, start, end)))
            frames += take
            if frames >= limit:
                return

    def _untrained_error(self) -> float:
        """The reconstruction error per visible unit of the Gaussian layer as
        initialised, over the first UNTRAINED_FRAMES frames of every rank (the
        same on every rank: one Allreduce).  It grows with the layer's width (its
        reconstruction sums that many random weights): on 11 spliced frames of
        the synthetic corpus about 1.0 at 32 hidden units, 2.7 at 512, 42 at 4,096."""
        rbm, xp = self.rbm, self.xp
        rng = np.random.default_rng([self.cfg.training.seed, self.comm.rank, 0, 1 << 31])
        sums = np.zeros(2, dtype=np.float64)
        for v0 in self._first_frames(UNTRAINED_FRAMES):
            uniforms = backend.to_device(
                rng.random((len(v0), rbm.hidden_dim), dtype=np.float32), xp)
            sample = (uniforms < rbm.hidden_probabilities(v0)).astype(v0.dtype)
            diff = v0 - rbm.reconstruct(sample)
            sums += (float(backend.to_host((diff * diff).sum(dtype=xp.float64))), len(v0))
        self.comm.allreduce_(sums, op="sum")
        return float(sums[0] / max(sums[1] * rbm.visible_dim, 1.0))

    def _check_alive(self, index: int) -> None:
        """Stop when every hidden unit of the layer in training (at a checkpoint,
        or at its end) gives the same probability on every frame: a rate so large
        that the hidden biases saturated (CD-1 then learns nothing and the weight
        decay wears W away) leaves a layer that passes nothing on, whose
        reconstruction error looks like any other's and whose layer above
        reconstructs its constant input with no error at all; a network started
        from it did not learn (the same probabilities everywhere)."""
        _, var, frames = self._activation_moments(self.stack.rbms + [self.rbm],
                                                  limit=ALIVE_FRAMES)
        spread = math.sqrt(float(var.max()))
        if spread >= DEAD_LAYER_STD or not frames:
            return
        # an input as constant over those frames (long digital silence) is no sign
        _, below, _ = self._activation_moments(self.stack.rbms, limit=ALIVE_FRAMES)
        if math.sqrt(float(below.max())) < DEAD_LAYER_STD:
            return
        rate, rate_key = self._rates(index)
        kind = "Gaussian-Bernoulli" if index == 0 else "Bernoulli-Bernoulli"
        raise TrainingError(f"pretrain: layer {index + 1} ({kind}) diverged at step "
                            f"{self.layer_step}: each of its "
                            f"{self.rbm.hidden_dim} hidden units gives the same probability "
                            f"on every frame (standard deviation at most {spread:.2g} over "
                            f"{frames} frames), so the stack would pass nothing on; lower "
                            f"{rate_key} (now {rate:g}){self._decay_note()}", agreed=True)

    def _check_before_checkpoint(self, index: int) -> None:
        """Stop on the RBM in training before a checkpoint inside its layer holds it
        (at an averaging point: every rank holds the same RBM and judges it alike).
        A diverged one is said as such, not as a file that cannot hold NaN (the log
        lines that check it may be further apart); nor is a saturated one kept: a
        resume at a lower rate would go on from it, stuck, and be told to lower
        that rate again."""
        if not bool(backend.to_host(self.xp.isfinite(self.rbm.params).all())):
            rate, rate_key = self._rates(index)
            self._check_divergence(index, math.nan, rate, rate_key)
        self._check_alive(index)

    def _decay_note(self) -> str:
        # a weight decay raised above the default can be the cause as well
        decay = self.cfg.pretrain.weight_decay
        return f", or pretrain.weight_decay (now {decay:g})" \
            if decay > PretrainConfig().weight_decay else ""

    def _splice(self, feats, idx, start, end):
        out = self.inputs[:len(idx)] if len(idx) == len(self.inputs) else \
            self.xp.empty((len(idx), self.inputs.shape[1]), dtype=np.float32)
        ctx = self.ctx[:len(idx)] if len(idx) == len(self.ctx) else None
        cfg = self.cfg
        return splice_batch_(feats, idx, start, end, cfg.data.left_context,
                             cfg.data.right_context, out=out, ctx=ctx)

    # -- the run directory and the log ----------------------------------------------
    def _say(self, text: str) -> None:
        if self.log is not None:
            self.log.say(text)
        else:
            self._pending.append(text)

    def _open_run_dir(self) -> None:
        self._lock, lines = take_run_dir(self.comm, self.run_dir, self.cfg,
                                         resume=self.resuming, overwrite=self.overwrite,
                                         lock=self._lock,
                                         seen=self._checkpoints_seen)
        self._pending[:0] = lines
        self.log = MetricsLog(self.run_dir, enabled=self.is_root, stream=self._stream_out,
                              append=self.resuming)
        for line in self._pending:
            self.log.say(line)
        self._pending = []

    # -- checkpoints -------------------------------------------------------------------
    def _rates(self, index: int) -> tuple:
        p = self.cfg.pretrain
        if index == 0:
            return p.learning_rate_gaussian, "pretrain.learning_rate_gaussian"
        return p.learning_rate, "pretrain.learning_rate"

    def _global_step(self) -> int:
        return sum(self.layer_steps[:self.layer]) + self.layer_step

    def _check_run_dir(self, writing: str) -> None:
        """Rank 0, before it writes: stop if the run directory was removed or moved."""
        problem = self._lock.moved(writing) if self._lock is not None else None
        if problem:
            raise TrainingError(problem)

    def save_checkpoint(self, rewrite=None) -> None:
        """Rank 0 writes the stack so far, the current RBM and every rank's state.
        ``rewrite``: the path of the checkpoint to replace (an ended run's, given
        accepted settings), instead of the next one by step."""
        in_layer = self.rbm is not None and self.layer_step > 0
        rank_state = {"reader": self.stream.state_dict()}
        if in_layer:
            rank_state["momentum"] = self.cd.state_dict()
        states = gather_rank_states(self.comm, rank_state)
        if not self.is_root:
            return
        self._check_run_dir("a checkpoint")
        rbms = self.stack.rbms + ([self.rbm] if in_layer else [])
        stack = RBMStack(rbms, feat_dim=self.stack.feat_dim,
                         left_context=self.stack.left_context,
                         right_context=self.stack.right_context,
                         cmvn_mean=self.stack.cmvn_mean, cmvn_scale=self.stack.cmvn_scale,
                         speaker_cmvn=self.stack.speaker_cmvn)
        path = rewrite or checkpoint_path(self.run_dir, self._global_step())
        with atomic_h5_file(path, checksum=True, what="checkpoint") as f:
            f.attrs["format"] = CHECKPOINT_FORMAT
            f.attrs["config"] = config_to_yaml(self.cfg)
            f.attrs["layer"] = self.layer
            f.attrs["layer_step"] = self.layer_step
            f.attrs["layer_steps"] = self.layer_steps[self.layer] \
                if self.layer < len(self.layer_steps) else 0
            f.attrs["frames_seen"] = self.frames_seen
            f.attrs["num_ranks"] = len(states)
            if in_layer:
                # the layer's yardstick and the small windows not judged yet, so a
                # resumed run judges divergence as the uninterrupted run does
                # (no first window yet: no attribute, a file holds no NaN)
                if self._window_first is not None:
                    f.attrs["window_first"] = float(self._window_first)
                f.attrs["pool_error"] = float(self._pool[0])
                f.attrs["pool_frames"] = int(self._pool[1])
            # the directories the paths named, and what the training corpus held
            for key, value in {**corpus_places(self.cfg),
                               **corpus_identity({"data.train": self.manifest})}.items():
                f.attrs[key] = value
            write_stack_group(f.create_group("stack"), stack)
            ranks = f.create_group("ranks")
            for r, state in enumerate(states):
                write_state(ranks.create_group(f"{r:05d}"), state)
        self.log.write("checkpoint", layer=self.layer + 1, step=self.layer_step)
        if rewrite:
            return              # (no checkpoint more: nothing to rotate)
        # each layer's end stays, for model.init_from of the stack up to it
        rotate_checkpoints(path, max(self.cfg.training.keep_checkpoints, MIN_KEEP),
                           spare=_at_layer_end)

    def _read_checkpoint(self, path) -> dict:
        with open_h5_for_reading(path, "checkpoint") as f, reading_errors(path, "checkpoint"):
            if f.attrs.get("format") != CHECKPOINT_FORMAT:
                raise _NotPretraining(path, f.attrs.get("format"))
            attrs = {}
            for name in ("layer", "layer_step", "layer_steps", "frames_seen", "num_ranks"):
                value = f.attrs.get(name)
                if not isinstance(value, (int, np.integer)) or int(value) < 0:
                    raise ValueError(f"{path}: checkpoint attribute '{name}': expected a "
                                     f"non-negative int, got {shown(value)}")
                attrs[name] = int(value)
            attrs["judging"] = _read_judging(f.attrs, path)
            attrs["config"] = str(f.attrs.get("config", ""))
            attrs["places"] = {key: str(f.attrs[key]) for key in f.attrs
                               if key.startswith("place_")}
            attrs["corpus"] = {key: int(f.attrs[key]) for key in f.attrs
                               if key.startswith("corpus_")
                               and isinstance(f.attrs[key], (int, np.integer))}
            stack = read_stack_group(f["stack"], path, xp=self.xp)
            # the layer in training is one of the stack's (its count: at the end), and
            # its step one of its planned steps
            if attrs["layer"] > len(stack.rbms):
                raise ValueError(f"{path}: checkpoint attribute 'layer' is {attrs['layer']}, "
                                 f"but the stack holds {len(stack.rbms)} layers")
            if attrs["layer_steps"] and attrs["layer_step"] > attrs["layer_steps"]:
                raise ValueError(f"{path}: checkpoint attribute 'layer_step' is "
                                 f"{attrs['layer_step']}, past the layer's "
                                 f"{attrs['layer_steps']} planned steps ('layer_steps')")
            same_ranks = attrs["num_ranks"] == self.comm.size
            name = f"ranks/{self.comm.rank:05d}"
            rank = read_state(f["ranks"][f"{self.comm.rank:05d}"], path, what="checkpoint") \
                if same_ranks else None
            if rank is not None:
                _check_rank_state(rank, stack, attrs["layer"], name, path)
            verify_file(f, path, what="checkpoint")
        return {**attrs, "stack": stack, "rank": rank, "path": path}

    def _resume(self) -> None:
        found = list_checkpoints(self.run_dir) if self.is_root else []
        # (a job that still wrote here until the lock was ours: _open_run_dir)
        self._checkpoints_seen = {os.path.basename(path) for path in found}
        chosen, notes, formats = None, [], []
        for path in reversed(found):
            try:
                self._read_checkpoint(path)
            except (ValueError, OSError) as exc:
                notes.append(f"skipped {os.path.basename(path)}: {exc}")
                formats.append(exc.format if isinstance(exc, _NotPretraining) else None)
                continue
            chosen = path
            break
        way = None
        if self.is_root and not found:
            way = no_checkpoint_way(self.run_dir, RESULT_NAME)
        # every checkpoint a train run's (not a list of them, each "not a pretraining one")
        train_run = bool(formats) and all(f == TRAIN_CHECKPOINT_FORMAT for f in formats)
        chosen, notes, way, train_run = self.comm.bcast_obj([chosen, notes, way, train_run],
                                                            root=0)
        if way is not None:
            raise TrainingError(f"{self.run_dir}: no pretraining checkpoint (ckpt-*.h5) to "
                                f"continue from; {way}", agreed=True)
        if chosen is None and train_run:
            raise TrainingError(f"{self.run_dir}: a train run's directory (its checkpoints "
                                "are a model's); pretrain in a run directory of its own",
                                agreed=True)
        if chosen is None:
            raise TrainingError(f"{self.run_dir}: no pretraining checkpoint (ckpt-*.h5) "
                                "verifies" + (": " + "; ".join(notes) if notes else ""),
                                agreed=True)
        try:
            ckpt = self._read_checkpoint(chosen)
        except (ValueError, OSError) as exc:
            raise TrainingError(str(exc)) from None
        try:
            saved = config_from_yaml(ckpt["config"])
        except ValueError as exc:
            raise TrainingError(f"{chosen}: the stored config: {' '.join(str(exc).split())}",
                                agreed=True) from None
        changes, moved = resume_changes(saved, self.cfg,
                                        {**ckpt["places"], **ckpt["corpus"]},
                                        corpus_identity({"data.train": self.manifest}),
                                        unused=reads_every_setting)
        notes += moved
        changes = [c for c in changes if c.startswith(PRETRAIN_SETTINGS)]
        if changes and not self.accept_changes:
            raise TrainingError(f"{chosen}: --resume with settings that change the result: "
                                + "; ".join(changes) + " (restore them, or pass "
                                "--accept-changes)", agreed=True)
        self._accepted = changes
        # --accept-changes takes a new rate or length, but the RBMs trained so far
        # cannot take another shape (they failed later inside numpy on every rank)
        shape = self._shape_changes(ckpt["stack"])
        if shape:
            raise TrainingError(f"{chosen}: --resume cannot change the shape of the RBMs "
                                "trained so far: " + "; ".join(shape) + " (restore it, or "
                                "pretrain afresh with --overwrite)", agreed=True)
        # fewer layers than the checkpoint holds: the stack kept would not be the one
        # asked for, and one cut down would replace RBMs already trained
        held, wanted = len(ckpt["stack"].rbms), len(self.layer_steps)
        if held > wanted:
            end = None
            if self.is_root:
                end = next((path for path in list_checkpoints(self.run_dir)
                            if _layers_at_end(path) == wanted), None)
            end = self.comm.bcast_obj(end, root=0)
            way = f"model.init_from={end} is the stack of the first {wanted}" if end else \
                "pretrain afresh with --overwrite"
            raise TrainingError(f"{chosen}: --resume cannot drop RBMs trained so far: "
                                f"model.hidden_layers is {wanted}, the checkpoint holds "
                                f"{held} (restore it; {way})", agreed=True)
        # accepted changes that step through the data otherwise: the saved reader
        # positions are places in another plan's chunks and batches, so the data is
        # planned anew as on another number of ranks (they failed as out of range for
        # the rank's data, or were read as other places)
        digest = "corpus_data.train_digest"
        now_digest = corpus_identity({"data.train": self.manifest}).get(digest)
        was_digest = ckpt["corpus"].get(digest)
        replanned = [key for key, was, now in (
            ("pretrain.minibatch", saved.pretrain.minibatch, self.cfg.pretrain.minibatch),
            ("data.chunk_frames", saved.data.chunk_frames, self.cfg.data.chunk_frames),
            ("training.seed", saved.training.seed, self.cfg.training.seed),
            ("the training corpus", was_digest,
             was_digest if now_digest is None or was_digest is None else now_digest))
            if was != now]
        if replanned and ckpt["rank"] is not None:
            ckpt = {**ckpt, "rank": None}
            notes.append(f"{', '.join(replanned)} changed: data re-planned, the same "
                         "fraction of the layer counts as done, momentum starts afresh")
        for line in notes:
            self._say(f"resume: {line}")
        # (the layer's epochs as the checkpoint planned them: a re-plan keeps the
        # passes over the data already made, not the fraction of a longer layer)
        ckpt = {**ckpt, "layer_epochs": layer_epochs(saved.pretrain, ckpt["layer"])}
        self._resume_state = ckpt
        self._say(f"resumed from {chosen} at layer {ckpt['layer'] + 1}, step "
                  f"{ckpt['layer_step']}")

    def _shape_changes(self, stored) -> list:
        """How this config's stack differs in shape from a checkpoint's ``stored``
        one, over the layers both have (their count: _resume judges it)."""
        cfg, found = self.cfg, []
        for key, was, now in (("data.left_context", stored.left_context, cfg.data.left_context),
                              ("data.right_context", stored.right_context,
                               cfg.data.right_context),
                              ("data.train's feat_dim", stored.feat_dim, self.manifest.feat_dim)):
            if was != now:
                found.append(f"{key} was {was}, now {now}")
        if not found:
            for i, rbm in enumerate(stored.rbms[:len(self.dims) - 1]):
                if rbm.hidden_dim != self.dims[i + 1]:
                    found.append(f"model.hidden_dim was {rbm.hidden_dim}, now "
                                 f"{self.dims[i + 1]}")
                    break
        return found

    def _restore(self, ckpt) -> None:
        """Continue from a read checkpoint (called once the run directory is open)."""
        stored = ckpt["stack"].rbms
        self.layer, self.frames_seen = ckpt["layer"], ckpt["frames_seen"]
        self.stack.rbms = stored[:self.layer]
        same_ranks = ckpt["rank"] is not None
        if ckpt["layer"] >= len(self.layer_steps) or len(stored) < self.layer:
            self.layer_step = 0
            if self._accepted:
                # the checkpoint rewritten to hold them keeps the data's place, where
                # a layer added later starts
                self._place_reader(ckpt, same_ranks)
            return
        step = ckpt["layer_step"]
        if not same_ranks and ckpt["layer_steps"]:
            # another number of ranks or data plan: the same passes over the data are
            # done (the same fraction of the layer unless its epochs changed too)
            scale = ckpt["layer_epochs"] / layer_epochs(self.cfg.pretrain, self.layer)
            step = int(round(step * scale * self.layer_steps[self.layer]
                             / ckpt["layer_steps"]))
        self.layer_step = min(step, self.layer_steps[self.layer])
        self._place_reader(ckpt, same_ranks)
        if len(stored) > self.layer and self.layer_step > 0:
            self._new_layer(self.layer)
            self.rbm.params[...] = stored[self.layer].params
            if ckpt["judging"] is not None:       # (absent from older checkpoints)
                self._window_first, self._pool = ckpt["judging"]
            if same_ranks and "momentum" in ckpt["rank"]:
                self.cd.load_state_dict(ckpt["rank"]["momentum"])
            self.strategy.setup(self.rbm, self.cd)

    def _place_reader(self, ckpt, same_ranks: bool) -> None:
        """The reader where the checkpoint's left it, or (another number of ranks
        or data plan) at the global step reached."""
        if same_ranks:
            try:
                self.stream.load_state_dict(ckpt["rank"]["reader"])
            except ValueError as exc:
                raise ValueError(f"{ckpt['path']}: ranks/{self.comm.rank:05d}/reader: "
                                 f"{exc}") from None
        else:
            done = self._global_step()
            self.stream.seek(done // self.steps_per_epoch, done % self.steps_per_epoch)

    # -- the loop ----------------------------------------------------------------------
    def _banner(self) -> str:
        return (f"mpitrain pretrain: {self.comm.size} rank(s), {len(self.layer_steps)} RBMs "
                f"{'-'.join(str(d) for d in self.dims)}; {self.steps_per_epoch} "
                f"steps/epoch of {self.cfg.pretrain.minibatch} frames per rank, averaging "
                f"every {plural(self.every_steps, 'step')}")

    def dry_run_lines(self) -> list:
        """What a run would say before its first step (``pretrain --dry-run``)."""
        return list(self._pending) + [self._banner()]

    def run(self) -> dict:
        comm = self.comm
        self._open_run_dir()
        if self._resume_state is not None:
            self._restore(self._resume_state)
            chosen, self._resume_state = self._resume_state["path"], None
            if self.layer >= len(self.layer_steps):
                return self._leave_complete_run(chosen)
        self.log.say(self._banner())
        self.log.write("start", mode="pretrain", ranks=comm.size, layers=self.dims,
                       layer_steps=self.layer_steps, layer=self.layer + 1,
                       step=self.layer_step)
        try:
            return self._run_layers()
        except (Exception, KeyboardInterrupt) as exc:
            with contextlib.suppress(Exception):
                self.log.write("error", layer=self.layer + 1, step=self.layer_step,
                               **error_record(exc))
            record_failure_alone(self.comm, self.run_dir, exc, layer=self.layer + 1,
                                 step=self.layer_step)
            raise

    def _run_layers(self) -> dict:
        comm = self.comm
        started, self._first_step = comm.wtime(), self._global_step()
        recon = float("nan")
        while self.layer < len(self.layer_steps):
            if self.rbm is None:
                self._new_layer(self.layer)
            recon = self._train_layer(started)
            if self._stop is not None and self.layer_step < self.layer_steps[self.layer]:
                return self._end_on_signal(started, written=False)     # inside the layer
            self._check_alive(self.layer)
            self.stack.rbms.append(self.rbm)
            self.log.write("layer", layer=self.layer + 1, visible=self.rbm.visible,
                           recon_mse=recon, frames=self.frames_seen)
            self.layer, self.layer_step, self.rbm = self.layer + 1, 0, None
            self.save_checkpoint()
            if self._stop is not None and self.layer < len(self.layer_steps):
                return self._end_on_signal(started, written=True)     # at a layer's end
        if self.is_root:
            self._check_run_dir(RESULT_NAME)
            save_rbm_stack(os.path.join(self.run_dir, RESULT_NAME), self.stack)
        result = {"layers": len(self.stack.rbms), "frames": self.frames_seen,
                  "recon_mse": recon, "seconds": comm.wtime() - started}
        self.log.write("end", **result)
        self.log.say(f"done: {plural(len(self.stack.rbms), 'RBM')}, {self.frames_seen} frames in "
                     f"{format_duration(result['seconds'])}; stack "
                     f"{os.path.join(self.run_dir, RESULT_NAME)}")
        return result

    def _leave_complete_run(self, chosen) -> dict:
        """``--resume`` of a pretraining that had ended, with no layer to add: the
        stack stands (written from the last checkpoint if it is missing), as
        ``train`` leaves an ended run's final model; accepted changes rewrite that
        checkpoint (``chosen``), as ``train``'s final one, so that the next
        ``--resume`` compares with the settings config.yaml now holds."""
        if self._accepted:
            # (rank 0's path may be relative to its own working directory)
            rewritten = os.path.join(self.run_dir, os.path.basename(chosen))
            self.save_checkpoint(rewrite=rewritten)
            self.log.say("resume: settings changed (--accept-changes): "
                         + "; ".join(self._accepted)
                         + f"; {os.path.basename(rewritten)} now holds them")
        path = os.path.join(self.run_dir, RESULT_NAME)
        problem = None
        if self.is_root:
            try:
                load_rbm_stack(path)
            except (OSError, ValueError) as exc:   # lost, or damaged (its checksum)
                problem = " ".join(str(exc).split())
        if problem is not None:
            self._check_run_dir(RESULT_NAME)
            save_rbm_stack(path, self.stack)
            self.log.say(f"resume: wrote {path} from the last checkpoint ({problem})")
            self.log.write("end", layers=len(self.stack.rbms), frames=self.frames_seen,
                           stack_written_on_resume=True)
        self.log.say(f"resume: the pretraining had ended ({plural(len(self.stack.rbms), 'RBM')}); "
                     "nothing to pretrain (raise model.hidden_layers to add layers)")
        return {"layers": len(self.stack.rbms), "frames": self.frames_seen, "seconds": 0.0,
                "complete": True}

    def _end_on_signal(self, started: float, *, written: bool) -> dict:
        """A signal stopped the run at a checkpoint (``written``: just written at a
        layer's end; else written here): one line, and a result that says so."""
        code, ranks = self._stop
        if not written:
            # (a signal's checkpoint is judged as the loop's are)
            self._check_before_checkpoint(self.layer)
            self.save_checkpoint()
        path = checkpoint_path(self.run_dir, self._global_step())
        name = signal_name(code)
        self.log.write("stop", layer=self.layer + 1, step=self.layer_step, signal=name,
                       ranks=ranks, checkpoint=path)
        self.log.say(f"stopped at layer {self.layer + 1}, step {self.layer_step} on {name} "
                     f"(received by {ranks} of {self.comm.size} rank(s)): checkpoint {path}; "
                     "--resume continues from it")
        return {"layers": len(self.stack.rbms), "frames": self.frames_seen,
                "seconds": self.comm.wtime() - started, "stopped": name, "checkpoint": path}

    def _train_layer(self, started: float) -> float:
        """CD-1 steps until the layer's planned end, or until the ranks agree to stop
        on a signal (``self._stop`` set; stop.py); returns its last window's error."""
        cfg, comm, xp = self.cfg, self.comm, self.xp
        p, index, rbm = cfg.pretrain, self.layer, self.rbm
        below = self.stack.rbms
        steps = self.layer_steps[index]
        rate, rate_key = self._rates(index)
        sq_err = xp.zeros((), dtype=xp.float64)
        frames, window_start, recon = 0, comm.wtime(), float("nan")
        if self.layer_step == 0:       # (a resumed layer keeps its checkpoint's)
            self._window_first, self._pool = None, [0.0, 0]
        ck = cfg.training.checkpoint_interval
        next_checkpoint = (self.layer_step // ck + 1) * ck if ck else 0
        stop_poll = StopPoll(comm, max_every=cfg.training.log_interval)
        stop_poll.start(self.layer_step)
        clock = CheckpointClock(comm, cfg.training.checkpoint_minutes)
        while self.layer_step < steps:
            chunk, idx = self.stream.next_batch()
            v0 = self._splice(chunk.feats, idx, chunk.utt_start, chunk.utt_end)
            for lower in below:
                v0 = lower.hidden_probabilities(v0)
            uniforms = np.random.default_rng(
                [cfg.training.seed, comm.rank, index, self.layer_step]).random(
                    (len(idx), rbm.hidden_dim), dtype=np.float32)
            momentum = momentum_at(self.layer_step * p.minibatch, initial=p.momentum_initial,
                                   final=p.momentum_final, ramp_frames=p.momentum_ramp_frames)
            if self.layer_step and ramp_step(self.layer_step * p.minibatch,
                                             p.momentum_ramp_frames) \
                    != ramp_step((self.layer_step - 1) * p.minibatch, p.momentum_ramp_frames):
                self.cd.reset_rate_factor()       # (Kaldi sets the rate afresh here)
            sq_err += self.cd.step(v0, backend.to_device(uniforms, xp), learning_rate=rate,
                                   momentum=momentum)
            frames += len(idx)
            self.layer_step += 1
            self.frames_seen += len(idx) * comm.size
            self.strategy.after_update(rbm, self.cd, self.layer_step)
            last = self.layer_step == steps
            if self.layer_step % cfg.training.log_interval == 0 or last:
                # error, frames, the guard's catches (eqn:guard) and rate factor, and
                # whether a signal asked this rank to stop, by signal (stop.py);
                # last, whether rank 0's clock says a checkpoint is due
                sums = np.zeros(4 + len(STOP_SIGNALS) + 1, dtype=np.float64)
                # (the device's figures in one read)
                err, fired, factor = backend.to_host(
                    xp.stack([sq_err, self.cd.fired, self.cd.rate_factor]))
                sums[:4] = (err, frames, fired, factor)
                if requested.code():
                    sums[3 + requested.code()] = 1
                sums[-1] = clock.flag()
                comm.allreduce_(sums, op="sum")
                stop_poll.heard(self.layer_step)
                clock.hear(sums[-1])
                if self._stop is None:
                    self._stop = agreed_stop(sums[4:-1], is_root=self.is_root)
                with np.errstate(all="ignore"):
                    recon = float(sums[0] / (sums[1] * rbm.visible_dim))
                now = comm.wtime()
                self._log_window(index, steps, recon, rate * (1 - momentum), momentum,
                                 sums[1] / max(now - window_start, 1e-9), started,
                                 fired=int(sums[2]), factor=sums[3] / comm.size)
                self._check_divergence(index, recon, rate, rate_key, frames=int(sums[1]))
                sq_err[...] = 0
                self.cd.fired[...] = 0
                frames, window_start = 0, comm.wtime()
            elif self._stop is None and stop_poll.due(self.layer_step):
                # log lines far apart: the signals (and rank 0's clock) are told in a
                # poll of their own
                flags, timed = stop_poll.exchange(self.layer_step, rank0_flag=clock.flag())
                self._stop = agreed_stop(flags, is_root=self.is_root)
                clock.hear(timed)
            steps_due = next_checkpoint and self.layer_step >= next_checkpoint
            if (steps_due or clock.agreed) and not last \
                    and self.layer_step % self.every_steps == 0:
                if steps_due:
                    next_checkpoint = (self.layer_step // ck + 1) * ck
                clock.written()
                self._check_before_checkpoint(index)
                self.save_checkpoint()
            # a signal: at the first averaging point from the log line where the ranks
            # agreed (one rank alone: at once); at a layer's last step, its end's
            # checkpoint is the one
            if comm.size == 1 and self._stop is None and requested.code():
                self._stop = (requested.code(), 1)
            if self._stop is not None and not last \
                    and (comm.size == 1 or self.layer_step % self.every_steps == 0):
                return recon
        # a last partial block is averaged too, so every rank holds the same RBM
        self.strategy.finalize(rbm, self.cd, self.layer_step)
        return recon

    def _log_window(self, index, steps, recon, lr, momentum, rate, started, *, fired=0,
                    factor=1.0) -> None:
        """One window's line and record; ``fired``: minibatches the Gaussian layer's
        guard caught in it (all ranks), ``factor``: the ranks' mean rate factor."""
        step_total = self._global_step()
        left = sum(self.layer_steps) - step_total
        # the steps of this process alone: a resumed run took those before elsewhen
        per_step = (self.comm.wtime() - started) / max(step_total - self._first_step, 1)
        lr *= factor
        record = {"layer": index + 1, "step": self.layer_step, "frames": self.frames_seen,
                  "recon_mse": recon, "lr": lr, "momentum": momentum,
                  "frames_per_sec": rate, "rss_mb": resident_mb(), "guard_fired": fired,
                  "lr_factor": factor}
        self.log.write("pretrain", **record)
        guard = f" scaled down {fired}x (reconstruction over twice the data's spread)" \
            if fired else ""
        self.log.say(f"layer {index + 1}/{len(self.layer_steps)} ({self.rbm.visible}) step "
                     f"{self.layer_step}/{steps} frames {self.frames_seen} recon mse "
                     f"{recon:.4f} lr {lr:.3g} momentum {momentum:.3f}{guard} {rate:,.0f} "
                     f"fr/s ETA {format_duration(per_step * left)}")

    def _check_divergence(self, index, recon, rate, rate_key, frames=None) -> None:
        """Stop when the reconstruction error is not finite or has exploded; every
        rank sees the same summed figure, so every rank stops here together.  A
        window of fewer than MIN_JUDGED_FRAMES ``frames`` (all ranks') is judged
        for an explosion pooled with the next ones (one frame's error swings ten
        times over, and a run that learned stopped as diverged)."""
        factor = self.cfg.pretrain.divergence_factor
        if math.isfinite(recon) and frames is not None \
                and (self._pool[1] or frames < MIN_JUDGED_FRAMES):
            self._pool[0] += recon * frames
            self._pool[1] += frames
            if self._pool[1] < MIN_JUDGED_FRAMES:
                return
            recon, self._pool = self._pool[0] / self._pool[1], [0.0, 0]
        if self._window_first is None and math.isfinite(recon):
            self._window_first = recon
        first = self._window_first
        # the features are standardised, so a Gaussian layer that gave every frame
        # the mean would err by their variance, 1, and the untrained layer errs as
        # measured (more, the wider it is): a first window far above both has
        # exploded already and must not become the yardstick
        cap = max(1.0, self._untrained)
        reference = first if first is None or index > 0 else min(first, cap)
        exploded = factor and reference is not None and recon > factor * reference
        if math.isfinite(recon) and not exploded:
            return
        kind = "Gaussian-Bernoulli" if index == 0 else "Bernoulli-Bernoulli"
        what = "is not finite" if not math.isfinite(recon) else \
            f"exploded to {recon:.4g} (first window {first:.4g}" + \
            ("" if reference == first else "; the features' variance is 1" +
             ("" if cap == 1.0 else f", the untrained layer's error {cap:.3g}")) + ")"
        also = self._decay_note()
        if exploded and factor < 1.5:
            # a window only a little above the yardstick counts as exploding (as the
            # training's last words say of training.divergence_factor)
            also += (f"; or raise pretrain.divergence_factor ({factor:g}: a window above "
                     "that many times the first counts as exploding)")
        raise TrainingError(f"pretrain: layer {index + 1} ({kind}) diverged at step "
                            f"{self.layer_step}: reconstruction error {what}; lower "
                            f"{rate_key} (now {rate:g}){also}", agreed=True)

    def dry_run_done(self) -> None:
        """Every rank has finished a dry run alike (pretraining splits off nothing)."""

    def close(self) -> None:
        self.stream.close()
        if self.log is not None:
            self.log.close()
        if self._lock is not None:
            self._lock.release()

