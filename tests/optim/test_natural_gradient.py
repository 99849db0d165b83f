"""Natural-gradient preconditioners against the spec (docs/natural-gradient.md).

The fast W form is checked against the spec's worked example, against a slow
dense float64 reference written here from the spec's equations (it keeps R, d
and rho and inverts the D x D smoothed Fisher matrix), and against the spec's
test oracles.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from mpitrain import backend
from mpitrain.optim import natural_gradient as pc
from mpitrain.optim.natural_gradient import (IdentityPreconditioner, OnlineNaturalGradient,
                                           SimpleNaturalGradient, default_ranks,
                                           forgetting_factor, special_orthonormal)

ALPHA = 4.0
EPS = 1e-10
DELTA = 5e-4


# -- dense reference ---------------------------------------------------------------
class DenseReference:
    """Kaldi's online NG in its textbook form: F = R^T diag(d) R + rho I, dense."""

    def __init__(self, rank, *, update_period=1, num_samples_history=2000.0, alpha=ALPHA):
        self.rank, self.period, self.hist, self.alpha = rank, update_period, num_samples_history, alpha
        self.t, self.R = 0, None

    def eta(self, n):
        return min(0.9, 1 - math.exp(-n / self.hist))

    def fisher(self):
        return self.R.T @ np.diag(self.d) @ self.R + self.rho * np.eye(self.R.shape[1])

    def call(self, X, updating=None):
        X = np.array(X, dtype=np.float64)
        n, dim = X.shape
        if self.R is None:
            self.init(X)
        if updating is None:
            updating = self.t <= 10 or (self.t - 10) % self.period == 0
        F = self.fisher()
        Fs = F + self.alpha / dim * np.trace(F) * np.eye(dim)
        beta = self.rho * (1 + self.alpha) + self.alpha / dim * self.d.sum()
        Xhat = beta * np.linalg.solve(Fs, X.T).T
        gamma = math.sqrt(np.sum(X ** 2) / np.sum(Xhat ** 2)) if np.any(X) else 1.0
        if updating:
            self.update(X, F)
        self.t += 1
        return Xhat, gamma

    def init(self, X0):
        dim = X0.shape[1]
        r = min(self.rank, dim - 1)
        self.R = special_orthonormal(r, dim)
        self.d = np.full(r, EPS)
        self.rho = EPS
        for _ in range(1 if X0.shape[0] <= r else 3):
            self.update(X0, self.fisher())

    def update(self, X, F):
        n, dim = X.shape
        r = self.R.shape[0]
        eta = self.eta(n)
        T = eta / n * X.T @ X + (1 - eta) * F
        Y = self.R @ T
        Z = Y @ Y.T
        c, U = np.linalg.eigh(Z)
        c, U = c[::-1], U[:, ::-1]
        reorth = c[0] > 1e6 * c[-1]
        cfloor = (self.rho * (1 - eta)) ** 2
        if np.any(c < cfloor):
            reorth, c = True, np.maximum(c, cfloor)
        sc = np.sqrt(c)
        rho1 = (np.trace(T) - sc.sum()) / (dim - r)
        d1 = sc - rho1
        f = max(EPS, DELTA * sc.max())
        self.floored_rho = rho1 < f
        rho1, d1 = max(rho1, f), np.maximum(d1, f)
        R1 = (U / sc).T @ Y
        if reorth:
            O = R1 @ R1.T
            if np.max(np.abs(np.tril(O - np.eye(r)))) > 1e-3:
                C = np.linalg.cholesky(O)
                R1 = np.linalg.solve(C, R1)
        self.R, self.d, self.rho = R1, d1, rho1


# -- helpers -----------------------------------------------------------------------
def e_of(d, rho, dim, alpha=ALPHA):
    beta = rho * (1 + alpha) + alpha / dim * np.sum(d)
    return d / (d + beta)


def state_of(prec):
    s = prec.state_dict()
    W = s["W"].astype(np.float64)
    return W, s["d"], s["rho"]


def spectrum_rows(rng, n, dim, decay=0.7, scale=1.0):
    """Rows with a decaying spectrum, so the top subspace is well defined."""
    basis, _ = np.linalg.qr(rng.standard_normal((dim, dim)))
    sd = scale * decay ** np.arange(dim)
    return (rng.standard_normal((n, dim)) * sd) @ basis.T


def ill_conditioned_rows(rng, n, dim):
    """Column scales over 8 decades, a mean offset and a constant column (the bias)."""
    X = rng.standard_normal((n, dim)) * np.logspace(-4, 4, dim)[rng.permutation(dim)]
    X += 3.0 * rng.standard_normal(dim)
    X[:, -1] = 1.0
    return X


def run(prec, batches):
    outs = []
    for X in batches:
        Xhat, g = prec.precondition(np.array(X))
        outs.append((g * Xhat, g))
    return outs


# -- worked example (spec section 6) -----------------------------------------------
X0 = np.array([[1, 0, 0], [0, 2, 0], [0, 0, 1], [1, 1, 1]], dtype=np.float64)
X1 = np.array([[2, -1, 0], [0, 1, 1], [1, 0, -1], [0, 0, 0]], dtype=np.float64)


def test_worked_example_initialisation_and_two_calls():
    prec = OnlineNaturalGradient(rank=1, update_period=1)
    assert prec.eta(4) == pytest.approx(0.0019980013, abs=1e-10)
    prec._initialize(X0.copy())
    W, d, rho = state_of(prec)
    assert np.abs(W[0]) == pytest.approx([0.1831241765, 0.3817567280, 0.1810819308], abs=1e-9)
    assert d[0] == pytest.approx(0.0055404192, abs=1e-9)
    assert rho == pytest.approx(0.0026397207, abs=1e-9)
    assert prec.t == 0

    Xhat, gamma = prec.precondition(X0.copy())
    assert gamma == pytest.approx(1.1467253213, abs=1e-9)
    assert gamma * Xhat[0] == pytest.approx([1.1082705023, -0.0801662903, -0.0380259615], abs=1e-9)
    assert gamma * Xhat[3] == pytest.approx([0.9900782506, 0.8201650914, 0.9918252171], abs=1e-9)
    W, d, rho = state_of(prec)
    assert np.abs(W[0]) == pytest.approx([0.1796960089, 0.3900106279, 0.1780731523], abs=1e-9)
    assert d[0] == pytest.approx(0.0075443389, abs=1e-9)
    assert rho == pytest.approx(0.0034612844, abs=1e-9)

    Xhat, gamma = prec.precondition(X1.copy())
    assert gamma == pytest.approx(1.0337070282, abs=1e-9)
    assert gamma * Xhat[0] == pytest.approx([2.0731015560, -1.0213629296, 0.0056361350], abs=1e-9)
    assert np.all(Xhat[3] == 0)


def test_worked_example_first_call_initialises_itself():
    prec = OnlineNaturalGradient(rank=1, update_period=1)
    Xhat, gamma = prec.precondition(X0.copy())
    assert gamma == pytest.approx(1.1467253213, abs=1e-9)
    assert prec.t == 1


def test_worked_example_affine_update():
    X = np.array([[1, 2], [0, 1], [-1, 0], [2, -1]], dtype=np.float64)
    G = np.array([[.5, -.5], [-1, 1], [.25, 0], [0, -.25]])
    rank_in, rank_out = default_ranks(2, 2)
    assert (rank_in, rank_out) == (1, 1)
    p_in = OnlineNaturalGradient(rank=rank_in, update_period=4)
    p_out = OnlineNaturalGradient(rank=rank_out, update_period=4)
    Xt = np.hstack([X, np.ones((4, 1))])
    Xh, g_in = p_in.precondition(Xt)
    Gh, g_out = p_out.precondition(G.copy())
    s = 0.1 * g_in * g_out
    assert g_in == pytest.approx(1.0702337759, abs=1e-9)
    assert g_out == pytest.approx(1.1561498117, abs=1e-9)
    dW = s * Gh.T @ Xh[:, :2]
    db = s * Gh.T @ Xh[:, 2]
    assert dW == pytest.approx(np.array([[0.0198211002, 0.0022418173],
                                         [-0.1127451805, 0.0322482362]]), abs=1e-9)
    assert db == pytest.approx([-0.0257558527, 0.0302293728], abs=1e-9)


