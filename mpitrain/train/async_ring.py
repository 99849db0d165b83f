"""The training loop of asynchronous ADPSGD (``parallel.method: adpsgd`` with
``parallel.asynchronous: true``).

Every rank trains at its own pace on its own data, past its own epochs when it
is fast, and mixes through :class:`~mpitrain.parallel.async_adpsgd.AsyncRingMixing`.
No collective can run while the ranks take their own numbers of steps, so:

- each rank sends rank 0 a progress report after every step (its steps, its
  frames and communication seconds; every ``log_interval`` of its steps also its
  loss sums, the one read of the device, as in a synchronous log line);
- rank 0, which trains too, writes the progress records from the reports,
  evaluates its own model on the whole held-out set, and calls the quiet
  points: a checkpoint at each ``training.checkpoint_interval`` of steps per
  rank, and the end once the ranks' steps together reach the job's budget
  (``training.epochs`` of every rank's own data, capped by
  ``training.max_steps`` per rank: the frames a synchronous run would train);
- a rank that a signal asked to stop (train/stop.py) says so in its next
  report; rank 0 then calls the end of this attempt as it calls a quiet point,
  and the trainer writes its checkpoint there (rank 0's own signal counts at
  once while it waits for the end and after its evaluation);
- the mixes also carry every rank's step count as its sender last heard of it
  (parallel/async_adpsgd.py): a rank other than 0 that can tell from them that
  the budget is reached takes no further step and waits for rank 0's call,
  answering its partners meanwhile; rank 0, slow or evaluating, saw the end
  only between its own steps, and the others trained on until then; rank 0
  also sends the counts to every rank after each of its turns, and near the end
  every rank does after each step (the mixes bring them late);
- at a quiet point rank 0 sends every rank ``HALT``; each rank, at the end of
  its step, finishes its exchanges (``quiesce``), and then all meet in the
  collective (the checkpoint's gather, or the end's average); at a checkpoint
  they go on together once rank 0 has written it.  A quiet point waits for the
  slowest rank's current step, not for its step count.

The learning rate of a rank's k-th step is the schedule's at min(k, planned
steps per rank): a fast rank reaches the final rate sooner.

Example::

    # in Trainer._train_to_end, for asynchronous ADPSGD
    return train_at_own_pace(trainer, run_start)
"""

from __future__ import annotations

import numpy as np

from ..comm.base import ANY_SOURCE
from .checkpoint_clock import CheckpointClock
from .divergence import ROLL_BACK, Diverged, restart_advice
from .evaluate import WholeHeldOut
from .metrics import epoch_of_step, format_duration, resident_mb
from .stop import STOPPED, requested

#: Message tags: a progress report to rank 0, a quiet point's call from rank 0.
REPORT_TAG, HALT_TAG = 7420, 7421
#: Report kinds.
PROGRESS, FINAL = 1.0, 2.0
#: Halt kinds: a checkpoint, the end, the end on a signal (a checkpoint follows).
CHECKPOINT, STOP, SIGNALLED = 1.0, 2.0, 3.0
# report: kind, steps, frames, loss sum, correct, frames, skipped, comm seconds,
# the stop signal's code (stop.py; 0: none)
_REPORT_SIZE = 9
#: From this many steps per rank before the budget on (in the steps a rank knows of,
#: or its own steps times the ranks) every rank spreads its counts to every rank
#: after each step: all-to-all messages every step, enough warning to stop near the
#: budget (a rank judges it from its own view, which may be stale), cheap over a run.
NEAR_THE_END_STEPS_PER_RANK = 16
#: Rank 0 waits for an end it foresaw at most this many times the time it foresaw
#: it in (its step or its evaluation), then steps on.
WAIT_SLACK = 2.0


def near_the_end(budget: int, ranks: int) -> float:
    """The steps of all ranks together from which every rank spreads its counts."""
    return max(0, budget - NEAR_THE_END_STEPS_PER_RANK * ranks)


