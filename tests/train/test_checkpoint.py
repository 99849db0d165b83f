"""Checkpoints: rotated, complete, verified on load, with a fallback; no temporaries left."""

import errno
import os

import h5py
import numpy as np
import pytest

from mpitrain.files import DiskFullError
from mpitrain.h5io import CHECKSUM_ATTR, DIGEST_ATTR, read_state, write_state
from mpitrain.nn.affine import Affine
from mpitrain.nn.model_file import ModelMismatchError, write_model_group
from mpitrain.nn.network import Network
from mpitrain.nn.nonlinear import ReLU
from mpitrain.train.checkpoint import (FORMAT, checkpoint_path, list_checkpoints,
                                       load_checkpoint, load_latest_good_checkpoint,
                                       remove_stale_temporaries, save_checkpoint)

from ..helpers import train_in_process


@pytest.mark.slow
def test_checkpoints_are_rotated_and_complete(small_corpus, tmp_path):
    run = tmp_path / "run"
    train_in_process(run, small_corpus, ["training.checkpoint_interval=5",
                                         "training.keep_checkpoints=2", "training.max_steps=23",
                                         "model.hidden_dim=32", "training.plot=true"])
    # training.plot draws the run's curves as a PNG next to the model
    with open(run / "curves.png", "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    found = list_checkpoints(run)
    assert [os.path.basename(p) for p in found] == ["ckpt-00000020.h5", "ckpt-00000023.h5"]
    ckpt = load_checkpoint(found[-1])
    assert ckpt.step == 23 and ckpt.num_ranks == 1
    assert ckpt.rank_state(0)["reader"]["batch_pos"] >= 0
    assert not [f for f in os.listdir(run) if ".tmp" in f]


# ---------------------------------------------------------------- verified checkpoints

def small_net(seed=1):
    net = Network([Affine(12, 8), ReLU(8), Affine(8, 3)], feat_dim=4, left_context=1,
                  right_context=1)
    net.init_params(seed=seed)
    return net


def rank_states(net, ranks=2):
    return [{"optimizer": {"num_steps": 5, "lr": 0.01,
                           "delta": np.full(net.num_params, 0.5 + r, np.float32),
                           "preconditioners": {"affine0": {"W": np.ones((2, 13), np.float32),
                                                           "d": np.zeros(0), "rho": 0.1}}},
             "reader": {"epoch": 0, "chunk_pos": 1, "batch_pos": 2 + r}} for r in range(ranks)]


def write(run_dir, step, *, seed=None, keep=None, trainer_state=None, ranks=2):
    net = small_net(seed if seed is not None else step)
    path = checkpoint_path(run_dir, step)
    save_checkpoint(path, net=net, step=step, frames_seen=10 * step, config_yaml="a: 1\n",
                    rank_states=rank_states(net, ranks),
                    strategy_state={"global_model": np.array(net.params)},
                    class_priors=np.full(3, 1 / 3), keep=keep, trainer_state=trainer_state)
    return path, net


def write_old_format(path, net, ranks=2):
    """A checkpoint as written before checksums: the same groups, no digests."""
    with h5py.File(path, "w") as f:
        f.attrs.update({"format": FORMAT, "step": 7, "frames_seen": 70, "num_ranks": ranks,
                        "config": "a: 1\n"})
        write_model_group(f.create_group("model"), net, class_priors=np.full(3, 1 / 3))
        group = f.create_group("ranks")
        for r, state in enumerate(rank_states(net, ranks)):
            write_state(group.create_group(f"{r:05d}"), state)
        write_state(f.create_group("strategy"), {"global_model": np.array(net.params)})


def flip_data_byte(path, dataset, index=0):
    """Invert one byte inside ``dataset``'s stored data, as bit rot would."""
    with h5py.File(path, "r") as f:
        offset = f[dataset].id.get_offset()
    assert offset is not None, dataset
    with open(path, "r+b") as fh:
        fh.seek(offset + index)
        byte = fh.read(1)
        fh.seek(offset + index)
        fh.write(bytes([byte[0] ^ 0xFF]))


def one_line(exc) -> str:
    text = str(exc.value)
    assert "\n" not in text, text
    return text


@pytest.mark.parametrize("dataset", ["model/params", "model/cmvn_scale", "model/class_priors",
                                     "ranks/00001/optimizer/delta",
                                     "ranks/00001/optimizer/preconditioners/affine0/W",
                                     "strategy/global_model"])
def test_a_flipped_byte_in_any_dataset_is_refused_naming_file_and_dataset(tmp_path, dataset):
    path, net = write(tmp_path, 100)
    flip_data_byte(path, dataset, index=5)
    # every rank judges the whole file, not only its own part
    with pytest.raises(ValueError) as err:
        load_checkpoint(path, ranks=[0])
    text = one_line(err)
    assert text.startswith(f"{path}: damaged checkpoint") and f"'{dataset}'" in text
    assert "SHA-256" in text


def test_damage_to_an_attribute_is_refused(tmp_path):
    path, _ = write(tmp_path, 100)
    raw = open(path, "rb").read()
    assert raw.count(b"a: 1\n") == 1
    with open(path, "r+b") as fh:               # the config text, as stored
        fh.seek(raw.index(b"a: 1\n") + 3)
        fh.write(b"2")
    with pytest.raises(ValueError) as err:
        load_checkpoint(path)
    assert "attributes or layout do not match the stored SHA-256 checksum" in one_line(err)


def test_a_lost_checksum_attribute_is_not_taken_for_an_old_file(tmp_path):
    path, _ = write(tmp_path, 100)
    with h5py.File(path, "a") as f:
        del f.attrs[CHECKSUM_ATTR]
    with pytest.raises(ValueError) as err:
        load_checkpoint(path)
    assert f"attribute '{CHECKSUM_ATTR}' is missing but its datasets carry" in one_line(err)


def test_nan_in_the_parameters_is_refused_naming_the_dataset(tmp_path):
    path, _ = write(tmp_path, 100)
    with h5py.File(path, "a") as f:
        f["model/params"][3] = np.nan
    with pytest.raises(ValueError) as err:
        load_checkpoint(path)
    assert "'model/params'" in one_line(err)
    # without checksums (an old file) the value itself is refused
    old = tmp_path / "ckpt-00000007.h5"
    write_old_format(old, small_net())
    with h5py.File(old, "a") as f:
        f["model/params"][3] = np.nan
        f["ranks/00001/optimizer/delta"][0] = np.inf
    with pytest.raises(ValueError) as err:
        load_checkpoint(old, ranks=[0])
    assert one_line(err) == (f"{old}: dataset 'model/params' holds a non-finite value "
                             "(nan at flat index 3)")
    with h5py.File(old, "a") as f:
        f["model/params"][3] = 0.0
    with pytest.raises(ValueError, match="'ranks/00001/optimizer/delta' holds a non-finite"):
        load_checkpoint(old, ranks=[0])
    with h5py.File(old, "a") as f:
        f["ranks/00001/optimizer/delta"][0] = 0.0
        f["ranks/00000/optimizer/preconditioners/affine0"].attrs["rho"] = np.nan
    with pytest.raises(ValueError, match="attribute 'ranks/00000/optimizer/preconditioners/"
                                         "affine0/rho' is not finite"):
        load_checkpoint(old)


def test_a_non_finite_model_is_never_written(tmp_path):
    good, _ = write(tmp_path, 100)
    net = small_net()
    net.params[4] = np.nan
    with pytest.raises(ValueError) as err:
        save_checkpoint(checkpoint_path(tmp_path, 200), net=net, step=200, frames_seen=0,
                        config_yaml="", rank_states=rank_states(net), strategy_state={},
                        keep=2)
    assert one_line(err).startswith(f"{checkpoint_path(tmp_path, 200)}: not written: "
                                    "dataset 'model/params' holds a non-finite value")
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(good)]


