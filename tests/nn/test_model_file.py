"""Model files: checksummed, verified before a network is built, finite, old files still load."""

import contextlib
import errno
import os
import re

import h5py
import numpy as np
import pytest

from mpitrain.files import DiskFullError
from mpitrain.h5io import CHECKSUM_ATTR, DIGEST_ATTR
from mpitrain.nn.affine import Affine
from mpitrain.nn.model_file import (ModelMismatchError, load_model, model_in_run_dir,
                                    read_model_group, save_model, write_model_group)
from mpitrain.nn.network import Network
from mpitrain.nn.nonlinear import ReLU

PRIORS = np.array([0.2, 0.3, 0.5])


def small_net(seed=1, hidden=8):
    net = Network([Affine(12, hidden), ReLU(hidden), Affine(hidden, 3)], feat_dim=4,
                  left_context=1, right_context=1)
    net.init_params(seed=seed)
    return net


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "final.h5"
    save_model(path, small_net(), class_priors=PRIORS)
    return path


def flip_data_byte(path, dataset, index=0):
    with h5py.File(path, "r") as f:
        offset = f[dataset].id.get_offset()
    with open(path, "r+b") as fh:
        fh.seek(offset + index)
        byte = fh.read(1)
        fh.seek(offset + index)
        fh.write(bytes([byte[0] ^ 0x01]))


def error_of(path) -> str:
    with pytest.raises(ValueError) as err:
        load_model(path)
    text = str(err.value)
    assert text.startswith(f"{path}: ") and "\n" not in text, text
    return text


def test_a_saved_model_carries_digests_and_loads_exactly(model):
    with h5py.File(model, "r") as f:
        assert f.attrs[CHECKSUM_ATTR].startswith("sha256:")
        assert all(DIGEST_ATTR in f[name].attrs for name in f)
    net, priors = load_model(model)
    assert net.params.tobytes() == small_net().params.tobytes()
    np.testing.assert_array_equal(priors, PRIORS)


@pytest.mark.parametrize("dataset", ["params", "cmvn_mean", "cmvn_scale", "class_priors"])
def test_a_flipped_bit_in_any_dataset_is_refused_naming_it(model, dataset):
    flip_data_byte(model, dataset, index=2)
    assert error_of(model) == (f"{model}: damaged model: the data of dataset '{dataset}' does "
                               "not match its SHA-256 checksum")


def test_a_changed_attribute_is_refused(model):
    with h5py.File(model, "a") as f:
        f.attrs["note"] = "edited by hand"     # read by nothing: only the checksum tells
    assert "attributes or layout do not match the stored SHA-256 checksum" in error_of(model)
    with h5py.File(model, "a") as f:
        f.attrs[CHECKSUM_ATTR] = "sha256:xyz"
    assert "attribute 'checksum' is not 'sha256:' and 64 hex digits" in error_of(model)


def write_old_format(path, net):
    """A model file as written before checksums."""
    with h5py.File(path, "w") as f:
        write_model_group(f, net, class_priors=PRIORS)


def test_an_old_model_without_checksums_still_loads(tmp_path):
    path = tmp_path / "old.h5"
    write_old_format(path, small_net(4))
    net, priors = load_model(path)
    assert net.params.tobytes() == small_net(4).params.tobytes()
    np.testing.assert_array_equal(priors, PRIORS)


@pytest.mark.parametrize("dataset,index,value", [("params", 7, np.nan), ("params", 0, -np.inf),
                                                 ("cmvn_scale", 1, np.inf),
                                                 ("class_priors", 2, np.nan)])
def test_non_finite_values_are_refused_naming_the_dataset(tmp_path, dataset, index, value):
    path = tmp_path / "old.h5"
    write_old_format(path, small_net())
    with h5py.File(path, "a") as f:
        f[dataset][index] = value
    assert error_of(path) == (f"{path}: dataset '{dataset}' holds a non-finite value "
                              f"({value} at flat index {index})")


def test_a_non_finite_model_is_not_written(tmp_path, model):
    net = small_net()
    net.params[2] = np.nan
    with pytest.raises(ValueError, match=r"final.h5: not written: dataset 'params' holds"):
        save_model(model, net)
    assert sorted(os.listdir(tmp_path)) == ["final.h5"]
    load_model(model)                        # the previous file is untouched


def test_a_full_disk_names_the_model_file(tmp_path, model, monkeypatch):
    import mpitrain.h5io
    real = mpitrain.h5io.atomic_open

    @contextlib.contextmanager
    def atomic_open(path, mode="w"):
        with real(path, mode) as fh:
            fh.write(b"\x89HDF")
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
            yield fh

    monkeypatch.setattr(mpitrain.h5io, "atomic_open", atomic_open)
    with pytest.raises(DiskFullError) as err:
        save_model(model, small_net(2))
    assert str(err.value) == f"disk quota exceeded writing {model}"
    assert sorted(os.listdir(tmp_path)) == ["final.h5"]
    monkeypatch.undo()
    assert load_model(model)[0].params.tobytes() == small_net().params.tobytes()