# -- dense reference (oracle 5) -----------------------------------------------------
@pytest.mark.parametrize("kind,period", [("random", 1), ("random", 3), ("ill", 1), ("ill", 4)])
def test_matches_dense_reference(kind, period):
    rng = np.random.default_rng(1 if kind == "random" else 2)
    n, dim, rank = 24, 16, 5
    if kind == "random":
        batches = [spectrum_rows(rng, n, dim) for _ in range(30)]
    else:
        batches = [ill_conditioned_rows(rng, n, dim) for _ in range(30)]
    fast = OnlineNaturalGradient(rank=rank, update_period=period)
    ref = DenseReference(rank, update_period=period)
    tol = 1e-12 if kind == "random" else 1e-6
    for X in batches:
        Y, g = fast.precondition(X.copy())
        Yr, gr = ref.call(X)
        assert g == pytest.approx(gr, rel=tol)
        assert np.linalg.norm(g * Y - gr * Yr) <= tol * np.linalg.norm(X)
    W, d, rho = state_of(fast)
    # Ill-conditioned: the first pass from epsilon leaves R orthonormal to ~1e-5 only;
    # the W form keeps that (Kaldi reorthogonalises above 1e-3), the dense form does not.
    assert d == pytest.approx(ref.d, rel=1e-10 if kind == "random" else 1e-4)
    assert rho == pytest.approx(ref.rho, rel=1e-6)
    # Rows of W may flip sign: compare W^T W with R^T E R.
    e = e_of(ref.d, ref.rho, dim)
    assert W.T @ W == pytest.approx(ref.R.T @ np.diag(e) @ ref.R, abs=1e-6)


def test_matches_dense_reference_small_batches_and_low_rank_data():
    """N <= r (one init pass) and rank-deficient batches over 5 decades of scale."""
    rng = np.random.default_rng(3)
    dim, rank = 12, 6
    fast = OnlineNaturalGradient(rank=rank, update_period=1)
    ref = DenseReference(rank)
    for i in range(25):
        n = 4 if i % 2 == 0 else 40
        X = rng.standard_normal((n, 2)) @ rng.standard_normal((2, dim)) * 10.0 ** (i % 5 - 2)
        Y, g = fast.precondition(X.copy())
        Yr, gr = ref.call(X)
        assert np.linalg.norm(g * Y - gr * Yr) <= 1e-6 * np.linalg.norm(X)
    check_invariants(fast, dim)


def test_matches_dense_reference_when_the_rho_floor_binds():
    """Data in a fixed 2-D subspace and a short memory drive rho' below its floor.

    Then d' must use the unfloored rho' (Kaldi's order), not the floored one.
    """
    rng = np.random.default_rng(24)
    dim, rank = 12, 4
    basis = rng.standard_normal((2, dim))
    fast = OnlineNaturalGradient(rank=rank, update_period=1, num_samples_history=20.0)
    ref = DenseReference(rank, num_samples_history=20.0)
    floored = 0
    for _ in range(12):
        X = rng.standard_normal((40, 2)) @ basis
        Y, g = fast.precondition(X.copy())
        Yr, gr = ref.call(X)
        floored += ref.floored_rho
        assert np.linalg.norm(g * Y - gr * Yr) <= 1e-9 * np.linalg.norm(X)
    assert floored >= 10
    _, d, rho = state_of(fast)
    assert d == pytest.approx(ref.d, rel=1e-9) and rho == pytest.approx(ref.rho, rel=1e-9)


# -- oracles 1-4 --------------------------------------------------------------------
def check_invariants(prec, dim):
    W, d, rho = state_of(prec)
    e = e_of(d, rho, dim)
    R = W / np.sqrt(e)[:, None]
    assert np.max(np.abs(R @ R.T - np.eye(len(d)))) < 1e-3
    assert rho >= EPS and np.all(d >= EPS)
    assert d.min() > 0.9 * DELTA * d.max()
    assert rho > 0.9 * DELTA * d.max()


@pytest.mark.parametrize("maker", [spectrum_rows, ill_conditioned_rows])
def test_oracles_1_to_3(maker):
    rng = np.random.default_rng(4)
    dim = 20
    prec = OnlineNaturalGradient(rank=6, update_period=2)
    for _ in range(20):
        X = maker(rng, 32, dim)
        if prec.initialized:
            W_before = state_of(prec)[0]
        Xhat, gamma = prec.precondition(X.copy())
        # 1: norm preserved, gamma >= 1, rows not turned around
        assert np.linalg.norm(gamma * Xhat) == pytest.approx(np.linalg.norm(X), rel=1e-6)
        assert gamma >= 1.0
        assert np.all(np.einsum("ij,ij->i", X, Xhat) >= 0)
        # 2: Xhat = X - X W^T W with the pre-call W; spectrum of I - W^T W in (0, 1]
        if prec.t > 1:
            assert Xhat == pytest.approx(X - X @ W_before.T @ W_before, abs=1e-10 * np.abs(X).max())
            eig = np.linalg.eigvalsh(np.eye(dim) - W_before.T @ W_before)
            assert eig.min() > 0 and eig.max() <= 1 + 1e-12
        # 3: state invariants after every call
        check_invariants(prec, dim)


def test_oracle_4_trace_is_kept():
    rng = np.random.default_rng(5)
    n, dim = 64, 30
    prec = OnlineNaturalGradient(rank=8, update_period=1)
    prec.precondition(spectrum_rows(rng, n, dim, decay=0.9))
    for _ in range(5):
        _, d, rho = state_of(prec)
        X = spectrum_rows(rng, n, dim, decay=0.9)
        prec.precondition(X.copy())
        _, d1, rho1 = state_of(prec)
        floor = max(EPS, DELTA * np.max(d1 + rho1))
        assert rho1 > floor and np.all(d1 > floor), "a floor is active: pick other data"
        eta = forgetting_factor(n)
        expected = eta * np.sum(X ** 2) / n + (1 - eta) * (dim * rho + d.sum())
        assert dim * rho1 + d1.sum() == pytest.approx(expected, rel=1e-10)


# -- oracle 6: equivariance ---------------------------------------------------------
def test_oracle_6_permutation_sign_and_scale():
    rng = np.random.default_rng(6)
    batches = [spectrum_rows(rng, 16, 10) for _ in range(15)]
    perms = [rng.permutation(16) for _ in batches]
    signs = [rng.choice([-1.0, 1.0], size=(16, 1)) for _ in batches]
    scale = 37.0
    base = OnlineNaturalGradient(rank=4, update_period=2, epsilon=1e-30)
    permuted = OnlineNaturalGradient(rank=4, update_period=2, epsilon=1e-30)
    flipped = OnlineNaturalGradient(rank=4, update_period=2, epsilon=1e-30)
    scaled = OnlineNaturalGradient(rank=4, update_period=2, epsilon=1e-30)
    for X, p, s in zip(batches, perms, signs):
        Y, g = base.precondition(X.copy())
        Yp, gp = permuted.precondition(X[p].copy())
        Ys, gs = flipped.precondition(X * s)
        Yc, gc = scaled.precondition(X * scale)
        assert gp == pytest.approx(g, rel=1e-10) and Yp == pytest.approx(Y[p], abs=1e-10)
        assert gs == pytest.approx(g, rel=1e-10) and Ys == pytest.approx(Y * s, abs=1e-10)
        assert gc == pytest.approx(g, rel=1e-8) and Yc == pytest.approx(Y * scale, rel=1e-7, abs=1e-9)
    W, d, rho = state_of(base)
    for other, c in ((permuted, 1.0), (flipped, 1.0), (scaled, scale)):
        W2, d2, rho2 = state_of(other)
        assert W2.T @ W2 == pytest.approx(W.T @ W, abs=1e-9)
        assert d2 == pytest.approx(d * c ** 2, rel=1e-7)
        assert rho2 == pytest.approx(rho * c ** 2, rel=1e-7)


# -- oracle 7: zero minibatches -----------------------------------------------------
def test_oracle_7_zero_batch_after_data_decays_state():
    rng = np.random.default_rng(7)
    prec = OnlineNaturalGradient(rank=3, update_period=1)
    for _ in range(3):
        prec.precondition(spectrum_rows(rng, 20, 8, decay=0.9))
    W, d, rho = state_of(prec)
    Xhat, gamma = prec.precondition(np.zeros((20, 8)))
    assert gamma == 1.0 and not np.any(Xhat)
    W1, d1, rho1 = state_of(prec)
    eta = forgetting_factor(20)
    assert d1 == pytest.approx((1 - eta) * d, rel=1e-12)
    assert rho1 == pytest.approx((1 - eta) * rho, rel=1e-12)
    assert W1.T @ W1 == pytest.approx(W.T @ W, abs=1e-12)


def test_oracle_7_all_zero_from_start_stays_at_epsilon():
    prec = OnlineNaturalGradient(rank=3, update_period=1)
    for _ in range(5):
        Xhat, gamma = prec.precondition(np.zeros((10, 6)))
        assert gamma == 1.0 and not np.any(Xhat)
        _, d, rho = state_of(prec)
        assert rho == EPS and np.all(d == EPS)