def test_an_old_checkpoint_without_checksums_loads_bit_exactly(tmp_path):
    net = small_net(3)
    path = tmp_path / "ckpt-00000007.h5"
    write_old_format(path, net)
    with h5py.File(path, "r") as f:
        assert CHECKSUM_ATTR not in f.attrs and DIGEST_ATTR not in f["model/params"].attrs
    into = small_net(9)
    ckpt = load_checkpoint(path, ranks=[1], into=into)
    assert ckpt.net is into and ckpt.step == 7 and ckpt.trainer_state == {}
    np.testing.assert_array_equal(into.params, net.params)
    assert into.params.tobytes() == net.params.tobytes()
    np.testing.assert_array_equal(ckpt.rank_state(1)["optimizer"]["delta"],
                                  rank_states(net)[1]["optimizer"]["delta"])


def test_a_written_checkpoint_round_trips_and_carries_digests(tmp_path):
    path, net = write(tmp_path, 100, trainer_state={"lr_scale": 0.5, "rollbacks": 1,
                                                     "skipped_total": 3, "note": None})
    with h5py.File(path, "r") as f:
        assert f.attrs[CHECKSUM_ATTR].startswith("sha256:")
        assert len(f["model/params"].attrs[DIGEST_ATTR]) == 64
    into = small_net(9)
    ckpt = load_checkpoint(path, into=into)
    assert into.params.tobytes() == net.params.tobytes()
    assert ckpt.trainer_state == {"lr_scale": 0.5, "rollbacks": 1, "skipped_total": 3,
                                  "note": None}
    assert ckpt.rank_state(1)["optimizer"]["preconditioners"]["affine0"]["d"].shape == (0,)


