"""Where a run continues from: checkpoints chosen, loaded and restored, and runs
that had ended.

The trainer's state beyond the network is the optimizer's and reader's state
of every rank, the strategy's state, and the trainer's scalars (divergence
counts, the schedule's and the model selection's state, the plan's step counts,
the directories the corpus paths named, whether the run ended).  ``--resume``
restores what fits: all of it on the same number of ranks and settings; on
another number of ranks the data is re-planned and per-rank state starts
afresh; with accepted changes a part whose state does not fit starts afresh.
:class:`CheckpointResume` is the part of :class:`~mpitrain.train.trainer.Trainer`
that does this.
"""

from __future__ import annotations

import contextlib
import os

from .. import backend
from ..config import config_from_yaml
from ..h5io import open_h5_for_reading
from ..nn.model_file import BEST_MODEL, ModelMismatchError, save_model
from ..parallel.registry import takes_own_steps
from ..state_fields import count, flag, is_integer
from .checkpoint import list_checkpoints, load_checkpoint
from .errors import TrainingError
from .run_dir import (corpus_identity, corpus_places, init_from_identity,
                      no_checkpoint_way, resume_changes)
from ..words import plural, shown

#: Prefixes of the schedule's and the model selection's scalars in the
#: checkpoint's group 'trainer'.
SCHEDULE_PREFIX = "schedule_"
SELECTION_PREFIX = "selection_"