def test_zero_batch_with_eta_cap_stays_finite():
    prec = OnlineNaturalGradient(rank=2, update_period=1, num_samples_history=10.0)
    assert prec.eta(100) == 0.9
    rng = np.random.default_rng(8)
    prec.precondition(rng.standard_normal((100, 5)))
    for _ in range(30):
        prec.precondition(np.zeros((100, 5)))
    _, d, rho = state_of(prec)
    assert np.all(np.isfinite(d)) and np.isfinite(rho) and rho >= EPS


# -- oracle 8: ranks, D == 1, schedule, eta ------------------------------------------
def test_oracle_8_rank_too_large_is_reduced_with_warning():
    prec = OnlineNaturalGradient(rank=10)
    with pytest.warns(UserWarning, match="rank 10 >= dim 4"):
        prec.precondition(np.random.default_rng(0).standard_normal((8, 4)))
    assert state_of(prec)[0].shape == (3, 4)
    prec.reset()
    assert prec.state_dict()["rank"] == 0 and prec.rank == 10


def test_oracle_8_dim_one_is_identity():
    prec = OnlineNaturalGradient(rank=5)
    X = np.arange(6.0).reshape(6, 1)
    Xhat, gamma = prec.precondition(X.copy())
    assert gamma == 1.0 and np.array_equal(Xhat, X)


def test_oracle_8_update_schedule():
    rng = np.random.default_rng(9)
    prec = OnlineNaturalGradient(rank=2, update_period=4)
    updated = []
    for t in range(30):
        before = prec.state_dict()
        assert prec.updating() == (t <= 10 or (t - 10) % 4 == 0)
        prec.precondition(rng.standard_normal((10, 6)))
        after = prec.state_dict()
        if t > 0:
            updated.append(t) if after["rho"] != before["rho"] else None
    assert updated == list(range(1, 11)) + [14, 18, 22, 26]


def test_frozen_stops_updates_but_t_advances():
    rng = np.random.default_rng(10)
    prec = OnlineNaturalGradient(rank=2, update_period=1)
    prec.precondition(rng.standard_normal((10, 6)))
    prec.frozen = True
    before = prec.state_dict()
    for _ in range(3):
        prec.precondition(rng.standard_normal((10, 6)))
    after = prec.state_dict()
    assert after["t"] == before["t"] + 3
    assert after["rho"] == before["rho"] and np.array_equal(after["W"], before["W"])


def test_frozen_from_the_start_still_initialises():
    X = np.random.default_rng(11).standard_normal((10, 6))
    frozen = OnlineNaturalGradient(rank=2, frozen=True)
    live = OnlineNaturalGradient(rank=2)
    live._initialize(X.copy())
    frozen.precondition(X.copy())
    assert frozen.state_dict()["rho"] == live.state_dict()["rho"]


def test_oracle_8_eta_values():
    assert forgetting_factor(128) == pytest.approx(0.0619950, abs=1e-7)
    assert forgetting_factor(512) == pytest.approx(0.2258580, abs=1e-7)
    assert forgetting_factor(4604) < 0.9 and forgetting_factor(4606) == 0.9
    assert forgetting_factor(512, num_minibatches_history=8) == 0.125


def test_default_ranks():
    assert default_ranks(440, 2048) == (20, 80)
    assert default_ranks(2048, 4000) == (20, 80)
    assert default_ranks(10, 30) == (5, 15)
    assert default_ranks(1, 1) == (1, 1)
    with pytest.raises(ValueError, match="in_dim"):
        default_ranks(0, 4)


def test_special_orthonormal():
    R = special_orthonormal(3, 8)
    assert R @ R.T == pytest.approx(np.eye(3), abs=1e-15)
    assert R[0, 0] / R[0, 3] == pytest.approx(1.1)
    assert np.all(np.abs(R).sum(axis=0) > 0)


@pytest.mark.parametrize("kwargs", [dict(rank=0), dict(rank=2.5), dict(rank=2, update_period=0),
                                    dict(rank=2, num_samples_history=0.0),
                                    dict(rank=2, num_minibatches_history=1.0),
                                    dict(rank=2, alpha=-1.0), dict(rank=2, epsilon=0.0),
                                    dict(rank=2, delta=0.1)])
def test_bad_arguments_raise(kwargs):
    with pytest.raises(ValueError, match="OnlineNaturalGradient"):
        OnlineNaturalGradient(**kwargs)


def test_options_are_keyword_only():
    with pytest.raises(TypeError):
        OnlineNaturalGradient(5)


def test_bad_input_raises():
    prec = OnlineNaturalGradient(rank=2)
    with pytest.raises(ValueError, match="2-D"):
        prec.precondition(np.zeros(5))
    with pytest.raises(ValueError, match="float32 or float64"):
        prec.precondition(np.zeros((4, 5), dtype=np.int64))


def test_overwrites_contiguous_input_in_place():
    X = np.random.default_rng(12).standard_normal((10, 6)).astype(np.float32)
    Xhat, gamma = OnlineNaturalGradient(rank=2).precondition(X)
    assert Xhat is X and isinstance(gamma, float)
    view = np.random.default_rng(12).standard_normal((6, 10)).T
    Xhat, _ = OnlineNaturalGradient(rank=2).precondition(view)
    assert Xhat is not view


def test_rows_of_another_dimension_than_the_estimate_are_refused_naming_both():
    # they failed in a matrix product ("matmul: Input operand 1 has a mismatch ...")
    rng = np.random.default_rng(3)
    prec = OnlineNaturalGradient(rank=2)
    prec.precondition(rng.standard_normal((8, 6)))
    for dim in (7, 1):
        with pytest.raises(ValueError, match=rf"precondition: rows of dimension {dim}, but "
                                             r"the estimate is of dimension 6"):
            prec.precondition(rng.standard_normal((8, dim)))
    resumed = OnlineNaturalGradient(rank=2)
    resumed.load_state_dict(prec.state_dict())
    with pytest.raises(ValueError, match="rows of dimension 5, but the estimate is of "
                                         "dimension 6"):
        resumed.precondition(rng.standard_normal((8, 5)))
    prec.reset()
    assert prec.precondition(rng.standard_normal((8, 5)))[0].shape == (8, 5)


def test_read_only_rows_are_copied_and_other_objects_named():
    # NumPy's "output array is read-only" named nothing; a list was "got shape None"
    X = np.random.default_rng(4).standard_normal((10, 6))
    want, gamma = OnlineNaturalGradient(rank=2).precondition(X.copy())
    X.flags.writeable = False
    Xhat, got = OnlineNaturalGradient(rank=2).precondition(X)
    assert Xhat is not X and np.array_equal(Xhat, want) and got == gamma
    for prec in (OnlineNaturalGradient(rank=2), SimpleNaturalGradient()):
        with pytest.raises(ValueError, match=r"precondition: expected a 2-D \(N, D\) array "
                                             r"with N >= 1, got a list"):
            prec.precondition(X.tolist())


def test_float32_tracks_float64():
    rng = np.random.default_rng(13)
    batches = [spectrum_rows(rng, 64, 40, decay=0.8) for _ in range(20)]
    p64 = OnlineNaturalGradient(rank=10)
    p32 = OnlineNaturalGradient(rank=10)
    for X in batches:
        Y64, g64 = p64.precondition(X.copy())
        Y32, g32 = p32.precondition(X.astype(np.float32))
        assert Y32.dtype == np.float32
        assert np.linalg.norm(g32 * Y32 - g64 * Y64) <= 1e-4 * np.linalg.norm(X)


# -- state ----------------------------------------------------------------------------
def test_state_dict_round_trip_gives_identical_outputs(tmp_path):
    h5py = pytest.importorskip("h5py")
    rng = np.random.default_rng(14)
    batches = [spectrum_rows(rng, 32, 12).astype(np.float32) for _ in range(25)]
    prec = OnlineNaturalGradient(rank=4, update_period=3)
    run(prec, batches[:13])
    state = prec.state_dict()
    assert all(isinstance(v, (np.ndarray, int, float)) for v in state.values())
    with h5py.File(tmp_path / "state.h5", "w") as f:
        for key, value in state.items():
            f[key] = value
    with h5py.File(tmp_path / "state.h5", "r") as f:
        loaded = {key: f[key][()] for key in f}
    resumed = OnlineNaturalGradient(rank=4, update_period=3)
    resumed.load_state_dict(loaded)
    assert resumed.t == 13
    for (a, ga), (b, gb) in zip(run(prec, batches[13:]), run(resumed, batches[13:])):
        assert ga == gb and np.array_equal(a, b)


def test_state_dict_of_fresh_object_round_trips():
    fresh = OnlineNaturalGradient(rank=4)
    other = OnlineNaturalGradient(rank=4)
    other.load_state_dict(fresh.state_dict())
    assert not other.initialized and other.t == 0
    X = np.random.default_rng(15).standard_normal((8, 6))
    (a, ga), = run(fresh, [X])
    (b, gb), = run(other, [X])
    assert ga == gb and np.array_equal(a, b)