def test_trainer_state_holds_scalars_only(tmp_path):
    with pytest.raises(TypeError, match=r"trainer_state\['curve'\]: expected a scalar"):
        write(tmp_path, 100, trainer_state={"curve": np.zeros(3)})
    assert os.listdir(tmp_path) == []
    path, _ = write(tmp_path, 100, trainer_state={})
    assert load_checkpoint(path).trainer_state == {}
    with h5py.File(path, "a") as f:              # crafted: a dataset where scalars belong
        f["trainer"].create_dataset("big", shape=(10 ** 10,), dtype="f4", chunks=(1024,))
    with pytest.raises(ValueError) as err:
        load_checkpoint(path)
    assert "checkpoint group 'trainer' holds 'big'; expected scalars only" in one_line(err)


def test_a_damaged_file_leaves_the_network_untouched(tmp_path):
    path, _ = write(tmp_path, 100)
    flip_data_byte(path, "strategy/global_model")
    into = small_net(9)
    before = into.params.copy()
    with pytest.raises(ValueError):
        load_checkpoint(path, ranks=[0], into=into)
    np.testing.assert_array_equal(into.params, before)


def test_fallback_skips_a_damaged_newest_checkpoint(tmp_path):
    for step in (100, 200, 300):
        write(tmp_path, step, keep=3)
    newest = checkpoint_path(tmp_path, 300)
    flip_data_byte(newest, "model/params", index=8)
    into = small_net(9)
    ckpt, skipped = load_latest_good_checkpoint(tmp_path, ranks=[0], into=into)
    assert ckpt.step == 200 and ckpt.net is into
    assert into.params.tobytes() == small_net(200).params.tobytes()
    assert [p for p, _ in skipped] == [newest]
    reason = skipped[0][1]
    assert reason == ("damaged checkpoint: the data of dataset 'model/params' does not match "
                      "its SHA-256 checksum")
    # rewritten whole: the newest, nothing skipped
    write(tmp_path, 300, keep=3)
    ckpt, skipped = load_latest_good_checkpoint(tmp_path)
    assert ckpt.step == 300 and skipped == []


def test_fallback_with_every_checkpoint_bad_is_one_line_naming_each(tmp_path):
    for step in (100, 200):
        write(tmp_path, step)
    flip_data_byte(checkpoint_path(tmp_path, 200), "model/params")
    with open(checkpoint_path(tmp_path, 100), "r+b") as fh:     # not HDF5 any more
        fh.write(b"\0" * 64)
    with pytest.raises(ValueError) as err:
        load_latest_good_checkpoint(tmp_path, ranks=[0])
    text = one_line(err)
    assert text.startswith(f"{tmp_path}: no checkpoint verifies; tried ckpt-00000200.h5 (")
    assert "ckpt-00000100.h5 (not a readable HDF5 checkpoint" in text
    with pytest.raises(ValueError, match="no checkpoint .ckpt-.\\.h5. found"):
        load_latest_good_checkpoint(tmp_path / "empty")


def test_fallback_does_not_skip_a_model_of_another_shape(tmp_path):
    write(tmp_path, 100)
    write(tmp_path, 200)
    other = Network([Affine(12, 5), ReLU(5), Affine(5, 3)], feat_dim=4, left_context=1,
                    right_context=1)
    with pytest.raises(ModelMismatchError, match="ckpt-00000200.h5: the stored model"):
        load_latest_good_checkpoint(tmp_path, into=other)