def plan_ring_steps(cfg, rank: int, counts) -> tuple:
    """(own steps per epoch, job budget, planned steps per rank) of ``rank``, from
    every rank's own minibatch count per epoch (``counts``); the budget is the sum
    over the ranks of their planned steps (``training.epochs`` of their own data,
    each capped at ``training.max_steps``).

    Example::

        plan_ring_steps(cfg, 0, [120] * 4)     # (120, 1440, 360) for 3 epochs
    """
    counts = [int(n) for n in counts]
    empty = [r for r, n in enumerate(counts) if n == 0]
    if empty:
        raise ValueError(f"rank {empty[0]} has no complete minibatch of "
                         f"{cfg.training.minibatch} frames; lower training.minibatch, raise "
                         "data.chunk_frames, or use fewer ranks")
    epochs, cap = cfg.training.epochs, cfg.training.max_steps
    planned = [max(int(round(epochs * n)), 1) for n in counts]
    budget = sum(min(p, cap) if cap else p for p in planned)
    return counts[rank], budget, max(sum(planned) // len(counts), 1)


def train_at_own_pace(trainer, run_start: float):
    """Train until rank 0 calls the end; every rank returns there together: None,
    or ``STOPPED`` when a signal ended it (``trainer._stop`` then says which).

    Example::

        train_at_own_pace(trainer, run_start=trainer.comm.wtime())
    """
    return OwnPaceLoop(trainer, run_start).run()


class OwnPaceLoop:
    """One rank's loop; rank 0's also keeps the job's progress (module docstring)."""

    def __init__(self, trainer, run_start: float):
        t = self.t = trainer
        self.run_start = run_start
        self.comm, self.ring = t.comm, t.strategy
        self._report = np.zeros(_REPORT_SIZE)
        self._halt = np.zeros(1)
        self._comm_at_report = self.comm.comm_time
        self.own_frames = self.ring.own_steps * t.cfg.training.minibatch
        # rank 0: every rank's steps and frames as last reported, and the window's sums
        # (from a resumed checkpoint, each rank's own; collective)
        counts = self.comm.allgather_obj([self.ring.own_steps, self.own_frames])
        self.steps_of = [int(s) for s, _ in counts]
        self.frames_of = [int(f) for _, f in counts]
        self.ring.note_counts(self.steps_of)
        self.finished = set()
        self.signalled = {}          # rank 0: rank -> the stop signal's code it reported
        self._new_window()
        self._dev = None
        # rank 0: when its last turn ended, the others' steps then, and how long its
        # last evaluation took (the end is foreseen from them: _end_is_near)
        self._turn_end, self._others_then = self.comm.wtime(), self._others()
        self._eval_seconds = 0.0

    # -- every rank ------------------------------------------------------------------
    def run(self):
        t, ring = self.t, self.ring
        step = t._new_training_step()
        self.training_step = step
        cap = max(t.planned_steps - 1, 0)
        if self.comm.rank == 0:
            self._set_marks()
        while True:
            if self.comm.rank != 0 and ring.known_steps() >= t.budget:
                halt = self._wait_for_the_call()
            elif self.comm.rank == 0:
                self._step(cap)
                halt = self._root_turn()
            else:
                self._step(cap)
                halt = self._halt_called()
                if halt is None:
                    # every step (a few bytes): rank 0's view of the job
                    self._send_report(PROGRESS)
                    self._share_counts()
            if halt == CHECKPOINT:
                self._checkpoint()
            elif halt == STOP:
                self._end()
                return None
            elif halt == SIGNALLED:
                self._end()
                code, ranks = self.comm.bcast_obj(
                    [min(self.signalled.values()), len(self.signalled)]
                    if self.comm.rank == 0 else None, root=0)
                t._stop = (code, ranks)
                return STOPPED

    def _step(self, cap: int) -> None:
        t, ring = self.t, self.ring
        rate = t.guard.lr_scale * t.schedule.rate(min(ring.own_steps, cap))
        self.rate = self.training_step.run(ring.own_steps, rate, t.stream.next_batch)
        self.own_frames += self.training_step.minibatch

    def _share_counts(self) -> None:
        """After a step: merge the counts the others spread, and spread this rank's
        (rank 0's, from every report, after each of its turns; every rank's near the
        end).  A rank hears the others' counts otherwise only through its mixes: one
        whose request waits on a slow partner heard nothing meanwhile, a far rank's
        counts came a mix per hop later, and with every rank's step times very uneven
        the ranks trained on past the budget."""
        ring = self.ring
        ring.take_news()
        near = near_the_end(self.t.budget, self.comm.size)
        if self.comm.rank == 0 or ring.known_steps() >= near \
                or ring.own_steps * self.comm.size >= near:
            ring.spread_counts()

    def _wait_for_the_call(self):
        """A rank other than 0 that knows the budget is reached (its last step is
        reported): no more steps; it answers its partners until rank 0 calls."""
        while True:
            served = self.ring.serve()
            halt = self._halt_called()
            if halt is not None:
                return halt
            if not served:
                self.comm.idle()

    def _halt_called(self):
        """A non-root rank: rank 0's call, if one came."""
        if self.comm.iprobe(0, HALT_TAG) is None:
            return None
        self.comm.recv(self._halt, 0, tag=HALT_TAG)
        return float(self._halt[0])

    def _send_report(self, kind: float) -> None:
        # the counters every step; the loss sums (a read of the device) every
        # log_interval of this rank's steps and at the end, as a log line reads them
        if kind == FINAL or self.ring.own_steps % self.t.cfg.training.log_interval == 0:
            loss_sum, correct, frames, skipped = self.training_step.take_sums()
        else:
            loss_sum = correct = frames = skipped = 0
        comm_now = self.comm.comm_time
        report = self._report
        report[:] = (kind, self.ring.own_steps, self.own_frames, loss_sum, correct, frames,
                     skipped, comm_now - self._comm_at_report, requested.code())
        self._comm_at_report = comm_now
        if self.comm.rank == 0:
            self._take(0, report)
        else:
            self.comm.send(report, 0, tag=REPORT_TAG)

    # -- the quiet points ----------------------------------------------------------------
    def _checkpoint(self) -> None:
        t = self.t
        self.ring.quiesce()
        counts = self.comm.allgather_obj([self.ring.own_steps, self.own_frames])
        self.ring.note_counts([s for s, _ in counts])
        t.step = sum(s for s, _ in counts) // self.comm.size
        t.frames_seen = sum(f for _, f in counts)
        reported = None
        if self.comm.rank == 0:
            # (reports sent before the others heard HALT: their sums are out of the
            # ranks' own windows)
            self._drain_reports()
            loss, _, frames, skipped, _ = self.sums
            reported = (loss, frames, skipped)
        good = self.comm.bcast_obj(bool(t.guard.last_window_good), root=0)
        # and the part of the window under way: the sums reported to rank 0 since
        # its last log line and those every rank has not reported yet (the lock-step
        # rule; judged by the last whole window alone, a checkpoint written inside a
        # bad stretch was the model a resume went on from)
        if good:
            good = t._window_so_far_good(reported)
        if good and t._params_finite():
            t.save_checkpoint()
        else:
            t._say(f"step {t.step}: checkpoint not written (the model is diverging or "
                   "not finite)")
        # every rank waits while rank 0 writes the file, as at a synchronous method's
        # checkpoint: the others stepped on meanwhile, so rank 0 fell behind, saw the
        # end of the budget late and the ranks hardly mixed
        self.comm.barrier()

    def _end(self) -> None:
        t = self.t
        self._send_report(FINAL)
        self.ring.quiesce()
        self.ring.end_news()
        if self.comm.rank == 0:
            while len(self.finished) < self.comm.size:
                found = self.comm.iprobe(ANY_SOURCE, REPORT_TAG)
                if found is None:
                    self.comm.idle()
                    continue
                self._receive_report(found[0])
            self._log()
        t.step, t.frames_seen = self.comm.bcast_obj(
            [sum(self.steps_of) // self.comm.size, sum(self.frames_of)]
            if self.comm.rank == 0 else None, root=0)

    # -- rank 0: the job's progress ------------------------------------------------------
    def _new_window(self) -> None:
        self.window_start = self.comm.wtime()
        self.frames_at_window = sum(self.frames_of)
        self.sums = np.zeros(5)      # loss, correct, their frames, skipped, comm seconds
        self.window_steps = 0

    def _set_marks(self) -> None:
        t, cfg = self.t, self.t.cfg
        per_rank = sum(self.steps_of) // self.comm.size
        frames_per_rank = sum(self.frames_of) // self.comm.size
        self.next_log = (per_rank // cfg.training.log_interval + 1) * cfg.training.log_interval
        every = cfg.training.eval_interval
        self.eval_every = every
        self.next_eval = (frames_per_rank // every + 1) * every if every else \
            (per_rank // t.steps_per_epoch + 1) * t.steps_per_epoch
        ck = cfg.training.checkpoint_interval
        self.next_checkpoint = (per_rank // ck + 1) * ck if ck else 0
        self.clock = CheckpointClock(self.comm, cfg.training.checkpoint_minutes)

    def _drain_reports(self) -> None:
        """Take every report that has come.  One empty poll is not enough: MPI may
        move only some of many small messages per progress call, and a lagging
        view of the ranks' steps makes the quiet points late."""
        empty = 0
        while empty < 2:
            found = self.comm.iprobe(ANY_SOURCE, REPORT_TAG)
            if found is None:
                empty += 1
                continue
            empty = 0
            self._receive_report(found[0])

    def _receive_report(self, source: int) -> None:
        self.comm.recv(self._report, source, tag=REPORT_TAG)
        self._take(source, self._report)

    def _take(self, source: int, report) -> None:
        kind, steps, frames, loss, correct, window_frames, skipped, comm_s, signal = report
        if signal:
            self.signalled.setdefault(source, int(signal))
        self.window_steps += int(steps) - self.steps_of[source]
        self.steps_of[source], self.frames_of[source] = int(steps), int(frames)
        self.ring.note_count(source, int(steps))
        self.sums += (loss, correct, window_frames, skipped, comm_s)
        if kind == FINAL:
            self.finished.add(source)

    def _root_turn(self):
        """Rank 0 after each of its steps: take the reports, log, evaluate, and call a
        quiet point when one is due (returns its kind, or None)."""
        t, comm = self.t, self.comm
        self._send_report(PROGRESS)
        self._drain_reports()
        self._share_counts()
        # the others step on while rank 0 steps or evaluates: when they would reach
        # the budget meanwhile, rank 0 waits for it instead, else it saw the end one
        # slow step (a slow or oversubscribed rank 0) or one evaluation late, and the
        # job trained up to a third more than its budget
        step_seconds = comm.wtime() - self._turn_end
        if self._end_is_near(step_seconds):
            self._wait_for_the_end(step_seconds)
        total = self.ring.known_steps()
        per_rank = sum(self.steps_of) // comm.size
        halt = None
        if total >= t.budget:
            halt = STOP
        if per_rank >= self.next_log and halt is None and self.sums[2]:
            self._log()
            self.next_log = (per_rank // t.cfg.training.log_interval + 1) \
                * t.cfg.training.log_interval
        frames_per_rank = sum(self.frames_of) // comm.size
        mark = frames_per_rank if self.eval_every else per_rank
        # a reported stop signal comes first: the cluster kills the job soon, and an
        # evaluation of a large held-out set could take the grace the checkpoint needs
        if halt is None and mark >= self.next_eval and t.dev_manifest is not None \
                and not self.signalled:
            step = self.eval_every or t.steps_per_epoch
            self.next_eval = (mark // step + 1) * step
            if self._end_is_near(self._eval_seconds) \
                    and self._wait_for_the_end(self._eval_seconds):
                # the end's evaluation of the averaged model comes first
                halt = STOP if self.ring.known_steps() >= t.budget else None
            else:
                started = comm.wtime()
                self._evaluate(per_rank)
                self._eval_seconds = comm.wtime() - started
                # a signal during the evaluation is the stop of this turn, not of the
                # next, after one more step of rank 0
                self._note_own_signal()
        if halt is None and self.signalled:
            halt = SIGNALLED        # (its checkpoint stands for one due now)
        steps_due = self.next_checkpoint and per_rank >= self.next_checkpoint
        if halt is None and (steps_due or self.clock.due()):
            if steps_due:
                ck = t.cfg.training.checkpoint_interval
                self.next_checkpoint = (per_rank // ck + 1) * ck
            self.clock.written()
            halt = CHECKPOINT
        if halt is not None:
            self._halt[0] = halt
            comm.waitall([comm.isend(self._halt, r, tag=HALT_TAG)
                          for r in range(1, comm.size)])
        # the steps the others reported meanwhile (an evaluation's worth) are counted
        # before the pace's start, not as if taken during rank 0's next step, when
        # they foretold an end that was an evaluation or more away
        self._drain_reports()
        self._turn_end, self._others_then = comm.wtime(), self._others()
        return halt

    def _others(self) -> int:
        return self.ring.known_steps() - self.ring.own_steps

    def _end_is_near(self, seconds: float) -> bool:
        """Rank 0: would the other ranks, at their pace since its last turn, reach
        the budget within ``seconds``?"""
        left = self.t.budget - self.ring.known_steps()
        elapsed = self.comm.wtime() - self._turn_end
        done = self._others() - self._others_then
        if left <= 0 or done <= 0 or elapsed <= 0:
            return False
        return done / elapsed * seconds >= left

    def _wait_for_the_end(self, seconds: float) -> bool:
        """Rank 0: take reports, not stepping, until the budget is reached (or a rank
        reports a stop signal); False when that did not come within WAIT_SLACK times
        the ``seconds`` it was foreseen in (rank 0 then goes on).  The pace it was
        foreseen from is that of one turn, and a wrong one (the others slowed down,
        or reports that came together looked like a burst of steps) kept rank 0 from
        stepping, checkpointing and evaluating for up to half of the run.  Nobody
        waits for rank 0 meanwhile: it is an active rank, which only asks."""
        give_up = self.comm.wtime() + WAIT_SLACK * seconds
        while self.ring.known_steps() < self.t.budget and not self.signalled:
            # (its own signal too: it reports one only after its next step, and the
            # wait could outlast the cluster's grace, as a long evaluation would)
            self._note_own_signal()
            if self.signalled:
                break
            if self.comm.wtime() > give_up:
                return False
            found = self.comm.iprobe(ANY_SOURCE, REPORT_TAG)
            if found is None:
                self.comm.idle()
                continue
            self._receive_report(found[0])
        return True

    def _note_own_signal(self) -> None:
        """Rank 0: a stop signal it received since its report counts at once."""
        if requested.code():
            self.signalled.setdefault(0, requested.code())

    def _log(self) -> None:
        t, comm = self.t, self.comm
        if not self.window_steps or not self.sums[2]:
            return          # no loss sums yet in this window: the line waits for them
        now = comm.wtime()
        elapsed = max(now - self.window_start, 1e-9)
        loss, correct, frames, skipped, comm_s = self.sums
        with np.errstate(all="ignore"):       # a NaN window is reported, not warned
            xent = loss / frames
            acc = correct / frames
        t.step = sum(self.steps_of) // comm.size
        t.frames_seen = sum(self.frames_of)
        record = {"step": t.step, "epoch": epoch_of_step(t.step, t.steps_per_epoch),
                  "frames": t.frames_seen, "seconds": now - self.run_start,
                  "xent": float(xent), "acc": float(acc), "lr": self.rate,
                  "frames_per_sec": (sum(self.frames_of) - self.frames_at_window) / elapsed,
                  "comm_fraction": min(1.0, comm_s / comm.size / elapsed),
                  "skipped": int(skipped), "rss_mb": resident_mb(),
                  "steps_min": int(min(self.steps_of)), "steps_max": int(max(self.steps_of)),
                  "mixes": int(self.ring.mixes)}
        verdict = t.guard.observe(xent=float(xent), skipped=int(skipped),
                                  frames=int(frames))
        t.log.write("train", **record)
        per_step = (now - self.run_start) / max(t.step - t._start_step, 1)
        t.log.progress(
            t.step, t.total_steps,
            f"step {t.step}/{t.total_steps} ep {record['epoch']} frames {t.frames_seen} "
            f"xent {xent:.4f} acc {acc:.4f} lr {self.rate:.3g} "
            f"{record['frames_per_sec']:,.0f} fr/s "
            f"comm {record['comm_fraction']:.1%} steps per rank {record['steps_min']}-"
            f"{record['steps_max']} ETA "
            f"{format_duration(per_step * max(t.total_steps - t.step, 0))}")
        if verdict == ROLL_BACK:
            raise Diverged(
                f"{t.run_dir}: adpsgd: {t.guard.events} non-finite or exploding "
                "minibatches/windows since the last checkpoint; an asynchronous run "
                "cannot roll back: "
                + restart_advice(t.run_dir, t.cfg))
        self._new_window()

    def _evaluate(self, step: int) -> None:
        """Rank 0's own model on the whole held-out set (no other rank takes part)."""
        t = self.t
        if self._dev is None:
            self._dev = WholeHeldOut(t.dev_manifest, max_frames=t.cfg.training.eval_max_frames)
        xent, acc, frames = self._dev.score(t.net)
        result = {"dev_xent": xent, "dev_acc": acc, "dev_frames": frames}
        t.step, t.frames_seen = step, sum(self.frames_of)
        t.log.write("eval", step=step, frames=t.frames_seen, **result,
                    seconds=self.comm.wtime() - self.run_start, model="rank 0")
        t._keep_best(result)            # (its selection record follows the eval record)
        t.log.say(f"held-out at step {step}: xent {result['dev_xent']:.4f} acc "
                  f"{result['dev_acc']:.4f} ({frames} frames, rank 0's model)")