def test_load_state_dict_rejects_bad_fields():
    prec = OnlineNaturalGradient(rank=2)
    prec.precondition(np.random.default_rng(16).standard_normal((8, 6)))
    state = prec.state_dict()
    with pytest.raises(ValueError, match="missing field 'rho'"):
        prec.load_state_dict({k: v for k, v in state.items() if k != "rho"})
    with pytest.raises(ValueError, match="'W'"):
        prec.load_state_dict(dict(state, d=np.ones(5)))
    # a damaged checkpoint: NaN in W (or an infinite rho) made every output NaN
    with pytest.raises(ValueError, match="field 'W' holds a value that is not finite"):
        prec.load_state_dict(dict(state, W=np.full_like(state["W"], np.nan)))
    with pytest.raises(ValueError, match="field 'rho': expected a finite number"):
        prec.load_state_dict(dict(state, rho=np.inf))
    # text where a count belongs: the field is named (it said "invalid literal for
    # int() with base 10")
    for key in ("rank", "t", "rho"):
        with pytest.raises(ValueError, match=f"field '{key}': expected .*, got 'x'"):
            prec.load_state_dict(dict(state, **{key: "x"}))


@pytest.mark.parametrize("change,named", [
    # (a forged checkpoint, its checksum recomputed: all were taken, and training went
    # on with outputs scaled to nothing, overflowing, or NaN from the first update)
    ({"rho": 1e300}, "field 'rho': expected a finite number in (0, 3.40282e+38], got 1e+300"),
    ({"rho": -1.0}, "field 'rho': expected a finite number in (0,"),
    ({"rho": "1e-3"}, "field 'rho': expected a finite number in (0,"),
    ({"d": np.array([1.0, 1e300])}, "field 'd': expected finite numbers in (0, 3.40282e+38], "
                                    "got 1e+300"),
    ({"d": np.array([1.0, -2.0])}, "field 'd': expected finite numbers"),
    ({"d": np.array([1, 2])}, "field 'd': expected an array of floats"),
    ({"W": "x"}, "field 'W': expected an array of floats, got 'x'"),
    ({"t": -1}, "field 't': expected an int in [0,"),
    ({"t": 5.5}, "field 't': expected an int in [0,"),
    ({"rank": True}, "field 'rank': expected an int"),
    ({"pending_rows": 3, "pending_J": np.zeros((2, 6)), "pending_gram": np.zeros((4, 4)),
      "pending_x_sq": np.array(-1.0)}, "field 'pending_x_sq': expected one float in [0,"),
])
def test_load_state_dict_refuses_what_no_update_produces(change, named):
    prec = OnlineNaturalGradient(rank=2)
    prec.precondition(np.random.default_rng(16).standard_normal((8, 6)))
    state = prec.state_dict()
    with pytest.raises(ValueError) as err:
        prec.load_state_dict(dict(state, **change))
    assert named in str(err.value)


def test_load_state_dict_refuses_a_row_of_w_longer_than_one():
    prec = OnlineNaturalGradient(rank=2)
    prec.precondition(np.random.default_rng(16).standard_normal((8, 6)))
    state = prec.state_dict()
    assert np.all(np.linalg.norm(state["W"], axis=1) < 1)
    with pytest.raises(ValueError, match="field 'W': a row of norm 445.5; expected rows of "
                                         "norm below 1"):
        prec.load_state_dict(dict(state, W=state["W"] * 1e3))


def test_reset_forgets_everything():
    rng = np.random.default_rng(17)
    X = rng.standard_normal((8, 6))
    prec = OnlineNaturalGradient(rank=2)
    (first, _), = run(prec, [X])
    run(prec, [rng.standard_normal((8, 6)) for _ in range(3)])
    prec.reset()
    assert prec.t == 0 and not prec.initialized
    (again, _), = run(prec, [X])
    assert np.array_equal(first, again)


def test_identity_preconditioner():
    X = np.ones((3, 4), np.float32)
    Xhat, gamma = IdentityPreconditioner().precondition(X)
    assert Xhat is X and gamma == 1.0 and IdentityPreconditioner().state_dict() == {}


# -- reorthogonalisation fallbacks ---------------------------------------------------------
def count_calls(monkeypatch, name):
    calls = []
    original = getattr(pc, name)
    monkeypatch.setattr(pc, name, lambda m: calls.append(1) or original(m))
    return calls


def load_skewed_state(prec, rank, dim, skew):
    """A state whose R rows are not orthonormal: unit row 1 leans towards row 0."""
    d = np.array([1.0, 0.5, 0.25])
    rho = 1e-2
    R = special_orthonormal(rank, dim)
    R[1] = (1 - skew) * R[1] + skew * R[0]
    R[1] /= np.linalg.norm(R[1])
    W = np.sqrt(e_of(d, rho, dim))[:, None] * R
    prec.load_state_dict({"t": 20, "rank": rank, "W": W, "d": d, "rho": rho})


@pytest.mark.parametrize("skew,path", [(0.0, None), (0.05, "_cholesky_inverse"),
                                       (0.9999, "_gram_schmidt_rows")])
def test_reorthogonalisation_paths_restore_orthonormal_rows(monkeypatch, skew, path):
    # Always check orthogonality, as if every update were ill-conditioned.
    monkeypatch.setattr(pc, "CONDITION_THRESHOLD", 0.0)
    cholesky = count_calls(monkeypatch, "_cholesky_inverse")
    gram_schmidt = count_calls(monkeypatch, "_gram_schmidt_rows")
    dim, rank = 10, 3
    prec = OnlineNaturalGradient(rank=rank, update_period=1)
    load_skewed_state(prec, rank, dim, skew)
    X = np.random.default_rng(18).standard_normal((40, dim)) * 0.01
    prec.precondition(X)
    prec.finish_update()
    assert bool(cholesky) == (path is not None)
    assert bool(gram_schmidt) == (path == "_gram_schmidt_rows")
    check_invariants(prec, dim)
    W, d, rho = state_of(prec)
    R = W / np.sqrt(e_of(d, rho, dim))[:, None]
    if path is not None:
        assert np.max(np.abs(R @ R.T - np.eye(rank))) < 1e-10


def test_folded_cholesky_equals_transform_of_the_computed_w(monkeypatch):
    """The reorthogonalisation folded into A equals Kaldi's transform of W' itself."""
    monkeypatch.setattr(pc, "CONDITION_THRESHOLD", 0.0)
    dim, rank = 10, 3
    X = np.random.default_rng(19).standard_normal((40, dim)) * 0.3
    folded = OnlineNaturalGradient(rank=rank, update_period=1)
    load_skewed_state(folded, rank, dim, 0.05)
    folded.precondition(X.copy())
    folded.finish_update()
    monkeypatch.setattr(pc, "ORTHOGONALITY_TOLERANCE", np.inf)
    plain = OnlineNaturalGradient(rank=rank, update_period=1)
    load_skewed_state(plain, rank, dim, 0.05)
    plain.precondition(X.copy())
    W1, d1, rho1 = state_of(plain)
    sqrt_e = np.sqrt(e_of(d1, rho1, dim))
    O = (W1 @ W1.T) / np.outer(sqrt_e, sqrt_e)
    assert np.max(np.abs(O - np.eye(rank))) > 1e-3
    C_inv = np.linalg.inv(np.linalg.cholesky(O))
    expected = (sqrt_e[:, None] * C_inv / sqrt_e[None, :]) @ W1
    assert state_of(folded)[0] == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("device", ["host", "standin"])
@pytest.mark.parametrize("seed", [1, 3, 6])
def test_first_update_on_data_of_rank_below_r_keeps_rows_orthonormal(seed, device):
    """From the epsilon state, float32 data of rank r - 1: B = J + g W nearly
    cancels under A, so the folded check from the float32 Gram matrix saw an
    orthonormal W' while a row of W' had vanished (|R R^T - I| = 1, kept for
    many calls).  Such a plan is checked on the computed W', as Kaldi does."""
    import contextlib
    from mpitrain.testing import standin_cupy
    rng = np.random.default_rng(seed)
    dim, rank, n = 101, 20, 512
    basis = rng.standard_normal((rank - 1, dim))
    X = (rng.standard_normal((n, rank - 1)) @ basis).astype(np.float32)
    context = standin_cupy.installed() if device == "standin" else contextlib.nullcontext(np)
    with context as xp:
        prec = OnlineNaturalGradient(rank=rank, update_period=4)
        prec.precondition(backend.to_device(X, xp))
        check_invariants(prec, dim)
        later = (rng.standard_normal((n, rank - 1)) @ basis).astype(np.float32)
        prec.precondition(backend.to_device(later, xp))
        check_invariants(prec, dim)