def test_rotation_keeps_at_least_two(tmp_path):
    for step in (100, 200, 300):
        write(tmp_path, step, keep=1)
    assert [os.path.basename(p) for p in list_checkpoints(tmp_path)] == \
        ["ckpt-00000200.h5", "ckpt-00000300.h5"]
    write(tmp_path, 400, keep=3)
    write(tmp_path, 500, keep=3)
    assert [os.path.basename(p) for p in list_checkpoints(tmp_path)] == \
        ["ckpt-00000300.h5", "ckpt-00000400.h5", "ckpt-00000500.h5"]


def test_a_directory_named_like_a_checkpoint_is_neither_counted_nor_removed(tmp_path):
    # it counted toward the kept checkpoints, and the rotation that reached it
    # failed the save with IsADirectoryError
    (tmp_path / "ckpt-00000050.h5").mkdir()
    (tmp_path / "ckpt-00000050.h5" / "mine.txt").write_text("x")
    for step in (100, 200, 300):
        write(tmp_path, step, keep=2)
    assert [os.path.basename(p) for p in list_checkpoints(tmp_path)] == \
        ["ckpt-00000200.h5", "ckpt-00000300.h5"]
    assert (tmp_path / "ckpt-00000050.h5" / "mine.txt").exists()


def test_a_named_pipe_named_like_a_checkpoint_is_never_opened(tmp_path):
    """A named pipe (or a link to one) where a checkpoint belongs: opening it to
    read its progress waited for a writer for ever (``--resume`` hung), and a
    checkpoint written there waited for a reader."""
    import subprocess
    import sys
    write(tmp_path, 100)
    os.mkfifo(tmp_path / "ckpt-00000200.h5")
    os.symlink(tmp_path / "ckpt-00000200.h5", tmp_path / "ckpt-00000300.h5")
    script = (
        "import sys\n"
        "from mpitrain.train.checkpoint import checkpoint_path, list_checkpoints\n"
        "from tests.train.test_checkpoint import write\n"
        "print([p.rsplit('/', 1)[1] for p in list_checkpoints(sys.argv[1])])\n"
        "for step in (200, 300):\n"
        "    try:\n"
        "        write(sys.argv[1], step)\n"
        "    except ValueError as exc:\n"
        "        print(exc)\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=root,
                          capture_output=True, text=True, timeout=60)
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and lines[0] == "['ckpt-00000100.h5']", done
    for step, said in zip((200, 300), lines[1:]):
        assert said.startswith(f"{tmp_path}/ckpt-00000{step}.h5: is not a regular file"), said
    assert len(lines) == 3 and os.path.islink(tmp_path / "ckpt-00000300.h5")


def test_rotation_drops_checkpoints_of_an_abandoned_timeline(tmp_path):
    # resumed from 200 after 300 and 400 were skipped: the next save is at 250
    for step in (100, 200, 300, 400):
        write(tmp_path, step, keep=None)
    write(tmp_path, 250, keep=3)
    assert [os.path.basename(p) for p in list_checkpoints(tmp_path)] == \
        ["ckpt-00000100.h5", "ckpt-00000200.h5", "ckpt-00000250.h5"]


def test_stale_temporaries_are_removed_and_nothing_else(tmp_path):
    path, _ = write(tmp_path, 100)
    stale = [".ckpt-00000200.h5.tmp-4242", ".final.h5.tmp-17", ".config.yaml.tmp-999999"]
    kept = ["notes.txt", ".hidden", "ckpt-00000300.h5.tmp-5", ".x.tmp-", ".x.tmp-12a",
            ".x.tmp-12.bak", f".own.h5.tmp-{os.getpid()}", "metrics.jsonl"]
    for name in stale + kept:
        (tmp_path / name).write_bytes(b"partial")
    (tmp_path / ".dir.tmp-5").mkdir()
    removed = remove_stale_temporaries(tmp_path)
    assert removed == sorted(str(tmp_path / name) for name in stale)
    assert sorted(os.listdir(tmp_path)) == sorted(kept + [".dir.tmp-5",
                                                          os.path.basename(path)])


