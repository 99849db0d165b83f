"""The training loop: data, model, optimizer and strategy, step after step.

Each rank runs this same loop on its own data.  The strategy decides how ranks
combine their work; rank 0 alone prints, writes metrics and checkpoints.
Figures it prints combine all ranks with one small collective at each log
interval (every rank reaches it at the same step): cross-entropy and accuracy
per frame over all ranks' frames, frames/s summed, the comm fraction averaged.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import time

import numpy as np

from .. import backend
from ..config import (STRONG_L2_SHRINK, RunConfig, config_to_yaml, l2_rate_limit,
                      l2_shrink)
from ..data.batcher import MinibatchStream, plan_chunks
from ..data.corpus import CorpusError, manifest_path, speaker_cmvn_kind
from ..data.validate import validate_corpus, validate_slices
from ..files import dotted_keys
from ..nn.dropout import DropoutMasks, DropoutSchedule
from ..nn.model_file import save_model
from ..nn.network import RELATIVE_VARIANCE_FLOOR, build_network, constant_dimensions
from ..optim.factory import build_optimizer, build_schedule
from ..parallel.registry import build_strategy, data_share, takes_own_steps
from ..threads import available_cores, current_blas_threads
from .checkpoint import checkpoint_path, gather_rank_states, list_checkpoints, save_checkpoint
from .checkpoint_clock import CheckpointClock
from .divergence import ROLL_BACK, DivergenceGuard, Diverged, divergence_advice
from .evaluate import evaluate_chunks, load_eval_chunks
from .errors import TrainingError, error_record, record_failure_alone
from .metrics import MetricsLog, format_duration, resident_mb
from .resume import CheckpointResume
from .run_dir import ACCEPT_CHANGES_NEW_RUN, take_run_dir, unused_settings
from .search import RateTrials
from .selection import ModelSelection, held_out_identity, save_best_model
from .setup import balanced_plan, load_manifests, no_minibatch_error, select_device
from .step import TrainingStep
from .stop import STOP_SIGNALS, STOPPED, StopPoll, agreed_stop, requested, signal_name
from ..words import plural


# Problems each rank sends to rank 0 to be counted without repeats (the rest are
# counted as they are).
_PROBLEMS_GATHERED = 1000

#: How far above the commonest class's share of the held-out frames a final
#: accuracy must be to count as learned (a model of the priors alone scores at
#: most that share; a learning model passes it within its first epoch).
NOTHING_LEARNED_MARGIN = 0.005


class Trainer(CheckpointResume):
    """Example::

        cfg = load_config("jobs/configs/quickstart.yaml")
        result = Trainer(cfg, run_dir="runs/quickstart", comm=create_communicator()).run()
        result["dev_acc"]
    """

    def __init__(self, cfg: RunConfig, *, run_dir: str, comm, resume: bool = False,
                 overwrite: bool = False, accept_changes: bool = False, stream=None,
                 lock=None):
        self.cfg, self.run_dir, self.comm = cfg, run_dir, comm
        self.is_root = comm.rank == 0
        self.resuming, self.overwrite, self.accept_changes = resume, overwrite, accept_changes
        # rank 0's lock on the run directory, while it runs (``lock``: taken by the
        # command line before the run is judged, run_dir.lock_a_used_run_dir)
        self._lock = lock if comm.rank == 0 else None
        self.checkpoints_seen = None  # rank 0, resuming: the checkpoints there when it chose
        self._ran = False            # run() returned (on every rank)
        self._stopped_together = False   # every rank stopped at the same step (diverged)
        self.diverged = False        # the run stopped past its last roll back (every rank)
        self._graph_said = False     # cuda_graph asked for and not used: said once
        # Nothing is written before the run is validated: lines wait for the log.
        self._stream_out = stream
        self.log = None
        self._pending_lines: list = []
        self._pending_records: list = []
        self.xp = select_device(cfg, comm)
        # Collective: every rank agrees on how device buffers travel before step 1.
        self.transport = comm.setup_device_transport(self.xp)
        # Collective: where each rank runs, for the start record (a slow node is
        # found from the train records' slowest_rank)
        self.placement = comm.allgather_obj(
            [socket.gethostname(), backend.device_index(self.xp)])
        if not cfg.data.train:
            raise TrainingError("data.train: no training corpus given (set data.train "
                                "in the config or with --set data.train=DIR)", agreed=True)
        if cfg.training.plot and self.is_root:
            try:
                import matplotlib  # noqa: F401  (checked now, not after hours of training)
            except ImportError as exc:
                raise TrainingError("training.plot: true needs matplotlib; "
                                    "pip install matplotlib (or the [plot] extra)",
                                    setting=True) from exc
        if cfg.training.tensorboard:     # checked now, on every rank alike
            from .tensorboard import require_tensorboard
            try:
                require_tensorboard()
            except ValueError as exc:
                raise TrainingError(str(exc), setting=True) from None
        self.manifest, self.dev_manifest = load_manifests(comm, cfg.data.train, cfg.data.dev)
        self._build_model()
        self._build_data()
        self._note_blas_threads()
        self._note_unread_settings()
        self._note_strong_l2()
        try:
            self.strategy = build_strategy(cfg, self.comm, total_steps=self.planned_steps)
        except ValueError as exc:        # from the settings and the rank count: every rank's
            raise TrainingError(str(exc), agreed=True, setting=True) from None
        self.schedule = build_schedule(cfg.optimizer, planned_steps=self.planned_steps,
                                       frames_per_step=cfg.training.minibatch * comm.size,
                                       progress=self.rate_progress,
                                       rate_limit=l2_rate_limit(cfg))
        self._trials = None       # optimizer.schedule: search, built at the first search
        self.step = 0
        self.frames_seen = 0      # summed over all ranks
        t = cfg.training
        # the initial model's cross-entropy is ln C (its output layer is zero): the
        # first window is judged against it rather than taken as the reference
        self.guard = DivergenceGuard(factor=t.divergence_factor,
                                     max_events=t.max_divergence_events,
                                     max_rollbacks=t.max_rollbacks, lr_factor=t.rollback_lr_factor,
                                     initial_xent=math.log(self.manifest.num_classes),
                                     advice=divergence_advice(cfg))
        # held-out figures dip while dropout rises: early stopping counts from its end
        # (measured: counting through the dip stopped a 20-epoch run 2.3 points short)
        rise_end = self.dropout_schedule.last_rise_end if self.dropout_schedule else 0.0
        self.selection = ModelSelection(select_by=t.select_by, patience=t.early_stop.patience,
                                        min_delta=t.early_stop.min_delta,
                                        patience_from_step=self._first_step_at(rise_end),
                                        held_out_set=held_out_identity(self.dev_manifest))
        if rise_end and t.early_stop.patience:
            self._say(f"early_stop: counts held-out evaluations from step "
                      f"{self.selection.patience_from_step} on, where "
                      "model.dropout_schedule stops raising the proportion")
        # (step, best) of a resumed run that had ended; the final checkpoint's step count
        self._complete, self._complete_at = None, None
        self._stopped_early = False
        self._training_step = None   # the loop's TrainingStep, once training began
        self._resumed_window = None  # a checkpoint's log-window sums, to continue
        if resume:
            self._resume()
            self._initial = None
        else:
            if accept_changes:
                self._say(ACCEPT_CHANGES_NEW_RUN)
            self.strategy.setup(self.net, self.optimizer)
            # what a roll back before the first checkpoint returns to
            self._initial = self._state_snapshot()
        self._dev = None
        self._verdict = None         # the last held-out evaluation's model selection
        self._said_nonfinite_held_out = False
        self._stopped_at = None      # (step, result, model) of the evaluation that stopped
        self._run_start = None       # the communicator's clock when training began
        self._steps_trained = 0      # steps trained since (a roll back's abandoned ones too)
        self._combination = None     # training.combine: snapshots for train/combine.py
        self._checkpointed_at = None  # the step of the checkpoint written last
        self._stop = None            # (signal code, ranks that got it) once agreed
        if cfg.training.combine:
            from .combine import FinalCombination
            self._combination = FinalCombination(cfg, comm, total_steps=self.total_steps,
                                                 sync_period=self.strategy.sync_period)

    # -- construction ------------------------------------------------------------
    def _build_model(self) -> None:
        cfg, m = self.cfg, self.manifest
        self.net = build_network(
            feat_dim=m.feat_dim, num_classes=m.num_classes,
            left_context=cfg.data.left_context, right_context=cfg.data.right_context,
            hidden_layers=cfg.model.hidden_layers, hidden_dim=cfg.model.hidden_dim,
            nonlinearity=cfg.model.nonlinearity, pnorm_output_dim=cfg.model.pnorm_output_dim,
            pnorm_p=cfg.model.pnorm_p, normalize=cfg.model.normalize, xp=self.xp)
        self.net.init_params(seed=cfg.training.seed)
        self.net.set_cmvn(m.cmvn_mean, m.cmvn_var)
        constant = int(np.sum(constant_dimensions(m.cmvn_mean, m.cmvn_var)))
        if constant:
            self._say(f"data: {constant} of {m.feat_dim} feature dimension(s) of "
                      f"{cfg.data.train} are constant (variance below "
                      f"{RELATIVE_VARIANCE_FLOOR:g} of the mean square): they carry nothing")
        self.net.speaker_cmvn = m.speaker_cmvn      # written into the model for export
        # hidden layers from `mpitrain pretrain` (RBMs); a resumed run's come from
        # its checkpoint, so the pretrained file is not needed then
        if cfg.model.init_from and not self.resuming:
            from .pretrained_init import init_from_pretrained
            try:
                refitted = init_from_pretrained(self.net, cfg)
            except ValueError as exc:    # every rank reads the same file: all stop alike
                raise TrainingError(str(exc), agreed=True) from None
            if refitted:
                self._say(f"model.init_from: {cfg.model.init_from} was pretrained on "
                          "features normalised otherwise (CMVN) than data.train's; its "
                          "first layer is rescaled to give the same outputs on data.train's")
        if self.dev_manifest is not None:
            self._check_dev_matches(m)
        self.optimizer = build_optimizer(cfg.optimizer, self.net,
                                         minibatch=cfg.training.minibatch)
        self.dropout_schedule = None
        if cfg.model.dropout_schedule or cfg.model.dropout > 0:
            try:
                self.dropout_schedule = DropoutSchedule(cfg.model.dropout_schedule
                                                        or str(cfg.model.dropout))
            except ValueError as exc:
                raise TrainingError(f"model.dropout_schedule: {exc}", agreed=True,
                                    setting=True) from None

            self.net.dropout = DropoutMasks(seed=cfg.training.seed, rank=self.comm.rank)

    def _build_data(self) -> None:
        cfg, comm = self.cfg, self.comm
        # which part of the data this rank trains on (a parameter server: none)
        try:
            share, shares = data_share(cfg, rank=comm.rank, size=comm.size)
        except ValueError as exc:        # from the settings and the rank count: every rank's
            raise TrainingError(str(exc), agreed=True, setting=True) from None
        try:
            # every rank plans, a parameter server too (it trains on no share): planning
            # reads the same files on every rank, so every rank fails alike
            plan = balanced_plan(self.manifest, shares)
        except CorpusError as exc:
            raise TrainingError(" ".join(str(exc).split()), agreed=True) from None
        slices = plan[share] if share is not None else []
        # every rank checks its own part before step 1, the held-out set shared out
        problems = validate_slices(self.manifest, slices, num_classes=self.manifest.num_classes)
        if self.dev_manifest is not None:
            problems += validate_corpus(self.dev_manifest, rank=comm.rank, size=comm.size,
                                        num_classes=self.manifest.num_classes)
        self._stop_on_data_problems(problems)
        chunks = plan_chunks(self.manifest, slices, cfg.data.chunk_frames)
        local_steps = sum(c.frames // cfg.training.minibatch for c in chunks)
        if self._takes_own_steps():
            return self._build_own_steps_data(chunks, share, shares, local_steps)
        # every rank must take the same number of steps, or a collective hangs
        steps = int(comm.allreduce_scalar(local_steps, op="min"))
        if steps == 0:
            raise no_minibatch_error(self.manifest, comm, local_steps, cfg.training.minibatch,
                                     "training.minibatch")
        self.stream = MinibatchStream(
            self.manifest, chunks, minibatch=cfg.training.minibatch, seed=cfg.training.seed,
            rank=comm.rank, cmvn=(backend.to_host(self.net.cmvn_mean),
                                  backend.to_host(self.net.cmvn_scale)),
            xp=self.xp, steps_per_epoch=steps, prefetch=cfg.data.prefetch)
        self.steps_per_epoch = steps
        # equal step counts and whole minibatches per chunk leave some frames out
        self._say_frames_left_out(steps * cfg.training.minibatch * comm.size,
                                  f"every rank takes {plural(steps, 'step')}, as "
                                  "many as the rank with the least data, of whole "
                                  "minibatches per chunk; "
                                  f"fewer ranks, {self._fewer_shards() or 'more shards'} or "
                                  "a larger data.chunk_frames leave out less")
        total = int(round(cfg.training.epochs * steps))
        if cfg.training.max_steps:
            total = min(total, cfg.training.max_steps)
        self.total_steps = max(total, 1)
        self.planned_steps = max(int(round(cfg.training.epochs * steps)), 1)

    def _fewer_shards(self) -> str | None:
        """Advice for fewer, larger shards where they would help, else None: a chunk
        never crosses shards, so shards of a few minibatches each leave each one's
        remainder out."""
        m, minibatch = self.manifest, self.cfg.training.minibatch
        average = m.num_frames / max(len(m.shards), 1)
        # (with no more shards than ranks, the ranks split shards: fewer help nothing)
        if average < 4 * minibatch and len(m.shards) > self.comm.size:
            return (f"fewer, larger shards (prepare --shards: {len(m.shards)} of "
                    f"{average:,.0f} frames on average, minibatches of {minibatch})")
        return None

    def _note_unread_settings(self) -> None:
        """The note on settings given (other than their defaults) that this run does
        not read: those of another parallel method, rate schedule or optimizer (a
        config written for one, run with another through --set), of p-norm units
        without them, of a combination or early stopping that is off."""
        given, defaults = dotted_keys(self.cfg.to_dict()), dotted_keys(RunConfig().to_dict())
        unread = [f"{key}={_shown_setting(value)}" for key, value in given.items()
                  if key.startswith(unused_settings(given)) and value != defaults.get(key)]
        if unread:
            self._say(f"config: {', '.join(unread)}: set, but not read with this run's "
                      f"other settings (parallel.method {self.cfg.parallel.method}, "
                      f"optimizer.name {self.cfg.optimizer.name}, optimizer.schedule "
                      f"{self.cfg.optimizer.schedule}, model.nonlinearity "
                      f"{self.cfg.model.nonlinearity})")

    def _note_strong_l2(self) -> None:
        """The note on an L2 term strong enough to wear the model down: accepted
        (below the bound of 1 a step), it ended runs at chance without a word."""
        for key in ("l2_regularize", "l2_regularize_output"):
            shrink = l2_shrink(self.cfg, key)
            if shrink >= STRONG_L2_SHRINK:
                value = getattr(self.cfg.optimizer, key)
                self._say(f"config: optimizer.{key}={value:g} takes {shrink:.2g} of the "
                          f"weights off them a step at the largest rate (2 x rate x L2 x "
                          f"training.minibatch); from {STRONG_L2_SHRINK:g} the model wears "
                          f"down towards chance (Kaldi's values, 1e-5 to 1e-3, take well "
                          f"under 0.001)")

    def _say_frames_left_out(self, used: int, why: str) -> None:
        """The note when an epoch trains on less than 95% of the corpus' frames."""
        if self.manifest.num_frames and used < 0.95 * self.manifest.num_frames:
            # rounded down: a share that is trained on never reads as 100% left out
            left_out = int(100 * (1 - used / self.manifest.num_frames))
            self._say(f"data: {left_out}% of the training frames are left out of each "
                      f"epoch (only {used:,} of {self.manifest.num_frames:,} are trained "
                      f"on): {why}")

    def _check_dev_matches(self, m) -> None:
        """The held-out corpus must hold features of the training corpus' kind
        (every rank reads the same manifests, so all ranks stop alike)."""
        dev = self.dev_manifest
        for field in ("feat_dim", "num_classes"):
            if getattr(dev, field) != getattr(m, field):
                hint = (f"; prepare it with --num-classes {m.num_classes} (the number of pdfs)"
                        if field == "num_classes" and dev.num_classes < m.num_classes
                        else "")
                raise TrainingError(f"{manifest_path(dev.directory)}: {field} is "
                                    f"{getattr(dev, field)}, but the training corpus has "
                                    f"{getattr(m, field)}{hint}", agreed=True)
        dev_kind, train_kind = speaker_cmvn_kind(dev.speaker_cmvn), \
            speaker_cmvn_kind(m.speaker_cmvn)
        if dev_kind != train_kind:
            raise TrainingError(f"{manifest_path(dev.directory)}: {dev_kind}, but the training "
                                f"corpus has {train_kind}; prepare both alike", agreed=True)

    # -- asynchronous methods: each rank takes its own steps ---------------------------
    def _takes_own_steps(self) -> bool:
        return takes_own_steps(self.cfg)

    def _build_own_steps_data(self, chunks, share, shares: int, local_steps: int) -> None:
        """Each rank reads its own minibatches (its own count); a parameter server
        reads none."""
        from .serving import plan_own_steps
        cfg, comm = self.cfg, self.comm
        # every rank with a share trains on it, as in the lock-step methods: a client
        # past the corpus' utterances trained nothing, and nothing said so
        trains = share is not None
        # every training rank's own steps per epoch (None: a server), gathered once
        # for the checks, the plan and the banner
        self._own_counts = comm.allgather_obj(local_steps if trains else None)
        if 0 in self._own_counts:
            raise no_minibatch_error(self.manifest, comm, local_steps, cfg.training.minibatch,
                                     "training.minibatch", trains=trains, trainers=shares)
        # each rank goes through its own share, but in whole minibatches per chunk
        # (a few frames per rank; many ranks on a small corpus lose a share of it)
        used = sum(n for n in self._own_counts if n is not None)
        fewer = self._fewer_shards()
        self._say_frames_left_out(used * cfg.training.minibatch,
                                  "each rank trains whole minibatches of its share per "
                                  "chunk; fewer ranks, a smaller training.minibatch, "
                                  + (f"{fewer} " if fewer else "")
                                  + "or a larger data.chunk_frames leave out less")
        self.budget = 0         # asynchronous ADPSGD: the steps of all ranks together
        self.stream = MinibatchStream(
            self.manifest, chunks, minibatch=cfg.training.minibatch, seed=cfg.training.seed,
            rank=share or 0, cmvn=(backend.to_host(self.net.cmvn_mean),
                                   backend.to_host(self.net.cmvn_scale)),
            xp=self.xp, steps_per_epoch=local_steps, prefetch=cfg.data.prefetch)
        try:
            if cfg.parallel.method == "adpsgd":
                from .async_ring import plan_ring_steps
                self.steps_per_epoch, self.budget, self.planned_steps = plan_ring_steps(
                    cfg, self.comm.rank, self._own_counts)
                self.total_steps = max(self.budget // self.comm.size, 1)
            else:
                self.steps_per_epoch, self.total_steps, self.planned_steps = plan_own_steps(
                    cfg, self.comm.rank, self._own_counts)
        except ValueError as exc:
            raise TrainingError(f"{self.manifest.directory}: {exc}", agreed=True) from None

    def _stop_on_data_problems(self, problems: list) -> None:
        """All ranks stop together when any rank found bad data; rank 0 names the first.

        A problem of a whole file (a compressed dataset, a bad attribute) is found
        by every rank that reads part of it: it is counted once."""
        if not int(self.comm.allreduce_scalar(len(problems), op="sum")):
            return
        found = self.comm.gather_obj((problems[:_PROBLEMS_GATHERED], len(problems)), root=0)
        if self.is_root:
            distinct = list(dict.fromkeys(p for listed, _ in found for p in listed))
            total = len(distinct) + sum(max(0, n - _PROBLEMS_GATHERED) for _, n in found)
            more = f" ({total - 1} more problem(s): run `mpitrain check` on the corpus)" \
                if total > 1 else ""
            raise TrainingError(distinct[0] + more, agreed=True)
        raise TrainingError("bad training data (reported by rank 0)", agreed=True)

    def _note_blas_threads(self) -> None:
        """A ``blas_threads`` above the cores this process may use is said: the BLAS
        threads then wait on each other (on 2 cores, 1024 of them made a step of a
        small model a thousand times slower, with no word of why)."""
        requested = self.cfg.blas_threads
        cores = available_cores() if requested else 0
        if requested > cores:
            self._say(f"threads: blas_threads {requested} is more than the {cores} core(s) "
                      "this process may use: its BLAS threads wait on each other and a "
                      "step may take many times longer; 0 gives each rank its share of "
                      "the cores")

    # -- the run directory ------------------------------------------------------------
    def _say(self, text: str) -> None:
        if self.log is not None:
            self.log.say(text)
        else:
            self._pending_lines.append(text)

    def _record(self, kind: str, **fields) -> None:
        if self.log is not None:
            self.log.write(kind, **fields)
        else:
            self._pending_records.append((kind, fields))

    def _open_run_dir(self) -> None:
        """Rank 0 writes the run directory once the run has been validated."""
        self._lock, lines = take_run_dir(self.comm, self.run_dir, self.cfg,
                                         resume=self.resuming, overwrite=self.overwrite,
                                         lock=self._lock,
                                         seen=self.checkpoints_seen)
        self._pending_lines[:0] = lines
        self.log = MetricsLog(self.run_dir, enabled=self.is_root, stream=self._stream_out,
                              append=self.resuming, tensorboard=self.cfg.training.tensorboard)
        for kind, fields in self._pending_records:
            self.log.write(kind, **fields)
        for line in self._pending_lines:
            self.log.say(line)
        self._pending_lines, self._pending_records = [], []

    # -- roll back (the state it restores: resume.py) ------------------------------------
    def _roll_back(self, reason: str) -> None:
        """Return to the newest good checkpoint (or the start) with a lower rate."""
        try:
            self.guard.roll_back()
        except Diverged as exc:
            self._stopped_together = self.diverged = True
            raise TrainingError(f"{self.run_dir}: {exc}", agreed=True) from None
        counts = self.guard.state_dict()     # the checkpoint's counts are older
        found = self.comm.bcast_obj(bool(list_checkpoints(self.run_dir)) if self.is_root
                                    else None, root=0)
        if found:
            ckpt, _, _ = self._choose_checkpoint(judge_settings=False)
            self._restore(ckpt)
            where = os.path.basename(ckpt.path)
            reference = self.guard.running_mean      # the checkpoint's
        else:
            init = self._initial
            self.net.params[...] = backend.to_device(init["params"], self.xp)
            self.optimizer.load_state_dict(init["optimizer"])
            self.stream.load_state_dict(init["reader"])
            self.strategy.load_state_dict(init["strategy"])
            self.strategy.resume(self.net)
            self.step, self.frames_seen = init["step"], init["frames_seen"]
            self.schedule.load_state_dict(init["schedule"])
            where = "the initial model"
            reference = self.guard.initial_xent
        self.guard.load_state_dict(counts)
        # judged against the model returned to (None left the first window after a
        # roll back unjudged: a rate that blew up at once became the reference)
        self.guard.events, self.guard.running_mean = 0, reference
        self._checkpointed_at = None     # (the counts differ from the file's now)
        self.schedule.after_roll_back()
        lr_scale, rollbacks = self.guard.lr_scale, self.guard.rollbacks
        self._say(f"divergence: {reason}; rolled back to {where} (step {self.step}), "
                  f"learning rate x{lr_scale:g} (roll back {rollbacks} of "
                  f"{self.guard.max_rollbacks})")
        self._record("rollback", step=self.step, reason=reason, lr_scale=lr_scale,
                     rollbacks=rollbacks)

    def _params_finite(self) -> bool:
        """Whether every rank's parameters are finite (collective)."""
        xp = self.xp
        local = int(bool(backend.to_host(xp.isfinite(self.net.params).all())))
        return bool(self.comm.allreduce_scalar(local, op="min"))

    def _window_so_far_good(self, reported=None) -> bool:
        """Whether the log window under way, summed over the ranks, is good so far
        (collective; True when the checkpoint comes right after a log line).
        ``reported``: (loss, frames, skipped) of the window that reached this rank
        in messages and is not in its own sums (asynchronous ADPSGD's rank 0)."""
        loss, _, frames, skipped = self._training_step.window_state()
        sums = np.array([loss, frames, skipped], dtype=np.float64)
        if reported is not None:
            sums += np.asarray(reported, dtype=np.float64)
        self.comm.allreduce_(sums, op="sum")
        with np.errstate(all="ignore"):
            xent = float(sums[0] / sums[1]) if sums[1] else None
        return self.guard.part_is_good(xent=xent, skipped=int(sums[2]), frames=int(sums[1]))

    def _check_run_dir(self, writing: str) -> None:
        """Rank 0, before it writes: stop if the run directory was removed or moved."""
        problem = self._lock.moved(writing) if self._lock is not None else None
        if problem:
            raise TrainingError(problem)

    def save_checkpoint(self) -> None:
        rank_state = {"optimizer": self.optimizer.state_dict(),
                      "reader": self.stream.state_dict()}
        if self._training_step is not None:
            # the log window's sums so far: a resumed run's first log line is the same
            rank_state["window"] = self._training_step.window_state()
        own_model = self.strategy.rank_state_dict()      # ADPSGD: each rank's own model
        if own_model:
            rank_state["strategy"] = own_model
        states = gather_rank_states(self.comm, rank_state)
        if self.is_root:
            self._check_run_dir("a checkpoint")
            started = time.perf_counter()
            with self._agreed_model(average=False):      # /model: the job's model
                self._write_checkpoint(states)
            self._record("checkpoint", step=self.step,
                         seconds=round(time.perf_counter() - started, 4))
        self.guard.checkpoint_written()
        self._checkpointed_at = self.step

    def _write_checkpoint(self, states) -> None:
        save_checkpoint(checkpoint_path(self.run_dir, self.step), net=self.net,
                        step=self.step, frames_seen=self.frames_seen,
                        config_yaml=config_to_yaml(self.cfg), rank_states=states,
                        strategy_state=self.strategy.state_dict(),
                        class_priors=self.manifest.class_priors(),
                        keep=self.cfg.training.keep_checkpoints,
                        trainer_state=self._trainer_state())

    # -- evaluation ------------------------------------------------------------------
    def evaluate(self) -> dict:
        """Held-out cross-entropy per frame and frame accuracy, over all ranks."""
        if self.dev_manifest is None:
            return {}
        if self._dev is None:
            self._dev = load_eval_chunks(self.dev_manifest, self.net, rank=self.comm.rank,
                                         size=self.comm.size,
                                         max_frames=self.cfg.training.eval_max_frames)
        sums = np.array(evaluate_chunks(self.net, self._dev), dtype=np.float64)
        self.comm.allreduce_(sums, op="sum")
        if sums[2] == 0:
            return {}
        return {"dev_xent": sums[0] / sums[2], "dev_acc": sums[1] / sums[2],
                "dev_frames": int(sums[2])}

    # -- the loop ------------------------------------------------------------------------
    def _new_training_step(self) -> TrainingStep:
        cfg = self.cfg
        step = TrainingStep(self.net, self.optimizer, self.strategy,
                            minibatch=cfg.training.minibatch,
                            left_context=cfg.data.left_context,
                            right_context=cfg.data.right_context,
                            cuda_graph=cfg.cuda_graph and cfg.device == "gpu", log=self._say,
                            dropout_proportion=self.dropout_at)
        if cfg.cuda_graph and not self._graph_said:
            # asked for and not used: say so once, not silently
            self._graph_said = True
            why = "it replays steps on a GPU (device: cpu)" if cfg.device != "gpu" else \
                (step.graph.why_not if step.graph is not None and not step.graph.enabled
                 else "")
            if why:
                self._say(f"cuda_graph: not used: {why}")
        return step

    def progress(self, step: int) -> float:
        """The fraction of the planned training data trained before 0-based ``step``:
        step / planned steps, unless the strategy's ranks sit steps out by plan (Kaldi's
        job ramp).  The exponential rate and the dropout schedule run over it, as
        Kaldi's over the archives processed."""
        fraction = self.strategy.data_fraction(step)
        return step / self.planned_steps if fraction is None else fraction

    def rate_progress(self, step: int) -> float:
        """:meth:`progress` as the learning-rate schedule reads it (Kaldi's method: the
        final rate in its last iteration)."""
        fraction = self.strategy.rate_fraction(step)
        return step / self.planned_steps if fraction is None else fraction

    def _first_step_at(self, fraction: float) -> int:
        """The first step whose :meth:`progress` reaches ``fraction`` (planned steps
        if none does): ceil(fraction x planned steps) when progress is the steps'."""
        low, high = 0, self.planned_steps
        while low < high:               # progress grows with the step
            middle = (low + high) // 2
            if self.progress(middle) >= fraction:
                high = middle
            else:
                low = middle + 1
        return low

    def dropout_at(self, step: int) -> float:
        """model.dropout's proportion at 0-based ``step`` (its schedule runs over the
        planned data, as Kaldi's)."""
        if self.dropout_schedule is None:
            return 0.0
        return self.dropout_schedule.proportion(self.progress(step))

    def run(self) -> dict:
        cfg, xp, comm = self.cfg, self.xp, self.comm
        self._open_run_dir()
        if self._complete is not None:
            result = self._leave_complete_run()
            self._ran = True
            return result
        self.log.say(self._banner())
        self.log.write("start", step=self.step, frames=self.frames_seen,
                       total_steps=self.total_steps, planned_steps=self.planned_steps,
                       ranks=comm.size, device=backend.device_name(xp),
                       hosts=self._hosts(), gpus=self._gpus(),
                       transport=self.transport, transport_reason=self._transport_reason(),
                       precision=cfg.precision, strategy=self.strategy.name,
                       optimizer=self.optimizer.name, blas_threads=current_blas_threads())
        try:
            return self._run_from_start()
        except (Exception, KeyboardInterrupt) as exc:
            with contextlib.suppress(Exception):
                self._record("error", step=self.step, **error_record(exc))
            record_failure_alone(self.comm, self.run_dir, exc, step=self.step)
            raise

    def _run_from_start(self) -> dict:
        net, comm = self.net, self.comm
        # the ranks start timing together: the others' wait while rank 0 wrote the start
        # record would count as their communication in the first window, and name
        # rank 0 the slowest
        comm.barrier()
        # the communicator's clock: wall time under MPI, simulated time on virtual ranks
        run_start, self._start_step = comm.wtime(), self.step
        self._run_start = run_start
        # steps trained since then, those a roll back abandoned too: the ETA's pace
        self._steps_trained = 0
        comm.reset_comm_time()
        while True:
            outcome = self._train_to_end(run_start)
            if outcome == ROLL_BACK:
                continue
            if outcome == STOPPED:
                return self._end_on_signal(run_start)
            self.strategy.finalize(net, self.optimizer, self.step)
            # a model that is not finite is never saved as the result
            if self._params_finite():
                break
            self._roll_back("the final parameters are not finite")
        if self._combination is not None:
            self._combine()
        # a run that stopped at an evaluation (early stopping, newbob) ended before its
        # plan's end, whatever training.max_steps said: a resume that raises it must
        # not train on past that decision
        self._stopped_early = self._stopped_at is not None
        # evaluated first, so the final checkpoint holds the selection it made
        result = self._final_eval()
        self._complete_at = self.planned_steps if self._stopped_early else self.total_steps
        self.save_checkpoint()
        if self.is_root:
            self._check_run_dir("final.h5")
            save_model(os.path.join(self.run_dir, "final.h5"), net,
                       class_priors=self.manifest.class_priors())
        result.update(steps=self.step, frames=self.frames_seen,
                      seconds=comm.wtime() - run_start,
                      skipped_minibatches=self.guard.skipped_total,
                      exploded_windows=self.guard.exploded_total,
                      rollbacks=self.guard.rollbacks)
        if self.selection.best_step >= 0:        # what best.h5 holds
            result.update(best_step=self.selection.best_step,
                          best_value=self.selection.best_value,
                          select_by=self.selection.select_by)
        if self.schedule.name == "search":      # compute the trials took, over all ranks
            result["trial_frames"] = self.schedule.trial_frames
        self.log.write("end", **result)
        if self.is_root and self.cfg.training.plot:
            from ..plotting import plot_runs
            png = plot_runs([self.run_dir], os.path.join(self.run_dir, "curves.png"))
            self.log.say(f"curves: {png}")
        trouble = ""
        g = self.guard
        if g.skipped_total or g.rollbacks or g.exploded_total:
            # exploded windows too: a run that blew up but never reached a roll back
            exploded = f"{g.exploded_total} exploding window(s), " if g.exploded_total else ""
            trouble = (f"; {g.skipped_total} minibatch(es) skipped as non-finite, "
                       f"{exploded}{g.rollbacks} roll back(s)")
        best = f", best {self.run_dir}/best.h5 ({self.selection.describe()})" \
            if self.selection.best_step >= 0 else ""
        self.log.say(f"done: {plural(self.step, 'step')}, {self.frames_seen} frames in "
                     f"{format_duration(result['seconds'])}{trouble}; model "
                     f"{self.run_dir}/final.h5{best}")
        self._note_nothing_learned(result)
        self._ran = True
        return result

    def _note_nothing_learned(self, result: dict) -> None:
        """The note on a final model no better than always answering the commonest
        class: a diverging setting (a large rate, BMUF's block_lr far past 1) can
        settle there, where the divergence guard sees a steady objective, and the run
        ended with status 0 and a model that only knows the class priors."""
        counts = self.dev_manifest.class_counts if self.dev_manifest is not None else []
        # (the counts are the whole held-out set's: a part, training.eval_max_frames,
        # may have a commonest class of its own, far more common)
        if "dev_acc" not in result or not sum(counts) \
                or result.get("dev_frames", 0) < sum(counts):
            return
        commonest = max(counts) / sum(counts)
        if result["dev_acc"] <= commonest + NOTHING_LEARNED_MARGIN:
            block_lr = (", parallel.block_lr" if self.cfg.parallel.method == "bmuf"
                        and self.cfg.parallel.block_lr > 1.0 else "")
            self._say(f"warning: the final model's held-out accuracy {result['dev_acc']:.4f} "
                      f"is no better than always answering the commonest class "
                      f"({commonest:.4f} of the held-out frames): it learned nothing "
                      f"but the class priors; look for a rate too large "
                      f"(optimizer.initial_learning_rate{block_lr}) or too few steps")

    def _end_on_signal(self, run_start: float) -> dict:
        """A signal stopped the loop where every rank holds what a periodic checkpoint
        holds: write that checkpoint (unless it was just written), say why in one
        line, and return a result that says so (``stopped``: the signal's name)."""
        code, ranks = self._stop
        written = checkpoint_path(self.run_dir, self.step)
        if self._checkpointed_at != self.step:
            # (rank 0's divergence guard: the one that judges a window on every method)
            good = self.comm.bcast_obj(bool(self.guard.last_window_good), root=0)
            # and, between log lines, the window under way (the lock-step loop's; the
            # asynchronous ring keeps its window on rank 0 alone)
            if good and not self._takes_own_steps():
                good = self._window_so_far_good()
            if good and self._params_finite():
                self.save_checkpoint()
            else:
                written = None
        name = signal_name(code)
        self._record("stop", step=self.step, signal=name, ranks=ranks, checkpoint=written)
        where = (f"checkpoint {written}; --resume continues from it" if written else
                 "no checkpoint written (the model is diverging or not finite); --resume "
                 "continues from the newest earlier one")
        self._say(f"stopped at step {self.step} of {self.total_steps} on {name} (received "
                  f"by {ranks} of {self.comm.size} rank(s)): {where}")
        self._ran = True
        return {"steps": self.step, "frames": self.frames_seen,
                "seconds": self.comm.wtime() - run_start, "stopped": name,
                "checkpoint": written}

    def _stop_agreed(self, flags) -> None:
        """From every rank's stop flags summed (one count per signal of
        :data:`~mpitrain.train.stop.STOP_SIGNALS`, identical on every rank): the
        signal to name and how many ranks got one."""
        if self._stop is None:
            self._stop = agreed_stop(flags, is_root=self.is_root)

    def _train_to_end(self, run_start: float):
        """Steps until the planned end or an early stop; ``ROLL_BACK`` when it rolled
        back (the caller starts again from the restored step), ``STOPPED`` when a
        signal stopped it (train/stop.py)."""
        cfg, comm = self.cfg, self.comm
        batch = cfg.training.minibatch
        self._stopped_at = None
        training_step = self._training_step = self._new_training_step()
        if self._resumed_window is not None:
            training_step.resume_window(self._resumed_window)
            self._resumed_window = None
        window_start = comm.wtime()
        comm_at_window = comm.comm_time
        cpu_at_window, steps_at_window = time.process_time(), self.step
        eval_every = cfg.training.eval_interval
        next_eval = (self.frames_seen // comm.size // eval_every + 1) * eval_every \
            if eval_every else None
        ck = cfg.training.checkpoint_interval
        next_checkpoint = (self.step // ck + 1) * ck if ck else 0
        if self._takes_own_steps() and self.cfg.parallel.method == "adpsgd":
            # asynchronous ADPSGD: each rank at its own pace until rank 0 calls the end
            from .async_ring import train_at_own_pace
            return train_at_own_pace(self, run_start)
        if self._takes_own_steps():
            # param_server: the ranks serve or train on their own until all are done
            from .serving import train_asynchronously
            return train_asynchronously(self, run_start)
        stop_poll = StopPoll(comm, max_every=cfg.training.log_interval)
        stop_poll.start(self.step)
        clock = CheckpointClock(comm, cfg.training.checkpoint_minutes)
        while self.step < self.total_steps and not self.schedule.stopped:
            if self.schedule.search_due(self.step):
                self._search_rate()
            active_ranks = self.strategy.active_ranks(self.step)
            rate = self.guard.lr_scale * self.schedule.rate(self.step)
            lr = training_step.run(self.step, rate, self.stream.next_batch)
            self.step += 1
            self._steps_trained += 1
            self.frames_seen += batch * active_ranks
            last = self.step == self.total_steps
            if self._combination is not None:
                self._combination.observe(self.step, self.net, self.strategy.result_params())
            if self.step % cfg.training.log_interval == 0 or last:
                comm_now = comm.comm_time
                loss_sum, correct_sum, frames, skipped = training_step.take_sums()
                # and each rank's own time in the window, in a slot of its own; then
                # whether a signal asked this rank to stop (train/stop.py), by signal;
                # last, whether rank 0's clock says a checkpoint is due
                sums = np.zeros(4 + comm.size + len(STOP_SIGNALS) + 1, dtype=np.float64)
                sums[:4] = [loss_sum, correct_sum, frames, skipped]
                if requested.code():
                    sums[4 + comm.size + requested.code() - 1] = 1
                sums[-1] = clock.flag()
                # (timed from here: the read of the sums above waits for a device's
                # queued steps, which is training, not the sum)
                summing = comm.wtime()
                # this rank's time outside the communicator in the window, up to the sum
                # (the read above included); the rest of the group's window, to the end
                # of the sum, is communication and waiting for slower ranks
                sums[4 + comm.rank] = (summing - window_start) - (comm_now - comm_at_window)
                comm.allreduce_(sums, op="sum")
                # the window ends here, where every rank has done its steps: a rank ahead
                # of a slower one has waited for it (before the sum it had not, between
                # averages, and its window read faster than the group trains)
                summed, comm_at_sum = comm.wtime(), comm.comm_time
                self.on_progress(int(sums[2]), summed - summing)
                self._stop_agreed(sums[4 + comm.size:-1])
                clock.hear(sums[-1])
                stop_poll.heard(self.step)
                rank_own = sums[4:4 + comm.size]
                # the rank the others waited for, at an average or at this sum: the one
                # longest on its own steps (its time communicating was no sign: between
                # averages no rank had any, and the waits at this sum come after it)
                slowest = int(np.argmax(rank_own)) \
                    if comm.size > 1 and rank_own.max() > 0 else None
                elapsed = summed - window_start
                # (the steps since the start undercount after a roll back: the first
                # line after a roll back to step 0 gave 10x the time left)
                per_step = (summed - run_start) / max(self._steps_trained, 1)
                skipped = int(sums[3])
                # a NaN window is reported, not warned; so is a window of no time on
                # a virtual rank that sat its steps out (Kaldi's idle jobs)
                with np.errstate(all="ignore"):
                    xent = sums[0] / sums[2]
                    record = {"step": self.step, "epoch": self.stream.epoch,
                              "frames": self.frames_seen, "seconds": summed - run_start,
                              "steps_trained": self._steps_trained,
                              "xent": float(xent),
                              "acc": sums[1] / sums[2], "lr": lr,
                              "frames_per_sec": sums[2] / elapsed,
                              "comm_fraction": min(1.0, max(
                                  0.0, 1.0 - rank_own.sum() / comm.size / elapsed)),
                              "slowest_rank": slowest,
                              "slowest_host": None if slowest is None
                              else self.placement[slowest][0],
                              "skipped": skipped, "rss_mb": resident_mb(),
                              # rank 0's own CPU time: steady even when the machine is shared
                              "cpu_ms_per_step": 1e3 * (time.process_time() - cpu_at_window)
                              / max(self.step - steps_at_window, 1)}
                verdict = self.guard.observe(xent=float(xent), skipped=skipped,
                                             frames=int(sums[2]))
                self.log.write("train", **record)
                trouble = ""
                if verdict != "ok":
                    trouble = (f" | divergence: {skipped} skipped, "
                               f"{self.guard.events} event(s) since the last checkpoint "
                               f"(limit {self.guard.max_events})")
                self.log.progress(
                    self.step, self.total_steps,
                    f"step {self.step}/{self.total_steps} ep {self.stream.epoch} "
                    f"frames {self.frames_seen} xent {record['xent']:.4f} "
                    f"acc {record['acc']:.4f} lr {lr:.3g} {record['frames_per_sec']:,.0f} "
                    f"fr/s comm {record['comm_fraction']:.1%} "
                    f"ETA {format_duration(per_step * (self.total_steps - self.step))}"
                    + trouble)
                # (the next window from the end of this one: rank 0's record and line
                # are part of the run's time)
                window_start, comm_at_window = summed, comm_at_sum
                cpu_at_window, steps_at_window = time.process_time(), self.step
                if verdict == ROLL_BACK:
                    self._roll_back(f"{self.guard.events} non-finite or exploding "
                                    f"minibatches/windows since the last checkpoint")
                    return ROLL_BACK
            elif self._stop is None and stop_poll.due(self.step):
                # log lines far apart: the signals (and rank 0's clock) are told in a
                # poll of their own
                flags, timed = stop_poll.exchange(self.step, rank0_flag=clock.flag())
                self._stop_agreed(flags)
                clock.hear(timed)
            # decided from the step count alone, so every rank evaluates together
            epoch_done = self.step % self.steps_per_epoch == 0
            # (not at the last step: the final evaluation follows, counted once)
            interval_due = next_eval is not None and not last \
                and self.frames_seen // comm.size >= next_eval
            # newbob decides at every epoch end, whatever training.eval_interval says
            schedule_eval = epoch_done and not last and self.schedule.uses_epoch_eval
            due_eval = interval_due or (next_eval is None and epoch_done and not last) \
                or schedule_eval
            if due_eval and self.dev_manifest is not None:
                result = self._log_eval()
                stop = self.on_eval(result)
                stop = self._stops_early() or stop
                if interval_due:
                    next_eval += eval_every
                if schedule_eval:
                    stop = self._end_schedule_epoch(result) or stop
                if stop:
                    with self._agreed_model(average=True):      # the model evaluated
                        self._stopped_at = (self.step, result, self.net.params.copy())
                    return None
            # checkpoint at the first point after each interval (of steps, or of
            # minutes by rank 0's clock) where all ranks agree
            steps_due = next_checkpoint and self.step >= next_checkpoint
            if (steps_due or clock.agreed) and not last \
                    and self.strategy.can_checkpoint(self.step):
                if steps_due:
                    next_checkpoint = (self.step // ck + 1) * ck
                clock.written()
                if self.guard.last_window_good and self._window_so_far_good() \
                        and self._params_finite():
                    self.save_checkpoint()
                else:
                    self.log.say(f"step {self.step}: checkpoint not written (the model is "
                                 "diverging or not finite)")
            # a signal: one rank alone needs nobody's word; ranks that agreed at a log
            # line stop at the first step from there where a checkpoint may be written
            if comm.size == 1 and self._stop is None and requested.code():
                self._stop = (requested.code(), 1)
            if self._stop is not None and not last and self.strategy.can_checkpoint(self.step):
                return STOPPED
        return None

    # -- the learning-rate schedule's decisions (optimizer.schedule) ---------------------
    def _search_rate(self) -> None:
        """search: try each factor's rate on the start of the coming chunk, keep the best."""
        cfg = self.cfg
        if self._trials is None:
            self._trials = RateTrials(self.net, self.optimizer, self.strategy, self.stream,
                                      self.comm, minibatch=cfg.training.minibatch,
                                      left_context=cfg.data.left_context,
                                      right_context=cfg.data.right_context)
        scale, step, steps = self.guard.lr_scale, self.step, self.schedule.trial_steps
        found = self.schedule.search(
            step, lambda rate: self._trials.run(scale * rate, steps=steps, step=step))
        self._record("search", step=step, trial_steps=steps, **found)
        # the rates as the steps take them: a roll back's scale applies to each
        tried = ", ".join(f"{scale * r:.3g}: {o:.4f}"
                          for r, o in zip(found["rates"], found["objectives"]))
        after = f", the schedule's x{scale:g} after roll backs" if scale != 1.0 else ""
        self._say(f"search at step {step}: rate {scale * found['chosen']:.3g} (trial xent "
                  f"{tried}{after})")

    def _end_schedule_epoch(self, result: dict) -> bool:
        """newbob: the epoch's held-out result decides the rate; True to stop."""
        if not result:
            return False
        decision = self.schedule.end_epoch(result["dev_xent"], result["dev_acc"])
        self._record("schedule", step=self.step, **decision)
        self._say(f"{self.schedule.name} after epoch {decision.get('epoch')}: rate "
                  f"{decision.get('rate', 0.0):.3g}" + (", halving" if decision.get("halving")
                                                        else "")
                  + (", stopping" if decision.get("stopped") else ""))
        return self.schedule.stopped

    # -- hooks for callers that time or stop early (benchmark mode) -------------------
    def on_progress(self, frames: int, sum_seconds: float) -> None:
        """Called on every rank right after the ranks summed a progress window (every
        ``training.log_interval`` steps and at the last step): ``frames`` were trained
        by all ranks in the window; ``sum_seconds`` this rank spent in the sum (and the
        wait in it for slower ranks), not in the read of its sums before it (which
        waits for a device's queued steps).  Every rank has then finished the
        window's steps, so time taken here paces the whole group (the window of a
        ``train`` record ends here too)."""

    def on_eval(self, result: dict) -> bool:
        """Called on every rank after each held-out evaluation inside the loop.

        Return True to stop training there; the model is then finalised, saved
        and evaluated as at the normal end.  Every rank must give the same
        answer: decide from ``result`` (identical on all ranks) or agree with a
        collective.
        """
        return False

    def _combine(self) -> None:
        """training.combine: the model becomes the best combination of the last ones."""
        found = self._combination.combine(self.net, self.dev_manifest or self.manifest)
        # a method whose model is not the one the ranks train on (BMUF's w_g) takes the
        # combination as its model: the evaluation, best.h5 and the final checkpoint
        # read that one (they held the model before the combination)
        result = self.strategy.result_params()
        if result is not None:
            result[...] = self.net.params
        # without data.dev the weights are fit on training frames: not held out
        held_out = self.dev_manifest is not None
        self._record("combine", step=self.step, frames_from="data.dev" if held_out
                     else "data.train", **found)
        weights = ", ".join(f"{m} {w:.3f}" for m, w in zip(found["models"], found["weights"]))
        frames = "held-out" if held_out else "training (no data.dev)"
        self._say(f"combine: {len(found['models'])} models on {found['frames']} {frames} "
                  f"frames: xent {found['combined_xent']:.4f} acc {found['combined_acc']:.4f}, "
                  f"best single ({found['best_single']}) xent "
                  f"{found['best_single_xent']:.4f}, gain {found['gain_xent']:.4f}; "
                  f"weights {weights}")

    def _final_eval(self) -> dict:
        """The final model's held-out result.  A run stopped at an evaluation (an
        early stop, the schedule's or a caller's) whose final model is the one
        evaluated there keeps that result: one evaluation, one record, one verdict
        of model selection.  Otherwise (a last average or block update, a
        combination changed it) the final model is evaluated."""
        if self.dev_manifest is None:
            return {}
        stopped, self._stopped_at = self._stopped_at, None
        if stopped is not None and self._combination is None:
            step, result, model = stopped
            same = step == self.step and bool(self.xp.array_equal(self.net.params, model))
            if self.comm.allreduce_scalar(int(same), op="min"):    # all ranks alike
                return dict(result)
        if self.cfg.parallel.method == "param_server":
            # the better of the average and the model trained
            from .serving import choose_final_model
            self._verdict = None
            return choose_final_model(self)
        return self._log_eval(final=True)

    def _log_eval(self, *, final: bool = False) -> dict:
        """Evaluate the ranks' common model (their average where they differ), log
        it, and keep it as best.h5 when it is the best so far."""
        self._verdict = None
        with self._agreed_model(average=not final):
            res = self.evaluate()
            if res:
                seconds = {} if self._run_start is None else {
                    "seconds": self.comm.wtime() - self._run_start}
                self.log.write("eval", step=self.step, frames=self.frames_seen, **res,
                               **seconds)
                self._keep_best(res)
                self.log.say(f"held-out at step {self.step}: xent {res['dev_xent']:.4f} "
                             f"acc {res['dev_acc']:.4f} ({res['dev_frames']} frames)"
                             + (", the best so far" if self._verdict.improved else ""))
        return res

    @contextlib.contextmanager
    def _agreed_model(self, *, average: bool):
        """The network holds the job's model inside, its own parameters after: the
        method's result model (BMUF's w_g), else the average of the ranks' models
        where they may differ (between model averages, or ADPSGD)."""
        result = self.strategy.result_params()
        differ = result is None and average and self.comm.size > 1 \
            and not self.strategy.models_agree(self.step)
        own = self.net.params.copy() if differ or result is not None else None
        if result is not None:
            self.net.params[...] = result
        elif differ:
            self.strategy.average_models_(self.net.params, self.step)
        try:
            yield
        finally:
            if own is not None:
                self.net.params[...] = own

    def _keep_best(self, result: dict) -> None:
        """Model selection on a held-out result (identical on every rank)."""
        verdict = self._verdict = self.selection.observe(result, step=self.step)
        if verdict.restarted_from_frames and verdict.other_set:
            self._say(f"model selection starts afresh at step {self.step}: the held-out "
                      "figures are over another held-out set than those before (data.dev "
                      "names another corpus, or its corpus was written again), which do not "
                      "compare")
        elif verdict.restarted_from_frames:
            self._say(f"model selection starts afresh at step {self.step}: the held-out "
                      f"figures are over {result.get('dev_frames')} frames, those before over "
                      f"{verdict.restarted_from_frames} (data.dev or training.eval_max_frames "
                      "changed), which do not compare")
        if not np.isfinite(result.get("dev_xent", 0.0)) and not self._said_nonfinite_held_out:
            # the model's weights are finite (the divergence guard watches them), so
            # some held-out frames overflow it: said once, as the run goes on
            self._said_nonfinite_held_out = True
            self._say(f"warning: the held-out loss at step {self.step} is not finite: some "
                      "held-out frames overflow the model (features far outside the range "
                      "of the training data?); best.h5 is chosen among finite results only")
        if verdict.improved and self.is_root:
            self._check_run_dir("best.h5")
            save_best_model(self.run_dir, self.net, class_priors=self.manifest.class_priors(),
                            result=result, step=self.step, select_by=self.selection.select_by)
        restarted = {"restarted_from_frames": verdict.restarted_from_frames} \
            if verdict.restarted_from_frames else {}
        self._record("selection", step=self.step, best=verdict.improved,
                     since_gain=verdict.since_gain, best_step=self.selection.best_step,
                     best_value=self.selection.best_value, select_by=self.selection.select_by,
                     **restarted)

    def _stops_early(self) -> bool:
        """training.early_stop: True (with a line) when patience has run out."""
        verdict = self._verdict
        if verdict is None or not verdict.stop:
            return False
        es = self.cfg.training.early_stop
        self._say(f"early stop at step {self.step}: {verdict.since_gain} held-out "
                  f"evaluation(s) without a gain of more than {es.min_delta:g} in "
                  f"{self.selection.select_by}; best {self.selection.describe()}")
        self._record("early_stop", step=self.step, since_gain=verdict.since_gain,
                     best_step=self.selection.best_step,
                     best_value=self.selection.best_value)
        return True

    def _transport_reason(self) -> str:
        return self.comm.transport_reason

    def _hosts(self) -> dict:
        """{host: [its ranks]}, hosts in the order of their first rank."""
        hosts: dict = {}
        for rank, (host, _) in enumerate(self.placement):
            hosts.setdefault(host, []).append(rank)
        return hosts

    def _gpus(self):
        """Each rank's CUDA device number on its host, None on the CPU."""
        gpus = [device for _, device in self.placement]
        return None if all(device is None for device in gpus) else gpus

    def dry_run_lines(self) -> list:
        """What a run would say before its first step: its notes (resume) and the
        banner (``train --dry-run`` prints them instead of training)."""
        return list(self._pending_lines) + [self._banner()]

    def _banner(self) -> str:
        cfg, net = self.cfg, self.net
        device = backend.device_name(self.xp)
        if cfg.device == "gpu":
            reason = self._transport_reason()
            device += (f" ({cfg.precision}), transport {self.transport}"
                       + (f" ({reason})" if reason else ""))
        elif cfg.precision != "fp32":
            device += f" ({cfg.precision} products emulated)"
        hosts = self._hosts()
        per_host = sorted({len(ranks) for ranks in hosts.values()})
        where = (f" on {len(hosts)} hosts ({'-'.join(map(str, per_host))} per host)"
                 if len(hosts) > 1 else "")
        return (f"mpitrain: {self.comm.size} rank(s){where}, device {device}, "
                f"strategy {self.strategy.name}, optimizer {self.optimizer.name}; model "
                f"{model_shape(cfg.model, net.input_dim, net.num_classes)} "
                f"({net.num_params:,} params); {self._steps_said()}")

    def _steps_said(self) -> str:
        """The banner's steps: per rank in lock step; the server's updates from its
        clients' own steps; asynchronous ADPSGD's budget of all ranks together."""
        minibatch = self.cfg.training.minibatch
        if not self._takes_own_steps():
            return (f"{self.steps_per_epoch} steps/epoch of {minibatch} frames per rank, "
                    f"{self.total_steps} steps")
        counts = [n for n in self._own_counts if n is not None]
        low, high = min(counts), max(counts)
        each = f"{low}" if low == high else f"{low}-{high}"
        if self.budget:
            return (f"{each} steps/epoch of {minibatch} frames per rank, {self.budget} steps "
                    f"of all ranks together (about {self.total_steps} per rank)")
        return (f"{sum(counts)} updates/epoch from {len(counts)} client(s) ({each} steps/epoch "
                f"of {minibatch} frames each), {self.total_steps} updates")

    def dry_run_done(self) -> None:
        """Every rank has finished a dry run alike: :meth:`close` then frees what the
        strategy split off, as after a run (MPI's finalize said the world
        communicator still had references)."""
        self._ran = True

    def close(self) -> None:
        self.stream.close()
        self.optimizer.close()
        if self._ran or self._stopped_together:
            # after a run that ended on every rank alike (freeing what the strategy
            # split off is collective: a rank that failed alone must not wait there)
            self.strategy.close()
        if self.log is not None:
            self.log.close()
        if self._lock is not None:
            self._lock.release()


def model_shape(model, input_dim: int, num_classes: int) -> str:
    """The network's shape in the usual notation: ``440-3x512-120``; a p-norm layer's
    groups as ``3x2000/400`` (its input and output widths); no hidden layers:
    ``440-120``.

    Example::

        model_shape(cfg.model, 440, 120)        # '440-3x512-120'
    """
    if model.hidden_layers == 0:
        return f"{input_dim}-{num_classes}"
    hidden = f"{model.hidden_layers}x{model.hidden_dim}"
    if model.nonlinearity == "pnorm":
        hidden += f"/{model.pnorm_output_dim}"
    return f"{input_dim}-{hidden}-{num_classes}"


def _shown_setting(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