def test_one_row_minibatches_match_dense_reference():
    """N = 1 <= r: the first update from the epsilon state is as ill-conditioned
    as it gets (c_1 / c_r ~ 1e20); in float64 it must still follow the dense form."""
    rng = np.random.default_rng(25)
    dim, rank = 41, 20
    fast = OnlineNaturalGradient(rank=rank, update_period=1)
    ref = DenseReference(rank)
    for _ in range(40):
        X = rng.standard_normal((1, dim))
        Y, g = fast.precondition(X.copy())
        Yr, gr = ref.call(X)
        assert np.linalg.norm(g * Y - gr * Yr) <= 1e-6 * np.linalg.norm(X)
        check_invariants(fast, dim)


def test_float32_long_run_keeps_invariants():
    rng = np.random.default_rng(23)
    dim = 201
    prec = OnlineNaturalGradient(rank=20, update_period=4)
    for _ in range(60):
        X = ill_conditioned_rows(rng, 128, dim).astype(np.float32) * 1e-2
        Xhat, gamma = prec.precondition(X.copy())
        assert np.all(np.isfinite(Xhat)) and gamma >= 1.0
        assert np.linalg.norm(gamma * Xhat.astype(np.float64)) == pytest.approx(
            np.linalg.norm(X.astype(np.float64)), rel=1e-4)
    check_invariants(prec, dim)


def test_gram_schmidt_rows():
    m = np.array([[1.0, 1.0, 0.0], [1.0, 1.0 + 1e-9, 0.0], [0.0, 0.0, 0.0]])
    q = pc._gram_schmidt_rows(m)
    assert q @ q.T == pytest.approx(np.eye(3), abs=1e-12)
    assert q[0] == pytest.approx(np.array([1, 1, 0]) / math.sqrt(2))


def test_cholesky_inverse_rejects_indefinite_and_large():
    assert pc._cholesky_inverse(np.array([[1.0, 2.0], [2.0, 1.0]])) is None
    assert pc._cholesky_inverse(np.array([[1.0, 0.0], [0.0, 1e-6]])) is None
    c_inv = pc._cholesky_inverse(np.array([[4.0, 2.0], [2.0, 2.0]]))
    assert c_inv @ np.array([[4.0, 2.0], [2.0, 2.0]]) @ c_inv.T == pytest.approx(np.eye(2))


# -- simple variant ------------------------------------------------------------------
@pytest.mark.parametrize("n,dim", [(30, 8), (6, 10)])
def test_simple_matches_direct_leave_one_out(n, dim):
    rng = np.random.default_rng(19)
    X = rng.standard_normal((n, dim)) * np.linspace(0.2, 3.0, dim)
    alpha = 4.0
    lam = alpha * np.sum(X ** 2) / (n * dim)
    direct = np.empty_like(X)
    for i in range(n):
        others = np.delete(X, i, axis=0)
        A = lam * np.eye(dim) + others.T @ others / (n - 1)
        direct[i] = np.linalg.solve(A, X[i])
    direct *= np.linalg.norm(X) / np.linalg.norm(direct)
    Xhat, gamma = SimpleNaturalGradient(alpha=alpha).precondition(X.copy())
    assert gamma == 1.0
    assert Xhat == pytest.approx(direct, rel=1e-9, abs=1e-12)


def test_simple_passes_non_finite_rows_through():
    """A NaN or infinite minibatch (which SGD skips and counts) stopped the run
    with FloatingPointError in the leave-one-out check."""
    for bad in (np.nan, np.inf):
        X = np.ones((8, 5), np.float32)
        X[2, 3] = bad
        Xhat, gamma = SimpleNaturalGradient().precondition(X)
        assert gamma == 1.0 and not np.all(np.isfinite(Xhat))


def test_simple_edge_cases():
    prec = SimpleNaturalGradient()
    zero = np.zeros((4, 3))
    assert prec.precondition(zero)[0] is zero
    one = np.ones((1, 3))
    assert prec.precondition(one)[0] is one
    with pytest.raises(ValueError, match="alpha"):
        SimpleNaturalGradient(alpha=0.0)
    X32 = np.random.default_rng(20).standard_normal((16, 5)).astype(np.float32)
    Xhat, _ = prec.precondition(X32)
    assert Xhat.dtype == np.float32
    assert np.linalg.norm(Xhat) == pytest.approx(np.linalg.norm(X32), rel=1e-5)


@pytest.mark.parametrize("alpha,rows,dim,scale", [
    (1e-6, 2, 201, 1.0),      # FloatingPointError: leave-one-out values past N - 1
    (1e-8, 3, 1000, 1.0),
    (1e4, 3, 5, 1e18),        # ZeroDivisionError: ||Q||^2 vanished in float32
    (1e30, 64, 5, 1.0),
])
def test_simple_at_extreme_alphas_gives_finite_rows_of_the_norm_of_x(alpha, rows, dim, scale):
    X = (np.random.default_rng(22).standard_normal((rows, dim)) * scale).astype(np.float32)
    Xhat, gamma = SimpleNaturalGradient(alpha=alpha).precondition(X.copy())
    assert gamma == 1.0 and Xhat.dtype == np.float32 and np.all(np.isfinite(Xhat))
    assert np.linalg.norm(Xhat.astype(np.float64)) == pytest.approx(
        np.linalg.norm(X.astype(np.float64)), rel=1e-5)
    with pytest.raises(ValueError, match="alpha must be >= 1e-08"):
        SimpleNaturalGradient(alpha=1e-9)


# -- downhill ------------------------------------------------------------------------
def softmax_regression(rng, n=200, dim=12, classes=5):
    X = rng.standard_normal((n, dim)) * np.linspace(0.1, 5.0, dim) + 1.0
    true = rng.standard_normal((classes, dim + 1))
    labels = np.argmax(np.hstack([X, np.ones((n, 1))]) @ true.T + rng.gumbel(size=(n, classes)), axis=1)
    return X, labels


