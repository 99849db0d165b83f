"""One training step, the same for the trainer and for every benchmark.

A step is: pick the minibatch, splice its context windows into the first
layer's input, forward and backward with the summed cross-entropy, let the
strategy combine gradients, take the optimizer step, let the strategy average
models.  Running totals (cross-entropy, correct frames) stay on the device;
:meth:`TrainingStep.take_sums` reads them, once per log line.

Example::

    step = TrainingStep(net, optimizer, strategy, minibatch=256,
                        left_context=5, right_context=5)
    for n in range(steps):
        lr = step.run(n, schedule(n / steps), stream.next_batch)
    loss_sum, correct, frames, skipped = step.take_sums()
"""

from __future__ import annotations

import numpy as np

from .. import backend
from ..data.splice import splice_batch_
from ..optim.base import ReplayableOptimizer


class TrainingStep:
    """The per-minibatch work of training on one rank.

    ``next_batch()`` returns ``(chunk, idx)``: a chunk with ``feats``,
    ``labels``, ``utt_start`` and ``utt_end`` on the network's device, and the
    minibatch's frame indices into it.
    """

    def __init__(self, net, optimizer, strategy, *, minibatch: int, left_context: int,
                 right_context: int, cuda_graph: bool = False, log=None,
                 dropout_proportion=None):
        self.net, self.optimizer, self.strategy = net, optimizer, strategy
        # model.dropout: step -> proportion; None keeps the masks' current proportion
        self.dropout_proportion = dropout_proportion
        self.minibatch = int(minibatch)
        self.left, self.right = int(left_context), int(right_context)
        xp = net.xp
        # With fused kernels the minibatch is spliced straight into the first
        # layer's input buffer; otherwise into a contiguous one that it copies.
        inputs = net.first_input_view(self.minibatch) if backend.fused_kernels(xp) else None
        self.inputs = inputs if inputs is not None else \
            xp.empty((self.minibatch, net.input_dim), dtype=xp.float32)
        self.ctx = xp.empty((self.minibatch, net.context), dtype=xp.int64)
        self.sums = xp.zeros(2, dtype=xp.float64)   # summed cross-entropy, correct frames
        self.frames = 0
        # what one log line reads: the sums and the optimizer's count of skipped steps
        self._readout = xp.zeros(3, dtype=xp.float64)
        self._skipped_before = int(backend.to_host(self._readout_now())[2])
        self.graph = None
        if cuda_graph:
            self.graph = _StepGraph(self, log=log)
            if net.dropout is not None:     # new masks each step: not one fixed graph
                self.graph.enabled = False
                self.graph.why_not = "dropout draws new masks every step"

    def run(self, step: int, lr: float, next_batch) -> float:
        """Train 0-based step ``step`` with the schedule's rate ``lr``; returns the
        rate the strategy used (it may scale it)."""
        net, strategy = self.net, self.strategy
        lr = strategy.learning_rate(lr, step)
        self.optimizer.set_l2_factor(strategy.l2_factor(step))
        self.optimizer.set_max_change_factor(strategy.max_change_factor(step))
        if strategy.is_active(step):
            # parallel.straggler: a rank made slow on purpose sleeps after its step
            slow = strategy.straggler
            if slow is not None:
                slow.step_started()
            chunk, idx = next_batch()
            self.prepare_dropout(step)
            if self.graph is not None and self.graph.enabled:
                self.graph.step(chunk, idx, lr)
            else:
                self.launch(chunk, idx, lr)
            self.frames += self.minibatch
            if slow is not None:
                slow.step_finished()
        strategy.after_update(net, self.optimizer, step + 1)
        return lr

    def prepare_dropout(self, step: int) -> None:
        """New dropout masks for 0-based ``step`` (at the scheduled proportion)."""
        masks = self.net.dropout
        if masks is None:
            return
        proportion = masks.proportion if self.dropout_proportion is None \
            else self.dropout_proportion(step)
        masks.draw(step=step, proportion=proportion)

    def launch(self, chunk, idx, lr) -> None:
        """The step's device work, launched from Python (``lr`` None: a replayable
        optimizer's loaded rate)."""
        splice_batch_(chunk.feats, idx, chunk.utt_start, chunk.utt_end, self.left,
                      self.right, out=self.inputs, ctx=self.ctx)
        self.net.forward_backward(self.inputs, chunk.labels[idx], into=self.sums)
        self.strategy.reduce_gradients(self.net)
        self.optimizer.step(lr)

    def _readout_now(self):
        readout = self._readout
        readout[:2] = self.sums
        skipped = self.optimizer.skipped_steps()
        readout[2] = skipped if isinstance(skipped, int) else skipped[0]
        return readout

    def take_sums(self) -> tuple:
        """(summed cross-entropy, correct frames, frames, skipped steps) since the last
        call; resets them.  A skipped step's loss was not finite or its change was
        not (the optimizer left the parameters alone).

        The one read of the device per log line.
        """
        loss_sum, correct, skipped = backend.to_host(self._readout_now())
        frames = self.frames
        self.sums[...] = 0
        self.frames = 0
        new_skips = int(skipped) - self._skipped_before
        self._skipped_before = int(skipped)
        return float(loss_sum), float(correct), frames, new_skips

    def window_state(self) -> np.ndarray:
        """The log window's sums so far, without resetting them (for a checkpoint
        written inside a window): [cross-entropy, correct, frames, skipped steps]."""
        loss_sum, correct, skipped = backend.to_host(self._readout_now())
        return np.array([loss_sum, correct, self.frames, int(skipped) - self._skipped_before],
                        dtype=np.float64)

    def resume_window(self, state) -> None:
        """Continue a log window from a checkpoint's :meth:`window_state`, so that a
        resumed run's first log line (and the divergence guard's judgement of it)
        is the uninterrupted run's."""
        state = np.asarray(state, dtype=np.float64)
        self.sums[...] = self.net.xp.asarray(state[:2])
        self.frames = int(state[2])
        self._skipped_before -= int(state[3])


