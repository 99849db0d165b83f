"""RBM stack files (nn/rbm_file.py): round trip, checksum, sizes checked before reading."""

import h5py
import numpy as np
import pytest

from mpitrain.nn.rbm import RBM, RBMStack
from mpitrain.nn.rbm_file import load_rbm_stack, save_rbm_stack


def _stack():
    bottom, top = RBM(6, 4, visible="gaussian"), RBM(4, 3)
    bottom.init_params(seed=1)
    top.init_params(seed=2)
    top.visible_bias[...] = 0.5
    return RBMStack([bottom, top], feat_dim=2, left_context=1, right_context=1,
                    cmvn_mean=np.arange(2.0), cmvn_scale=np.ones(2))


def test_a_stack_file_round_trips(tmp_path):
    path = str(tmp_path / "pretrain.h5")
    save_rbm_stack(path, _stack())
    loaded = load_rbm_stack(path)
    assert [r.spec() for r in loaded.rbms] == [r.spec() for r in _stack().rbms]
    for a, b in zip(loaded.rbms, _stack().rbms):
        np.testing.assert_array_equal(a.params, b.params)
    np.testing.assert_array_equal(loaded.cmvn_mean, [0, 1])
    assert (loaded.left_context, loaded.right_context, loaded.feat_dim) == (1, 1, 2)


def test_a_damaged_stack_file_is_refused_by_its_checksum(tmp_path):
    path = str(tmp_path / "pretrain.h5")
    save_rbm_stack(path, _stack())
    with h5py.File(path, "r+") as f:
        f["layer_001"][0] += 1.0
    with pytest.raises(ValueError, match="pretrain.h5"):
        load_rbm_stack(path)


def test_declared_sizes_are_checked_before_reading(tmp_path):
    path = str(tmp_path / "pretrain.h5")
    save_rbm_stack(path, _stack())
    with h5py.File(path, "r+") as f:
        f.attrs["layers"] = '[{"visible": "gaussian", "visible_dim": 6, "hidden_dim": 400000}]'
    with pytest.raises(ValueError, match="dataset 'layer_000' has shape"):
        load_rbm_stack(path)
    with h5py.File(path, "r+") as f:
        f.attrs["layers"] = '[{"visible": "poisson", "visible_dim": 6, "hidden_dim": 4}]'
    with pytest.raises(ValueError, match="attribute 'layers'"):
        load_rbm_stack(path)
