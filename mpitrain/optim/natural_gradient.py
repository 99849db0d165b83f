"""Online natural gradient (Povey, Zhang & Khudanpur, "Parallel training of DNNs
with natural gradient and parameter averaging", arXiv 1410.7455; Kaldi nnet3's
``OnlineNaturalGradient``), and nnet2's simple variant.

An affine layer's gradient is ``G^T X`` summed over the N rows of a minibatch.
NG-SGD multiplies it on each side by the inverse of a smoothed Fisher
estimate, which amounts to preconditioning the input rows X and the
output-derivative rows G separately; each side of each layer owns one
:class:`Preconditioner` (docs/natural-gradient.md has the full spec).

The rule, for rows X (N x D), Fisher estimate ``F = R^T diag(d) R + rho I``::

    W     = diag(sqrt e) R,   e_i = d_i / (d_i + beta),  beta = rho (1 + alpha) + alpha sum(d) / D
    Xhat  = X - (X W^T) W                     every call
    gamma = ||X|| / ||Xhat||                  gamma Xhat replaces X in the gradient
    every update: T = eta X^T X / N + (1 - eta) F;  Y = R T;  Y Y^T = U diag(c) U^T
                  R' = diag(c)^(-1/2) U^T Y;  d' = sqrt(c) - rho';  rho' keeps tr F' = tr T

Symbols in the code: X and Xhat are ``X`` (overwritten in place), W is
``self.W`` (rows ``_wj[:rank]``), ``H = X W^T`` is ``h``, ``J = H^T X`` is
``_wj[rank:]``, d and rho are ``_d`` and ``_rho``, eta is :meth:`eta`, r is
``rank``, t is ``t``; the r x r part of an update (Z, its eigendecomposition,
the floors, ``W' = A B``) is :func:`_plan_updates`, in float64 on the host, for
every layer side of one rank at once (:class:`JointFisherUpdates`), or for each
side on a worker thread while the GPU goes on (``JointFisherUpdates(threads=N)``).

With ``delayed_updates`` an update started in one call is applied at the next
updating call instead of the next call (past the initial updates, 3 calls
later with ``update_period`` 4).  The estimates are Kaldi's, update for
update (the rows of an updating call see the same W either way); the calls in
between use the estimate one update older.  That leaves the host until then
to plan the update, and leaves the calls in between fixed device work.

Example::

    prec_in = OnlineNaturalGradient(rank=20)
    xhat, gamma = prec_in.precondition(x)     # x: (N, D) float32; may be overwritten
    step = lr * gamma * xhat                  # gamma * xhat has the norm of x
"""

from __future__ import annotations

import math
import warnings
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .. import backend
from ..state_fields import FLOAT32_MAX, count, described, float32_buffer, number
from ..words import shown
from . import kernels

#: The simple variant's least alpha: its leave-one-out values stay inside (0, N-1)
#: in float64 down to about 1e-10 for layers up to a thousand wide (checked on
#: random, duplicated, zero-column and widely scaled rows, minibatches of 2 up)
SIMPLE_MIN_ALPHA = 1.0e-8

# Kaldi hard-codes these in natural-gradient-online.cc.
NUM_INITIAL_UPDATES = 10      # updates on every call while t <= 10
CONDITION_THRESHOLD = 1.0e6   # c_1 > 1e6 c_r asks for a reorthogonalisation check
ORTHOGONALITY_TOLERANCE = 1.0e-3
CHOLESKY_INVERSE_LIMIT = 100.0
#: The longest row of W a saved state may hold: W = diag(sqrt e) R has rows of norm
#: sqrt(e) < 1; float32 rounding and a reorthogonalisation within its tolerance
#: leave them at most a little longer
MAX_W_ROW_NORM = 1.01