class _StepGraph:
    """Replays the device work of a step from a captured CUDA graph.

    A step qualifies when its work is the same fixed kernels on the same
    buffers each time: the optimizer says so (plain SGD always; NG-SGD between
    its Fisher updates), the strategy does not communicate inside the step, and
    the chunk is the one captured (a new chunk is captured anew).  The
    minibatch's indices, its labels and the learning rate enter through fixed
    device buffers set before each replay; the host counters a step advances
    are advanced by hand.  Other steps run eagerly on the same buffers.  A
    capture that fails turns graphs off for the run, with one log line.
    """

    def __init__(self, owner: TrainingStep, *, log=None):
        self.owner, self.log = owner, log
        net = owner.net
        xp = net.xp
        self.xp = xp
        self.enabled = (backend.fused_kernels(xp) and not owner.strategy.reduces_gradients
                        and isinstance(owner.optimizer, ReplayableOptimizer))
        self.why_not = "" if self.enabled else (
            "needs the fused GPU kernels, a step without gradient communication and an "
            "optimizer whose steps can be replayed")
        if self.enabled:
            self.why_not = backend.graph_capture_problem(xp)
            self.enabled = not self.why_not
        self.stream = backend.use_own_stream(xp) if self.enabled else None
        self.idx = xp.empty(owner.minibatch, dtype=xp.int64)
        self.labels = None
        self.graph, self.key = None, None
        self.eager_steps = 0
        self.replays = 0

    def _body(self, chunk) -> None:
        """The device work of a fixed step, on the fixed index and label buffers."""
        owner = self.owner
        splice_batch_(chunk.feats, self.idx, chunk.utt_start, chunk.utt_end, owner.left,
                      owner.right, out=owner.inputs, ctx=owner.ctx)
        self.xp.take(chunk.labels, self.idx, out=self.labels)
        owner.net.forward_backward(owner.inputs, self.labels, into=owner.sums)
        owner.strategy.reduce_gradients(owner.net)
        owner.optimizer.step(None)

    def step(self, chunk, idx, lr: float) -> None:
        owner, optimizer = self.owner, self.owner.optimizer
        if self.xp.cuda.get_current_stream() != self.stream:
            self.stream.use()            # all of the step's work in order on one stream
        if not optimizer.static_step_ahead():
            owner.launch(chunk, idx, lr)
            self.eager_steps += 1
            return
        if self.labels is None or self.labels.dtype != chunk.labels.dtype:
            self.labels = self.xp.empty(owner.minibatch, dtype=chunk.labels.dtype)
        self.idx[...] = idx
        optimizer.load_learning_rate(lr)
        # the graph holds addresses and reads them as the types captured
        key = tuple((a.data.ptr, a.shape, a.dtype.str) for a in
                    (chunk.feats, chunk.labels, chunk.utt_start, chunk.utt_end, self.labels))
        key += (optimizer.l2_factor, optimizer.max_change_factor)   # in the graph
        key += optimizer.graph_key()        # and the optimizer's buffers where they are
        if self.graph is not None and key == self.key:
            self.graph.launch()
            optimizer.count_replayed_step()
            self.replays += 1
            return
        if self.eager_steps >= 2:
            # every buffer the step touches exists after two launched steps
            snapshot = optimizer.host_step_state()
            graph, why = backend.capture_graph(self.xp, lambda: self._body(chunk))
            if graph is not None:
                self.graph, self.key = graph, key
                graph.launch()
                self.replays += 1
                return
            optimizer.restore_host_step_state(snapshot)
            self.enabled, self.why_not = False, f"capture failed: {why}"
            if self.log is not None:
                self.log(f"cuda_graph: off for this run ({self.why_not})")
        self._body(chunk)
        self.eager_steps += 1