def test_loading_into_another_shape_is_a_mismatch_not_damage(model):
    other = small_net(hidden=5)
    before = other.params.copy()
    with h5py.File(model, "r") as f, pytest.raises(ModelMismatchError, match="stored model"):
        read_model_group(f, str(model), into=other)
    np.testing.assert_array_equal(other.params, before)


@pytest.mark.parametrize("change,shown", [
    (dict(nonlinearity="sigmoid"), ("440-64-64-120 relu with", "440-64-64-120 sigmoid with")),
    (dict(normalize=True), ("440-64-64-120 relu with 5", "440-64-64-120 relu+normalize with 7")),
    (dict(nonlinearity="pnorm", pnorm_output_dim=16, pnorm_p=3.0),
     ("component 1: kind pnorm in_dim 64 out_dim 16 p 2.0",
      "component 1: kind pnorm in_dim 64 out_dim 16 p 3.0")),
])
def test_a_mismatch_names_what_differs(tmp_path, change, shown):
    """The description of the two models differed only in the affine sizes and
    the component count: another nonlinearity read as the same model twice."""
    from mpitrain.nn.network import build_network
    base = dict(feat_dim=40, num_classes=120, left_context=5, right_context=5,
                hidden_layers=2, hidden_dim=64)
    if change.get("pnorm_p"):
        base.update(nonlinearity="pnorm", pnorm_output_dim=16)
    saved = build_network(**base)
    saved.init_params(seed=1)
    save_model(tmp_path / "m.h5", saved)
    other = build_network(**{**base, **change})
    with h5py.File(tmp_path / "m.h5", "r") as f, pytest.raises(ModelMismatchError) as err:
        read_model_group(f, str(tmp_path / "m.h5"), into=other)
    message = str(err.value)
    stored, built = message.split(") is not the one the config builds (")
    assert shown[0] in stored and shown[1] in built, message


@pytest.mark.parametrize("name,value", [("selected_dev_frames", np.array([1, 2])),
                                        ("selected_at_step", np.inf),
                                        ("selected_dev_acc", np.array([0.5, 0.6]))])
def test_a_run_directory_with_a_damaged_selection_record_names_no_figure(tmp_path, name, value):
    with h5py.File(tmp_path / "best.h5", "w") as f:
        f.attrs.update({"selected_by": "acc", "selected_dev_acc": 0.5,
                        "selected_at_step": 7, "selected_dev_frames": 100})
        f.attrs[name] = value
    # the model loader names the damage; choosing the file raised TypeError (a traceback)
    assert model_in_run_dir(str(tmp_path)) == (str(tmp_path / "best.h5"),
                                               f"using {tmp_path / 'best.h5'}")


@pytest.mark.parametrize("error", [
    RuntimeError("Error iterating over attributes (integer offset out of bounds)"),
    KeyError("Unable to synchronously open object (unable to determine object type)")])
def test_a_run_directory_whose_best_model_cannot_list_its_attributes(tmp_path, monkeypatch,
                                                                     error):
    """h5py's errors on a damaged attribute heap or root object header (one flipped
    bit of best.h5): eval and export of the run directory ended on a traceback or a
    line naming nothing, before the model loader could name the file."""
    import mpitrain.nn.model_file as model_file
    (tmp_path / "best.h5").write_bytes(b"")

    class Damaged:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        @property
        def attrs(self):
            raise error
    monkeypatch.setattr(model_file, "open_h5_for_reading", lambda path, what: Damaged())
    assert model_in_run_dir(str(tmp_path)) == (str(tmp_path / "best.h5"),
                                               f"using {tmp_path / 'best.h5'}")


def _h5_with_format(path, fmt):
    with h5py.File(path, "w") as f:
        f.attrs["format"] = fmt


@pytest.mark.parametrize("fmt,what", [("mpitrain-rbm-stack", "an RBM stack"),
                                      ("mpitrain-pretrain-checkpoint", "a checkpoint")])
def test_a_pretraining_file_given_as_the_model_says_what_it_is(tmp_path, fmt, what):
    # (it said only "not an mpitrain model (attribute 'format' is 'mpitrain-rbm-stack', ...)")
    _h5_with_format(tmp_path / "pretrain.h5", fmt)
    with pytest.raises(ValueError) as caught:
        load_model(tmp_path / "pretrain.h5")
    assert str(caught.value) == (
        f"{tmp_path / 'pretrain.h5'}: {what} of `mpitrain pretrain`, not a model: train a "
        "model from the run's pretrain.h5 (--set model.init_from=RUN/pretrain.h5) and give that")