class Preconditioner(ABC):
    """Transforms the (N, D) rows of one side of an affine layer's gradient.

    ``precondition(X)`` returns ``(Xhat, gamma)`` such that ``gamma * Xhat``
    replaces X in the gradient.  It may overwrite X and return it as Xhat:
    callers pass a buffer they no longer need.  State goes to checkpoints
    through :meth:`state_dict` (host NumPy arrays and Python scalars only).

    Example::

        xhat, gamma = prec.precondition(x)
        saved = prec.state_dict()
        prec.reset()
        prec.load_state_dict(saved)
    """

    @abstractmethod
    def precondition(self, X):
        """Return ``(Xhat, gamma)`` for the (N, D) rows X."""

    def reset(self) -> None:
        """Forget all statistics (a fresh start, as after model averaging in Kaldi)."""

    def state_dict(self) -> dict:
        """The state needed to continue exactly where this object is."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""


class IdentityPreconditioner(Preconditioner):
    """Plain SGD: returns X unchanged and gamma = 1.0.

    Example::

        xhat, gamma = IdentityPreconditioner().precondition(x)   # (x, 1.0)
    """

    def precondition(self, X):
        return X, 1.0


def default_ranks(in_dim: int, out_dim: int) -> tuple[int, int]:
    """Kaldi's NG-affine ranks ``(min(20, (I+1)//2), min(80, (O+1)//2))``.

    ``in_dim`` is the affine layer's input dim I; the input side preconditions
    I + 1 columns (the appended 1), which is why ranks use ``I + 1``.

    Example::

        default_ranks(440, 2048)   # (20, 80)
    """
    if int(in_dim) != in_dim or int(out_dim) != out_dim or in_dim < 1 or out_dim < 1:
        raise ValueError(f"default_ranks: in_dim and out_dim must be positive integers, "
                         f"got {in_dim!r} and {out_dim!r}")
    return min(20, (int(in_dim) + 1) // 2), min(80, (int(out_dim) + 1) // 2)


def forgetting_factor(num_rows: int, *, num_samples_history: float = 2000.0,
                      num_minibatches_history: float = 0.0) -> float:
    """eta(N): ``1/num_minibatches_history`` if set, else ``min(0.9, 1 - exp(-N/S))``.

    Example::

        forgetting_factor(512)   # 0.2258580...
    """
    if num_minibatches_history > 0:
        return 1.0 / num_minibatches_history
    # The cap keeps an all-zero minibatch from driving the state towards NaN.
    return min(0.9, 1.0 - math.exp(-num_rows / num_samples_history))


def special_orthonormal(rank: int, dim: int) -> np.ndarray:
    """Kaldi's starting R: row k has entries at columns k, k+r, k+2r, ... < dim.

    The first entry is 1.1 and the rest 1 before the row is normalised, so the
    matrix has orthonormal rows and no zero row or column (for dim >= rank).

    Example::

        special_orthonormal(2, 5) @ special_orthonormal(2, 5).T   # identity
    """
    r0 = np.zeros((rank, dim))
    for k in range(rank):
        cols = np.arange(k, dim, rank)
        r0[k, cols] = 1.0
        r0[k, k] = 1.1
        r0[k] /= math.sqrt(1.1 ** 2 + len(cols) - 1)
    return r0


def _e_from(d: np.ndarray, rho, alpha: float, dim) -> np.ndarray:
    """e_i = d_i / (d_i + beta), beta = rho (1 + alpha) + (alpha/D) sum(d); for one
    estimate (d (r,)) or a stack (d (k, r), rho and dim (k,))."""
    beta = np.asarray(rho * (1.0 + alpha) + alpha * np.sum(d, axis=-1) / dim)
    return 1.0 / (beta[..., None] / d + 1.0)


def _gram_schmidt_rows(m: np.ndarray) -> np.ndarray:
    """Orthonormal rows by Gram-Schmidt, in order (Kaldi's OrthogonalizeRows).

    A row that (nearly) vanishes is orthogonalised again, and a zero row is
    replaced by a seeded random direction, so the result is reproducible.
    """
    m = np.array(m, dtype=np.float64)
    rng = np.random.default_rng(0)
    for i in range(m.shape[0]):
        for _attempt in range(100):
            start = float(m[i] @ m[i])
            if not np.isfinite(start) or start == 0.0:
                m[i] = rng.standard_normal(m.shape[1])
                continue
            m[i] -= (m[:i] @ m[i]) @ m[:i]
            end = float(m[i] @ m[i])
            if end > 0.01 * start:
                m[i] /= math.sqrt(end)
                break
            if end == 0.0:
                m[i] = rng.standard_normal(m.shape[1])
        else:
            raise FloatingPointError("Gram-Schmidt of the natural-gradient basis did not converge")
    return m


class _UpdatePlan:
    """The r x r results of one Fisher update, all float64 on the host.

    ``gram_schmidt``: W' must be orthogonalised by Gram-Schmidt; ``check``: the
    Gram matrix cannot tell whether W' is orthogonal, so W' W'^T must be
    computed from W' itself (Kaldi's check) once W' exists."""

    __slots__ = ("a_matrix", "g", "d", "rho", "e", "gram_schmidt", "check")

    def __init__(self, a_matrix, g, d, rho, e, gram_schmidt, check=False):
        self.a_matrix, self.g, self.d, self.rho, self.e = a_matrix, g, d, rho, e
        self.gram_schmidt = gram_schmidt
        self.check = check


def _plan_update(gram: np.ndarray, x_sq: float, d: np.ndarray, rho: float, *,
                 num_rows: int, dim: int, eta: float, rounding: float, alpha: float,
                 epsilon: float, delta: float) -> _UpdatePlan:
    """The r x r part of one Fisher update (spec section 1), in float64; see
    :func:`_plan_updates`."""
    return _plan_updates(gram[None], np.array([x_sq]), d[None], np.array([rho]),
                         num_rows=np.array([num_rows]), dim=np.array([dim]),
                         eta=np.array([eta]), rounding=np.array([rounding]), alpha=alpha,
                         epsilon=epsilon, delta=delta)[0]


def _plan_updates(gram, x_sq, d, rho, *, num_rows, dim, eta, rounding, alpha: float,
                  epsilon: float, delta: float) -> list:
    """The r x r parts of k Fisher updates of one rank r at once, in float64.

    Stacked: ``gram`` (k, 2r, 2r), ``d`` (k, r), and ``x_sq``, ``rho``,
    ``num_rows``, ``dim``, ``eta`` (k,); ``rounding`` (k,) is the machine
    epsilon of the product that gave the Gram matrix (``backend.gemm_epsilon``).  Each ``gram`` is
    the Gram matrix of [W; J]: it holds W W^T, L = W J^T (= H^T H) and
    K = J J^T.  The new W is ``A (J + diag(g) W)`` with the returned A and g.
    When a reorthogonalisation is due, its lower-triangular transform is
    folded into A, using W' W'^T = A B B^T A^T computed from ``gram``, so the
    device needs no second round trip -- unless the rounding of ``gram``,
    magnified by A, could hide a departure from orthogonality: then the plan
    asks for Kaldi's check on W' itself (``check``).  One call for every layer
    side of a rank costs one pass of small array operations instead of one
    per side (on a GPU the step waits for the host meanwhile); each
    eigendecomposition is the same LAPACK call.
    """
    k, r = d.shape
    ww = gram[:, :r, :r]
    l_mat = 0.5 * (gram[:, :r, r:] + gram[:, r:, :r])   # W J^T and J W^T: symmetrise
    k_mat = 0.5 * (gram[:, r:, r:] + gram[:, r:, r:].transpose(0, 2, 1))
    a = eta / num_rows                                   # (k,)
    b = 1.0 - eta
    u = d + rho[:, None]
    e = _e_from(d, rho, alpha, dim)
    s = 1.0 / np.sqrt(e)
    ss = s[:, :, None] * s[:, None, :]
    # Z = Y Y^T, Y = R T, T = eta X^T X / N + (1 - eta) F   (eqn Zt)
    z_mat = (a * a)[:, None, None] * ss * k_mat \
        + (a * b)[:, None, None] * ss * l_mat * (u[:, :, None] + u[:, None, :])
    diagonal = np.arange(r)
    z_mat[:, diagonal, diagonal] += (b[:, None] * u) ** 2
    # Z grows as the 4th power of the data: eigendecompose a scaled copy.
    z_scale = np.maximum(1.0, np.trace(z_mat, axis1=1, axis2=2))
    c, u_mat = np.linalg.eigh(z_mat / z_scale[:, None, None])
    c = c[:, ::-1] * z_scale[:, None]
    u_mat = u_mat[:, :, ::-1]
    c_floor = (rho * b) ** 2
    reorthogonalize = (c[:, 0] > CONDITION_THRESHOLD * c[:, -1]) \
        | np.any(c < c_floor[:, None], axis=1)
    c = np.maximum(c, c_floor[:, None])
    sqrt_c = np.sqrt(c)
    # rho' keeps tr F' = tr T; the floors follow after d' uses the unfloored rho'.
    rho1 = (a * x_sq + b * (dim * rho + np.sum(d, axis=1)) - np.sum(sqrt_c, axis=1)) / (dim - r)
    d1 = sqrt_c - rho1[:, None]
    floor = np.maximum(epsilon, delta * np.max(sqrt_c, axis=1))
    rho1 = np.maximum(rho1, floor)
    d1 = np.maximum(d1, floor[:, None])
    e1 = _e_from(d1, rho1, alpha, dim)
    sqrt_e1 = np.sqrt(e1)
    g = b[:, None] * u / a[:, None]                    # B = J + diag(g) W
    a_matrix = (a[:, None] * sqrt_e1 / sqrt_c)[:, :, None] * u_mat.transpose(0, 2, 1) \
        * s[:, None, :]
    plans = []
    for i in range(k):
        gram_schmidt = check = False
        a_i = a_matrix[i]
        if reorthogonalize[i]:
            a_i, gram_schmidt, check = _reorthogonalized(
                a_i, g[i], ww[i], l_mat[i], k_mat[i], sqrt_e1[i], float(rounding[i]))
        plans.append(_UpdatePlan(a_i, g[i], d1[i], float(rho1[i]), e1[i], gram_schmidt, check))
    return plans


