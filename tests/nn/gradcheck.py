"""Float64 central-difference gradient checks, for the layer and network tests."""

import numpy as np

EPS = 1e-6


def numeric_grad(f, array):
    """d f / d array by central differences (array is modified and restored)."""
    grad = np.zeros_like(array)
    flat, gflat = array.reshape(-1), grad.reshape(-1)
    for i in range(flat.size):
        saved = flat[i]
        flat[i] = saved + EPS
        up = f()
        flat[i] = saved - EPS
        down = f()
        flat[i] = saved
        gflat[i] = (up - down) / (2 * EPS)
    return grad


def check_component(comp, x, *, rtol=1e-6, atol=1e-8):
    """Loss = sum(w * comp(x)) for a fixed random w; compare analytic and numeric."""
    rng = np.random.default_rng(0)
    params = np.zeros(comp.num_params)
    grads = np.zeros(comp.num_params)
    if comp.num_params:
        comp.bind(params, grads)
        params[...] = rng.standard_normal(comp.num_params)
    w = rng.standard_normal((x.shape[0], comp.out_dim))

    def loss():
        return float((comp.forward(x.copy()) * w).sum())

    comp.forward(x.copy())
    dx = comp.backward(w.copy(), need_input_grad=True)
    np.testing.assert_allclose(dx, numeric_grad(loss, x), rtol=rtol, atol=atol)
    if comp.num_params:
        np.testing.assert_allclose(grads, numeric_grad(loss, params), rtol=rtol, atol=atol)