class FullDisk:
    """A file handle whose disk fills after ``room`` bytes."""

    def __init__(self, fh, room):
        self.fh, self.room = fh, room

    def write(self, data):
        data = memoryview(data)
        if len(data) > self.room:
            self.fh.write(data[:self.room])
            self.room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.fh.write(data)


def fill_disk_after(monkeypatch, room):
    import contextlib

    import mpitrain.h5io
    real = mpitrain.h5io.atomic_open

    @contextlib.contextmanager
    def atomic_open(path, mode="w"):
        with real(path, mode) as fh:
            yield FullDisk(fh, room)

    monkeypatch.setattr(mpitrain.h5io, "atomic_open", atomic_open)


def test_a_full_disk_names_the_checkpoint_and_leaves_no_temporary(tmp_path, monkeypatch):
    run = tmp_path / "runs" / "x"
    good, _ = write(run, 50)
    fill_disk_after(monkeypatch, 4096)
    target = checkpoint_path(run, 100)
    with pytest.raises(DiskFullError) as err:
        write(run, 100, keep=2)
    assert str(err.value) == f"no space left on device writing {target}"
    assert err.value.errno == errno.ENOSPC and isinstance(err.value, RuntimeError)
    assert sorted(os.listdir(run)) == [os.path.basename(good)]
    monkeypatch.undo()
    write(run, 100, keep=2)                  # HDF5 is left in good order
    assert load_checkpoint(target).step == 100


def test_read_state_sees_the_digest_only_on_datasets(tmp_path):
    # the per-dataset digest is an attribute of the dataset, never a state field
    path, _ = write(tmp_path, 100)
    with h5py.File(path, "r") as f:
        state = read_state(f["ranks/00000"])
    assert DIGEST_ATTR not in state["optimizer"] and set(state) == {"optimizer", "reader"}


def test_a_flipped_bit_anywhere_loads_the_same_content_or_is_one_line_naming_the_file(tmp_path):
    # Most of a small file is HDF5 metadata and free space: a flip there may be harmless,
    # but whatever loads must be exactly what was written.
    path, net = write(tmp_path, 100)
    raw = open(path, "rb").read()
    rng = np.random.default_rng(5)
    damaged = tmp_path / "damaged.h5"
    refused = 0
    for pos, bit in zip(rng.integers(0, len(raw), 40), rng.integers(0, 8, 40)):
        data = bytearray(raw)
        data[pos] ^= 1 << int(bit)
        damaged.write_bytes(bytes(data))
        try:
            ckpt = load_checkpoint(damaged)
        except ValueError as exc:
            assert str(exc).startswith(f"{damaged}: ") and "\n" not in str(exc), str(exc)
            refused += 1
            continue
        assert ckpt.net.params.tobytes() == net.params.tobytes(), pos
        assert ckpt.step == 100 and ckpt.config_yaml == "a: 1\n", pos
    assert refused > 5


def _write_at(run_dir, step, frames, keep=3):
    save_checkpoint(checkpoint_path(run_dir, step), net=small_net(step), step=step,
                    frames_seen=frames, config_yaml="a: 1\n",
                    rank_states=[{"optimizer": {}, "reader": {}}], strategy_state={},
                    keep=keep)


def _two_rank_timeline(run_dir):
    """Checkpoints at steps 100..400 of a run whose frames are 10 x its steps."""
    for step in (100, 200, 300, 400):
        _write_at(run_dir, step, 10 * step, keep=None)


def test_a_resume_that_numbers_steps_lower_keeps_its_fallbacks(tmp_path):
    # 2 ranks wrote steps 100..400; resumed on 4 ranks, step 400 became 200 and the
    # next checkpoint is named 250: the ones it came from are older, not abandoned
    # (only the new one was left, with no fallback should it be damaged)
    _two_rank_timeline(tmp_path)
    _write_at(tmp_path, 250, 4000 + 50 * 4 * 10)
    assert [os.path.basename(p) for p in list_checkpoints(tmp_path)] == \
        ["ckpt-00000300.h5", "ckpt-00000400.h5", "ckpt-00000250.h5"]
    # a second resume continues from the newest training, not the highest number
    ckpt, skipped = load_latest_good_checkpoint(tmp_path, ranks=[])
    assert ckpt.step == 250 and skipped == []
    _write_at(tmp_path, 300, 4000 + 100 * 4 * 10)      # replaces the old step 300
    _write_at(tmp_path, 350, 4000 + 150 * 4 * 10)
    assert [os.path.basename(p) for p in list_checkpoints(tmp_path)] == \
        ["ckpt-00000250.h5", "ckpt-00000300.h5", "ckpt-00000350.h5"]