def _reorthogonalized(a_matrix, g, ww, l_mat, k_mat, sqrt_e1, rounding):
    """A with the transform that makes W' = A B orthogonal (rows of R') folded in,
    whether Gram-Schmidt must run on W' instead, and whether W' W'^T must be
    computed from W' itself because the folded estimate cannot be trusted.

    Entry (k, l) of B B^T, assembled from the Gram matrix, carries a rounding
    error of order ``rounding n_k n_l`` with ``n_k = |J_k| + |g_k| |W_k|`` >= |B_k|
    (``rounding``: machine epsilon of the Gram matrix's dtype), so entry (i, j)
    of O is off by about ``rounding m_i m_j``, ``m = |A| n / sqrt(e')``: the
    factor by which B cancels under A.  In steady state m is below ~30 and O
    from the Gram matrix agrees with W' W'^T to ~1e-5 in float32.  A first
    update from the epsilon state on data of rank below r has m of 1e4 or
    more, and O from the Gram matrix can say W' is orthonormal when a row of
    W' has in fact vanished: then W' W'^T is taken from W' itself.
    """
    n = np.sqrt(np.maximum(np.diagonal(k_mat), 0.0)) \
        + np.abs(g) * np.sqrt(np.maximum(np.diagonal(ww), 0.0))
    magnification = (np.abs(a_matrix) @ n) / sqrt_e1
    if not rounding * float(np.max(magnification)) ** 2 <= ORTHOGONALITY_TOLERANCE:
        return a_matrix, False, True
    bbt = k_mat + l_mat * g[None, :] + g[:, None] * l_mat + g[:, None] * ww * g[None, :]
    o_mat = (a_matrix @ bbt @ a_matrix.T) / np.outer(sqrt_e1, sqrt_e1)
    transform, gram_schmidt = _orthogonalizing_transform(o_mat, sqrt_e1)
    if transform is None:
        return a_matrix, gram_schmidt, False
    return transform @ a_matrix, False, False


def _orthogonalizing_transform(o_mat, sqrt_e1):
    """Kaldi's ReorthogonalizeRt1 on ``O = E'^{-1/2} W' W'^T E'^{-1/2}``:
    ``(None, False)`` when O is the unit matrix within the tolerance,
    ``(E'^{1/2} C^{-1} E'^{-1/2}, False)`` to multiply W' by (O = C C^T), or
    ``(None, True)`` when Gram-Schmidt must run instead."""
    r = sqrt_e1.size
    if np.max(np.abs(np.tril(o_mat - np.eye(r)))) <= ORTHOGONALITY_TOLERANCE:
        return None, False
    c_inv = _cholesky_inverse(o_mat)
    if c_inv is None:
        return None, True
    # W' <- E'^{1/2} C^{-1} E'^{-1/2} W'
    return sqrt_e1[:, None] * c_inv / sqrt_e1[None, :], False


def _cholesky_inverse(o_mat: np.ndarray):
    """C^{-1} for O = C C^T, or None when Kaldi would fall back to Gram-Schmidt."""
    try:
        c_mat = np.linalg.cholesky(o_mat)
        c_inv = np.linalg.inv(c_mat)
    except np.linalg.LinAlgError:
        return None
    c_inv = np.tril(c_inv)
    if not np.all(np.isfinite(c_inv)) or not np.max(c_inv) < CHOLESKY_INVERSE_LIMIT:
        return None
    return c_inv


def _received(pending):
    """``(gram, x_sq, num_rows, dim)`` of a started update once its copies have
    reached the host (float64), or None when its rows were not finite."""
    gram_copy, x_sq_copy, num_rows, dim = pending
    gram = np.asarray(gram_copy.result(), dtype=np.float64)
    x_sq = float(np.asarray(x_sq_copy.result(), dtype=np.float64))
    if not (math.isfinite(x_sq) and np.all(np.isfinite(gram))):
        return None
    return gram, x_sq, num_rows, dim


def _planned_update(pending, d, rho, options):
    """The plan of one started update (:func:`_plan_update`), None when its rows
    were not finite.  Touches no preconditioner, so a worker thread may run it
    while the step goes on."""
    received = _received(pending)
    if received is None:
        return None
    gram, x_sq, num_rows, dim = received
    return _plan_update(gram, x_sq, d, rho, num_rows=num_rows, dim=dim, **options)


