"""Whole-or-nothing writes and the one YAML reader."""

import errno
import os

import pytest

from mpitrain.files import (DiskFullError, atomic_open, atomic_path, disk_full_error,
                            parse_yaml, read_yaml, remove_stale_temporaries, temporary_path,
                            write_yaml)


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "notes.txt"
    target.write_text("old\n")
    with pytest.raises(RuntimeError):
        with atomic_open(target) as fh:
            fh.write("half")
            raise RuntimeError("disk full")
    assert target.read_text() == "old\n"
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"]
    with atomic_open(target) as fh:
        fh.write("new\n")
    assert target.read_text() == "new\n" and sorted(os.listdir(tmp_path)) == ["notes.txt"]


def test_atomic_path_writes_through_a_hidden_name_in_the_same_directory(tmp_path):
    target = tmp_path / "sub" / "model.bin"
    with atomic_path(target) as tmp:
        assert os.path.dirname(tmp) == str(tmp_path / "sub") and tmp == temporary_path(target)
        assert os.path.basename(tmp).startswith(".") and not target.exists()
        with open(tmp, "wb") as fh:
            fh.write(b"\x00\x01")
    assert target.read_bytes() == b"\x00\x01" and not os.path.exists(tmp)


def test_a_name_of_up_to_255_bytes_is_written_through_a_temporary_that_fits(tmp_path):
    # the temporary's name (.NAME.tmp-PID) passed NAME_MAX for names of 243 bytes and
    # more: 'File name too long' for a name the file system takes
    from mpitrain.nn.model_file import load_model, save_model
    from mpitrain.nn.affine import Affine
    from mpitrain.nn.network import Network
    names = ["a" * 246 + ".json", "a" * 246 + ".yaml", "\u00fc" * 125, "b" * 255]
    for name in names:
        tmp = temporary_path(tmp_path / name)
        assert len(os.fsencode(os.path.basename(tmp))) <= 255
        with atomic_open(tmp_path / name) as fh:
            fh.write(name)
        assert (tmp_path / name).read_text() == name
    # two names that start alike do not share a temporary
    assert temporary_path(tmp_path / names[0]) != temporary_path(tmp_path / names[1])
    net = Network([Affine(4, 3)], feat_dim=4)
    net.init_params(seed=1)
    model = tmp_path / ("m" * 247 + ".h5")
    save_model(model, net)
    assert load_model(model)[0].params.tobytes() == net.params.tobytes()
    assert sorted(os.listdir(tmp_path)) == sorted(names + [model.name])


def test_stale_temporaries_of_long_names_are_recognised(tmp_path):
    long, other = "ll" + "x" * 246 + ".ark", "ll" + "x" * 246 + ".scp"
    for target in (long, other, "short.ark"):
        stale = temporary_path(tmp_path / target).replace(f"-{os.getpid()}", "-1")
        open(stale, "w").close()
    removed = remove_stale_temporaries(tmp_path, of={long, "short.ark"})
    assert len(removed) == 2 and all(len(os.path.basename(p)) <= 255 for p in removed)
    assert os.path.basename(removed[1]) == ".short.ark.tmp-1"
    [left] = os.listdir(tmp_path)
    assert left == os.path.basename(temporary_path(tmp_path / other)).replace(
        f"-{os.getpid()}", "-1")
    assert remove_stale_temporaries(tmp_path) == [str(tmp_path / left)]


def test_yaml_reads_exponent_numbers_as_numbers():
    assert parse_yaml("lr: 1e-3\nb: 5E+2\nc: 2.5\nd: 7\ne: 1e5x\nf: '1e-3'") == \
        {"lr": 0.001, "b": 500.0, "c": 2.5, "d": 7, "e": "1e5x", "f": "1e-3"}


def test_yaml_never_builds_python_objects():
    with pytest.raises(ValueError, match="not valid YAML"):
        parse_yaml("!!python/object/apply:os.system ['echo unsafe']")


def test_a_key_given_twice_is_refused_naming_both_lines():
    # PyYAML kept the last silently: a section written twice lost the first's keys
    with pytest.raises(ValueError) as info:
        parse_yaml("training:\n  epochs: 1\nmodel: {}\ntraining:\n  minibatch: 64\n",
                   where="run.yaml")
    assert str(info.value) == ("run.yaml: not valid YAML at line 4: key 'training' given "
                               "twice (first at line 1)")
    with pytest.raises(ValueError, match="at line 3: key 'epochs' given twice"):
        parse_yaml("training:\n  epochs: 1\n  epochs: 2\n")
    # keys that read alike are the same key (a dict keeps one of them)
    with pytest.raises(ValueError, match="key 'on' given twice"):
        parse_yaml("a: {yes: 1, on: 2}")
    # a merge's keys may be overridden, as YAML intends
    assert parse_yaml("base: &b {epochs: 1, minibatch: 64}\n"
                      "training:\n  <<: *b\n  minibatch: 32\n")["training"] == \
        {"epochs": 1, "minibatch": 32}