def test_a_renumbered_resume_past_damaged_checkpoints_drops_them(tmp_path):
    _two_rank_timeline(tmp_path)
    flip_data_byte(checkpoint_path(tmp_path, 400), "model/params")
    with open(checkpoint_path(tmp_path, 300), "r+b") as fh:     # not HDF5 any more
        fh.write(b"\0" * 64)
    # resumed from 200 on more ranks: step 200 became 100, the next is named 120
    _write_at(tmp_path, 120, 2000 + 20 * 4 * 10)
    assert [os.path.basename(p) for p in list_checkpoints(tmp_path)] == \
        ["ckpt-00000100.h5", "ckpt-00000200.h5", "ckpt-00000120.h5"]


def test_a_checkpoint_not_named_by_step_keeps_the_newest_others(tmp_path):
    _two_rank_timeline(tmp_path)
    path = tmp_path / "snapshot.h5"
    save_checkpoint(path, net=small_net(1), step=250, frames_seen=2500, config_yaml="a: 1\n",
                    rank_states=[{"optimizer": {}, "reader": {}}], strategy_state={}, keep=3)
    assert [os.path.basename(p) for p in list_checkpoints(tmp_path)] == \
        ["ckpt-00000200.h5", "ckpt-00000300.h5", "ckpt-00000400.h5"]
    assert path.exists()


def test_a_damaged_old_checkpoint_goes_once_it_is_older_than_every_one_kept(tmp_path):
    # it stayed for the rest of the run, skipped on every resume
    _write_at(tmp_path, 50, 500, keep=None)
    _write_at(tmp_path, 100, 1000, keep=None)
    with open(checkpoint_path(tmp_path, 100), "r+b") as fh:     # not HDF5 any more
        fh.write(b"\0" * 64)
    _write_at(tmp_path, 200, 2000, keep=3)
    # among the ones kept (by its step) it stays
    assert [os.path.basename(p) for p in list_checkpoints(tmp_path)] == \
        ["ckpt-00000050.h5", "ckpt-00000100.h5", "ckpt-00000200.h5"]
    _write_at(tmp_path, 300, 3000, keep=2)
    assert [os.path.basename(p) for p in list_checkpoints(tmp_path)] == \
        ["ckpt-00000200.h5", "ckpt-00000300.h5"]


def test_rotation_goes_by_the_steps_when_the_new_file_cannot_be_read_back(tmp_path, monkeypatch):
    from mpitrain.train import checkpoint
    _two_rank_timeline(tmp_path)
    real = checkpoint._progress
    monkeypatch.setattr(checkpoint, "_progress",
                        lambda path: None if "00000250" in str(path) else real(path))
    _write_at(tmp_path, 250, 2500, keep=3)
    assert [os.path.basename(p) for p in list_checkpoints(tmp_path)] == \
        ["ckpt-00000100.h5", "ckpt-00000200.h5", "ckpt-00000250.h5"]


def test_the_module_layout_names_every_group_a_rank_writes(tmp_path):
    """The layout in train/checkpoint.py's docstring against a checkpoint holding all a
    trainer's rank gathers: the log window, and ADPSGD's own model."""
    import mpitrain.train.checkpoint as module
    documented = {line.split()[0].strip("/").replace("<r>", "*")
                  for line in module.__doc__.splitlines() if line.startswith("    /")}
    net = small_net(3)
    states = rank_states(net)
    for state in states:
        state["window"] = np.array([1.5, 2.0, 4.0, 0.0])
        state["strategy"] = {"params": np.array(net.params)}
    path = checkpoint_path(tmp_path, 4)
    save_checkpoint(path, net=net, step=4, frames_seen=40, config_yaml="a: 1\n",
                    rank_states=states, strategy_state={}, trainer_state={"rollbacks": 0})
    with h5py.File(path, "r") as f:
        written = set(f) - {"ranks"}
        written |= {f"ranks/*/{name}" for r in f["ranks"] for name in f["ranks"][r]}
    assert written - documented == set()