class OnlineNaturalGradient(Preconditioner):
    """Kaldi's online natural gradient on (N, D) rows (nnet3 semantics).

    Keeps ``F = R^T diag(d) R + rho I`` (R: rank x D, orthonormal rows) as
    ``W = diag(sqrt e) R`` and returns ``Xhat = X - (X W^T) W`` with
    ``gamma = ||X|| / ||Xhat||``.  The estimate is updated on the first 11
    calls and then every ``update_period`` calls, unless ``frozen``.  N x D
    and rank x D products run in the dtype of X on X's device; all rank x rank
    work is float64 on the host, with one small transfer per update.

    ``precondition`` overwrites X in place and returns it as Xhat (a copy is
    made only when X is not C-contiguous).  gamma is a Python float for NumPy
    input and a 0-d device array for CuPy input, so that calls without an
    update never wait for the GPU; ``float(gamma)`` works for both.

    An update is started in the call whose rows it uses and finished at the
    start of the next call (or when the state is read): its r x r host part
    needs the Gram matrix of [W; J], which is copied to the host without
    stopping the GPU, and waiting for it one call later lets the GPU run the
    rest of the minibatch meanwhile.  The results are the same as finishing
    at once, because nothing reads W in between.  With a ``joint``
    (:class:`JointFisherUpdates`) the first side that finishes finishes every
    side's pending update.

    With ``delayed_updates`` the update is finished at the next updating call
    instead (see the module's docstring); reading the state then leaves a
    pending update pending, and :meth:`state_dict` saves it.

    Example::

        prec = OnlineNaturalGradient(rank=80, update_period=4)
        gh, gamma_out = prec.precondition(g)        # g: (512, 2048) float32
        prec.frozen = True                           # no more updates (t still advances)
    """

    def __init__(self, *, rank: int, update_period: int = 4,
                 num_samples_history: float = 2000.0, num_minibatches_history: float = 0,
                 alpha: float = 4.0, epsilon: float = 1e-10, delta: float = 5e-4,
                 frozen: bool = False, delayed_updates: bool = False):
        if isinstance(rank, bool) or int(rank) != rank or rank < 1:
            raise ValueError(f"OnlineNaturalGradient: rank must be an integer >= 1, got {rank!r}")
        if isinstance(update_period, bool) or int(update_period) != update_period \
                or update_period < 1:
            raise ValueError("OnlineNaturalGradient: update_period must be an integer >= 1, "
                             f"got {update_period!r}")
        if not 0.0 < num_samples_history <= 1.0e6:
            raise ValueError("OnlineNaturalGradient: num_samples_history must be in (0, 1e6], "
                             f"got {num_samples_history!r}")
        if num_minibatches_history != 0 and not num_minibatches_history > 1.0:
            raise ValueError("OnlineNaturalGradient: num_minibatches_history must be 0 (off) "
                             f"or > 1, got {num_minibatches_history!r}")
        if not alpha >= 0.0:
            raise ValueError(f"OnlineNaturalGradient: alpha must be >= 0, got {alpha!r}")
        if not 0.0 < epsilon <= 1.0e-5:
            raise ValueError(f"OnlineNaturalGradient: epsilon must be in (0, 1e-5], got {epsilon!r}")
        if not 0.0 < delta <= 1.0e-2:
            raise ValueError(f"OnlineNaturalGradient: delta must be in (0, 1e-2], got {delta!r}")
        self.rank = int(rank)
        self.update_period = int(update_period)
        self.num_samples_history = float(num_samples_history)
        self.num_minibatches_history = float(num_minibatches_history)
        self.alpha = float(alpha)
        self.epsilon = float(epsilon)
        self.delta = float(delta)
        self.frozen = bool(frozen)
        self.delayed_updates = bool(delayed_updates)
        # the JointFisherUpdates this object's updates are finished with, or None
        self.joint = None
        self.dropped_updates = 0    # updates left out because their rows were not finite
        self.reset()

    # -- state -----------------------------------------------------------------
    def reset(self) -> None:
        pending = getattr(self, "_pending", None)
        if pending is not None:
            # Its copies may still be on their way into the pinned buffers let go of
            # here, and CuPy's pinned pool hands such a block to the next transfer
            # at once: let them land first.
            pending[0].result()
            pending[1].result()
        self.t = 0
        self._rank = self.rank   # may drop to D - 1 at initialisation
        self._d = None           # float64 (rank,) on the host
        self._rho = 0.0
        self._wj = None          # (2 rank, D) device buffer: rows [W; J]
        self._wj_next = None     # the buffer the next W is written into
        self._rows = None        # (H, tmp) scratch for the current minibatch size
        self._cells = None       # on a device: ||X||^2, ||Xhat||^2 and gamma
        self._gram = None        # (2 rank, 2 rank) device buffer, and its host copies
        self._gram_host = None
        self._x_sq_host = None
        self._pending = None     # an update started but not yet finished
        self._planned = None     # its plan on a worker thread (a Future), if any

    @property
    def initialized(self) -> bool:
        return self._wj is not None

    @property
    def W(self):
        """The (rank, D) matrix ``diag(sqrt e) R`` on the device, or None."""
        self._settle()
        return None if self._wj is None else self._wj[:self._rank]

    @property
    def d(self):
        self._settle()
        return None if self._d is None else self._d.copy()

    @property
    def rho(self) -> float:
        self._settle()
        return self._rho

    def _settle(self) -> None:
        """Before the state is read: finish a pending update, unless updates are
        delayed (then finishing it now would change the calls until it is due)."""
        if not self.delayed_updates:
            self._finish_update()

    def state_dict(self) -> dict:
        self._settle()
        if not self.initialized:
            return {"t": int(self.t), "rank": 0, "W": np.zeros((0, 0), np.float32),
                    "d": np.zeros(0), "rho": 0.0}
        state = {"t": int(self.t), "rank": int(self._rank),
                 "W": np.array(backend.to_host(self.W)), "d": self._d.copy(),
                 "rho": float(self._rho)}
        if self._pending is not None:
            # a delayed update: its host inputs and J (rows rank: of the device buffer)
            gram_copy, x_sq_copy, num_rows, _dim = self._pending
            state.update(
                pending_gram=np.array(gram_copy.result()),
                pending_x_sq=np.array(x_sq_copy.result(), dtype=np.float64).reshape(()),
                pending_rows=int(num_rows),
                pending_J=np.array(backend.to_host(self._wj[self._rank:])))
        return state

    def load_state_dict(self, state: dict) -> None:
        where = "OnlineNaturalGradient state"
        for key in ("t", "rank", "W", "d", "rho"):
            if key not in state:
                raise ValueError(f"{where}: missing field {key!r}")
        t = count(state, "t", where)
        rank = count(state, "rank", where)
        w, d = state["W"], state["d"]
        for key, array in (("W", w), ("d", d)):
            if not isinstance(array, np.ndarray) or array.dtype.kind != "f":
                raise ValueError(f"{where}: field {key!r}: expected an array of floats, got "
                                 f"{described(array)}")
        if w.size == 0:
            # (not started: its rho is 0.0, and nothing else is read)
            number(state, "rho", where, low=0.0)
            self.reset()
            self.t = t
            return
        if w.ndim != 2 or w.shape[0] != rank or d.shape != (rank,) or not 0 < rank < w.shape[1]:
            raise ValueError(f"{where}: fields 'W', 'd', 'rank' must be "
                             f"(rank, D), (rank,) and 0 < rank < D, got W {w.shape}, "
                             f"d {d.shape}, rank {rank}")
        # d and rho are a Fisher estimate of float32 rows, whose squared norm is a
        # float32 (a larger one is not finite, and its update is dropped): positive,
        # and at most float32's largest (the update squares d + rho in float64)
        rho = number(state, "rho", where, low=0.0, low_open=True, high=FLOAT32_MAX)
        if not (np.all(np.isfinite(d)) and np.all(d > 0) and np.all(d <= FLOAT32_MAX)):
            bad = d[~((d > 0) & (d <= FLOAT32_MAX))]
            raise ValueError(f"{where}: field 'd': expected finite numbers in (0, "
                             f"{FLOAT32_MAX:g}], got {shown(float(bad[0]))}")
        # W = diag(sqrt e) R with e < 1 and R's rows orthonormal: no row is longer than 1
        # (a little more after float32 rounding); a longer one scales every step up
        if not np.all(np.isfinite(w)):
            raise ValueError(f"{where}: field 'W' holds a value that is not finite")
        norms = np.sqrt(np.sum(np.square(w, dtype=np.float64), axis=1))
        if not np.all(norms <= MAX_W_ROW_NORM):
            raise ValueError(f"{where}: field 'W': a row of norm "
                             f"{float(np.max(norms)):.4g}; expected rows of norm below 1 "
                             "(W = diag(sqrt e) R)")
        self.reset()
        self.t = t
        self._rank = rank
        self._d = d.astype(np.float64)
        self._rho = rho
        self._set_w(np.array(w), np)
        if "pending_gram" in state:
            self._load_pending(state, w.shape[1])

    def _load_pending(self, state: dict, dim: int) -> None:
        """Restore a delayed update saved by :meth:`state_dict`."""
        rank = self._rank
        where = "OnlineNaturalGradient state"
        gram = np.asarray(state["pending_gram"])
        j_rows = np.asarray(state.get("pending_J", np.zeros(0)))
        num_rows = count(state, "pending_rows", where, default=0)
        if gram.shape != (2 * rank, 2 * rank) or j_rows.shape != (rank, dim) or num_rows < 1:
            raise ValueError("OnlineNaturalGradient state: fields 'pending_gram', 'pending_J' "
                             "and 'pending_rows' must be (2 rank, 2 rank), (rank, D) and >= 1, "
                             f"got {gram.shape}, {j_rows.shape} and {num_rows}")
        # (all three are float32 on the device: the Gram matrix, J, and ||X||^2 >= 0)
        gram = float32_buffer(gram, gram.shape, f"{where}: field 'pending_gram'")
        j_rows = float32_buffer(j_rows, j_rows.shape, f"{where}: field 'pending_J'")
        x_sq = state.get("pending_x_sq", np.nan)
        if not (isinstance(x_sq, np.ndarray) and x_sq.dtype.kind == "f" and x_sq.size == 1
                and 0 <= float(x_sq.reshape(())) <= FLOAT32_MAX):
            raise ValueError(f"{where}: field 'pending_x_sq': expected one float in [0, "
                             f"{FLOAT32_MAX:g}], got {described(x_sq)}")
        x_sq = np.asarray(x_sq, dtype=np.float64).reshape(())
        self._wj[rank:] = backend.to_device(j_rows.astype(self._wj.dtype), np)
        self._pending = (backend.HostCopy(gram.astype(self._wj.dtype)),
                         backend.HostCopy(x_sq), num_rows, dim)

    # -- preconditioning -------------------------------------------------------
    def eta(self, num_rows: int) -> float:
        """The forgetting factor for a minibatch of ``num_rows`` rows."""
        return forgetting_factor(num_rows, num_samples_history=self.num_samples_history,
                                 num_minibatches_history=self.num_minibatches_history)

    def updating(self) -> bool:
        """Whether the next call updates the Fisher estimate."""
        return not self.frozen and (self.t <= NUM_INITIAL_UPDATES or
                                    (self.t - NUM_INITIAL_UPDATES) % self.update_period == 0)

    def _update_due(self) -> bool:
        """Whether the next call must finish a pending update first: always, or
        with ``delayed_updates`` when that call updates (or never will)."""
        return self._pending is not None and (
            not self.delayed_updates or self.frozen or self.updating())

    def precondition(self, X):
        X = _check_rows(X, "OnlineNaturalGradient.precondition", writes=True)
        if self._wj is not None and X.shape[1] != self._wj.shape[1]:
            # (they failed in a matrix product, naming neither dimension)
            raise ValueError(f"OnlineNaturalGradient.precondition: rows of dimension "
                             f"{X.shape[1]}, but the estimate is of dimension "
                             f"{self._wj.shape[1]} (set by the first call or "
                             "load_state_dict); use one preconditioner per layer side, or "
                             "reset() it first")
        if X.shape[1] == 1:
            return X, 1.0                      # step 1: D = 1 is the identity
        if self._update_due():
            self._finish_update()              # the previous update
        if not self.initialized:
            self._initialize(X)                # step 2
        updating = self.updating()             # step 3
        gamma = self._precondition_and_update(X, updating)   # steps 4-5
        self.t += 1                            # step 6
        return X, gamma

    def _initialize(self, x0) -> None:
        """Start from the special orthonormal R and run 3 updating passes on X0."""
        xp = backend.get_array_module(x0)
        num_rows, dim = x0.shape
        rank = self.rank
        if rank >= dim:
            warnings.warn(f"OnlineNaturalGradient: rank {rank} >= dim {dim}, using {dim - 1}",
                          stacklevel=3)
            rank = dim - 1
        self._rank = rank
        self._rho = self.epsilon
        self._d = np.full(rank, self.epsilon)
        e0 = 1.0 / (2.0 + (dim + rank) * self.alpha / dim)
        self._set_w(special_orthonormal(rank, dim) * math.sqrt(e0), xp, dtype=x0.dtype)
        # With no more rows than the rank, one pass already finds X0's row space.
        passes = 1 if num_rows <= rank else 3
        for _ in range(passes):
            self._precondition_and_update(x0.copy(), True)
            self._finish_own_update()          # each pass starts from the last one's W

    def _set_w(self, w, xp, dtype=None) -> None:
        rank, dim = w.shape
        dtype = w.dtype if dtype is None else dtype
        self._wj = xp.zeros((2 * rank, dim), dtype=dtype)
        self._wj_next = xp.zeros((2 * rank, dim), dtype=dtype)
        self._wj[:rank] = backend.to_device(np.asarray(w, dtype=dtype), xp)
        self._rows = None

    def _buffers(self, X):
        """Scratch (H, tmp) for this minibatch, and W/J moved to X's device and dtype."""
        xp = backend.get_array_module(X)
        if backend.get_array_module(self._wj) is not xp or self._wj.dtype != X.dtype:
            wj = backend.to_host(self._wj).astype(X.dtype)
            self._set_w(wj[:self._rank], xp)
            self._wj[self._rank:] = backend.to_device(wj[self._rank:], xp)  # J of a pending update
        rows = self._rows
        if rows is None or rows[1].shape != X.shape or backend.get_array_module(rows[1]) is not xp:
            rows = (xp.empty((X.shape[0], self._rank), dtype=X.dtype),
                    xp.empty(X.shape, dtype=X.dtype))
            self._rows = rows
            # On a device the norms and gamma live in fixed cells, so that a step
            # allocates nothing (and can be captured as a CUDA graph).
            self._cells = None if xp is np else xp.empty(3, dtype=X.dtype)
        return xp, rows

    def _precondition_and_update(self, X, updating: bool):
        """Xhat = X - (X W^T) W in place with the pre-call state; start an update if asked."""
        xp, (h, tmp) = self._buffers(X)
        rank = self._rank
        w, j = self._wj[:rank], self._wj[rank:]
        cells = self._cells
        x_sq = kernels.sqnorm(X, None if cells is None else cells[0])
        backend.gemm(X, w, h, trans_b=True)            # H = X W^T
        if updating:
            backend.gemm(h, X, j, trans_a=True)        # J = H^T X, before X changes
        kernels.subtract_product_(X, h, w, tmp)        # Xhat = X - H W
        if cells is None:
            gamma = kernels.gamma(x_sq, kernels.sqnorm(X))
        else:
            gamma = kernels.gamma(x_sq, kernels.sqnorm(X, cells[1]), cells[2])
        if updating:
            self._start_update(xp, X.shape[0], X.shape[1], x_sq)
        return gamma

    def _start_update(self, xp, num_rows: int, dim: int, x_sq) -> None:
        """Queue the Gram matrix of [W; J] (W W^T, L, K) and ||X||^2 for the host."""
        backend.gemm(self._wj, self._wj, self._gram_buffer(xp), trans_b=True)
        self._pending = (backend.copy_to_host_async(self._gram, out=self._gram_host),
                         backend.copy_to_host_async(x_sq, out=self._x_sq_host), num_rows, dim)
        if self.joint is not None:
            self.joint.started(self)

    def _gram_buffer(self, xp):
        """The (2 rank, 2 rank) buffer of the Gram matrix on ``xp``, with its host copies."""
        size = 2 * self._rank
        if self._gram is None or self._gram.shape[0] != size \
                or backend.get_array_module(self._gram) is not xp:
            self._gram = xp.empty((size, size), dtype=self._wj.dtype)
            self._gram_host = backend.pinned_empty((size, size), self._wj.dtype)
            # on a device ||X||^2 is a 0-d array of X's dtype; on the host a float
            self._x_sq_host = None if xp is np else backend.pinned_empty((), self._wj.dtype)
        return self._gram

    def finish_update(self) -> None:
        """Finish an update started by the last call now (it waits for the GPU)."""
        self._finish_update()

    def _finish_update(self) -> None:
        """Finish the pending update: its plan from a worker thread, or this
        object's alone, or with those of its :class:`JointFisherUpdates` (which
        must come before W is read anyway)."""
        if self._pending is None:
            return
        if self.joint is not None and self._planned is None:
            self.joint.finish()
        else:
            self._finish_own_update()

    def _finish_own_update(self) -> None:
        planned, self._planned = self._planned, None
        if planned is not None:                      # planned on a worker thread
            plan = planned.result()
        else:
            plan = _planned_update(*self._plan_arguments())
        self._pending = None
        self._apply_planned(plan)

    def _plan_arguments(self):
        """The arguments of :func:`_planned_update` for the pending update (the
        host copies may still be on their way)."""
        pending = self._pending
        return pending, self._d, self._rho, dict(
            eta=self.eta(pending[2]), rounding=backend.gemm_epsilon(self._wj),
            alpha=self.alpha, epsilon=self.epsilon, delta=self.delta)

    def _apply_planned(self, plan) -> None:
        """Apply a plan of :func:`_planned_update`; None (rows not finite, a
        minibatch the optimizer skips) leaves the estimate as it was."""
        if plan is None:
            self.dropped_updates += 1
        else:
            self._apply_plan(plan)

    def _apply_plan(self, plan: _UpdatePlan) -> None:
        """Fisher update from J (in the buffer) and the host's plan: new W, d, rho."""
        xp = backend.get_array_module(self._wj)
        rank = self._rank
        dtype = self._wj.dtype
        small = backend.to_device(
            np.concatenate([plan.a_matrix, plan.g[:, None]], axis=1).astype(dtype), xp)
        w, b = self._wj[:rank], self._wj[rank:]
        kernels.add_scaled_rows_(b, small[:, rank:], w)   # B = J + diag(g) W
        w_new = self._wj_next[:rank]
        backend.gemm(small[:, :rank], b, w_new)           # W' = A B
        if xp is not np:
            # Copied back rather than swapped: W stays at one address, which a
            # captured CUDA graph of later calls keeps using.
            self._wj[:rank] = w_new
            w_new = self._wj[:rank]
        if plan.check:
            self._check_orthogonal(plan, w_new)
        if plan.gram_schmidt:
            r_new = _gram_schmidt_rows(backend.to_host(w_new))
            w_new[...] = backend.to_device((np.sqrt(plan.e)[:, None] * r_new).astype(dtype), xp)
        if xp is np:
            self._wj, self._wj_next = self._wj_next, self._wj
        self._d, self._rho = plan.d, plan.rho

    def _check_orthogonal(self, plan: _UpdatePlan, w_new) -> None:
        """Kaldi's reorthogonalisation check on the computed W': transform W' in
        place, or mark the plan for Gram-Schmidt.  It waits for the GEMM of
        W' W'^T, as an initialisation pass waits for its Gram matrix; in
        practice it runs only in the first few updates after a (re)start."""
        rank = self._rank
        # the Gram matrix was read already: its first r*r cells are free (an update
        # restored from a checkpoint brought its Gram matrix on the host: none yet)
        gram = self._gram_buffer(backend.get_array_module(w_new))
        o_dev = gram.reshape(-1)[:rank * rank].reshape(rank, rank)
        backend.gemm(w_new, w_new, o_dev, trans_b=True)
        sqrt_e1 = np.sqrt(plan.e)
        o_mat = np.asarray(backend.copy_to_host_async(o_dev).result(), dtype=np.float64) \
            / np.outer(sqrt_e1, sqrt_e1)
        transform, plan.gram_schmidt = _orthogonalizing_transform(o_mat, sqrt_e1)
        if transform is not None:
            xp = backend.get_array_module(w_new)
            scratch = self._wj_next[rank:]          # not W' (rows :rank of one buffer)
            small = backend.to_device(transform.astype(w_new.dtype), xp)
            backend.gemm(small, w_new, scratch)
            w_new[...] = scratch

    def static_call_ahead(self) -> bool:
        """Whether the next call only runs fixed device work (no update to start or
        finish, nothing to initialise): such a call may be replayed from a CUDA
        graph, followed by :meth:`count_replayed_call`."""
        # (and W and the scratch where the last call put them: not after a reset or
        # a load, whose first call moves W to the device and makes the scratch)
        return self.initialized and not self._update_due() and not self.updating() \
            and self._rows is not None

    def graph_buffers(self) -> tuple:
        """The addresses of the device buffers a replayed call uses (W, its scratch
        and cells); a captured graph is valid only while they stay put.  () on the
        host."""
        if self._rows is None or self._cells is None:
            return ()
        return tuple(a.data.ptr for a in (self._wj, *self._rows, self._cells))

    def count_replayed_call(self) -> None:
        """The host side of a call that was replayed from a CUDA graph."""
        self.t += 1


