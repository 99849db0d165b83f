"""Kaldi nnet2/nnet3 parallel training with parameter averaging (Povey, Zhang &
Khudanpur, arXiv 1410.7455; Kaldi's train_dnn.py / train_raw_dnn.py).

Training is cut into iterations of K minibatches per rank (Kaldi's
``samples_per_iter``).  In iteration i, J_i ranks ("jobs") train from the same
model at J_i times the scheduled rate; then their models are averaged::

    w <- (1/J_i) sum_{j < J_i} w_j        every rank continues from the average
    J_i = round(J_0 + (J_final - J_0) i / I)   (in multiples of jobs_step past it)

Each rank's momentum starts from zero after every average, as each Kaldi job
starts a fresh trainer.  Averaging J independently updated models divides
each job's step by J, hence the rate J_i lr; the L2 term is scaled by 1/J_i (Kaldi's
``l2_regularize_factor``), so that the weights shrink as much per iteration
as at the rate lr, however many jobs average.  The schedule's lr is set once
per iteration from the data processed before it, as Kaldi's,
lr_eff(i) = lr0 exp((p_i / A) ln(lr1 / lr0)) with p_i the job-minibatches of
the iterations before i and A those of the plan, and the last iteration
trains at lr1 (:meth:`KaldiAveraging.rate_fraction`); not over the steps.
The dropout schedule reads p_i / A (:meth:`KaldiAveraging.data_fraction`).
The first iteration's whole-model max-change is divided by sqrt(2), as
Kaldi's (its halved minibatch and best-job pick are not done).
Idle ranks (rank >= J_i) skip their training steps and take part in the
average with a zero contribution, so each iteration needs one Allreduce
whatever J_i is, and no communicator has to be split.

Symbols in the code: K is ``every_steps``, J_i is :meth:`KaldiAveraging.num_jobs`,
the schedule is :func:`jobs_schedule`, w_j is ``net.params``.
"""

from __future__ import annotations

from .base import Strategy, every_steps_from


def build(cfg, comm, *, total_steps: int = 0):
    """The strategy for ``parallel.method: kaldi``."""
    par = cfg.parallel
    return KaldiAveraging(comm, every_steps=every_steps_from(cfg), total_steps=total_steps,
                          jobs_initial=par.num_jobs_initial, jobs_final=par.num_jobs_final,
                          jobs_step=par.jobs_step)


def jobs_schedule(num_iters: int, jobs_initial: int, jobs_final: int, step: int = 1) -> list:
    """J_i for i = 0 .. num_iters-1, following Kaldi's train_dnn.py.

    Example::

        jobs_schedule(12, 2, 9, step=3)   # [2, 3, 3, 3, 3, 6, 6, 6, 6, 6, 9, 9]
        jobs_schedule(3, 3, 3, step=2)    # [3, 3, 3]: not Kaldi's 4, more than asked

    Kept between ``jobs_initial`` and ``jobs_final``: Kaldi's rounding to a multiple
    of ``step`` can pass them, and here each job is a rank (4 jobs on 3 ranks
    averaged 3 models over 4, at 4 times the rate).
    """
    low, high = sorted((jobs_initial, jobs_final))
    jobs = []
    for i in range(num_iters):
        v = jobs_initial + (jobs_final - jobs_initial) * i / num_iters
        rounded = int(0.5 + v) if v < step else int(0.5 + v / step) * step
        jobs.append(min(high, max(low, rounded)))
    return jobs


class KaldiAveraging(Strategy):
    """Example::

        strategy = KaldiAveraging(comm, every_steps=1500, total_steps=30000,
                                  jobs_initial=1, jobs_final=comm.size)
    """

    name = "kaldi"

    def __init__(self, comm, *, every_steps: int, total_steps: int, jobs_initial: int = 0,
                 jobs_final: int = 0, jobs_step: int = 1):
        super().__init__(comm)
        if every_steps < 1:
            raise ValueError(f"every_steps must be >= 1, got {every_steps}")
        self.every_steps = int(every_steps)
        final = jobs_final or comm.size
        initial = jobs_initial or final
        if not 1 <= initial <= comm.size or not 1 <= final <= comm.size:
            raise ValueError(f"parallel.num_jobs_initial/final must be in [1, {comm.size}] "
                             f"(the number of ranks), got {initial} and {final}")
        self.total_steps = max(1, int(total_steps))
        num_iters = -(-self.total_steps // self.every_steps)
        self.jobs = jobs_schedule(num_iters, initial, final, jobs_step)
        self.sync_period = self.every_steps
        # job-minibatches trained before each iteration, and in the whole plan
        self._before = [0]
        for i, jobs in enumerate(self.jobs):
            self._before.append(self._before[-1] + jobs * self._length(i))

    def _length(self, iteration: int) -> int:
        """Steps of ``iteration`` (the last one may be short)."""
        start = iteration * self.every_steps
        return min(self.every_steps, self.total_steps - start)

    def data_fraction(self, step: int) -> float:
        """p_i / A for the iteration i holding 0-based ``step``: the job-minibatches
        trained before the iteration over those of the plan.  Kaldi sets each
        iteration's rate and dropout once, from the archives processed before it
        (num_archives_processed / num_archives_to_process), which a ramp makes grow
        slower than the steps at first."""
        i = self._iteration(step)
        return self._before[i] / self._before[-1]

    def rate_fraction(self, step: int) -> float:
        """:meth:`data_fraction`, and 1.0 (the final rate) in the last iteration, as
        Kaldi's rate; its dropout keeps the data's fraction there."""
        if self._iteration(step) == len(self.jobs) - 1:
            return 1.0
        return self.data_fraction(step)

    def _iteration(self, step: int) -> int:
        return min(step // self.every_steps, len(self.jobs) - 1)

    def num_jobs(self, step: int) -> int:
        return self.jobs[self._iteration(step)]

    def is_active(self, step: int) -> bool:
        """Whether this rank trains at (0-based) ``step``."""
        return self.comm.rank < self.num_jobs(step)

    def active_ranks(self, step: int) -> int:
        return self.num_jobs(step)

    def learning_rate(self, lr: float, step: int = 0) -> float:
        return lr * self.num_jobs(step)

    def l2_factor(self, step: int = 0) -> float:
        return 1.0 / self.num_jobs(step)

    def max_change_factor(self, step: int = 0) -> float:
        """1/sqrt(2) in the first iteration, as Kaldi's train_dnn.py divides its
        max-param-change there (the model changes fastest then)."""
        return 2 ** -0.5 if self._iteration(step) == 0 and len(self.jobs) > 1 else 1.0

    def after_update(self, net, optimizer, step: int) -> None:
        if step % self.every_steps == 0:
            self._average(net, optimizer, step)

    def _average(self, net, optimizer, step: int) -> None:
        if self.comm.size > 1:
            self.average_models_(net.params, step)
        # each Kaldi job starts a fresh trainer, its momentum zero
        optimizer.clear_momentum()
        optimizer.after_average()

    def average_models_(self, params, step: int) -> None:
        """params <- the mean of the jobs of the iteration holding 0-based step
        ``step - 1`` (an idle rank still holds the model the iteration started
        from and adds zero)."""
        if not self.is_active(step - 1):
            params[...] = 0
        self.comm.allreduce_(params, op="sum")
        params *= 1.0 / self.num_jobs(step - 1)

    def finalize(self, net, optimizer, step: int = 0) -> None:
        if step % self.every_steps and self.comm.size > 1:
            self._average(net, optimizer, step)
