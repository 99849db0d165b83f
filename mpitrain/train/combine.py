"""Kaldi's final model combination (nnet2/nnet3 ``combine``), on many ranks.

During training, snapshots of the model are kept in memory at sync points
(where every rank holds the same model): the last ``training.combine_models``
of them, at least ``training.combine_every`` steps apart.  At the end the
candidates are those snapshots, each rank's own last model where the ranks
still differ (e.g. ADPSGD before its final average) and the final model.  The
combination is

    theta(alpha) = sum_m alpha_m theta_m,   alpha_m >= 0,  sum_m alpha_m = 1

with alpha minimising the cross-entropy per frame L on ``training.combine_frames``
held-out frames (``data.dev``, or the start of the training data without one).
The gradient is dL/dalpha_m = grad L(theta(alpha)) . theta_m, one forward and
backward pass over the frames.  alpha starts at the best single model and
moves by projected gradient steps on the simplex with a backtracking line
search; a step is kept only when it lowers L, so the result is never worse on
those frames than the best single model.  Every rank evaluates its share of
the frames and the sums are reduced, so every rank takes the same steps and
ends with the same model.

Not as in Kaldi: nnet3-combine runs L-BFGS on unconstrained per-component
weights and then, by default, enforces the sum to one; here there is one
weight per model, kept on the simplex throughout.
"""

from __future__ import annotations

import numpy as np

from .. import backend
from ..data.splice import splice, splice_indices
from .evaluate import EVAL_BATCH, load_eval_chunks

#: Objective evaluations (each one pass over the frames) the search may take.
MAX_EVALUATIONS = 30


def project_to_simplex(v):
    """The nearest point (Euclidean) of {a >= 0, sum a = 1} to ``v``.

    Example::

        project_to_simplex(np.array([0.8, 0.6]))     # array([0.6, 0.4])
    """
    v = np.asarray(v, dtype=np.float64)
    u = np.sort(v)[::-1]
    cumulative = np.cumsum(u) - 1.0
    ks = np.arange(1, len(v) + 1)
    rho = ks[u - cumulative / ks > 0][-1]
    return np.maximum(v - cumulative[rho - 1] / rho, 0.0)