class JointFisherUpdates:
    """Finishes the pending Fisher updates of several preconditioners together,
    or plans each on worker threads while the step goes on.

    NG-SGD updates every layer side's estimate in the same minibatches, and
    each update's r x r part runs on the host.  Finished one side at a time,
    that is a pass of small array operations per side, during which a GPU
    waits; here the first side that needs its update finished finishes all of
    them, with one :func:`_plan_updates` per rank.  The results are those of
    finishing each alone (bit for bit on NumPy, tested), since a side's W is
    read only by its own next call.

    With ``threads`` N > 0 each side's plan is handed to a pool of N threads
    as soon as its update is started: a thread waits for that side's Gram
    matrix to reach the host and plans it (NumPy's eigendecomposition lets
    other threads run), while the training thread goes on queueing the rest
    of the backward pass, the update and the next forward pass for the GPU.
    A side's next call waits for its own plan only.  Each plan is the same
    function of the same inputs as on the training thread, so the results are
    bit for bit those of ``threads=0`` (tested); what changes is that on a
    GPU the host's r x r work overlaps the device's.  On the CPU the threads
    would only take cores from the step's own BLAS.

    Example::

        joint = JointFisherUpdates(optimizer.preconditioners.values(), threads=4)
    """

    def __init__(self, members, *, threads: int = 0):
        if isinstance(threads, bool) or int(threads) != threads or threads < 0:
            raise ValueError(f"JointFisherUpdates: threads must be an integer >= 0, "
                             f"got {threads!r}")
        self.members = [m for m in members if isinstance(m, OnlineNaturalGradient)]
        for member in self.members:
            member.joint = self
        self.threads = int(threads)
        self._pool = None

    def started(self, member: OnlineNaturalGradient) -> None:
        """``member`` has queued an update: with threads, plan it on one now."""
        if self.threads == 0:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                self.threads, thread_name_prefix="fisher-plan",
                initializer=backend.thread_setup(backend.get_array_module(member._wj)))
        member._planned = self._pool.submit(_planned_update, *member._plan_arguments())

    def close(self) -> None:
        """Wait for plans still running on the threads and stop them (a plan
        nobody will take, started before a reset, may still be running)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def finish(self) -> None:
        """Finish every member's pending update now."""
        groups = {}
        for member in self.members:
            if member._planned is not None:
                member._finish_own_update()
            elif member._pending is not None:
                pending, d, rho, options = member._plan_arguments()
                member._pending = None
                received = _received(pending)
                if received is None:
                    member._apply_planned(None)   # that side keeps its estimate
                    continue
                gram, x_sq, num_rows, dim = received
                key = (member._rank, options["alpha"], options["epsilon"], options["delta"])
                groups.setdefault(key, []).append(
                    (member, (gram, x_sq, d, rho, dict(options, num_rows=num_rows, dim=dim))))
        for (_rank, alpha, epsilon, delta), taken in groups.items():
            plans = _plan_updates(
                np.stack([args[0] for _, args in taken]),
                np.array([args[1] for _, args in taken]),
                np.stack([args[2] for _, args in taken]),
                np.array([args[3] for _, args in taken]),
                num_rows=np.array([args[4]["num_rows"] for _, args in taken]),
                dim=np.array([args[4]["dim"] for _, args in taken]),
                eta=np.array([args[4]["eta"] for _, args in taken]),
                rounding=np.array([args[4]["rounding"] for _, args in taken]),
                alpha=alpha, epsilon=epsilon, delta=delta)
            for (member, _args), plan in zip(taken, plans):
                member._apply_plan(plan)


