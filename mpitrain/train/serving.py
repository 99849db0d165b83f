"""The training loop of an asynchronous method (``parallel.method: param_server``).

The ranks take their own numbers of steps, so none of the trainer's
collectives (log sums, sharded evaluation, checkpoint gather) can run between
the start and the end.  Instead:

- the server (rank 0) applies each client's gradient as it arrives and, by
  its own count of updates, writes the progress records (the clients' loss
  sums travel with their gradients), evaluates theta and the averaged model
  on the whole held-out set by itself, switches the average to uniform, and
  writes checkpoints alone;
- each client pulls the weights, computes the gradient of its next
  minibatch, pushes it, until its own data is done.

A signal that asks the run to stop (train/stop.py), on the server, in a
client's next push or in another server's word to server 0, has the server
write its checkpoint after the update it is applying and end the whole job
with exit status 75 (no point comes where every rank waits for the others
before the end).

Both then return to :meth:`Trainer.run`, whose end (``finalize``: every rank
gets the averaged model; the final checkpoint, evaluation and ``final.h5``)
is the same as every method's.  The protocol is in
:mod:`mpitrain.parallel.param_server`.

Example::

    # in Trainer._train_to_end, for param_server
    return train_asynchronously(trainer, run_start)
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from .. import backend
from ..config import config_to_yaml
from ..data.splice import splice_batch_
from ..parallel.param_server import DONE, LAST, UNIFORM
from ..parallel.registry import data_share
from .checkpoint import checkpoint_path, save_checkpoint
from .checkpoint_clock import CheckpointClock
from .divergence import ROLL_BACK, Diverged, restart_advice
from .evaluate import WholeHeldOut
from .metrics import epoch_of_step, format_duration, resident_mb
from .stop import EXIT_STOPPED, requested, signal_name

#: Seconds between the last line of a job stopped by a signal and its abort.
ABORT_GRACE_S = 1.0


def plan_own_steps(cfg, rank: int, counts) -> tuple:
    """(steps per epoch, total steps, planned steps) of ``rank`` when each client
    takes its own minibatches, from every rank's own minibatch count per epoch
    (``counts``; None or 0 for a server): a client's own counts; the server's are
    the sums over the clients (one update per minibatch).

    Example::

        plan_own_steps(cfg, 1, [None, 120, 120])    # client: (120, 360, 360), 3 epochs
    """
    counts = [int(n or 0) for n in counts]
    size = len(counts)
    epochs, cap = cfg.training.epochs, cfg.training.max_steps
    planned = [int(round(epochs * n)) for n in counts]
    totals = [min(p, cap) if cap else p for p in planned]
    clients = [r for r in range(size) if data_share(cfg, rank=r, size=size)[0] is not None]
    if not sum(totals[r] for r in clients):
        raise ValueError(f"no client rank has a complete minibatch of "
                         f"{cfg.training.minibatch} frames; lower training.minibatch, raise "
                         "data.chunk_frames, or use fewer ranks")
    if rank in clients:
        return counts[rank], totals[rank], max(planned[rank], 1)
    return (max(sum(counts[r] for r in clients), 1), sum(totals[r] for r in clients),
            max(sum(planned[r] for r in clients), 1))


def train_asynchronously(trainer, run_start: float) -> None:
    """Serve (rank 0) or train as a client until every client's data is done.

    Example::

        train_asynchronously(trainer, run_start=trainer.comm.wtime())
    """
    if trainer.comm.rank == 0:
        Server(trainer, run_start).serve()
    elif trainer.strategy.is_server:
        serve_slice(trainer)
    else:
        train_client(trainer)


def serve_slice(trainer) -> None:
    """A server other than 0 (``parallel.servers`` > 1): apply each push to this
    server's slice of the model and send the slice back, until every client is
    done; then answer server 0 until it is done too.

    Example::

        serve_slice(trainer)        # on ranks 1..S-1 of a job with S servers
    """
    ps, net = trainer.strategy, trainer.net
    ps.optimizer = trainer.optimizer         # server 0 may ask for its state's slices
    for client in ps.clients:
        ps.send_weights(net, client)
    left = set(ps.clients)
    while left:
        serve_next_push(trainer, left)
        # only server 0 can write the checkpoint and end the job
        ps.tell_stop(requested.code())
    ps.serve_until_released(net)


def serve_next_push(trainer, left: set, rate: float = 0.0) -> tuple:
    """A server: take the next push, step with it and answer (unless it was the
    client's last); ``left`` loses each client that is done.  Returns (the push,
    or None for a client without data; the rate used, else ``rate``)."""
    t, ps, net = trainer, trainer.strategy, trainer.net
    push = ps.receive_push(net)
    if push.kind == DONE:
        left.discard(push.source)
        return None, rate
    rate = t.guard.lr_scale * t.schedule.rate(t.step)
    ps.apply(net, t.optimizer, rate, push)
    if push.kind == LAST:
        left.discard(push.source)
    else:
        ps.send_weights(net, push.source)
    t.step += 1
    t.frames_seen += push.frames
    return push, rate


def choose_final_model(trainer) -> dict:
    """The end of a run, every rank, after ``finalize`` put theta_bar in the
    network: evaluate theta_bar and theta on the held-out set and keep the better
    by ``training.select_by`` as the final model (a tie keeps theta_bar, which the
    paper decodes with).  An average that never turned uniform may lag far behind
    theta (``average_eta`` tiny: held-out accuracy 0.045 where theta had 0.24).
    Logs one ``eval`` record (the kept model's figures, ``model``, and both
    models') and a line saying which was kept and why; returns the kept model's
    result (collective: the figures are the same on every rank).

    Example::

        result = choose_final_model(trainer)     # {"dev_acc": ..., "model": "current"}
    """
    t, ps, net = trainer, trainer.strategy, trainer.net
    average = net.params.copy()
    averaged = t.evaluate()
    ps.put_current(net)
    current = t.evaluate()
    if not averaged or not current:
        net.params[...] = average
        return {}
    keep_current = t.selection.better(current, averaged)
    if not keep_current:
        net.params[...] = average
    kept = "current" if keep_current else "average"
    result = dict(current if keep_current else averaged, model=kept)
    mode = ps.average.mode if ps.average is not None else None
    both = {"current_dev_xent": current["dev_xent"], "current_dev_acc": current["dev_acc"],
            "average_dev_xent": averaged["dev_xent"], "average_dev_acc": averaged["dev_acc"]}
    seconds = {} if t._run_start is None else {"seconds": t.comm.wtime() - t._run_start}
    t.log.write("eval", step=t.step, frames=t.frames_seen, **result, **both,
                average_mode=mode, **seconds)
    t._keep_best(result)
    key = "dev_" + t.selection.select_by
    name = "the current model" if keep_current else "the averaged model"
    other = "the averaged model's" if keep_current else "the current model's"
    why = (f"held-out {t.selection.select_by} {result[key]:.4f}, {other} "
           f"{(averaged if keep_current else current)[key]:.4f}")
    if keep_current and mode != UNIFORM:
        why += "; the average stayed exponential: it was never the better at an evaluation"
    elif not keep_current and current[key] == averaged[key]:
        why += "; a tie keeps the average"
    t.log.say(f"held-out at step {t.step}: xent {result['dev_xent']:.4f} acc "
              f"{result['dev_acc']:.4f} ({result['dev_frames']} frames)"
              + (", the best so far" if t._verdict.improved else ""))
    t.log.say(f"final model: {name} ({why})")
    return result


# ------------------------------------------------------------------- a client

def train_client(trainer) -> None:
    """Pull, compute a minibatch's gradient, push; ``trainer.total_steps`` times
    (less the minibatches a resumed checkpoint had applied).

    Example::

        train_client(trainer)       # on ranks 1..N-1 of a param_server job
    """
    ps, net, stream = trainer.strategy, trainer.net, trainer.stream
    cfg = trainer.cfg
    start = ps.resumed_client_steps()
    if start is None:               # a fresh run, or a resume on another number of ranks
        start = trainer.step
    total = trainer.total_steps
    step = trainer._new_training_step()      # its input buffers and loss sums
    ps.pull(net)                             # every client gets the weights first
    if start >= total:
        ps.done_without_data()
        trainer.step = total
        return
    if start:
        stream.seek(start // trainer.steps_per_epoch, start % trainer.steps_per_epoch)
    slow = ps.straggler
    for k in range(start, total):
        if slow is not None:
            slow.step_started()
        chunk, idx = stream.next_batch()
        step.prepare_dropout(k)
        splice_batch_(chunk.feats, idx, chunk.utt_start, chunk.utt_end, cfg.data.left_context,
                      cfg.data.right_context, out=step.inputs, ctx=step.ctx)
        net.forward_backward(step.inputs, chunk.labels[idx], into=step.sums)
        step.frames += step.minibatch
        if slow is not None:
            slow.step_finished()
        loss_sum, correct, frames, _ = step.take_sums()
        last = k == total - 1
        ps.push(net, loss_sum=loss_sum, correct=correct, frames=frames, position=k,
                last=last, stop=requested.code())
        if not last:
            ps.pull(net)
    trainer.step = total


# ------------------------------------------------------------------ the server

class Server:
    """Rank 0's loop: apply pushes, log, evaluate, checkpoint (module docstring).

    Example::

        Server(trainer, run_start=comm.wtime()).serve()
    """

    def __init__(self, trainer, run_start: float):
        self.t, self.run_start = trainer, run_start
        self.ps = trainer.strategy
        self._dev = None
        self._new_window()

    def _new_window(self) -> None:
        t = self.t
        self.window_start, self.comm_at_window = t.comm.wtime(), t.comm.comm_time
        self.sums = np.zeros(3)              # loss, correct, frames
        self.staleness: list = []
        self.skipped_before = self._skipped()

    def _skipped(self) -> int:
        skipped = self.t.optimizer.skipped_steps()
        return skipped if isinstance(skipped, int) else int(backend.to_host(skipped)[0])

    def serve(self) -> None:
        t, ps, net = self.t, self.ps, self.t.net
        cfg = t.cfg
        for client in ps.clients:
            ps.send_weights(net, client)
        left = set(ps.clients)
        clients = len(ps.clients)
        eval_every = cfg.training.eval_interval
        next_eval = (t.frames_seen // clients // eval_every + 1) * eval_every \
            if eval_every else None
        ck = cfg.training.checkpoint_interval
        next_checkpoint = (t.step // ck + 1) * ck if ck else 0
        clock = CheckpointClock(t.comm, cfg.training.checkpoint_minutes)
        rate = 0.0
        signalled = {}                  # rank -> the stop signal's code it sent
        while left:
            push, rate = serve_next_push(t, left, rate)
            if push is not None and push.stop:
                signalled.setdefault(push.source, push.stop)
            for server, code in ps.stops_told().items():
                signalled.setdefault(server, code)
            if requested.code() or signalled:
                self.stop_on_signal(requested.code() or min(signalled.values()),
                                    len(signalled) + bool(requested.code()))
            if push is None:
                continue
            self.sums += (push.loss_sum, push.correct, push.frames)
            self.staleness.append(push.staleness)
            last = not left
            if t.step % cfg.training.log_interval == 0 or last:
                self._log(rate)
            if last:
                break
            epoch_done = t.step % t.steps_per_epoch == 0
            due_eval = (next_eval is not None and t.frames_seen // clients >= next_eval) \
                or (next_eval is None and epoch_done)
            if due_eval and t.dev_manifest is not None:
                self.evaluate()
                if next_eval is not None:
                    next_eval += eval_every
            steps_due = next_checkpoint and t.step >= next_checkpoint
            if steps_due or clock.due():
                if steps_due:
                    next_checkpoint = (t.step // ck + 1) * ck
                clock.written()
                self.checkpoint()
        if self.staleness:
            self._log(rate)
        ps.release_servers()

    # -- progress ----------------------------------------------------------------
    def _log(self, lr: float) -> None:
        t = self.t
        now, comm_now = t.comm.wtime(), t.comm.comm_time
        elapsed = max(now - self.window_start, 1e-9)
        loss, correct, frames = self.sums
        with np.errstate(all="ignore"):       # a NaN window is reported, not warned
            xent = loss / frames
        stale = np.asarray(self.staleness or [0])
        skipped = self._skipped() - self.skipped_before
        record = {"step": t.step, "epoch": epoch_of_step(t.step, t.steps_per_epoch),
                  "frames": t.frames_seen, "xent": float(xent), "acc": correct / frames,
                  "lr": lr, "frames_per_sec": frames / elapsed,
                  "comm_fraction": min(1.0, (comm_now - self.comm_at_window) / elapsed),
                  "skipped": skipped, "rss_mb": resident_mb(),
                  "staleness_min": int(stale.min()), "staleness_mean": float(stale.mean()),
                  "staleness_max": int(stale.max()), "seconds": now - self.run_start}
        verdict = t.guard.observe(xent=float(xent), skipped=skipped, frames=int(frames))
        t.log.write("train", **record)
        per_step = (now - self.run_start) / max(t.step - t._start_step, 1)
        t.log.say(
            f"step {t.step}/{t.total_steps} ep {record['epoch']} frames {t.frames_seen} "
            f"xent {record['xent']:.4f} acc {record['acc']:.4f} lr {lr:.3g} "
            f"{record['frames_per_sec']:,.0f} fr/s staleness {record['staleness_min']}/"
            f"{record['staleness_mean']:.1f}/{record['staleness_max']} (min/mean/max) "
            f"ETA {format_duration(per_step * max(t.total_steps - t.step, 0))}")
        if verdict == ROLL_BACK:
            raise Diverged(
                f"{t.run_dir}: param_server: {t.guard.events} non-finite or exploding "
                "minibatches/windows since the last checkpoint; an asynchronous run "
                "cannot roll back: "
                + restart_advice(t.run_dir, t.cfg))
        self._new_window()

    def _window_so_far_good(self) -> bool:
        """Whether the updates since the last log line are good so far (the pushes'
        loss sums and the steps the optimizer skipped), counting nothing: as a
        lock-step checkpoint between log lines judges its window's part."""
        loss, _, frames = self.sums
        with np.errstate(all="ignore"):
            xent = float(loss / frames) if frames else None
        return self.t.guard.part_is_good(xent=xent,
                                         skipped=self._skipped() - self.skipped_before,
                                         frames=int(frames))

    # -- held-out evaluation and the average's switch ---------------------------------
    def _held_out(self) -> tuple:
        """(cross-entropy per frame, accuracy, frames) of the network's parameters."""
        t = self.t
        if self._dev is None:
            self._dev = WholeHeldOut(t.dev_manifest, max_frames=t.cfg.training.eval_max_frames)
        return self._dev.score(t.net)

    def evaluate(self) -> dict:
        """Both models: the first time the average is the better, it turns uniform;
        whenever the current model is the better of the two after that, the uniform
        average starts again from it."""
        t, ps, net = self.t, self.ps, self.t.net
        average = ps.average
        mode = average.mode
        ps.collect_slices(net)         # a split model: the other servers' slices
        current_xent, current_acc, current_frames = self._held_out()
        extra = {"average_mode": mode, "current_dev_xent": current_xent,
                 "current_dev_acc": current_acc}
        theta = net.params.copy()
        net.params[...] = average.average
        try:
            xent, acc, frames = self._held_out()
            result = {"dev_xent": xent, "dev_acc": acc, "dev_frames": frames}
            t.log.write("eval", step=t.step, frames=t.frames_seen, **result, **extra,
                        seconds=t.comm.wtime() - self.run_start)
            current = {"dev_xent": current_xent, "dev_acc": current_acc,
                       "dev_frames": current_frames}
            # best.h5 and early stopping: the better of the two (a tie: the average)
            if t.selection.better(current, result):
                net.params[...] = theta
                t._keep_best(current)
            else:
                t._keep_best(result)
        finally:
            net.params[...] = theta
        t.log.say(f"held-out at step {t.step}: xent {xent:.4f} acc {acc:.4f} ({frames} "
                  f"frames, {mode} average); current model xent {current_xent:.4f} acc "
                  f"{current_acc:.4f}")
        if mode != UNIFORM and xent < current_xent:
            ps.switch_to_uniform()
            t.log.write("average", step=t.step, mode=UNIFORM, switched_at=ps.updates)
            t.log.say(f"step {t.step}: the averaged model is the better on held-out data; "
                      "uniform (Polyak) average from here on")
        elif mode == UNIFORM and current_xent < xent:
            ps.restart_average(net)
            t.log.write("average", step=t.step, mode=UNIFORM, switched_at=ps.updates,
                        restarted=True)
            t.log.say(f"step {t.step}: the current model is the better on held-out data; "
                      "the uniform average starts again from it")
        return result

    def stop_on_signal(self, code: int, ranks: int) -> None:
        """A signal: the checkpoint of this update, one line, and the whole job ends
        with exit status 75 (the clients wait for weights: nothing else ends them)."""
        t = self.t
        written = self.checkpoint()
        name = signal_name(code)
        t.log.write("stop", step=t.step, signal=name, ranks=ranks, checkpoint=written)
        where = (f"checkpoint {written}; --resume continues from it" if written else
                 "no checkpoint written (the model is diverging or not finite); --resume "
                 "continues from the newest earlier one")
        t.log.say(f"stopped at step {t.step} of {t.total_steps} on {name} (received by "
                  f"{ranks} of {t.comm.size} rank(s)): {where}")
        t.log.close()
        if t._lock is not None:
            t._lock.release()
        # the launcher ends every process at the abort and may drop lines it has not
        # forwarded yet: give it a moment to pass the one above on
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        time.sleep(ABORT_GRACE_S)
        t.comm.abort(EXIT_STOPPED, f"param_server: stopped on {name}")
        os._exit(EXIT_STOPPED)      # (an abort may return before the launcher ends us)

    # -- checkpoints -------------------------------------------------------------
    def checkpoint(self):
        """The server writes alone: its model, the average, the counters.  Every
        rank's entry holds the server's optimizer and reader state; the clients'
        data positions are the strategy's ``client_steps``."""
        t, ps, net = self.t, self.ps, self.t.net
        ps.collect_slices(net)
        finite = bool(backend.to_host(t.xp.isfinite(net.params).all()))
        if not (t.guard.last_window_good and self._window_so_far_good() and finite):
            t.log.say(f"step {t.step}: checkpoint not written (the model is diverging or "
                      "not finite)")
            return None
        own = {"optimizer": ps.whole_optimizer_state(t.optimizer, net),
               "reader": t.stream.state_dict()}
        # a run directory moved or removed meanwhile: writing would make a new one
        # of that name holding checkpoints alone
        t._check_run_dir("a checkpoint")
        started = time.perf_counter()
        save_checkpoint(checkpoint_path(t.run_dir, t.step), net=net, step=t.step,
                        frames_seen=t.frames_seen, config_yaml=config_to_yaml(t.cfg),
                        rank_states=[own] * t.comm.size,
                        strategy_state=ps.server_state(net),
                        class_priors=t.manifest.class_priors(),
                        keep=t.cfg.training.keep_checkpoints,
                        trainer_state=t._trainer_state())
        t.log.write("checkpoint", step=t.step, seconds=round(time.perf_counter() - started, 4))
        t.guard.checkpoint_written()
        return checkpoint_path(t.run_dir, t.step)