def test_yaml_errors_say_what_is_wrong_on_one_line():
    for text, problem in (("data:\n\ttrain: x\n", "found character '\\t' that cannot "
                                                   "start any token"),
                          ("a: 1\n---\nb: 2\n", "expected a single document in the "
                                                 "stream but found another document"),
                          ("a: !!python/name:os.system x\n", "could not determine a "
                                                             "constructor for the tag")):
        with pytest.raises(ValueError) as info:
            parse_yaml(text, where="run.yaml")
        assert problem in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("content,message", [
    (None, "config not found"),
    ("directory", "is a directory"),
    (b"a: \xff\xfe\n", "not UTF-8"),
    (b"a: [1, 2\n", "not valid YAML at line 2"),
    # control characters: PyYAML's reader refuses them while the loader is built
    (b"data:\n  train: base/train\x07\n", "not valid YAML (character #x0007 at offset 25)"),
    (b"\x00\x01", "not valid YAML (character #x0000 at offset 0)"),
    # nine lines of anchors standing for a billion values: `check` of a corpus.yaml
    # holding them ran for ever, `train` ran out of memory
    (b"".join(b"%s: &%s [%s]\n" % (bytes([97 + i]), bytes([97 + i]),
                                   b",".join([b"*%s" % bytes([96 + i]) if i else b"x"] * 9))
              for i in range(9)) + b"data: *i\n",
     "not valid YAML at line 6: its aliases stand for more than 100,000 values beyond "
     "those written"),
    (b"a: &x [1, *x]\n", "not valid YAML at line 1: an alias stands for a value that holds it"),
    # Python's int() refuses more than 4300 digits in words naming nothing
    (b"training: {seed: 1" + b"0" * 5000 + b"}\n",
     "not valid YAML at line 1: an integer of 5001 characters; at most 1000 are read"),
    # brackets nested past Python's recursion limit (a RecursionError naming nothing)
    (b"training: {epochs: " + b"[" * 1000 + b"]" * 1000 + b"}\n",
     "not valid YAML: values nested too deep to read"),
])
def test_read_yaml_errors_are_one_line_naming_the_file(tmp_path, content, message):
    path = tmp_path / "run.yaml"
    if content == "directory":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(ValueError) as info:
        read_yaml(path, what="config")
    text = str(info.value)
    assert text.startswith(str(path)) and message in text and "\n" not in text


def test_write_yaml_round_trip(tmp_path):
    data = {"feat_dim": 40, "counts": [1, 2, 3], "name": "x"}
    path = write_yaml(tmp_path / "c.yaml", data, flow_leaves=True)
    assert read_yaml(path) == data
    assert "[1, 2, 3]" in (tmp_path / "c.yaml").read_text()


def test_a_full_disk_is_one_line_naming_the_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "config.yaml"
    with pytest.raises(DiskFullError) as info:
        with atomic_open(target) as fh:
            fh.write("a: 1\n")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert str(info.value) == f"no space left on device writing {target}"
    assert info.value.errno == errno.ENOSPC and os.listdir(tmp_path) == []


@pytest.mark.parametrize("exc,expected", [
    (OSError(errno.EDQUOT, "Disk quota exceeded"), "disk quota exceeded writing a.h5"),
    (OSError("Unable to synchronously close file (file write failed: errno = 28, error "
             "message = 'No space left on device')"), "no space left on device writing a.h5"),
    (RuntimeError("Unable to synchronously flush file (file write failed: errno = 28, "
                  "error message = 'No space left on device')"),
     "no space left on device writing a.h5"),
    (OSError(errno.EACCES, "Permission denied"), None),
    (ValueError("errno = 28"), None),
])
def test_disk_full_errors_are_recognised_from_errno_or_h5py_text(exc, expected):
    found = disk_full_error(exc, "a.h5")
    assert (None if found is None else str(found)) == expected


def test_a_full_disk_is_found_behind_the_cleanup_error_it_caused():
    try:
        try:
            raise RuntimeError("Unable to synchronously flush file (errno = 28)")
        except RuntimeError:
            raise RuntimeError("Can't destroy cache (slist already enabled?)")
    except RuntimeError as exc:
        assert str(disk_full_error(exc, "c.h5")) == "no space left on device writing c.h5"