def loss_and_grad(block, X, labels):
    """Summed negative log-prob and G = -dLoss/dY (Kaldi's sign) for y = [x, 1] block^T."""
    Xt = np.hstack([X, np.ones((len(X), 1))])
    logits = Xt @ block.T
    logits -= logits.max(axis=1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    G = -np.exp(logp)
    G[np.arange(len(X)), labels] += 1.0
    return -logp[np.arange(len(X)), labels].sum(), G, Xt


@pytest.mark.parametrize("variant", ["online", "simple"])
def test_preconditioned_step_is_downhill(variant):
    rng = np.random.default_rng(21)
    X, labels = softmax_regression(rng)
    classes, dim = 5, X.shape[1]
    block = np.zeros((classes, dim + 1))
    if variant == "online":
        r_in, r_out = default_ranks(dim, classes)
        p_in, p_out = OnlineNaturalGradient(rank=r_in), OnlineNaturalGradient(rank=r_out)
    else:
        p_in = p_out = SimpleNaturalGradient(alpha=4.0)
    start = loss_and_grad(block, X, labels)[0]
    for step in range(15):
        idx = rng.choice(len(X), 64, replace=False)
        loss, G, Xt = loss_and_grad(block, X[idx], labels[idx])
        true_ascent = G.T @ Xt                     # -dLoss/dblock
        Xh, g_in = p_in.precondition(Xt.copy())
        Gh, g_out = p_out.precondition(G.copy())
        delta = g_in * g_out * Gh.T @ Xh
        assert np.sum(delta * true_ascent) > 0
        small = 1e-4 / np.linalg.norm(delta)
        assert loss_and_grad(block + small * delta, X[idx], labels[idx])[0] < loss
        block += 0.002 * delta
    assert loss_and_grad(block, X, labels)[0] < 0.9 * start


# -- joint Fisher updates: every side's host part in one pass ----------------------------
def _ngsgd_network(seed=3):
    from mpitrain.nn.network import build_network
    from mpitrain.optim.ngsgd import NaturalGradientSGD
    net = build_network(feat_dim=6, num_classes=9, left_context=2, right_context=2,
                        hidden_layers=2, hidden_dim=40)
    net.init_params(seed=seed)
    return net, NaturalGradientSGD(net, rank_in=8, rank_out=12, update_period=2)


def _train_ngsgd(net, opt, steps, seed=4):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        x = rng.standard_normal((32, net.input_dim)).astype(np.float32)
        net.forward_backward(x, rng.integers(0, net.num_classes, 32))
        opt.step(0.01)


def test_joint_updates_equal_each_side_finishing_alone():
    joint_net, joint_opt = _ngsgd_network()
    alone_net, alone_opt = _ngsgd_network()
    for p in alone_opt.preconditioners.values():
        p.joint = None
    _train_ngsgd(joint_net, joint_opt, 20)
    _train_ngsgd(alone_net, alone_opt, 20)
    assert np.array_equal(joint_net.params, alone_net.params)
    for key, p in joint_opt.preconditioners.items():
        mine, theirs = p.state_dict(), alone_opt.preconditioners[key].state_dict()
        assert np.array_equal(mine["W"], theirs["W"]) and np.array_equal(mine["d"], theirs["d"])
        assert mine["rho"] == theirs["rho"] and mine["t"] == theirs["t"] > 0


def test_joint_updates_plan_once_per_rank_and_update(monkeypatch):
    net, opt = _ngsgd_network()
    _train_ngsgd(net, opt, 12)              # past the initial update-every-call phase
    calls = []
    real = pc._plan_updates

    def spy(gram, *args, **kwargs):
        calls.append(gram.shape)
        return real(gram, *args, **kwargs)

    monkeypatch.setattr(pc, "_plan_updates", spy)
    _train_ngsgd(net, opt, 8, seed=5)
    ranks = sorted({p._rank for p in opt.preconditioners.values()})
    sides = {r: sum(p._rank == r for p in opt.preconditioners.values()) for r in ranks}
    # update_period 2: four updates in 8 steps (the last finished when read below)
    opt.preconditioners["layer0_in"].finish_update()
    assert len(calls) == 4 * len(ranks)
    assert sorted(calls) == sorted((sides[r], 2 * r, 2 * r) for r in ranks for _ in range(4))


# -- delayed updates: applied at the next updating call ----------------------------------
def _rows(seed, count, n=40, dim=30):
    rng = np.random.default_rng(seed)
    scale = 0.5 ** (np.arange(dim) / 6)
    return [(rng.standard_normal((n, dim)) * scale).astype(np.float32) for _ in range(count)]


def test_delayed_updates_give_kaldis_estimates_used_later():
    """Fed the same rows, a delayed preconditioner holds Kaldi's estimate after
    every updating call and gives Kaldi's output there, bit for bit; in the
    calls between it uses the estimate one update older."""
    kaldi = OnlineNaturalGradient(rank=5, update_period=4)
    delayed = OnlineNaturalGradient(rank=5, update_period=4, delayed_updates=True)
    # Kaldi's estimate of one update before, frozen between updates
    older = OnlineNaturalGradient(rank=5, update_period=4, frozen=True)
    differed = 0
    for t, x in enumerate(_rows(1, 31)):
        updating = kaldi.updating()
        assert delayed.updating() == updating
        if updating and t >= pc.NUM_INITIAL_UPDATES:
            older.load_state_dict(kaldi.state_dict())     # the estimate before this update
        yk, gk = kaldi.precondition(x.copy())
        yd, gd = delayed.precondition(x.copy())
        if updating or t <= pc.NUM_INITIAL_UPDATES:
            assert np.array_equal(yk, yd) and gk == gd
        else:
            yo, go = older.precondition(x.copy())
            assert np.array_equal(yo, yd) and go == gd
            differed += not np.array_equal(yk, yd)
    assert differed >= 10
    # the last update (t = 30) finished by both: the same estimate
    delayed.frozen = True
    delayed.precondition(_rows(9, 1)[0])
    kaldi.precondition(_rows(9, 1)[0])
    assert np.array_equal(delayed.state_dict()["W"], kaldi.state_dict()["W"])
    assert np.array_equal(delayed.state_dict()["d"], kaldi.state_dict()["d"])


def test_delayed_update_pending_in_a_checkpoint_resumes_bit_for_bit():
    rows = _rows(2, 30)
    straight = OnlineNaturalGradient(rank=5, update_period=4, delayed_updates=True)
    outputs = [straight.precondition(x.copy())[0] for x in rows]
    first = OnlineNaturalGradient(rank=5, update_period=4, delayed_updates=True)
    for x in rows[:17]:                   # t = 14 updated: pending until t = 18
        first.precondition(x.copy())
    state = first.state_dict()
    assert "pending_gram" in state and state["pending_J"].shape == (5, 30)
    # reading the state changed nothing: the first run goes on as the straight one
    assert np.array_equal(first.precondition(rows[17].copy())[0], outputs[17])
    resumed = OnlineNaturalGradient(rank=5, update_period=4, delayed_updates=True)
    resumed.load_state_dict(state)
    for t in range(17, 30):
        assert np.array_equal(resumed.precondition(rows[t].copy())[0], outputs[t]), t
    bad = dict(state, pending_J=np.zeros((4, 30), np.float32))
    with pytest.raises(ValueError, match="pending_gram"):
        OnlineNaturalGradient(rank=5, delayed_updates=True).load_state_dict(bad)


def test_delayed_updates_leave_the_calls_between_updates_replayable():
    kaldi = OnlineNaturalGradient(rank=5, update_period=4)
    delayed = OnlineNaturalGradient(rank=5, update_period=4, delayed_updates=True)
    static = {"kaldi": 0, "delayed": 0}
    for x in _rows(3, 39):
        static["kaldi"] += kaldi.static_call_ahead()
        static["delayed"] += delayed.static_call_ahead()
        kaldi.precondition(x.copy())
        delayed.precondition(x.copy())
    # calls 11-38: 7 updates; Kaldi replays the 2 calls of 4 that neither start
    # nor finish one, delayed the 3 that do not update
    assert static == {"kaldi": 14, "delayed": 21}
# -- plans on worker threads: the same results, planned off the training thread -------
def _ngsgd_run(xp, plan_threads, steps=20, seed=4, update_period=2, delayed=False):
    """Params and preconditioner states after ``steps`` NG-SGD steps on ``xp``."""
    from mpitrain.nn.network import build_network
    from mpitrain.optim.ngsgd import NaturalGradientSGD
    net = build_network(feat_dim=6, num_classes=9, left_context=2, right_context=2,
                        hidden_layers=2, hidden_dim=40, xp=xp)
    net.init_params(seed=3)
    opt = NaturalGradientSGD(net, rank_in=8, rank_out=12, update_period=update_period,
                             plan_threads=plan_threads, delayed_updates=delayed)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        x = rng.standard_normal((32, net.input_dim)).astype(np.float32)
        net.forward_backward(backend.to_device(x, xp),
                             backend.to_device(rng.integers(0, net.num_classes, 32), xp))
        opt.step(0.01)
    return net, opt


@pytest.mark.parametrize("delayed", [False, True], ids=["kaldi-order", "delayed"])
@pytest.mark.parametrize("threads", [1, 3])
def test_plan_threads_train_exactly_as_the_training_thread(xp, threads, delayed, monkeypatch):
    import threading
    where = []
    real = pc._plan_update

    def spy(*args, **kwargs):
        # (a plan of another test's pool may still be running: threads are told
        # apart by object, not by name)
        where.append(threading.current_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(pc, "_plan_update", spy)
    net0, opt0 = _ngsgd_run(xp, 0, update_period=4, delayed=delayed)
    assert opt0.joint_updates._pool is None and threading.main_thread() in where
    where.clear()
    net1, opt1 = _ngsgd_run(xp, threads, update_period=4, delayed=delayed)
    # every update after the initialisation passes was planned on a worker thread
    workers = set(opt1.joint_updates._pool._threads)
    opt1.joint_updates.close()
    assert 0 < len(workers) <= threads and sum(t in workers for t in where) >= 10
    assert np.array_equal(backend.to_host(net0.params), backend.to_host(net1.params))
    for key, p in opt0.preconditioners.items():
        mine, theirs = p.state_dict(), opt1.preconditioners[key].state_dict()
        assert np.array_equal(mine["W"], theirs["W"]) and np.array_equal(mine["d"], theirs["d"])
        assert mine["rho"] == theirs["rho"] and mine["t"] == theirs["t"] > 0


def test_plan_threads_state_read_mid_update_and_reset():
    """A checkpoint taken while plans are on their way waits for them (the state
    equals the training thread's); a reset drops a plan still on its way."""
    _net0, opt0 = _ngsgd_run(np, 0, steps=15)
    _net1, opt1 = _ngsgd_run(np, 2, steps=15)
    assert any(p._planned is not None for p in opt1.preconditioners.values())
    assert opt0.state_dict()["preconditioners"].keys() == opt1.state_dict()["preconditioners"].keys()
    for key, saved in opt1.state_dict()["preconditioners"].items():
        assert np.array_equal(saved["W"], opt0.preconditioners[key].state_dict()["W"])
    _net2, opt2 = _ngsgd_run(np, 2, steps=15)
    opt2.reset_preconditioners()
    assert all(p._pending is None and p._planned is None and not p.initialized
               for p in opt2.preconditioners.values())
    for opt in (opt1, opt2):
        opt.joint_updates.close()          # the dropped plans end here
        assert opt.joint_updates._pool is None


def test_plan_threads_drop_an_update_of_rows_not_finite():
    prec_threads = OnlineNaturalGradient(rank=4, update_period=1)
    prec_alone = OnlineNaturalGradient(rank=4, update_period=1)
    joint = pc.JointFisherUpdates([prec_threads], threads=2)
    rng = np.random.default_rng(2)
    rows = [rng.standard_normal((20, 12)).astype(np.float32) for _ in range(4)]
    rows[2][3, 5] = np.nan
    for x in rows:
        prec_threads.precondition(x.copy())
        prec_alone.precondition(x.copy())
    assert prec_threads.dropped_updates == prec_alone.dropped_updates == 1
    assert np.array_equal(prec_threads.state_dict()["W"], prec_alone.state_dict()["W"])
    joint.close()


@pytest.mark.parametrize("threads", [-1, 1.5, True])
def test_plan_threads_must_be_a_count(threads):
    with pytest.raises(ValueError, match="threads must be an integer >= 0"):
        pc.JointFisherUpdates([], threads=threads)


@pytest.mark.parametrize("threshold", [pc.CONDITION_THRESHOLD, 0.0])
def test_stacked_plans_equal_one_at_a_time(monkeypatch, threshold):
    """_plan_updates over a stack gives each item's _plan_update, including items
    that reorthogonalise (threshold 0 checks every update)."""
    monkeypatch.setattr(pc, "CONDITION_THRESHOLD", threshold)
    inputs = []
    real = pc._plan_update

    def spy(gram, x_sq, d, rho, **options):
        inputs.append((gram, x_sq, d.copy(), rho, options))
        return real(gram, x_sq, d, rho, **options)

    monkeypatch.setattr(pc, "_plan_update", spy)
    rng = np.random.default_rng(6)
    for dim in (30, 31, 45):
        prec = OnlineNaturalGradient(rank=6, update_period=1)
        for _ in range(4):
            prec.precondition((rng.standard_normal((50, dim)) * 0.1 ** rng.random(dim))
                              .astype(np.float32))
        prec.finish_update()
    inputs = inputs[-9:]
    reorthogonalised = []
    real_reorthogonalized = pc._reorthogonalized
    monkeypatch.setattr(pc, "_reorthogonalized", lambda *a: reorthogonalised.append(1)
                        or real_reorthogonalized(*a))
    stacked = pc._plan_updates(
        np.stack([i[0] for i in inputs]), np.array([i[1] for i in inputs]),
        np.stack([i[2] for i in inputs]), np.array([i[3] for i in inputs]),
        num_rows=np.array([i[4]["num_rows"] for i in inputs]),
        dim=np.array([i[4]["dim"] for i in inputs]),
        eta=np.array([i[4]["eta"] for i in inputs]),
        rounding=np.array([i[4]["rounding"] for i in inputs]), alpha=ALPHA, epsilon=EPS,
        delta=DELTA)
    for (gram, x_sq, d, rho, options), plan in zip(inputs, stacked):
        alone = real(gram, x_sq, d, rho, **options)
        np.testing.assert_allclose(plan.a_matrix, alone.a_matrix, rtol=1e-12, atol=1e-300)
        for field in ("g", "d", "e"):
            assert np.array_equal(getattr(plan, field), getattr(alone, field))
        assert plan.rho == alone.rho and plan.gram_schmidt == alone.gram_schmidt
        assert plan.check == alone.check
    assert (len(reorthogonalised) > 0) == (threshold == 0.0)


# -- on the GPU: CuPy agrees with NumPy (marked gpu) -----------------------------------
# Skipped without CuPy or a CUDA device; with MPITRAIN_TEST_GPU=1 those skips
# become failures, so a GPU CI job cannot pass by skipping.

def batches(seed, n, dim, count, dtype=np.float32):
    rng = np.random.default_rng(seed)
    basis, _ = np.linalg.qr(rng.standard_normal((dim, dim)))
    sd = 0.9 ** np.arange(dim)
    out = []
    for _ in range(count):
        X = (rng.standard_normal((n, dim)) * sd) @ basis.T + 0.5
        X[:, -1] = 1.0                                  # the affine input's bias column
        out.append(X.astype(dtype))
    return out


def rel_err(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


CASES = [(128, 65, 8, 1), (256, 300, 20, 4), (512, 2048, 80, 4)]


@pytest.mark.gpu
@pytest.mark.parametrize("n,dim,rank,period", CASES)
def test_each_gpu_call_is_as_accurate_as_numpy_float32(cp, n, dim, rank, period):
    """Per call, from one shared state: the GPU's float32 result is as close to
    the float64 result as NumPy's float32 result is.

    Direct float32 agreement is not a fair test: Xhat = X - (X W^T) W cancels
    most of X (gamma = ||X|| / ||Xhat|| reaches 12 here) and the rows have a
    common offset, so float32 GEMMs summed in different orders (cuBLAS and
    OpenBLAS) differ by up to ~1e-3 relative in Xhat, and the smallest
    eigenvalues d_i of the r x r update inherit the Gram matrix's rounding
    times its condition number.  Both implementations do; the GPU must not be
    more than 3x further from float64 than NumPy, plus a floor where NumPy
    lands almost exactly (1e-6 for Xhat; 1e-5 of the largest d_i, float32's
    6e-8 times a condition number of ~100, for d).
    """
    gpu = OnlineNaturalGradient(rank=rank, update_period=period)
    for X in batches(0, n, dim, 20):
        shared = gpu.state_dict()
        results = {}
        for name, rows in (("f64", X.astype(np.float64)), ("f32", X.copy())):
            prec = OnlineNaturalGradient(rank=rank, update_period=period)
            prec.load_state_dict(shared)
            Y, g = prec.precondition(rows)
            results[name] = (g * Y.astype(np.float64), prec.state_dict())
        Yd, gd = gpu.precondition(cp.asarray(X))
        assert isinstance(gd, cp.ndarray) and gd.shape == () and gd.dtype == cp.float32
        assert isinstance(Yd, cp.ndarray) and Yd.dtype == cp.float32
        exact, exact_state = results["f64"]
        host, host_state = results["f32"]
        gpu_out = float(gd) * backend.to_host(Yd).astype(np.float64)
        assert rel_err(gpu_out, exact) <= 3 * rel_err(host, exact) + 1e-6
        gpu_state = gpu.state_dict()
        assert gpu_state["t"] == host_state["t"] == exact_state["t"]
        d_err = np.abs(gpu_state["d"] - exact_state["d"]).max()
        host_d_err = np.abs(host_state["d"] - exact_state["d"]).max()
        assert d_err <= 3 * host_d_err + 1e-5 * exact_state["d"].max()


@pytest.mark.gpu
@pytest.mark.parametrize("n,dim,rank,period", CASES)
def test_long_gpu_runs_drift_from_float64_like_numpy_float32(cp, n, dim, rank, period):
    """Over 20 calls both float32 runs drift from a float64 run; the GPU's drift
    must be of the same size as NumPy's float32 drift (two correct float32
    implementations), not larger: at most 3x NumPy's, plus 1e-6 for runs where
    NumPy happens to land very close."""
    ref = OnlineNaturalGradient(rank=rank, update_period=period)
    cpu = OnlineNaturalGradient(rank=rank, update_period=period)
    gpu = OnlineNaturalGradient(rank=rank, update_period=period)
    worst_cpu = worst_gpu = 0.0
    for X in batches(0, n, dim, 20):
        Y64, g64 = ref.precondition(X.astype(np.float64))
        Y, g = cpu.precondition(X.copy())
        Yd, gd = gpu.precondition(cp.asarray(X))
        exact = g64 * Y64
        worst_cpu = max(worst_cpu, rel_err(g * Y.astype(np.float64), exact))
        worst_gpu = max(worst_gpu, rel_err(float(gd) * backend.to_host(Yd).astype(np.float64),
                                           exact))
    assert worst_gpu <= 3 * worst_cpu + 1e-6, (worst_gpu, worst_cpu)
    assert gpu.state_dict()["t"] == cpu.state_dict()["t"] == 20


@pytest.mark.gpu
def test_gpu_state_resumes_on_cpu_and_back(cp):
    data = batches(1, 64, 40, 16)
    gpu = OnlineNaturalGradient(rank=6, update_period=2)
    for X in data[:8]:
        gpu.precondition(cp.asarray(X))
    cpu = OnlineNaturalGradient(rank=6, update_period=2)
    cpu.load_state_dict(gpu.state_dict())
    back = OnlineNaturalGradient(rank=6, update_period=2)
    back.load_state_dict(gpu.state_dict())
    for X in data[8:]:
        Yd, gd = gpu.precondition(cp.asarray(X))
        Yb, gb = back.precondition(cp.asarray(X))
        Y, g = cpu.precondition(X.copy())
        assert cp.array_equal(Yd, Yb) and float(gd) == float(gb)
        assert rel_err(float(gd) * backend.to_host(Yd), g * Y) < 1e-4


@pytest.mark.gpu
def test_zero_batch_on_gpu(cp):
    prec = OnlineNaturalGradient(rank=4)
    Y, g = prec.precondition(cp.zeros((16, 10), dtype=cp.float32))
    assert float(g) == 1.0 and not bool(cp.any(Y))
    assert prec.state_dict()["rho"] == prec.epsilon


@pytest.mark.gpu
@pytest.mark.parametrize("n,dim", [(64, 16), (8, 32)])
def test_simple_on_gpu_matches_numpy(cp, n, dim):
    X = batches(2, n, dim, 1)[0]
    Y, g = SimpleNaturalGradient().precondition(X.copy())
    Yd, gd = SimpleNaturalGradient().precondition(cp.asarray(X))
    assert g == gd == 1.0
    assert rel_err(backend.to_host(Yd), Y) < 1e-4


@pytest.mark.parametrize("alpha,n,dim", [(4.0, 64, 16), (1e-6, 2, 32), (1e4, 8, 32)])
def test_simple_on_a_stand_in_device_keeps_the_rows_there_and_matches_the_host(alpha, n,
                                                                               dim):
    """The float64 solve on a device: rows that stay device arrays of X's dtype, no
    host array in a device call (the stand-in refuses one), the host's result."""
    from mpitrain.testing import standin_cupy
    X = batches(5, n, dim, 1)[0]
    expected, _ = SimpleNaturalGradient(alpha=alpha).precondition(X.copy())
    with standin_cupy.installed() as xp:
        rows = backend.to_device(X, xp)
        before = backend.host_read_counts()["blocking"]
        Y, gamma = SimpleNaturalGradient(alpha=alpha).precondition(rows)
        # its reads (||X||^2, the leave-one-out values, the row norms) all go through
        # the backend, which counts them: none is an implicit conversion
        assert standin_cupy.READS["implicit"] == 0
        assert backend.host_read_counts()["blocking"] - before == standin_cupy.READS["asnumpy"]
        assert backend.get_array_module(Y) is xp and Y.dtype == np.float32 and gamma == 1.0
        assert np.array_equal(backend.to_host(Y), expected)

@pytest.mark.parametrize("device", ["host", "standin"])
def test_a_restored_pending_update_that_needs_the_check_resumes_bit_for_bit(device):
    """Data of rank below r: the first updates take Kaldi's orthogonality check.  A
    delayed update restored from a checkpoint brings its Gram matrix on the host;
    the check that finishes it needs the device scratch, which the restore had
    not made (AttributeError on resume, and in a rate-search trial's restore)."""
    import contextlib
    from mpitrain.testing import standin_cupy
    rng = np.random.default_rng(0)
    basis = rng.standard_normal((2, 40)).astype(np.float32)
    rows = [(rng.standard_normal((16, 2)) @ basis * 10.0 ** int(rng.integers(-3, 3))
             ).astype(np.float32) for _ in range(8)]
    context = standin_cupy.installed() if device == "standin" else contextlib.nullcontext(np)
    with context as xp:
        straight = OnlineNaturalGradient(rank=8, delayed_updates=True)
        outputs = [backend.to_host(straight.precondition(backend.to_device(x, xp))[0])
                   for x in rows]
        first = OnlineNaturalGradient(rank=8, delayed_updates=True)
        pending = 0
        for stop in range(1, len(rows)):
            first.precondition(backend.to_device(rows[stop - 1], xp))
            state = first.state_dict()
            pending += "pending_gram" in state
            resumed = OnlineNaturalGradient(rank=8, delayed_updates=True)
            resumed.load_state_dict(state)
            for t in range(stop, len(rows)):
                out = resumed.precondition(backend.to_device(rows[t], xp))[0]
                assert np.array_equal(backend.to_host(out), outputs[t]), (stop, t)
        assert pending >= 3


@pytest.mark.parametrize("delayed", [False, True])
def test_a_reset_or_a_load_lets_no_copy_land_in_buffers_it_let_go(delayed):
    """A started update copies its Gram matrix and ||X||^2 into pinned host buffers
    without waiting.  A reset (or a load, which resets) drops those buffers, and
    CuPy's pinned pool hands a dropped block to the next host-to-device transfer at
    once; a copy still in flight would then overwrite that transfer's data.  So
    the copies must have landed by then (the stand-in lands them only when waited
    for)."""
    from mpitrain.testing import standin_cupy
    rows = batches(6, 32, 24, 3)
    with standin_cupy.installed() as xp, standin_cupy.deferred_copies():
        prec = OnlineNaturalGradient(rank=4, delayed_updates=delayed)
        prec.precondition(backend.to_device(rows[0], xp))      # starts an update
        assert prec._pending is not None and standin_cupy.copies_in_flight() == 2
        prec.reset()
        assert standin_cupy.copies_in_flight() == 0
        prec.precondition(backend.to_device(rows[1], xp))
        saved = OnlineNaturalGradient(rank=4).state_dict()
        assert standin_cupy.copies_in_flight() == 2
        prec.load_state_dict(saved)
        assert standin_cupy.copies_in_flight() == 0


def test_a_call_after_a_reset_or_a_load_is_not_replayable():
    """A captured call reads W and its scratch where the last call left them; a
    reset or a load makes new ones (W on the host after a load), so the next call
    must run eagerly, however the update schedule stands."""
    prec = OnlineNaturalGradient(rank=5, update_period=4)
    rows = _rows(4, 30)
    for x in rows[:15]:
        prec.precondition(x.copy())
    while not prec.static_call_ahead():
        prec.precondition(rows[15].copy())
    state = prec.state_dict()
    restored = OnlineNaturalGradient(rank=5, update_period=4)
    restored.load_state_dict(state)
    assert restored.t == prec.t and not restored._update_due()
    assert not restored.static_call_ahead()
    restored.precondition(rows[16].copy())
    prec.precondition(rows[16].copy())
    assert restored.static_call_ahead() == prec.static_call_ahead()


def test_the_graph_key_follows_the_preconditioners_buffers():
    """NG-SGD's part of a CUDA graph's key is where each preconditioner's W, scratch
    and cells lie: buffers made anew (reset_on_average, a load) give another key,
    so the step is captured again rather than replayed on freed memory."""
    from mpitrain.nn.network import build_network
    from mpitrain.optim.ngsgd import NaturalGradientSGD
    from mpitrain.testing import standin_cupy
    with standin_cupy.installed() as cp:
        net = build_network(feat_dim=6, num_classes=9, left_context=1, right_context=1,
                            hidden_layers=1, hidden_dim=24, xp=cp)
        net.init_params(seed=3)
        opt = NaturalGradientSGD(net, rank_in=4, rank_out=6, update_period=4)
        assert opt.graph_key() == tuple(() for _ in opt.preconditioners)
        rng = np.random.default_rng(1)

        def step():
            x = rng.standard_normal((32, net.input_dim)).astype(np.float32)
            net.forward_backward(cp.asarray(x), cp.asarray(rng.integers(0, 9, 32)))
            opt.step(0.001)

        for _ in range(14):
            step()
        key = opt.graph_key()
        held = [(p._wj, *p._rows, p._cells) for p in opt.preconditioners.values()]
        assert all(len(k) == 4 for k in key)
        assert key == tuple(tuple(a.data.ptr for a in bufs) for bufs in held)
        step()
        assert opt.graph_key() == key or not opt.static_step_ahead()
        opt.after_average()                      # not reset: nothing moves
        assert opt.graph_key() == key
        opt.reset_on_average = True
        opt.after_average()                      # fresh estimates, new buffers
        assert not opt.static_step_ahead()
        for _ in range(14):
            step()
        assert opt.graph_key() != key            # (the old buffers are still held)
        assert held


def test_on_a_device_the_norms_and_gamma_land_in_the_fixed_cells():
    """A captured CUDA graph replays the step's kernels on the addresses they were
    recorded with: ||X||^2, ||Xhat||^2 and gamma must be written into the
    preconditioner's fixed cells, and gamma handed on is the cell itself."""
    from mpitrain.testing import standin_cupy
    rng = np.random.default_rng(2)
    X = rng.standard_normal((64, 30)).astype(np.float32)
    with standin_cupy.installed() as xp:
        prec = OnlineNaturalGradient(rank=6, update_period=4)
        for _ in range(3):
            rows = backend.to_device(X, xp)
            x_sq = float(np.sum(X.astype(np.float64) ** 2))
            xhat, gamma = prec.precondition(rows)
            cells = backend.to_host(prec._cells)
            xhat_sq = float(np.sum(backend.to_host(xhat).astype(np.float64) ** 2))
            # float32 sums of 1920 squares: a few ulps of the float64 sums
            np.testing.assert_allclose(cells[:2], [x_sq, xhat_sq], rtol=1e-5)
            np.testing.assert_allclose(cells[2], np.sqrt(x_sq / xhat_sq), rtol=1e-5)
            assert np.shares_memory(gamma, prec._cells)