class SimpleNaturalGradient(Preconditioner):
    """nnet2's simple (non-online) variant: leave-one-out Fisher per minibatch.

    Row i is multiplied by the inverse smoothed scatter of the other rows,
    ``(lambda I + S_i/(N-1))^{-1}`` with ``lambda = alpha ||X||^2 / (N D)``,
    via Sherman-Morrison; the result is rescaled to ``||X||`` and gamma is 1.
    It keeps no state.  Unlike :class:`OnlineNaturalGradient` it forms a
    D x D matrix when N >= D (else an N x N one), as nnet2 does, and works in
    float64 whatever the rows' dtype.  X is not modified; Xhat is a new array
    of X's dtype.  ``alpha`` must be at least :data:`SIMPLE_MIN_ALPHA`.

    Example::

        xhat, gamma = SimpleNaturalGradient(alpha=4.0).precondition(x)   # gamma == 1.0
    """

    def __init__(self, *, alpha: float = 4.0):
        if not alpha >= SIMPLE_MIN_ALPHA:
            raise ValueError(f"SimpleNaturalGradient: alpha must be >= {SIMPLE_MIN_ALPHA:g}, "
                             f"got {alpha!r}")
        self.alpha = float(alpha)

    def precondition(self, X):
        X = _check_rows(X, "SimpleNaturalGradient.precondition")
        xp = backend.get_array_module(X)
        num_rows, dim = X.shape
        # float64: in float32 the leave-one-out values h_i came within rounding of
        # N - 1 when lambda is small beside the scatter (a small alpha, N <= D),
        # and q's norm vanished when it is large (a large alpha or large rows)
        Xd = X.astype(np.float64)
        # read through the backend, which counts every device-to-host read
        x_sq = float(backend.to_host(kernels.sqnorm(Xd)))
        if num_rows == 1 or x_sq == 0.0 or not math.isfinite(x_sq):
            # non-finite rows go back as they are: the optimizer skips that step
            return X, 1.0
        lam = self.alpha * max(x_sq, 1e-20) / (num_rows * dim)
        if num_rows >= dim:
            # Q = X (lambda I + X^T X / (N-1))^{-1}
            scatter = xp.matmul(Xd.T, Xd) / (num_rows - 1)
            scatter.reshape(-1)[::dim + 1] += lam      # the diagonal, in place
            q = xp.linalg.solve(scatter, Xd.T).T
        else:
            # The same Q through the N x N matrix: (lambda I + X X^T / (N-1))^{-1} X
            scatter = xp.matmul(Xd, Xd.T) / (num_rows - 1)
            scatter.reshape(-1)[::num_rows + 1] += lam      # the diagonal, in place
            q = xp.linalg.solve(scatter, Xd)
        q = xp.ascontiguousarray(q)
        h = backend.to_host(kernels.row_dots(Xd, q))
        if not (np.all(h >= 0.0) and np.all(h < num_rows - 1)):
            raise FloatingPointError("SimpleNaturalGradient: bad leave-one-out values "
                                     f"x_i . q_i = {h.min()}..{h.max()} (need 0 <= . < N-1)")
        # xhat_i = q_i (N-1)/(N-1-h_i); then one rescale to ||X||, fused per row.
        factors = (num_rows - 1) / (num_rows - 1 - h)
        q_sq = backend.to_host(kernels.row_dots(q, q))
        factors *= math.sqrt(x_sq / float(np.sum(factors ** 2 * q_sq)))
        kernels.scale_rows_(q, backend.to_device(factors[:, None], xp))
        return q.astype(X.dtype), 1.0


def _check_rows(X, where: str, *, writes: bool = False):
    """X as a C-contiguous 2-D float array with at least one row (and one that may be
    written, for a caller that ``writes`` its result into it)."""
    if getattr(X, "ndim", None) is None:
        raise ValueError(f"{where}: expected a 2-D (N, D) array with N >= 1, got a "
                         f"{type(X).__name__}")
    if X.ndim != 2 or X.shape[0] < 1:
        raise ValueError(f"{where}: expected a 2-D (N, D) array with N >= 1, "
                         f"got shape {X.shape}")
    if X.dtype not in (np.float32, np.float64):
        raise ValueError(f"{where}: expected float32 or float64 rows, got {X.dtype}")
    # a read-only array (np.load(..., mmap_mode="r"), a broadcast) cannot take Xhat:
    # NumPy's "output array is read-only" named neither the call nor the argument
    if not X.flags.c_contiguous:
        X = backend.get_array_module(X).ascontiguousarray(X)
    elif writes and not getattr(X.flags, "writeable", True):
        X = X.copy()
    return X