def test_stale_temporaries_of_any_writer_are_removed(tmp_path):
    for target in ("ckpt-00000100.h5", "final.h5", "config.yaml"):
        stale = temporary_path(tmp_path / target).replace(f"-{os.getpid()}", "-1")
        open(stale, "w").close()
    (tmp_path / "final.h5").write_text("kept")
    (tmp_path / temporary_path("x").split(os.sep)[-1]).write_text("this process's own")
    removed = remove_stale_temporaries(tmp_path)
    assert [os.path.basename(p) for p in removed] == [
        ".ckpt-00000100.h5.tmp-1", ".config.yaml.tmp-1", ".final.h5.tmp-1"]
    assert sorted(os.listdir(tmp_path)) == [f".x.tmp-{os.getpid()}", "final.h5"]



def test_stale_temporaries_of_named_files_only(tmp_path):
    import re
    for target in ("ll.1.ark", "ll.2.ark", "shard-00003.h5", "notes.txt"):
        open(temporary_path(tmp_path / target).replace(f"-{os.getpid()}", "-1"), "w").close()
    removed = remove_stale_temporaries(tmp_path, of={"ll.1.ark"})
    assert [os.path.basename(p) for p in removed] == [".ll.1.ark.tmp-1"]
    removed = remove_stale_temporaries(tmp_path, of=re.compile(r"shard-[0-9]+\.h5"))
    assert [os.path.basename(p) for p in removed] == [".shard-00003.h5.tmp-1"]
    assert sorted(os.listdir(tmp_path)) == [".ll.2.ark.tmp-1", ".notes.txt.tmp-1"]

def test_yaml_files_keep_text_outside_ascii_as_it_is(tmp_path):
    # utterance ids and paths in reports and manifests must be found by grep
    path = write_yaml(tmp_path / "report.yaml", {"missing": ["spk\u00dcml\u00e4ut-utt004"],
                                                  "train": "data/\u00fcber/train"})
    text = (tmp_path / "report.yaml").read_text(encoding="utf-8")
    assert "spk\u00dcml\u00e4ut-utt004" in text and "data/\u00fcber/train" in text
    assert read_yaml(path) == {"missing": ["spk\u00dcml\u00e4ut-utt004"],
                               "train": "data/\u00fcber/train"}


def test_a_failed_write_names_the_file_not_its_temporary(tmp_path, monkeypatch):
    # a read-only file system (or a directory removed) when the temporary is renamed
    # into place was reported as "[Errno 30] Read-only file system: '.../.x.tmp-PID'
    # -> '.../x'", naming a hidden file that is gone
    target = tmp_path / "final.h5"

    def refused(src, dst):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), src, None, dst)

    monkeypatch.setattr(os, "replace", refused)
    with pytest.raises(OSError) as info:
        with atomic_open(target) as fh:
            fh.write("a: 1\n")
    assert str(info.value) == f"cannot write {target}: Read-only file system"
    assert info.value.errno == errno.EROFS and os.listdir(tmp_path) == []


def test_a_file_size_limit_names_the_file_and_leaves_no_temporary(tmp_path):
    # `ulimit -f`: the write fails with EFBIG (Python ignores SIGXFSZ), an error that
    # names no file; it was "[Errno 27] File too large"
    import subprocess
    import sys
    target = tmp_path / "ckpt-00000100.h5"
    code = ("import resource, sys\n"
            "from mpitrain.files import atomic_open\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
            "try:\n"
            "    with atomic_open(sys.argv[1], 'wb') as fh:\n"
            "        fh.write(bytes(100000))\n"
            "except OSError as exc:\n"
            "    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code, str(target)], capture_output=True,
                         text=True, timeout=60)
    assert out.stdout.strip() == f"cannot write {target}: File too large", out.stderr
    assert os.listdir(tmp_path) == []


def test_commit_over_a_directory_names_the_target_not_the_temporary(tmp_path):
    from mpitrain.files import WriteError, commit, temporary_path
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep").write_text("x")
    tmp = temporary_path(target)
    with open(tmp, "w") as fh:
        fh.write("data")
    with pytest.raises(WriteError) as err:
        commit(tmp, target)
    assert str(err.value).startswith(f"cannot write {target}: ") and tmp not in str(err.value)
    assert (target / "keep").read_text() == "x"


@pytest.mark.parametrize("module", ["throughput", "collectives", "ngsgd_overhead", "scaling",
                                    "ddp_compare"])
def test_a_json_output_that_cannot_be_written_is_refused_before_measuring(tmp_path, capsys,
                                                                           module):
    """It was found when the results were written: a traceback, the measurement lost."""
    import importlib
    (tmp_path / "file").write_text("")
    parse = importlib.import_module(f"mpitrain.bench.{module}")
    entry = getattr(parse, "parse_args", None) or parse.main
    for path, problem in [(tmp_path, "is a directory"),
                          (tmp_path / "file" / "x.json", "is not a directory")]:
        with pytest.raises(SystemExit) as exit_:
            entry(["--json", str(path)])
        assert exit_.value.code == 2
        assert f"error: --json {path}: " in capsys.readouterr().err