def copied_state(state):
    """``state`` with every array in its dicts and lists copied (the rest as it is).

    Example::

        copied_state({"delta": momentum, "num_steps": 3})["delta"] is momentum   # False
    """
    if isinstance(state, dict):
        return {key: copied_state(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(copied_state(value) for value in state)
    if hasattr(state, "shape") and hasattr(state, "copy"):
        return state.copy()
    return state


def later_best_model(path: str, select_by: str, after_step: int):
    """(figure, step, held-out frames) of the best model at ``path`` when it was
    selected by ``select_by`` after step ``after_step``; else None (no file, or
    one that cannot be read: the model loaders name its damage)."""
    if not os.path.isfile(path):
        return None
    try:
        with open_h5_for_reading(path, "model") as f:
            attrs = dict(f.attrs)
        step = int(attrs["selected_at_step"])
        value = float(attrs[f"selected_dev_{select_by}"])
        frames = int(attrs.get("selected_dev_frames", 0))
        if str(attrs["selected_by"]) != select_by or step <= after_step:
            return None
    except (OSError, ValueError, TypeError, OverflowError, KeyError, RuntimeError):
        return None
    return value, step, frames


def checked_plan(trainer_state: dict, step: int) -> dict:
    """The plan's counts in a checkpoint's trainer state, checked against what the
    trainer writes at ``step``: ``planned_steps`` and ``steps_per_epoch`` at least 1
    (0: a checkpoint from before they were stored), ``complete_at`` 0 (not ended)
    or at least 1, ``stopped_early`` a flag.  ValueError naming the field."""
    where = "the trainer's state"
    plan = {key: count(trainer_state, key, where, low=low) if key in trainer_state else 0
            for key, low in (("planned_steps", 1), ("steps_per_epoch", 1), ("complete_at", 0))}
    plan["stopped_early"] = flag(trainer_state, "stopped_early", where, default=0)
    if plan["stopped_early"] and not plan["complete_at"]:
        raise ValueError(f"{where}: field 'stopped_early' is 1 in a run that had not ended "
                         "(no 'complete_at')")
    return plan


def check_reader_against_step(reader: dict, steps_per_epoch: int, step: int) -> None:
    """A rank's reader in lock step reads one minibatch a step at most: it stands no
    further than ``step`` minibatches in (``epoch * steps_per_epoch + steps_in_epoch``);
    ValueError naming the field otherwise (a missing one: the reader's own check)."""
    read = _minibatches_read(reader, steps_per_epoch)
    if read is not None and read > step:
        raise ValueError(f"field 'epoch': epoch {shown(reader['epoch'])} and "
                         f"{shown(reader['steps_in_epoch'])} steps into it ({steps_per_epoch} "
                         f"steps an epoch) is past the checkpoint's step {step}")


def _minibatches_read(reader, steps_per_epoch: int):
    """How many minibatches a saved reader stands in, as a Python int (no int64
    overflow of a forged epoch); None where its fields are missing or not integers
    (the reader's own check names them)."""
    if not isinstance(reader, dict):
        return None
    epoch, into = reader.get("epoch"), reader.get("steps_in_epoch")
    if not (is_integer(epoch) and is_integer(into)):
        return None
    return int(epoch) * steps_per_epoch + int(into)


def check_reader_against_own_steps(reader: dict, own_steps, steps_per_epoch: int) -> None:
    """Asynchronous ADPSGD: a rank reads one minibatch for each of its own steps (a
    re-plan seeks its reader to them too), so its reader stands exactly
    ``own_steps`` minibatches in; ValueError naming the field otherwise (a missing
    or malformed field: the reader's or the strategy's own check)."""
    read = _minibatches_read(reader, steps_per_epoch)
    if read is None or not is_integer(own_steps):
        return
    if read != int(own_steps):
        raise ValueError(f"field 'epoch': epoch {shown(reader['epoch'])} and "
                         f"{shown(reader['steps_in_epoch'])} steps into it ({steps_per_epoch} "
                         f"steps an epoch) is not the rank's own {shown(own_steps)} steps "
                         "(field 'strategy/own_steps')")


def check_own_steps_against_step(own_steps: list, step: int) -> None:
    """Asynchronous ADPSGD writes its checkpoints at the mean of the ranks' own steps
    (``own_steps``, one per rank; None where a rank's state holds none, an older
    file: not judged); ValueError naming the field otherwise."""
    if not own_steps or any(steps is None for steps in own_steps):
        return
    mean = sum(own_steps) // len(own_steps)
    if mean != step:
        raise ValueError(f"field 'ranks/*/strategy/own_steps': the ranks' own steps "
                         f"{shown(list(own_steps))} make step {mean} (their mean), not the "
                         f"checkpoint's step {step}")


def best_model_problem(path: str, checkpoint_path: str) -> str | None:
    """Why ``path`` (the run's best.h5) cannot hold a best model of the run whose
    checkpoint is ``checkpoint_path``: missing, unreadable, or a model of other
    layers (another run's file copied in); None when it can."""
    if not os.path.isfile(path):
        return "is missing"
    try:
        with open_h5_for_reading(path, "model") as f:
            theirs = dict(f.attrs)
        with open_h5_for_reading(checkpoint_path, "checkpoint") as f:
            ours = dict(f["model"].attrs)
    except (OSError, ValueError, TypeError, KeyError, RuntimeError):
        return "cannot be read"
    for key in ("feat_dim", "left_context", "right_context", "components"):
        if str(theirs.get(key)) != str(ours.get(key)):
            return f"is not a model of this run (its {key} differs), another run's file"
    return None


class CheckpointResume:
    """Checkpoint state out of and back into a :class:`~mpitrain.train.trainer.Trainer`
    (a base class of it: the methods use the trainer's attributes)."""

    def _state_snapshot(self) -> dict:
        """This rank's whole training state, on the host (the start of the run): copies,
        since on the CPU the parts' state_dict() hands out their live buffers (the
        momentum, BMUF's block start), which training then changes."""
        return copied_state({"params": backend.to_host(self.net.params),
                        "optimizer": self.optimizer.state_dict(),
                        "reader": self.stream.state_dict(),
                        "strategy": self.strategy.state_dict(), "step": self.step,
                        "frames_seen": self.frames_seen,
                        "schedule": self.schedule.state_dict()})

    def _trainer_state(self) -> dict:
        schedule = {SCHEDULE_PREFIX + k: v for k, v in self.schedule.state_dict().items()}
        selection = {SELECTION_PREFIX + k: v for k, v in self.selection.state_dict().items()}
        # the final checkpoint says the run ended there (and with how many steps planned)
        complete = {} if self._complete_at is None else {
            "complete_at": self._complete_at, "stopped_early": int(self._stopped_early)}
        return {**self.guard.state_dict(), "planned_steps": self.planned_steps,
                "steps_per_epoch": self.steps_per_epoch, **schedule, **selection, **complete,
                **corpus_places(self.cfg), **self._corpus_identity()}

    def _corpus_identity(self) -> dict:
        # (data.dev may change on resume: only the training corpus is compared)
        if getattr(self, "_stack_identity", None) is None:
            # (read once: the stack is not written while the run uses it)
            self._stack_identity = init_from_identity(self.cfg)
        return {**corpus_identity({"data.train": self.manifest}), **self._stack_identity}

    def _leave_complete_run(self) -> dict:
        """``--resume`` of a run that had ended, with nothing that asks for more: the
        final model stands (written from the final checkpoint if it is missing)."""
        ckpt_step, best, old_planned, stopped_early = self._complete
        final = os.path.join(self.run_dir, "final.h5")
        if self.is_root and not os.path.exists(final):
            save_model(final, self.net, class_priors=self.manifest.class_priors())
            self._say(f"resume: wrote {final} from the final checkpoint")
            # the run's end, which writing final.h5 had failed to reach (a full disk):
            # `status` reads it from here on
            self._record("end", steps=ckpt_step, frames=self.frames_seen,
                         final_written_on_resume=True, **best)
        where = ""
        if old_planned and old_planned != self.planned_steps:
            # another number of ranks or minibatch: say where that end lies on this
            # job's plan, which settings must pass for anything to be trained
            where = (f" of {old_planned} planned, which is step "
                     f"{int(round(ckpt_step * self.planned_steps / old_planned))} of this "
                     f"job's {self.planned_steps} (it would end at step {self.total_steps})")
        if stopped_early == "schedule":
            how = "the newbob schedule had stopped it at an epoch's end"
        elif stopped_early:
            # (its count of evaluations without a gain is kept: more epochs alone
            # stop again at the next evaluation without one)
            how = ("training.early_stop had stopped it at a held-out evaluation, so a higher "
                   "training.max_steps changes nothing; raise training.early_stop.patience "
                   "(--accept-changes) to go on")
        else:
            # (more epochs change the result: without --accept-changes the
            # resume would be refused)
            how = "raise training.epochs (--accept-changes) or training.max_steps to go on"
        self._say(f"resume: the run had ended at step {ckpt_step}{where}; nothing to train "
                  f"({how})")
        return {"steps": ckpt_step, "frames": self.frames_seen, "seconds": 0.0,
                "complete": True, **best}

    def _choose_checkpoint(self, *, judge_settings: bool = True):
        """Rank 0 picks the newest checkpoint that verifies and compares its settings
        with the config; every rank loads that one (after the settings are accepted,
        so that a changed model size is named by its key, not found by the load).
        ``judge_settings``: refuse changes not accepted (a roll back judges none)."""
        chosen, num_ranks, notes, problem, changes = None, 0, [], None, []
        if self.is_root:
            found = list_checkpoints(self.run_dir)
            # (a job that still wrote here until the lock was ours: _open_run_dir)
            self.checkpoints_seen = {os.path.basename(path) for path in found}
            if not found:
                way = no_checkpoint_way(self.run_dir, "final.h5")
                problem = f"{self.run_dir}: no checkpoint (ckpt-*.h5) to continue from; {way}"
            for path in reversed(found):
                try:
                    header = load_checkpoint(path, ranks=[])
                except (ValueError, OSError) as exc:
                    # (one line: HDF5's messages hold line breaks)
                    notes.append(f"skipped {os.path.basename(path)}: "
                                 + " ".join(str(exc).split()))
                    continue
                chosen, num_ranks = path, header.num_ranks
                try:
                    changes, moved = resume_changes(config_from_yaml(header.config_yaml),
                                                    self.cfg, header.trainer_state,
                                                    self._corpus_identity())
                    # (training never reads the pretraining's settings: a config shared
                    # with `pretrain` may change them)
                    changes = [c for c in changes if not c.startswith("pretrain.")]
                    notes += moved
                except ValueError as exc:
                    problem = f"{path}: the stored config: {' '.join(str(exc).split())}"
                break
            if found and chosen is None and all("mpitrain-pretrain-checkpoint" in note
                                                for note in notes):
                # (each checkpoint "not an mpitrain checkpoint": an RBM stack's)
                problem = (f"{self.run_dir}: a pretraining run's directory (its checkpoints "
                           "are RBM stacks'); train from it in a run directory of its own "
                           f"with --set model.init_from={self.run_dir}/pretrain.h5")
            elif found and chosen is None:
                problem = (f"{self.run_dir}: no checkpoint verifies; tried "
                           + "; ".join(notes))
        chosen, num_ranks, notes, problem, changes = self.comm.bcast_obj(
            [chosen, num_ranks, notes, problem, changes], root=0)
        if problem:
            raise TrainingError(problem, agreed=True)
        if changes and judge_settings and not self.accept_changes:
            raise TrainingError(
                f"{chosen}: --resume with settings that change the result: "
                + "; ".join(changes) + " (restore them, or pass --accept-changes)", agreed=True)
        mine = [self.comm.rank] if num_ranks == self.comm.size else []
        ckpt, error = None, None
        # (rank 0's path is relative to its own working directory, which another
        # rank's need not be: that rank's run directory names the same place)
        here = chosen if self.is_root else os.path.join(self.run_dir, os.path.basename(chosen))
        try:
            ckpt = load_checkpoint(here, ranks=mine, into=self.net)
        except ModelMismatchError as exc:      # (accepted changes of the model settings)
            error = ValueError(f"{exc}; a resumed run keeps its network: restore the model "
                               "settings, or train in a new run directory")
        except (ValueError, OSError) as exc:
            error = exc
        # a model the config does not build fails on every rank alike: one line from
        # rank 0; a rank that alone cannot read the file aborts the job
        failed = int(self.comm.allreduce_scalar(0 if error is None else 1, op="sum"))
        if error is not None:
            raise TrainingError(str(error), agreed=failed == self.comm.size) from None
        return ckpt, notes, changes

    def _resume(self) -> None:
        ckpt, notes, changes = self._choose_checkpoint()
        try:
            plan = checked_plan(ckpt.trainer_state, ckpt.step)
        except ValueError as exc:
            # (the same group on every rank: all refuse it alike)
            raise TrainingError(f"{ckpt.path}: {exc}", agreed=True) from None
        for line in notes:
            self._say(f"resume: {line}")
        if changes:
            self._say("resume: settings changed (--accept-changes): " + "; ".join(changes))
            self._record("config_change", changes=changes)
        complete_at = plan["complete_at"]
        old_planned = plan["planned_steps"] or complete_at
        # compared as fractions of the plans: another number of ranks plans other counts
        asks_more = complete_at and self.total_steps * old_planned > \
            complete_at * self.planned_steps
        if complete_at:
            # rank 0's plan judges it (the one the checkpoint recorded): a parameter
            # server's clients plan their own steps, and one whose cap bound otherwise
            # trained on alone while the others had left
            asks_more = self.comm.bcast_obj(bool(asks_more), root=0)
        if complete_at and not changes and not asks_more:
            # a requeued job's --resume of a run that had ended: leave its results alone
            self.step, self.frames_seen = ckpt.step, ckpt.frames_seen
            try:
                self._load_selection_state(ckpt)
            except ValueError as exc:
                raise TrainingError(f"{ckpt.path}: {exc}", agreed=True) from None
            best = {} if self.selection.best_step < 0 else {
                "best_step": self.selection.best_step, "best_value": self.selection.best_value,
                "select_by": self.selection.select_by}
            early = "" if not plan["stopped_early"] else \
                "schedule" if ckpt.trainer_state.get(SCHEDULE_PREFIX + "stopped") else "eval"
            self._complete = (ckpt.step, best, old_planned, early)
            return
        self._restore(ckpt, settings_changed=bool(changes))
        # (a roll back restores a checkpoint too, but keeps the best model found since)
        # (another training.select_by: its best value is not one of the new figure's)
        if self._load_part(ckpt, "the model selection (best.h5, early stopping)",
                           self._load_selection_state, bool(changes)):
            self._keep_a_later_best_model(ckpt)
        self._say(f"resumed from {ckpt.path} at step {self.step}")

    def _keep_a_later_best_model(self, ckpt) -> None:
        """A run cut off (killed, its node lost) after it wrote best.h5 past the
        checkpoint leaves a best model the checkpoint's selection does not know:
        as after a roll back, it stays the best so far, so that what the run says
        of best.h5 is what the file holds."""
        found = problem = None
        path = os.path.join(self.run_dir, BEST_MODEL)
        if self.is_root and (self.selection.best_step >= 0 or os.path.lexists(path)):
            problem = best_model_problem(path, ckpt.path)
        problem = self.comm.bcast_obj(problem, root=0)
        if problem:
            # the model selected before is lost: the next evaluation's becomes best.h5
            # (early stopping counts on from the checkpoint, as before)
            lost = (f"; the model selected before ({self.selection.describe()}) is lost"
                    if self.selection.best_step >= 0 else "")
            self.selection.forget_best()
            self._say(f"resume: {path} {problem}{lost}; the next held-out evaluation "
                      f"writes {BEST_MODEL}")
            return
        if self.is_root:
            found = later_best_model(path, self.selection.select_by, ckpt.step)
        found = self.comm.bcast_obj(found, root=0)
        if found and self.selection.keep_later_best(*found):
            value, step, _ = found
            self._say(f"resume: {BEST_MODEL} holds the model selected at step {step} "
                      f"(held-out {self.selection.select_by} {value:.4f}), past the "
                      "checkpoint; it stays the best so far")

    def _restore(self, ckpt, *, settings_changed: bool = False) -> None:
        """Continue from a loaded checkpoint (its model is already in the network).

        ``settings_changed`` (``--resume --accept-changes``): a part whose saved
        state does not fit the new settings (another method, optimizer or
        schedule, momentum switched on) starts afresh, and the log says so."""
        try:
            self.guard.load_state_dict(ckpt.trainer_state)
        except ValueError as exc:
            raise TrainingError(f"{ckpt.path}: {exc}", agreed=True) from None
        self._load_part(ckpt, "the rate schedule", self._load_schedule_state, settings_changed)
        self.strategy.bind(self.net)
        if self._load_part(ckpt, "the parallel method's state",
                           lambda c: self.strategy.load_state_dict(c.strategy_state),
                           settings_changed):
            self.strategy.resume(self.net)
        else:
            self.strategy.setup(self.net, self.optimizer)    # from the checkpoint's model
        self.frames_seen = ckpt.frames_seen
        replanned = self._data_plan_change(ckpt)
        if not replanned:
            state = ckpt.rank_state(self.comm.rank)
            self._load_part(ckpt, "the optimizer state",
                            lambda c: self.optimizer.load_state_dict(state["optimizer"]),
                            settings_changed, every_rank=False)
            own_steps = self._saved_own_steps(state)
            try:
                if not self._takes_own_steps():
                    check_reader_against_step(state["reader"], self.steps_per_epoch, ckpt.step)
                elif own_steps is not None:
                    check_reader_against_own_steps(state["reader"], own_steps,
                                                   self.steps_per_epoch)
                self.stream.load_state_dict(state["reader"])
            except ValueError as exc:
                raise ValueError(f"{ckpt.path}: ranks/{self.comm.rank:05d}/reader: "
                                 f"{exc}") from None
            self._resumed_window = state.get("window")
            loaded = self._load_part(ckpt, "the parallel method's per-rank state",
                                     lambda c: self.strategy.load_rank_state_dict(
                                         state.get("strategy", {})), settings_changed,
                                     every_rank=False)
            if self._each_rank_own_pace():
                # (collective, on every rank alike whatever its state holds; every rank
                # gets the same list: all refuse a file alike)
                every = self.comm.allgather_obj(
                    int(own_steps) if loaded and own_steps is not None else None)
                try:
                    check_own_steps_against_step(every, ckpt.step)
                except ValueError as exc:
                    raise TrainingError(f"{ckpt.path}: {exc}", agreed=True) from None
            self.step = ckpt.step
            return
        # N -> M ranks, or settings that split the data otherwise: the data was
        # re-planned; the same fraction of the schedule is done; per-rank state
        # cannot carry over.
        old_planned = checked_plan(ckpt.trainer_state, ckpt.step)["planned_steps"]
        if old_planned <= 0:
            raise TrainingError(
                f"{ckpt.path}: {replanned}, and the checkpoint predates re-planning the "
                "data on resume; resume with the same number of ranks and settings",
                agreed=True)
        # (not capped by training.max_steps: a step past it trains nothing here, and the
        # checkpoint keeps the place a later resume with a higher limit goes on from)
        # The passes over the data already trained are kept: with training.epochs
        # accepted as changed, the same fraction of the new plan would count a longer
        # plan's share as trained (an ended run given more epochs trained nothing).
        scale = self._epochs_scale(ckpt)
        self.step = int(round(ckpt.step * self.planned_steps * scale / old_planned))
        if not self._takes_own_steps():
            self.stream.seek(self.step // self.steps_per_epoch,
                             self.step % self.steps_per_epoch)
        elif self.cfg.parallel.method == "adpsgd":
            self._seek_own_steps(ckpt.step * scale / old_planned)
        elif self.cfg.parallel.method == "param_server":
            # (its clients seek in the serving loop, serving.py, from their own counts)
            self.strategy.re_plan_client_steps(self.planned_steps * scale / old_planned)
        self._say(f"resume: {replanned}: data re-planned over "
                  f"{plural(self.comm.size, 'rank')}, step "
                  f"{ckpt.step} of {old_planned} becomes {self.step} of {self.planned_steps}, "
                  "optimizer state (momentum, natural-gradient statistics) starts afresh")
        self._record("rank_change", from_ranks=ckpt.num_ranks, to_ranks=self.comm.size,
                     from_step=ckpt.step, to_step=self.step)

    def _each_rank_own_pace(self) -> bool:
        """Asynchronous ADPSGD: each rank counts its own steps (a parameter server's
        clients are counted by the server)."""
        return self._takes_own_steps() and self.cfg.parallel.method == "adpsgd"

    def _saved_own_steps(self, rank_state: dict):
        """The steps this rank had taken at the checkpoint, where each rank takes its
        own (asynchronous ADPSGD); None for another method or an older file."""
        if not self._each_rank_own_pace():
            return None
        saved = rank_state.get("strategy")
        return saved.get("own_steps") if isinstance(saved, dict) else None

    def _epochs_scale(self, ckpt) -> float:
        """The checkpoint's training.epochs over this job's: the share of the old plan
        that was trained, times this, is the share of the new plan (1.0 when alike)."""
        try:
            saved = config_from_yaml(ckpt.config_yaml)
        except ValueError:
            return 1.0          # (judged already: changes were accepted or none made)
        return saved.training.epochs / self.cfg.training.epochs

    def _data_plan_change(self, ckpt) -> str:
        """Why the checkpoint's reader positions do not fit this job's data plan
        ('' when they do): another number of ranks, or accepted changes that split
        or step through the data otherwise (minibatch, chunk size, a parameter
        server's shares, each rank at its own pace)."""
        if ckpt.num_ranks != self.comm.size:
            return f"written by {plural(ckpt.num_ranks, 'rank')}, continuing on {self.comm.size}"
        try:
            saved = config_from_yaml(ckpt.config_yaml)
        except ValueError:
            return ""           # (judged already: changes were accepted or none made)
        now = self.cfg

        def shares(cfg):
            return cfg.parallel.servers if cfg.parallel.method == "param_server" else 0

        # another training corpus (its shards or their sizes; not one moved elsewhere,
        # nor new labels of the same shards): the saved reader positions are places in
        # the old corpus's chunks (a checkpoint that predates the digest: not compared)
        digest = "corpus_data.train_digest"
        old_corpus = ckpt.trainer_state.get(digest)
        new_corpus = self._corpus_identity().get(digest)
        changed = [name for name, old, new in (
            ("training.minibatch", saved.training.minibatch, now.training.minibatch),
            ("data.chunk_frames", saved.data.chunk_frames, now.data.chunk_frames),
            # (the seed orders the chunks: a saved position names a chunk of the old order)
            ("training.seed", saved.training.seed, now.training.seed),
            ("the training corpus", old_corpus,
             old_corpus if new_corpus is None or old_corpus is None else new_corpus),
            ("the ranks that read data", shares(saved), shares(now)),
            ("each rank at its own pace", takes_own_steps(saved), takes_own_steps(now)))
            if old != new]
        return f"{', '.join(changed)} changed" if changed else ""

    def _seek_own_steps(self, fraction: float) -> None:
        """Asynchronous ADPSGD after a re-plan: each rank has done the fraction of its
        own planned steps (its own data, its own count) that the job had done of its
        plan; not capped by ``training.max_steps``, as in the lock-step methods."""
        cfg = self.cfg
        planned = max(int(round(cfg.training.epochs * self.steps_per_epoch)), 1)
        own = min(int(round(fraction * planned)), planned)
        self.strategy.own_steps = own
        self.stream.seek(own // self.steps_per_epoch, own % self.steps_per_epoch)

    def _load_part(self, ckpt, what: str, load, settings_changed: bool, *,
                   every_rank: bool = True) -> bool:
        """Load one part's saved state; False when it did not fit changed settings
        and the part starts afresh instead (said in the log).  ``every_rank``: the
        state is the same on every rank, so a failure is every rank's."""
        try:
            load(ckpt)
            return True
        except (ValueError, TrainingError) as exc:
            if not settings_changed:
                if isinstance(exc, TrainingError):
                    raise
                raise TrainingError(f"{ckpt.path}: {exc}", agreed=every_rank) from None
            self._say(f"resume: {what} starts afresh: the checkpoint's does not fit the "
                      f"changed settings ({' '.join(str(exc).split())})")
            return False

    def _load_selection_state(self, ckpt) -> None:
        state = {k[len(SELECTION_PREFIX):]: v for k, v in ckpt.trainer_state.items()
                 if k.startswith(SELECTION_PREFIX)}
        if "by_xent" not in state:      # a checkpoint from before it was stored
            with contextlib.suppress(ValueError):
                saved = config_from_yaml(ckpt.config_yaml).training.select_by
                state["by_xent"] = int(saved == "xent")
        self.selection.load_state_dict(state)

    def _load_schedule_state(self, ckpt) -> None:
        saved = {k[len(SCHEDULE_PREFIX):]: v for k, v in ckpt.trainer_state.items()
                 if k.startswith(SCHEDULE_PREFIX)}
        try:
            self.schedule.load_state_dict(saved)
        except ValueError as exc:
            raise TrainingError(f"{ckpt.path}: {exc}", agreed=True) from None