class FinalCombination:
    """Snapshots during training, the combination at the end.

    Example::

        combination = FinalCombination(cfg, comm, sync_period=8, total_steps=1000)
        combination.observe(step, net)            # after every training step
        found = combination.combine(net, heldout_manifest)   # at the end, every rank
    """

    def __init__(self, cfg, comm, *, sync_period: int, total_steps: int):
        t = cfg.training
        self.comm = comm
        self.max_models, self.every, self.frames = t.combine_models, t.combine_every, \
            t.combine_frames
        self.sync_period, self.total_steps = max(int(sync_period), 1), int(total_steps)
        self.snapshots = []          # (step, host copy of the parameters), oldest first
        self.own_last = None         # this rank's model at the last step

    def observe(self, step: int, net, result_params=None) -> None:
        """After training step ``step``: keep a snapshot when it is due
        (``result_params``: the method's model when the ranks train on another
        point, BMUF's w_g; else ``net.params``)."""
        model = net.params if result_params is None else result_params
        # a roll back returns to an earlier step: later snapshots are another timeline
        self.snapshots = [(s, p) for s, p in self.snapshots if s < step]
        if step >= self.total_steps:
            self.own_last = backend.to_host(model).copy()
        if step % self.sync_period:
            return
        if self.every and self.snapshots and step - self.snapshots[-1][0] < self.every:
            return
        self.snapshots.append((step, backend.to_host(model).copy()))
        del self.snapshots[:-self.max_models]

    # -- candidates --------------------------------------------------------------
    def _candidates(self, net) -> list:
        """(label, host parameters), the same list on every rank."""
        comm = self.comm
        found = []
        steps = comm.bcast_obj([s for s, _ in self.snapshots], root=0)
        for i, step in enumerate(steps):
            buf = self.snapshots[i][1].copy() if comm.rank == 0 else \
                np.empty(net.num_params, dtype=np.float32)
            comm.bcast_(buf, root=0)     # ranks that never agree (ADPSGD) use rank 0's
            found.append((f"step {step}", buf))
        if self.own_last is not None and comm.size > 1 and self._ranks_differ(self.own_last):
            for r in range(comm.size):
                buf = self.own_last.copy() if comm.rank == r else np.empty_like(self.own_last)
                comm.bcast_(buf, root=r)
                found.append((f"rank {r}", buf))
        found.append(("final", backend.to_host(net.params).copy()))
        unique = []
        for label, params in found:
            if not any(np.array_equal(params, other) for _, other in unique):
                unique.append((label, params))
        return unique

    def _ranks_differ(self, params) -> bool:
        digest = float(np.dot(params.astype(np.float64), np.linspace(1.0, 2.0, len(params))))
        comm = self.comm
        return comm.allreduce_scalar(digest, op="max") != comm.allreduce_scalar(digest,
                                                                                  op="min")

    # -- the objective -----------------------------------------------------------
    def _objective(self, net, chunks, models, alpha, *, gradient: bool):
        """(cross-entropy per frame, accuracy, dL/dalpha or None) of theta(alpha),
        summed over every rank's frames."""
        xp = net.xp
        _install(net, models, alpha)
        sums = xp.zeros(2, dtype=xp.float64)
        grads = xp.zeros(net.num_params, dtype=xp.float64) if gradient else None
        frames = 0
        for feats, labels, start, end in chunks:
            for lo in range(0, len(labels), EVAL_BATCH):
                idx = xp.arange(lo, min(lo + EVAL_BATCH, len(labels)))
                ctx = splice_indices(idx, start[idx], end[idx], net.left_context,
                                     net.right_context)
                x = splice(feats, ctx)
                if gradient:
                    net.forward_backward(x, labels[idx], into=sums, dropout=False)
                    grads += net.grads
                else:
                    net.evaluate_batch(x, labels[idx], into=sums)
                frames += len(idx)
        local = np.zeros(3 + len(models))
        local[:2] = backend.to_host(sums)
        local[2] = frames
        if gradient:
            host = backend.to_host(grads)
            local[3:] = [np.dot(host, m) for m in models]
        self.comm.allreduce_(local, op="sum")
        n = max(local[2], 1.0)
        return local[0] / n, local[1] / n, (local[3:] / n if gradient else None), int(local[2])

    def combine(self, net, manifest) -> dict:
        """Replace ``net.params`` by the best combination found; every rank calls this.

        ``manifest``: the corpus the held-out frames come from.  Returns the
        record to log: the candidates, their weights, the best single model's
        and the combination's cross-entropy and accuracy, and the gain.
        """
        candidates = self._candidates(net)
        labels, models = [c[0] for c in candidates], [c[1] for c in candidates]
        chunks = load_eval_chunks(manifest, net, rank=self.comm.rank, size=self.comm.size,
                                  max_frames=self.frames)
        # the held-out gradient must not reach preconditioners or gradient reductions
        saved = [(a, a.preconditioner_in, a.preconditioner_out) for a in net.affine_layers()]
        hook, net.grad_ready_hook = net.grad_ready_hook, None
        for layer, _, _ in saved:
            layer.set_preconditioners(None, None)
        try:
            return self._search(net, chunks, labels, models)
        finally:
            for layer, prec_in, prec_out in saved:
                layer.set_preconditioners(prec_in, prec_out)
            net.grad_ready_hook = hook

    def _search(self, net, chunks, labels, models) -> dict:
        singles = []
        for m in range(len(models)):
            alpha = np.eye(len(models))[m]
            singles.append(self._objective(net, chunks, models, alpha, gradient=False))
        best = int(np.argmin([s[0] for s in singles]))
        alpha = np.eye(len(models))[best]
        xent, acc, frames = singles[best][0], singles[best][1], singles[best][3]
        best_xent, best_acc = xent, acc
        evaluations = len(models)
        step = None
        while len(models) > 1 and evaluations < MAX_EVALUATIONS:
            xent, acc, grad, _ = self._objective(net, chunks, models, alpha, gradient=True)
            evaluations += 1
            if step is None:      # first move: up to half the weight changes hands
                spread = float(grad.max() - grad.min())
                if spread <= 0:
                    break
                step = 0.5 / spread
            moved = False
            while evaluations < MAX_EVALUATIONS and step * float(np.abs(grad).max()) > 1e-6:
                trial = project_to_simplex(alpha - step * grad)
                trial_xent, trial_acc, _, _ = self._objective(net, chunks, models, trial,
                                                              gradient=False)
                evaluations += 1
                if trial_xent < xent:
                    alpha, xent, acc, moved = trial, trial_xent, trial_acc, True
                    step *= 2
                    break
                step /= 4
            if not moved:
                break
        _install(net, models, alpha)       # the last evaluation may have been a trial's
        return {"models": labels, "weights": [round(float(a), 6) for a in alpha],
                "best_single": labels[best], "best_single_xent": best_xent,
                "best_single_acc": best_acc, "combined_xent": xent, "combined_acc": acc,
                "gain_xent": best_xent - xent, "frames": frames, "evaluations": evaluations}


def _install(net, models, alpha) -> None:
    """net.params <- sum_m alpha_m theta_m (in float64, then float32)."""
    combined = sum(a * m.astype(np.float64) for a, m in zip(alpha, models) if a)
    net.params[...] = backend.to_device(combined.astype(np.float32), net.xp)
