"""Files the program writes appear whole or not at all, and YAML is read in one place.

Every file is written under a hidden temporary name in its own directory,
flushed to disk, renamed over the target and the directory entry flushed
too, so a crash or a full disk leaves either the old file or the new one,
never a half-written one; a failure removes the temporary file.
:func:`atomic_open` serves files written through a handle, :func:`atomic_path`
libraries that write by name (h5py, matplotlib).  A full disk (or quota) is
reported as one line naming the file being written (:class:`DiskFullError`),
whatever library hit it.  A process killed mid-write leaves its hidden
temporary behind; :func:`remove_stale_temporaries` clears a directory of them.

YAML is parsed with PyYAML's safe loader (no Python objects) extended to read
numbers such as ``1e-3`` as numbers, as YAML 1.2 does; errors are one line
naming the file.

Example::

    with atomic_open("run/notes.txt") as f:
        f.write("done\\n")
    write_yaml("corpus/corpus.yaml", {"feat_dim": 40})
    read_yaml("corpus/corpus.yaml", what="corpus manifest")   # {'feat_dim': 40}
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil
import stat

#: Accepted in YAML as floats besides PyYAML's forms: 1e-3, 5E+2, .5e1, 3.
_FLOAT_1_2 = re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)$")


# -- writing whole files ---------------------------------------------------------------

def temporary_path(path) -> str:
    """A hidden name beside ``path`` for writing it (unique per process)."""
    path = os.fspath(path)
    directory, name = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{_temporary_base(name)}.tmp-{os.getpid()}")


#: The longest name a file system takes (Linux's NAME_MAX), in bytes.
_NAME_MAX = 255
#: Room kept for the process id in a temporary's name (a pid_t is a 32-bit int), so
#: that its shortened form below depends on the name alone.
_PID_DIGITS = 10
#: Bytes of the name a temporary's name may hold: ``.NAME.tmp-PID`` within NAME_MAX.
_TEMPORARY_ROOM = _NAME_MAX - len(".") - len(".tmp-") - _PID_DIGITS


def _temporary_base(name: str) -> str:
    """``name``, or for a name too long to fit a temporary's name within NAME_MAX
    (a 250-byte model name), its start and a digest of the whole: names that
    share the start stay apart.

    Example::

        _temporary_base("model.h5")          # 'model.h5'
        _temporary_base("m" * 250)           # 'mmm...m~6ca616c2810f22f4' (239 bytes)
    """
    encoded = os.fsencode(name)
    if len(encoded) <= _TEMPORARY_ROOM:
        return name
    digest = hashlib.sha256(encoded).hexdigest()[:16]
    keep = _TEMPORARY_ROOM - len(digest) - 1
    head = name
    while len(os.fsencode(head)) > keep:     # (whole characters: UTF-8 stays whole)
        head = head[:-1]
    return f"{head}~{digest}"


def path_text(path) -> str:
    """``path`` as text that UTF-8 can hold, for the places that take nothing else
    (HDF5 attributes, Matplotlib's labels): the bytes of a name that are not UTF-8
    (a directory named in Latin-1) become backslash escapes; any other path is
    returned unchanged.

    Example::

        path_text(os.fsdecode(b"runs/caf\\xe9"))    # 'runs/caf\\xe9'
    """
    text = os.fspath(path)
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    try:    # (the raw bytes of the name, as Python's file functions hold them)
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def unexpanded_home(path) -> str | None:
    """Why ``path`` is refused when it starts with ``~`` (``~/runs/x``, ``~user/x``),
    else None.  Paths are taken as written, and the shell leaves ``~`` alone in
    quotes and after ``--option=``: such a path would name a directory ``~`` in
    the working directory, and one written there looks like the home directory.

    Example::

        unexpanded_home("~/runs/x")   # '~/runs/x: starts with ~, which ...'
    """
    text = os.fspath(path)
    if not isinstance(text, str) or not text.startswith("~"):
        return None
    head = text.split("/", 1)[0]
    meant = os.path.expanduser(text)
    return (f"{text}: starts with {head}, which mpitrain does not expand (nor "
            f"$VARIABLES); write the path out{f' ({meant})' if meant != text else ''}, or "
            f"./{text} for a directory named {head}")


def written_in_place(path) -> bool:
    """True for a character device or a named pipe (``/dev/null``, a FIFO from
    ``mkfifo``): such a target is written as it is, as a stream, since a file
    renamed over it would take its place (for root, /dev/null itself)."""
    try:
        mode = os.stat(os.fspath(path)).st_mode
    except OSError:
        return False
    return stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)


def special_file(path) -> bool:
    """True for a path that is neither a regular file nor a directory (a named pipe,
    socket or device, links followed): reading one may wait for a writer for ever,
    or be what one rank of many takes.  False for a path that does not exist."""
    try:
        mode = os.stat(os.fspath(path)).st_mode
    except (OSError, TypeError, ValueError):
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def rename_target(path) -> str:
    """Where a file written for ``path`` is renamed to: a symbolic link's target, so
    that the link stays and names the new file, as when a program writes through it
    (renaming over the link itself replaced it and left its target as it was)."""
    path = os.fspath(path)
    return os.path.realpath(path) if os.path.islink(path) else path


#: The names :func:`temporary_path` makes, and no others.
TEMPORARY_NAME = re.compile(r"\.(?P<name>.+)\.tmp-(?P<pid>[0-9]+)")


def remove_stale_temporaries(directory, *, of=None) -> list:
    """Delete the temporaries that writers killed mid-write left in ``directory``.

    Only regular files named exactly as :func:`temporary_path` names them are
    removed (not this process's own); call it before the program writes in
    ``directory``, when no other process writes there.  ``of``: only the
    temporaries of the files named so (a collection of names, or a compiled
    pattern the whole name must match, which sees a name too long for its
    temporary to hold only in its shortened form), for a directory other
    programs write in too.  Returns the removed paths, sorted.

    Example::

        remove_stale_temporaries("runs/x")   # ['runs/x/.ckpt-00000100.h5.tmp-4242']
        remove_stale_temporaries("exp", of={"loglikes.ark"})
    """
    directory = os.fspath(directory)
    if of is not None and not hasattr(of, "fullmatch"):
        # a long name's temporary holds its shortened form (temporary_path)
        of = set(of) | {_temporary_base(name) for name in of}
    removed = []
    for name in sorted(os.listdir(directory)):
        match = TEMPORARY_NAME.fullmatch(name)
        if not match or int(match.group("pid")) == os.getpid():
            continue
        if of is not None and not (of.fullmatch(match.group("name")) if hasattr(of, "fullmatch")
                                   else match.group("name") in of):
            continue
        path = os.path.join(directory, name)
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISREG(os.lstat(path).st_mode):
                os.remove(path)
                removed.append(path)
    return removed


class DiskFullError(OSError, RuntimeError):
    """A write failed for lack of space; ``str`` is one line naming the file.

    A RuntimeError too, so the command line reports it as one line.

    Example::

        DiskFullError(errno.ENOSPC, "no space left on device writing runs/x/final.h5")
    """

    def __str__(self) -> str:
        return str(self.strerror)


#: errno values that mean the file system (or the user's quota) is full.
_FULL = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded"}
# h5py reports the C library's errno inside its message, not in ``errno``.
_H5_ERRNO = re.compile(r"errno = (\d+)")


def disk_full_error(exc: BaseException, path) -> DiskFullError | None:
    """The one-line error for ``exc`` if it means the disk is full, else None.

    h5py raises RuntimeError or OSError with the C errno in its text, and on
    a full disk often a second error about its cache while cleaning up, so
    the exceptions ``exc`` was raised during are looked at too.

    Example::

        disk_full_error(OSError(errno.ENOSPC, "No space left"), "a.h5")   # ... writing a.h5
    """
    seen, first = 0, exc
    while exc is not None and seen < 8:
        code = exc.errno if isinstance(exc, OSError) else None
        if code not in _FULL and isinstance(exc, (OSError, RuntimeError)):
            found = _H5_ERRNO.search(str(exc))
            code = int(found.group(1)) if found else None
        if code in _FULL:
            return DiskFullError(code, f"{_FULL[code]} writing {os.fspath(path)}")
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    # h5py sometimes reports a full disk only as a broken internal state (e.g. "Can't
    # decrement id ref count"): an error while writing onto a nearly full device is taken
    # for what it almost surely is
    if first is not None and isinstance(first, (OSError, RuntimeError, ValueError)) \
            and _nearly_full(path):
        return DiskFullError(errno.ENOSPC, f"{_FULL[errno.ENOSPC]} writing {os.fspath(path)}")
    return None


#: free bytes below which an error while writing is taken to mean a full disk
NEARLY_FULL_BYTES = 1 << 20


def _nearly_full(path) -> bool:
    directory = os.path.dirname(os.path.abspath(os.fspath(path)))
    try:
        return shutil.disk_usage(directory).free < NEARLY_FULL_BYTES
    except OSError:
        return False


class WriteError(OSError):
    """A write that failed for another reason than space; ``str`` is one line naming
    the file being written (not the hidden temporary it was written under).

    Example::

        WriteError(errno.EROFS, "cannot write runs/x/final.h5: Read-only file system")
    """

    def __str__(self) -> str:
        return str(self.strerror)


def _write_error(exc: BaseException, tmp: str, path) -> WriteError | None:
    """The one-line error for an OSError while ``path`` was written under ``tmp``: one
    about the temporary, or one naming no file (a write, flush or fsync that failed:
    a read-only file system, a file size limit, an I/O error)."""
    if not isinstance(exc, OSError) or isinstance(exc, WriteError) \
            or exc.filename not in (None, tmp) or exc.errno is None:
        return None
    return WriteError(exc.errno, f"cannot write {os.fspath(path)}: {exc.strerror or exc}")


def _fsync_directory(directory: str) -> None:
    with contextlib.suppress(OSError):       # not every file system allows it
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def flush_to_disk(tmp: str) -> None:
    """Flush the written file ``tmp`` to disk."""
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())


def commit(tmp: str, path) -> None:
    """Flush ``tmp`` to disk and rename it over ``path`` (then flush the directory)."""
    flush_to_disk(tmp)
    try:
        os.replace(tmp, os.fspath(path))
    except OSError as exc:
        # the user named the target (a directory, say), not our temporary beside it
        if exc.errno is None:
            raise
        raise WriteError(exc.errno, f"cannot write {os.fspath(path)}: "
                                    f"{exc.strerror or exc}") from None
    _fsync_directory(os.path.dirname(os.path.abspath(os.fspath(path))))


def discard(tmp: str) -> None:
    """Remove a temporary file if it is there (never masking the error that led here)."""
    with contextlib.suppress(OSError):
        os.remove(tmp)


def make_parent_directories(path) -> None:
    """Make the missing directories above ``path``; a WriteError naming ``path`` when
    they cannot be made (a file stands where one belongs: makedirs said only
    "File exists" of that file)."""
    path = os.fspath(path)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    except OSError as exc:
        problem = output_file_problem(path) or exc.strerror or str(exc)
        raise WriteError(exc.errno, f"cannot write {path}: {problem}") from None


@contextlib.contextmanager
def atomic_path(path):
    """Yield a temporary name to write ``path`` under; it becomes ``path`` on success.

    Example::

        with atomic_path("curves.png") as tmp:
            fig.savefig(tmp, format="png")
    """
    path = os.fspath(path)
    if written_in_place(path):
        yield path
        return
    target = rename_target(path)
    make_parent_directories(target)
    tmp = temporary_path(target)
    try:
        yield tmp
        commit(tmp, target)
    except BaseException as exc:
        discard(tmp)
        full = disk_full_error(exc, path)
        if full is not None:
            raise full from exc
        named = _write_error(exc, tmp, path)
        if named is not None:
            raise named from exc
        raise


def remove_made_directory(path, expected=()) -> None:
    """Remove a directory a failed command made: the ``expected`` files in it, then
    the directory, and only while nothing else is in it (a file someone else put
    there, or a job that made it meanwhile and holds it, keeps it)."""
    with contextlib.suppress(OSError):
        if set(os.listdir(path)) <= set(expected):
            for name in expected:
                discard(os.path.join(path, name))
        os.rmdir(path)


@contextlib.contextmanager
def removed_if_failed(path, expected=()):
    """Within the block, a failure (a full disk above all) removes directory
    ``path`` if it was not there before the block (:func:`remove_made_directory`):
    a command that fails leaves no directory of its own behind.

    Example::

        with removed_if_failed("model_torch", expected=("weights.npz", "model.py")):
            os.makedirs("model_torch", exist_ok=True)
            ...
    """
    made = not os.path.lexists(path)
    try:
        yield
    except BaseException:
        if made:
            remove_made_directory(path, expected)
        raise


def working_directory() -> str:
    """This process's working directory, or '' when it was removed while the process
    runs in it (os.getcwd fails then)."""
    try:
        return os.getcwd()
    except OSError:
        return ""


def nearest_existing(path) -> str:
    """The nearest ancestor of ``path`` that exists (absolute): where the missing
    directories above ``path`` would be made, or fail to be.

    Example::

        nearest_existing("/tmp/a/b/c.txt")     # '/tmp' when a/ does not exist
    """
    above = os.path.dirname(os.path.abspath(os.fspath(path)))
    while not os.path.exists(above) and os.path.dirname(above) != above:
        above = os.path.dirname(above)
    return above


def output_file_problem(path) -> str | None:
    """Why ``path`` cannot become a written file (None when it can), checked before
    the work that produces it: a directory, or a parent that is a file or that
    cannot be written.  Missing parents are fine (they are made).

    Example::

        output_file_problem("/tmp")        # 'is a directory'
    """
    path = os.path.abspath(os.fspath(path))
    if os.path.isdir(path):
        return "is a directory"
    parent = nearest_existing(path)
    if not os.path.isdir(parent):
        return f"{parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot write in {parent}"
    return None


def check_json_option(parser, path) -> None:
    """``parser.error`` for a ``--json`` file that could not be written, before
    anything is measured (found only when the results were written, they were lost)."""
    problem = output_file_problem(path) if path else None
    if problem:
        parser.error(f"--json {path}: {problem}")


@contextlib.contextmanager
def atomic_open(path, mode: str = "w"):
    """Open ``path`` for writing through a temporary file renamed into place on success.

    Example::

        with atomic_open("report.json") as f:
            json.dump(report, f)
    """
    binary = "b" in mode
    with atomic_path(path) as tmp:
        with open(tmp, mode, **({} if binary else {"encoding": "utf-8"})) as fh:
            yield fh


# -- YAML ----------------------------------------------------------------------------

def _loader():
    import yaml

    class Loader(yaml.SafeLoader):
        """PyYAML's safe loader, with YAML 1.2's exponent floats (1e-3), refusing a
        key given twice in one mapping (PyYAML keeps the last silently: a section
        written twice lost every key of the first)."""

        def construct_mapping(self, node, deep=False):
            if isinstance(node, yaml.MappingNode):
                _refuse_repeated_keys(self, node)
            return super().construct_mapping(node, deep=deep)

        def construct_yaml_int(self, node):
            # Python refuses int() of more than 4300 digits in words naming nothing
            if len(str(node.value)) > MAX_INT_DIGITS:
                raise yaml.constructor.ConstructorError(
                    None, None, f"an integer of {len(str(node.value))} characters; at "
                                f"most {MAX_INT_DIGITS} are read", node.start_mark)
            return super().construct_yaml_int(node)

    Loader.add_constructor("tag:yaml.org,2002:int", Loader.construct_yaml_int)
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_1_2,
                                 list("-+0123456789."))
    return Loader


#: Digits of a YAML integer read at most (Python's own limit is 4300).
MAX_INT_DIGITS = 1000

_MERGE_TAG = "tag:yaml.org,2002:merge"


def _refuse_repeated_keys(loader, node) -> None:
    """ConstructorError at the second place a key of ``node`` is written.  Keys a
    merge (``<<: *defaults``) brings in may be overridden, as YAML intends."""
    import yaml
    first_seen = {}
    for key_node, _ in node.value:
        if key_node.tag == _MERGE_TAG or not isinstance(key_node, yaml.ScalarNode):
            continue
        key = loader.construct_object(key_node)
        try:
            earlier = first_seen.setdefault(key, key_node)
        except TypeError:           # unhashable: PyYAML says so itself
            continue
        if earlier is not key_node:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key_node.value!r} given twice (first at line "
                            f"{earlier.start_mark.line + 1})", key_node.start_mark)


class Written:
    """A plain YAML scalar that is not text (a number, boolean, null or date) with
    the text it was written as: a setting that takes text keeps ``010`` or
    ``2024-01-01`` as typed, and an error echoes ``yes`` rather than ``True``.

    Example::

        parse_yaml("a: yes", as_written=True)["a"]      # Written(True, 'yes')
    """

    __slots__ = ("value", "text")

    def __init__(self, value, text: str):
        self.value, self.text = value, text

    def __eq__(self, other):
        return self.value == (other.value if isinstance(other, Written) else other)

    def __hash__(self):
        return hash(self.value)

    def __repr__(self):
        return f"Written({self.value!r}, {self.text!r})"


def _as_written_loader(base):
    """``base`` whose non-text scalars come as :class:`Written`."""
    class AsWritten(base):
        pass

    for tag in ("bool", "int", "float", "null", "timestamp"):
        full = f"tag:yaml.org,2002:{tag}"
        build = base.yaml_constructors[full]
        AsWritten.add_constructor(
            full, lambda loader, node, build=build: Written(build(loader, node), node.value))
    return AsWritten


_LOADER = None
_WRITTEN_LOADER = None


def parse_yaml(text: str, *, where: str = "YAML text", as_written: bool = False):
    """The data of a YAML document; ValueError naming ``where`` (and the line) if bad.
    ``as_written``: numbers, booleans, nulls and dates come as :class:`Written`.

    Example::

        parse_yaml("lr: 1e-3")      # {'lr': 0.001}
    """
    import yaml
    global _LOADER, _WRITTEN_LOADER
    if _LOADER is None:
        _LOADER = _loader()
        _WRITTEN_LOADER = _as_written_loader(_LOADER)
    # (PyYAML composes nested values recursively: a few hundred levels of brackets
    # exhaust Python's stack, a RecursionError that named nothing)
    too_deep = f"{where}: not valid YAML: values nested too deep to read"
    try:
        # the safe loader above: builds no Python objects; its reader already
        # refuses control characters, so the constructor is inside the try too
        loader = (_WRITTEN_LOADER if as_written else _LOADER)(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{where}: not valid YAML ({_yaml_problem(exc)})") from None
    except RecursionError:
        raise ValueError(too_deep) from None
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_alias_expansion(node, where)
        return loader.construct_document(node)
    except RecursionError:
        raise ValueError(too_deep) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" at line {mark.line + 1}" if mark else ""
        # PyYAML's own words for it ("found character '\t' that cannot start any
        # token", a tag it will not build, a key given twice), on the same line
        problem = " ".join(str(getattr(exc, "problem", "") or "").split())
        context = getattr(exc, "context", None)
        if problem.startswith("but ") and context:     # "expected ... but found ..."
            problem = f"{context} {problem}"
        raise ValueError(f"{where}: not valid YAML{line}"
                         + (f": {problem}" if problem else "")) from None
    finally:
        loader.dispose()


#: Values that aliases (``*name``) may add to a document beyond those written in it.
MAX_ALIASED_VALUES = 100_000


def _check_alias_expansion(root, where: str) -> None:
    """ValueError when the document's aliases stand for more than MAX_ALIASED_VALUES
    values beyond those written, or for a value that holds itself.

    PyYAML shares an aliased value instead of copying it, so loading costs nothing;
    but nine lines of anchors can stand for a billion values, which every reader
    that walks the data (a check, an error message's repr, a digest) then meets:
    `check` ran for ever, `train` ran out of memory."""
    import yaml
    size, written, state, stack = {}, set(), {}, [root]
    while stack:
        node = stack[-1]
        key = id(node)
        written.add(key)
        children = []
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [item for pair in node.value for item in pair]
        if state.get(key) is None:
            state[key] = "open"
            for child in children:
                if state.get(id(child)) == "open":
                    raise ValueError(f"{where}: not valid YAML at line "
                                     f"{child.start_mark.line + 1}: an alias stands for a "
                                     "value that holds it")
                if id(child) not in state:
                    stack.append(child)
            continue
        stack.pop()
        if state[key] == "open":
            state[key] = "done"
            size[key] = 1 + sum(size[id(child)] for child in children)
            if size[key] > len(written) + MAX_ALIASED_VALUES:
                raise ValueError(f"{where}: not valid YAML at line {node.start_mark.line + 1}: "
                                 f"its aliases stand for more than {MAX_ALIASED_VALUES:,} "
                                 "values beyond those written")


def _yaml_problem(exc) -> str:
    """PyYAML's reader error in a few words: which character, where."""
    character = getattr(exc, "character", None)
    position = getattr(exc, "position", None)
    if isinstance(character, str):
        character = ord(character)
    if isinstance(character, int) and position is not None:
        return f"character #x{character:04x} at offset {position}"
    return type(exc).__name__


#: The most a YAML file (a config, a corpus manifest, an import report) is read to:
#: far above any of them, and a bound on a file named by mistake (a feature archive
#: given as the config, a manifest linked to /dev/zero), which was read whole.
MAX_YAML_BYTES = 1 << 30


def read_yaml(path, *, what: str = "YAML file", as_written: bool = False):
    """Parse a YAML file; one-line ValueError naming the file for every way it can fail
    (``as_written``: as :func:`parse_yaml` says).

    Example::

        read_yaml("jobs/configs/quickstart.yaml", what="config")
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as fh:
            info = os.fstat(fh.fileno())
            # (a regular file's size says it at once: no gigabyte read on every rank)
            raw = b"" if stat.S_ISREG(info.st_mode) and info.st_size > MAX_YAML_BYTES \
                else fh.read(MAX_YAML_BYTES + 1)
            too_big = len(raw) > MAX_YAML_BYTES or info.st_size > MAX_YAML_BYTES
    except FileNotFoundError:
        raise ValueError(f"{path}: {what} not found") from None
    except IsADirectoryError:
        raise ValueError(f"{path}: is a directory, expected a {what}") from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the {what} ({exc.strerror or exc})") from None
    if too_big:
        raise ValueError(f"{path}: holds over {MAX_YAML_BYTES >> 20} MiB, far more than a "
                         f"{what}; is it the file meant?")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: the {what} is not UTF-8 text (byte {exc.start})") from None
    return parse_yaml(text, where=path, as_written=as_written)


def dotted_keys(data: dict, prefix: str = "") -> dict:
    """Nested mappings (a config as YAML holds it) as one level of dotted keys.

    Example::

        dotted_keys({"model": {"hidden_dim": 512}})   # {'model.hidden_dim': 512}
    """
    out = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(dotted_keys(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


_DUMPER = None


def _dumper():
    """PyYAML's safe dumper, quoting the text that :func:`_loader` reads as a number
    (``1e-1``: a float in YAML 1.2, text to PyYAML's YAML 1.1), so that text
    written comes back as text."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    Dumper.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_1_2,
                                 list("-+0123456789."))
    return Dumper


def yaml_text(data, *, flow_leaves: bool = False) -> str:
    """YAML for plain data, keys in their order (``flow_leaves``: short lists on one line);
    text outside ASCII (utterance ids, paths) as it is, so that grep finds it."""
    import yaml
    global _DUMPER
    if _DUMPER is None:
        _DUMPER = _dumper()
    return yaml.dump(data, Dumper=_DUMPER, sort_keys=False, width=100, allow_unicode=True,
                     default_flow_style=None if flow_leaves else False)


def write_yaml(path, data, *, flow_leaves: bool = False) -> str:
    """Write ``data`` as YAML to ``path`` atomically; returns the path."""
    with atomic_open(path) as fh:
        fh.write(yaml_text(data, flow_leaves=flow_leaves))
    return os.fspath(path)