def test_output_file_problem_names_what_stands_in_the_way(tmp_path):
    from mpitrain.files import output_file_problem
    (tmp_path / "file").write_text("")
    assert output_file_problem(tmp_path) == "is a directory"
    assert output_file_problem(tmp_path / "file" / "x") == f"{tmp_path / 'file'} is not a directory"
    assert output_file_problem(tmp_path / "new" / "deeper" / "x.json") is None
    assert output_file_problem(tmp_path / "x.json") is None


def test_a_file_standing_where_a_parent_directory_belongs_is_named():
    # makedirs said "[Errno 17] File exists: 'notes'" of the file in the way
    import tempfile
    with tempfile.TemporaryDirectory() as top:
        blocker = os.path.join(top, "notes")
        with open(blocker, "w") as fh:
            fh.write("x")
        target = os.path.join(blocker, "sub", "curves.png")
        with pytest.raises(OSError) as info:
            with atomic_open(target) as fh:
                fh.write("never")
        assert str(info.value) == f"cannot write {target}: {blocker} is not a directory"


def test_a_named_pipe_is_written_in_place_and_a_link_through_to_its_target(tmp_path):
    import subprocess
    import stat
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE)
    try:
        with atomic_open(fifo, "wb") as fh:
            fh.write(b"data")
        got, _ = reader.communicate(timeout=10)
    finally:
        reader.kill()
    # renamed over, the pipe became a file and its reader waited for ever
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and got == b"data"
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "x.txt").write_text("old")
    (tmp_path / "link.txt").symlink_to(tmp_path / "real" / "x.txt")
    with atomic_open(tmp_path / "link.txt") as fh:
        fh.write("new")
    # the link stays and names the new contents, as when written through it
    assert (tmp_path / "link.txt").is_symlink()
    assert (tmp_path / "real" / "x.txt").read_text() == "new"
    assert sorted(os.listdir(tmp_path / "real")) == ["x.txt"]


def test_a_yaml_file_is_read_to_a_bound(tmp_path, monkeypatch):
    """A file named by mistake as a config or manifest (a feature archive, a link to
    /dev/zero) was read whole: the process ran out of memory, killed without a
    word.  Past the bound it is one line naming the file."""
    from mpitrain import files
    monkeypatch.setattr(files, "MAX_YAML_BYTES", 1024)
    path = tmp_path / "run.yaml"
    path.write_text("# " + "x" * 2000 + "\ntraining: {epochs: 1}\n")
    with pytest.raises(ValueError) as err:
        files.read_yaml(path, what="config file")
    assert str(err.value).startswith(f"{path}: holds over ")
    assert "far more than a config file; is it the file meant?" in str(err.value)
    assert "\n" not in str(err.value)
    path.write_text("training: {epochs: 1}\n")
    assert files.read_yaml(path) == {"training": {"epochs": 1}}
    # a regular file is refused by its size, before a byte of it is read
    path.write_text("# " + "x" * 2000 + "\n")
    reads = []
    real_open = open

    def counting_open(name, mode="r", *args, **kwargs):
        handle = real_open(name, mode, *args, **kwargs)
        if os.fspath(name) == str(path):
            real_read = handle.read
            handle.read = lambda *a: reads.append(a) or real_read(*a)
        return handle
    monkeypatch.setattr("builtins.open", counting_open)
    with pytest.raises(ValueError, match="holds over "):
        files.read_yaml(path, what="config file")
    assert reads == []


def test_special_files_are_pipes_sockets_and_devices_only(tmp_path):
    from mpitrain.files import special_file
    (tmp_path / "f").write_text("x")
    os.mkfifo(tmp_path / "p")
    assert [special_file(tmp_path / n) for n in ("f", "p", "missing")] == [False, True, False]
    assert special_file(tmp_path) is False and special_file(os.devnull) is True


def test_a_failed_block_removes_only_the_directory_it_made_and_only_when_empty(tmp_path):
    from mpitrain.files import removed_if_failed
    made, there, shared = tmp_path / "made", tmp_path / "there", tmp_path / "shared"
    there.mkdir()
    for directory, extra in ((made, None), (there, None), (shared, "notes.txt")):
        with pytest.raises(OSError):
            with removed_if_failed(directory, expected=("model.py",)):
                directory.mkdir(exist_ok=True)
                (directory / "model.py").write_text("half")
                if extra:                   # someone else's file: the directory stays
                    (directory / extra).write_text("theirs")
                raise OSError(28, "No space left on device")
    assert not made.exists()
    assert there.is_dir()                   # it was there before: kept, with what it holds
    assert sorted(os.listdir(shared)) == ["model.py", "notes.txt"]
    with removed_if_failed(made):           # a block that succeeds keeps what it made
        made.mkdir()
    assert made.is_dir()
