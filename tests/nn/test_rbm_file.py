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
                    cmvn_mean=np.arange(2.0), cmvn_scale=np.ones(2), speaker_cmvn=None)


def test_a_stack_file_round_trips(tmp_path):
    path = str(tmp_path / "pretrain.h5")
    save_rbm_stack(path, _stack())
    loaded = load_rbm_stack(path)
    assert [r.spec() for r in loaded.rbms] == [r.spec() for r in _stack().rbms]
    for a, b in zip(loaded.rbms, _stack().rbms):
        np.testing.assert_array_equal(a.params, b.params)
    np.testing.assert_array_equal(loaded.cmvn_mean, [0, 1])
    assert (loaded.left_context, loaded.right_context, loaded.feat_dim) == (1, 1, 2)
    assert loaded.speaker_cmvn is None            # recorded: the corpus had none


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


@pytest.mark.parametrize("text", ['{"norm_vars": "yes"}', '"import os"', "[1, 2]", "nul"])
def test_a_speaker_cmvn_record_that_is_neither_null_nor_the_mapping_is_one_line(tmp_path, text):
    path = str(tmp_path / "pretrain.h5")
    save_rbm_stack(path, _stack())
    with h5py.File(path, "r+") as f:
        f.attrs["speaker_cmvn"] = text
    with pytest.raises(ValueError) as info:
        load_rbm_stack(path)
    assert str(info.value).startswith(f"{path}: RBM stack attribute 'speaker_cmvn': expected "
                                      'JSON {"norm_vars": true|false} or null, got '), info.value


def test_a_stack_in_a_newer_format_is_refused_in_one_line(tmp_path):
    path = str(tmp_path / "pretrain.h5")
    save_rbm_stack(path, _stack())
    with h5py.File(path, "r+") as f:
        f.attrs["version"] = 7
    with pytest.raises(ValueError) as info:
        load_rbm_stack(path)
    assert str(info.value) == (f"{path}: RBM stack format version 7 is newer than this "
                               "mpitrain reads (up to 1); use a newer mpitrain")


def _checkpoint(path, *, layer, layer_step, layer_steps):
    from mpitrain.h5io import atomic_h5_file
    from mpitrain.nn.rbm_file import write_stack_group
    with atomic_h5_file(path, checksum=True, what="checkpoint") as f:
        f.attrs["format"] = "mpitrain-pretrain-checkpoint"
        f.attrs["layer"], f.attrs["layer_step"] = layer, layer_step
        f.attrs["layer_steps"] = layer_steps
        write_stack_group(f.create_group("stack"), _stack())
    return path


def test_a_checkpoint_from_a_layers_end_gives_its_stack(tmp_path):
    path = _checkpoint(str(tmp_path / "ckpt-00000040.h5"), layer=2, layer_step=0,
                       layer_steps=0)
    assert len(load_rbm_stack(path).rbms) == 2


def test_a_checkpoint_inside_a_layer_is_refused_in_one_line(tmp_path):
    # the stack's second RBM had 60 of its 179 steps
    path = _checkpoint(str(tmp_path / "ckpt-00000239.h5"), layer=1, layer_step=60,
                       layer_steps=179)
    with pytest.raises(ValueError) as err:
        load_rbm_stack(path)
    assert str(err.value) == (
        f"{path}: a pretraining checkpoint written during layer 2 (step 60 of 179), whose "
        "RBM is not fully trained; use the run's pretrain.h5, or a checkpoint written at "
        "the end of a layer")


def test_a_scale_no_variance_gives_is_refused_naming_the_dimension(tmp_path):
    """A crafted stack (or model) whose cmvn_scale holds zero, a negative value or one
    beyond 1/sqrt of the variance floor: it loaded and flipped or erased that feature
    dimension, or blew every output up (a line blaming the features)."""
    from mpitrain.h5io import write_checksums
    path = str(tmp_path / "pretrain.h5")
    save_rbm_stack(path, _stack())
    for value, shown in ((-0.5, "-0.5"), (3e38, "3e+38")):
        with h5py.File(path, "r+") as f:
            f["cmvn_scale"][1] = value
            del f.attrs["checksum"]
            write_checksums(f, path, what="RBM stack")
        with pytest.raises(ValueError) as info:
            load_rbm_stack(path)
        assert str(info.value) == (f"{path}: dataset 'cmvn_scale' holds {shown} at dimension "
                                   "1; the scales are 1/sqrt(variance), in (0, 1e+30]")