def test_a_run_directory_without_a_model_says_where_one_is(tmp_path):
    """eval/export/convert of a pretraining run's directory, or of a run stopped before
    its end and its first held-out evaluation, said only 'a run directory without
    best.h5 or final.h5'."""
    pre, stopped, empty = tmp_path / "pre", tmp_path / "stopped", tmp_path / "empty"
    for run in (pre, stopped, empty):
        run.mkdir()
    _h5_with_format(pre / "pretrain.h5", "mpitrain-rbm-stack")
    at_pre, at_stopped, at_empty = (re.escape(str(run)) for run in (pre, stopped, empty))
    with pytest.raises(FileNotFoundError, match=(
            rf"^{at_pre}: a pretraining run's directory: its pretrain.h5 is an RBM stack, not "
            rf"a model; train a model from it \(--set model.init_from={at_pre}/pretrain.h5\)")):
        model_in_run_dir(str(pre))
    (pre / "pretrain.h5").unlink()
    _h5_with_format(pre / "ckpt-00000100.h5", "mpitrain-pretrain-checkpoint")
    with pytest.raises(FileNotFoundError, match=rf"^{at_pre}: a pretraining run's directory, "
                                                "without its pretrain.h5 yet"):
        model_in_run_dir(str(pre))
    # the newest by when it was written (a run resumed on more ranks numbers its
    # steps lower than those of the run it continues)
    for step, age in ((200, 100), (300, 0)):
        save_model(stopped / f"ckpt-00000{step}.h5", small_net())
        os.utime(stopped / f"ckpt-00000{step}.h5", (1e9 + age, 1e9 + age))
    with pytest.raises(FileNotFoundError, match=(
            rf"^{at_stopped}: a run directory without best.h5 or final.h5 \(the run has not "
            r"ended, nor kept a best held-out model\); give a checkpoint as the model, e.g. "
            rf"the newest, {at_stopped}/ckpt-00000200.h5$")):
        model_in_run_dir(str(stopped))
    with pytest.raises(FileNotFoundError, match=rf"^{at_empty}: a run directory without "
                                                r"best.h5 or final.h5$"):
        model_in_run_dir(str(empty))


def test_a_corpus_directory_given_as_the_model_is_called_a_corpus(tmp_path, capsys):
    """`eval CORPUS MODEL` (the arguments swapped) or load_model(corpus) called the corpus
    'a run directory without best.h5 or final.h5'."""
    from mpitrain.cli import main
    corpus = tmp_path / "dev"
    corpus.mkdir()
    (corpus / "corpus.yaml").write_text("feat_dim: 3\n")
    at = re.escape(str(corpus))
    with pytest.raises(FileNotFoundError, match=rf"^{at}: a corpus directory \(it holds "
                                                r"corpus.yaml\), not a model; give a model "
                                                r"file or the run directory that holds one$"):
        model_in_run_dir(str(corpus))
    assert main(["eval", str(corpus), str(corpus)]) == 2
    assert "a corpus directory (it holds corpus.yaml), not a model" in capsys.readouterr().err


def test_a_benchmarks_report_given_as_the_model_points_to_its_runs(tmp_path, capsys):
    """`eval`/`export` of a bench --out called it 'a run directory without best.h5 or
    final.h5', where `status` and `plot` name it a benchmark's report."""
    from mpitrain.cli import main
    report = tmp_path / "bench-quickstart"
    report.mkdir()
    (report / "bench.json").write_text("{}\n")
    at = re.escape(str(report))
    with pytest.raises(FileNotFoundError, match=rf"^{at}: a benchmark's report \(bench.md, "
                                                rf"bench.json\), not a model; give one of its "
                                                rf"runs, {at}/runs/\*$"):
        model_in_run_dir(str(report))
    assert main(["eval", str(report), str(tmp_path)]) == 2
    assert "a benchmark's report (bench.md, bench.json), not a model" in capsys.readouterr().err


def test_values_read_from_the_file_are_shown_as_numbers_and_a_fixed_length_format_loads(
        tmp_path):
    """A fixed-length string 'format' (as other HDF5 writers store text) was refused
    as "attribute 'format' is np.bytes_(b'mpitrain-model'), expected 'mpitrain-model'",
    and a wrong count was shown as np.int64(-5)."""
    path = tmp_path / "old.h5"
    write_old_format(path, small_net())
    with h5py.File(path, "a") as f:
        f.attrs["format"] = np.bytes_(f.attrs["format"].encode())
        assert isinstance(f.attrs["format"], bytes)
    assert load_model(path)[0].feat_dim == 4
    with h5py.File(path, "a") as f:
        f.attrs["feat_dim"] = np.int64(-5)
    assert error_of(path).endswith("model attribute 'feat_dim': expected an int in "
                                   "[1, 65536], got -5")
