"""The run directory: what counts as a run in it, and when it may be (re)used.

A run directory holds one run: ``config.yaml``, ``metrics.jsonl``, ``pretrain.h5``,
``ckpt-*.h5``, ``best.h5``, ``final.h5``, ``curves.png`` and
``tensorboard/events.out.tfevents.*`` (and ``error-rank-*.json`` of a rank other
than 0 that failed: train/errors.py).  A new run refuses a directory holding
another one (``--resume`` continues it, ``--overwrite``
replaces it); ``--resume`` refuses to apply settings that change the result
unless ``--accept-changes`` is given, and then lists each difference.
Nothing is written until the run has been validated, so a failed start
leaves no directory behind.

Example::

    problem = run_dir_problem("runs/x", resume=False, overwrite=False)
    changes = changed_settings(old_cfg, new_cfg)   # ["optimizer.initial_learning_rate: ..."]
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import re
import stat
import time
import zlib

from ..config import dump_config
from ..files import (disk_full_error, dotted_keys, nearest_existing, path_text,
                     remove_made_directory, remove_stale_temporaries)
from ..h5io import stored_checksum
from .errors import TrainingError, remove_rank_errors
from .tensorboard import DIRECTORY as TENSORBOARD_DIRECTORY

#: Files a run writes (checkpoints are matched separately).
RUN_FILES = ("config.yaml", "metrics.jsonl", "best.h5", "final.h5", "curves.png",
             "pretrain.h5")

#: Settings that change how a run is carried out or reported, not what it computes:
#: they may differ on --resume.  Every other setting changes the result.
NEUTRAL_SETTINGS = (
    "data.dev", "data.prefetch", "training.max_steps", "training.log_interval",
    "training.eval_interval", "training.eval_max_frames", "training.checkpoint_interval",
    "training.checkpoint_minutes",
    "training.keep_checkpoints", "training.plot", "training.tensorboard",
    "training.divergence_factor",
    "training.max_divergence_events", "training.max_rollbacks",
    "training.rollback_lr_factor", "device", "device_transport", "fused_kernels",
    "cuda_graph", "blas_threads", "parallel.straggler.ranks", "parallel.straggler.slowdown",
    "parallel.straggler.jitter")


#: Settings that one parallel method alone reads (parallel.method -> prefixes).
METHOD_SETTINGS = {
    "model_averaging": ("parallel.average_momentum",),
    "allreduce": ("parallel.overlap", "parallel.bucket_mb"),
    "kaldi": ("parallel.num_jobs_", "parallel.jobs_step"),
    "bmuf": ("parallel.block_momentum", "parallel.block_lr", "parallel.nesterov"),
    "adpsgd": ("parallel.topology", "parallel.delay_by_one", "parallel.ranks_per_node"),
    "param_server": ("parallel.average_eta", "parallel.damp_staleness"),
}
#: Settings that one learning-rate schedule alone reads (optimizer.schedule -> prefixes).
SCHEDULE_SETTINGS = {
    "exponential": ("optimizer.final_learning_rate",),
    "hand": ("optimizer.hand_factor",),
    "adapt": ("optimizer.adapt_",),
    "search": ("optimizer.search_",),
    "newbob": ("optimizer.newbob_",),
}


def unused_settings(settings: dict) -> tuple:
    """Prefixes of the settings that a run with these dotted ``settings`` does not
    use: those of NG-SGD in a run that trains with another optimizer, those of the
    other parallel methods and learning-rate schedules, the p-norm's without
    p-norm units, the combination's without it, early stopping's least gain
    without early stopping.

    Example::

        unused_settings({"optimizer.name": "sgd"})    # ("optimizer.ngsgd.", ...)
    """
    unused = () if settings.get("optimizer.name") == "ngsgd" else ("optimizer.ngsgd.",)
    for method, keys in METHOD_SETTINGS.items():
        if settings.get("parallel.method") != method:
            unused += keys
    for schedule, keys in SCHEDULE_SETTINGS.items():
        if settings.get("optimizer.schedule") != schedule:
            unused += keys
    if settings.get("model.nonlinearity") != "pnorm":
        unused += ("model.pnorm_",)
    if not settings.get("training.combine"):
        unused += ("training.combine_",)
    if not settings.get("training.early_stop.patience"):
        unused += ("training.early_stop.min_delta",)
    return unused


def run_files(run_dir) -> list:
    """The files of a run found in ``run_dir`` (sorted)."""
    found = [os.path.join(run_dir, name) for name in RUN_FILES
             if os.path.exists(os.path.join(run_dir, name))]
    found += glob.glob(os.path.join(glob.escape(os.fspath(run_dir)), "ckpt-*.h5"))
    # training.tensorboard's event files: left by --overwrite, TensorBoard showed
    # the replaced run's curves under this directory's name
    found += glob.glob(os.path.join(glob.escape(os.fspath(run_dir)), TENSORBOARD_DIRECTORY,
                                    "events.out.tfevents.*"))
    # a directory of a checkpoint's name is the user's, not a file of the run
    return sorted(path for path in found if not os.path.isdir(path))


def no_checkpoint_way(run_dir, result: str) -> str:
    """What a ``--resume`` that finds no checkpoint in ``run_dir`` should do instead;
    ``result``: the file a finished run wrote (final.h5, pretrain.h5)."""
    if os.path.isfile(os.path.join(run_dir, result)):
        # (--overwrite alone would delete the finished result without a word)
        return (f"the run has finished ({result} is written): nothing to continue; "
                f"--overwrite trains it again, replacing {result}, or give another "
                "--run-dir")
    # a run stopped before its first checkpoint leaves its config and log, which a
    # start without --resume refuses
    if run_files(run_dir):
        return "start it afresh with --overwrite"
    return "start the run without --resume"


#: The line a new run (no --resume) given --accept-changes says: one command line
#: serves a job's first start and its requeues (train.sbatch adds --resume once
#: the directory holds a checkpoint), so it is not refused; nor silently dropped.
ACCEPT_CHANGES_NEW_RUN = ("--accept-changes: a new run, no checkpoint to compare its "
                          "settings with (it applies when the run is continued with --resume)")


def run_dir_problem(run_dir, *, resume: bool, overwrite: bool) -> str | None:
    """Why ``run_dir`` cannot be used as asked, as one line; None when it can."""
    if resume and overwrite:
        return "--resume and --overwrite exclude each other"
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        return f"{run_dir}: run directory exists and is not a directory"
    if os.path.islink(run_dir) and not os.path.exists(run_dir):
        return f"{run_dir}: run directory is a symbolic link to {os.readlink(run_dir)}, " \
               "which does not exist"
    above = nearest_existing(run_dir)
    if not os.path.isdir(above):
        return f"{run_dir}: cannot create the run directory ({above} is not a directory)"
    room = _name_room_problem(run_dir, above)
    if room:
        return room
    if resume:
        if not os.path.isdir(run_dir):
            return f"{run_dir}: --resume given but the run directory does not exist"
        if not os.access(run_dir, os.W_OK):
            return f"{run_dir}: run directory is not writable (a resumed run writes there)"
        return None
    if os.path.isfile(os.path.join(run_dir, "corpus.yaml")):
        # the run's checkpoints and models would lie among the shards, and a corpus
        # reader or `merge` of the directory would meet them
        return (f"{run_dir}: a corpus directory (it holds corpus.yaml), not a place for a "
                "run; choose another --run-dir")
    files = run_files(run_dir) if os.path.isdir(run_dir) else []
    if files and not overwrite:
        names = ", ".join(os.path.basename(p) for p in files[:4])
        more = f" and {len(files) - 4} more" if len(files) > 4 else ""
        return (f"{run_dir}: holds another run ({names}{more}); continue it with --resume, "
                "replace it with --overwrite, or choose another --run-dir")
    parent = os.path.dirname(os.path.abspath(run_dir))
    if not os.path.isdir(run_dir) and os.path.exists(parent) and not os.access(parent, os.W_OK):
        return f"{run_dir}: cannot create the run directory ({parent} is not writable)"
    if os.path.isdir(run_dir) and not os.access(run_dir, os.W_OK):
        return f"{run_dir}: run directory is not writable"
    return None


# the longest name a run writes: a rank's error record's temporary
# (``.error-rank-N.json.tmp-PID``; a checkpoint's, ``.ckpt-N.h5.tmp-PID``, is shorter)
_LONGEST_NAME = ".error-rank-000000.json.tmp-4194304"


def _name_room_problem(run_dir, existing: str) -> str | None:
    """A run directory whose files' paths would be too long for the file system
    (found at the first checkpoint, after the run had started writing)."""
    path = os.path.join(os.path.abspath(run_dir), _LONGEST_NAME)
    try:
        limit = os.pathconf(existing, "PC_PATH_MAX")
        name_limit = os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError):
        return None
    too_long = [part for part in os.path.abspath(run_dir).split(os.sep)
                if len(os.fsencode(part)) > name_limit]
    if too_long:
        return (f"{run_dir}: a directory name of {len(os.fsencode(too_long[0]))} bytes; this "
                f"file system takes at most {name_limit}")
    if len(os.fsencode(path)) >= limit:
        return (f"{run_dir}: the run's file paths would be {len(os.fsencode(path))} bytes long, "
                f"over this system's limit of {limit}; choose a shorter --run-dir")
    return None


def written_meanwhile(run_dir, *, resume: bool, overwrite: bool, seen=None) -> str | None:
    """Once rank 0 holds the lock on ``run_dir``: what another job wrote there after
    this one checked the directory (before the lock was its own: a job that was
    still running there, or started and ended meanwhile), as one line; None when
    nothing.  A new run (neither ``resume`` nor ``overwrite``) would overwrite the
    files of that job's run; a resume, whose checkpoint was chosen when ``seen``
    (names) were there, would train past newer checkpoints and rotate them away."""
    if resume:
        if seen is None:
            return None
        from .checkpoint import list_checkpoints
        newer = sorted({os.path.basename(p) for p in list_checkpoints(run_dir)} - set(seen))
        if not newer:
            return None
        return (f"{run_dir}: {', '.join(newer)} was written by another job after this "
                "one chose the checkpoint to continue from; start it again (--resume) to "
                "continue from the newest")
    if overwrite:
        return None
    return run_dir_problem(run_dir, resume=False, overwrite=False)


def clear_run(run_dir) -> list:
    """Remove the files of the run in ``run_dir`` (for --overwrite); returns them."""
    removed = run_files(run_dir)
    for path in removed:
        os.remove(path)
    try:
        os.rmdir(os.path.join(run_dir, TENSORBOARD_DIRECTORY))
    except OSError:
        pass            # absent, or it holds files of the user's
    return removed


#: Settings that name directories: compared by the directory they name (from the
#: working directory of each run), not by their spelling.
PLACE_SETTINGS = ("data.train", "data.dev", "model.init_from")


def corpus_places(cfg) -> dict:
    """``{"place_data.train": absolute real path, ...}`` of the path settings that
    are set: stored with a run's checkpoints, so a resume from another working
    directory is compared by what the paths name."""
    flat = dotted_keys(cfg.to_dict())
    # (as text: a checkpoint's HDF5 attributes take no name that is not UTF-8)
    return {f"place_{key}": path_text(os.path.realpath(flat[key])) for key in PLACE_SETTINGS
            if isinstance(flat.get(key), str) and flat[key]}


def corpus_identity(manifests: dict) -> dict:
    """``{"corpus_data.train_frames": ..., "_utterances": ..., "_digest": ...,
    "_content": ...}`` of each corpus in ``manifests`` (setting -> manifest or
    None): stored with a run's checkpoints, so that a corpus written again at
    the same path (``prepare --overwrite``) is noticed on resume.  The digest is
    a CRC-32 of the shard list (paths, frames, utterances), the classes and the
    feature dimension; the content one of the frames per class and the features'
    mean and variance: new alignments or other features of the same utterances
    change them, the sizes not."""
    identity = {}
    for key, manifest in manifests.items():
        if manifest is None:
            continue
        listing = ";".join(f"{s.path}:{int(s.frames)}:{int(s.utterances)}"
                           for s in manifest.shards)
        listing += f"|{int(manifest.num_classes)}|{int(manifest.feat_dim)}"
        content = json.dumps([[int(c) for c in manifest.class_counts],
                              [float(v) for v in manifest.cmvn_mean],
                              [float(v) for v in manifest.cmvn_var]])
        identity[f"corpus_{key}_frames"] = int(manifest.num_frames)
        identity[f"corpus_{key}_utterances"] = int(manifest.num_utterances)
        identity[f"corpus_{key}_digest"] = zlib.crc32(listing.encode("utf-8"))
        identity[f"corpus_{key}_content"] = zlib.crc32(content.encode("utf-8"))
    return identity


#: The trainer state's field of the stack ``model.init_from`` named: the leading 60
#: bits (an integer: the state's text is places alone) of its stored SHA-256 checksum.
INIT_FROM_CHECKSUM = "init_from_checksum"


def init_from_identity(cfg) -> dict:
    """``{INIT_FROM_CHECKSUM: N}`` of the RBM stack ``model.init_from`` names (from
    the checksum the file stores, unverified: a resume does not read the stack):
    stored with a run's checkpoints, so that the stack moved or copied elsewhere
    since (with the run directory, to a node's disk) is known on resume as the one
    the run started from.  Empty when none is set, or the file stores no checksum."""
    path = cfg.model.init_from
    checksum = stored_checksum(path) if path else None
    return {INIT_FROM_CHECKSUM: int(checksum[:15], 16)} if checksum else {}


def moved_init_from(old_state: dict, now_identity: dict, now_places: dict) -> dict:
    """``{"model.init_from": (old place, new place)}`` when the stack a checkpoint's
    trainer state (``old_state``) identifies (:func:`init_from_identity`) now lies
    elsewhere (``now_places``, :func:`corpus_places`); else empty."""
    key = "model.init_from"
    before, after = old_state.get(f"place_{key}"), now_places.get(f"place_{key}")
    if INIT_FROM_CHECKSUM in old_state and INIT_FROM_CHECKSUM in now_identity \
            and int(old_state[INIT_FROM_CHECKSUM]) == now_identity[INIT_FROM_CHECKSUM] \
            and before and after and str(before) != after:
        return {key: (str(before), after)}
    return {}


def _same_corpus(old_state: dict, now: dict, key: str) -> bool:
    """Whether the corpus of setting ``key`` is the one ``old_state`` identifies
    (what an older checkpoint did not record is not compared)."""
    return all(int(old_state[name]) == now[name]
               for name in (f"corpus_{key}_digest", f"corpus_{key}_content")
               if name in old_state and name in now)


def changed_corpora(old_state: dict, now: dict, now_places: dict | None = None) -> list:
    """``"data.train: ..."`` for each corpus whose :func:`corpus_identity` in a
    checkpoint's trainer state (``old_state``; absent in older checkpoints: not
    compared) differs from ``now``.  A corpus now at another place than the
    checkpoint's (``now_places``, :func:`corpus_places`) is another corpus, which
    :func:`changed_settings` names already."""
    changes = []
    for name in sorted(k for k in now if k.endswith("_digest")):
        key = name[len("corpus_"):-len("_digest")]
        if name not in old_state or _same_corpus(old_state, now, key):
            continue
        before = old_state.get(f"place_{key}")
        after = (now_places or {}).get(f"place_{key}")
        if before and after and str(before) != after:
            continue
        before = (int(old_state.get(f"corpus_{key}_frames", 0)),
                  int(old_state.get(f"corpus_{key}_utterances", 0)))
        after = (now[f"corpus_{key}_frames"], now[f"corpus_{key}_utterances"])
        if before != after:
            what = f"{before[0]} frames in {before[1]} utterances -> {after[0]} in {after[1]}"
        elif int(old_state[name]) != now[name]:
            what = "the same size, other shards, classes or dimension"
        else:
            what = ("the same shards and sizes, other labels or features: the frames per "
                    "class or the features' mean and variance differ")
        changes.append(f"{key}: the corpus was written again since the checkpoint ({what})")
    return changes


def moved_corpora(old_state: dict, now_identity: dict, now_places: dict) -> dict:
    """``{"data.train": (old place, new place)}`` for each corpus that is the one a
    checkpoint's trainer state (``old_state``) identifies (:func:`corpus_identity`:
    the same shards, frames, classes and dimension) but now lies elsewhere: a
    corpus copied to another disk (a node's local disk, a new scratch
    directory) between a run and its resume."""
    moved = {}
    for name in sorted(k for k in now_identity if k.endswith("_digest")):
        key = name[len("corpus_"):-len("_digest")]
        before, after = old_state.get(f"place_{key}"), now_places.get(f"place_{key}")
        if name in old_state and _same_corpus(old_state, now_identity, key) \
                and before and after and str(before) != after:
            moved[key] = (str(before), after)
    return moved


def changed_settings(old_cfg, new_cfg, *, neutral=NEUTRAL_SETTINGS,
                     old_places: dict | None = None, moved: dict | None = None,
                     unused=unused_settings) -> list:
    """``"key: old -> new"`` for each setting that differs and changes the result.

    ``old_places`` (:func:`corpus_places` of the old run, where it was saved):
    path settings then differ when they name other directories from here, however
    they are spelt (a relative path resumed from another working directory).
    ``moved`` (:func:`moved_corpora`): path settings that name the same corpus
    elsewhere, which changes nothing.  Settings that neither run uses
    (``unused``: dotted settings -> prefixes, :func:`unused_settings` as `train`
    reads them) change nothing either."""
    old, new = dotted_keys(old_cfg.to_dict()), dotted_keys(new_cfg.to_dict())
    places = corpus_places(new_cfg)
    unused = set(unused(old)) & set(unused(new))
    changes = []
    for key in sorted(set(old) | set(new)):
        if key in neutral or key in (moved or {}) or key.startswith(tuple(unused)):
            continue
        saved = (old_places or {}).get(f"place_{key}")
        if saved is not None and key in PLACE_SETTINGS:
            now = places.get(f"place_{key}")
            if now != saved:
                changes.append(f"{key}: {old.get(key)!r} (that is {saved}) -> "
                               f"{new.get(key)!r} (from here {now})")
            continue
        if old.get(key) != new.get(key):
            changes.append(f"{key}: {old.get(key)!r} -> {new.get(key)!r}")
    return changes


def resume_changes(old_cfg, new_cfg, old_state: dict, now_identity: dict, *,
                   unused=unused_settings) -> tuple:
    """``(changes, notes)`` of a resume from a checkpoint with config ``old_cfg``
    and trainer state ``old_state`` (its places, corpus and stack identity): the
    settings and corpora that differ (:func:`changed_settings`,
    :func:`changed_corpora`), and a line for each corpus or stack found elsewhere
    (:func:`moved_corpora`, :func:`moved_init_from`), which is no change.
    ``unused``: as in :func:`changed_settings`."""
    places = corpus_places(new_cfg)
    moved = moved_corpora(old_state, now_identity, places)
    notes = [f"{key}: the corpus this run trained on, moved from {before} to {after}"
             for key, (before, after) in moved.items()]
    stack = moved_init_from(old_state, now_identity, places)
    notes += [f"{key}: the RBM stack this run started from (the same checksum), moved "
              f"from {before} to {after}" for key, (before, after) in stack.items()]
    moved.update(stack)
    changes = changed_settings(
        old_cfg, new_cfg, old_places={k: v for k, v in old_state.items()
                                      if k.startswith("place_")}, moved=moved,
        unused=unused) \
        + changed_corpora(old_state, now_identity, places)
    return changes, notes


#: What flock says when another process holds the lock; any other error means
#: the filesystem cannot lock at all.
HELD_ERRNOS = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)

#: The line a run's rank 0 writes into ``.lock`` while it holds it (cleared when it
#: releases the lock): its process, host and the time it took the lock.
HOLDER_LINE = re.compile(r"^pid (\d+) on (\S+) since (.+)$")


def _process_exists(pid: int) -> bool:
    """Whether a process of this id runs on this host (one of another user's too)."""
    try:
        os.kill(pid, 0)
    except PermissionError:
        return True
    except (OSError, OverflowError):
        return False
    return True


def holder_line() -> str:
    """What this process writes into a run directory's ``.lock`` while it holds it."""
    since = time.strftime("%Y-%m-%d %H:%M:%S %z")
    return f"pid {os.getpid()} on {os.uname().nodename} since {since}"


class RunDirLock:
    """An exclusive lock on a run directory, held by rank 0 while its run uses it,
    so that a second job started on the same directory (``--resume`` or
    ``--overwrite`` while the first still runs) is refused instead of deleting
    or interleaving the first one's files.  Released when the process ends.
    :meth:`moved` tells whether the directory was removed or moved away since
    (a write would then make a new directory of the same name, without the
    run's config and log).

    The lock is the kernel's (flock; over NFS the file server's), never a
    process id judged alive or dead: a run killed with SIGKILL, or whose node
    was lost, holds it no more, and one on another host holds it while it runs
    there.  ``.lock`` holds :func:`holder_line` while a run holds it, to name
    that run, and is emptied when the run releases it: a line found there by a
    run that took the lock was left by a run that never released it (killed),
    which :meth:`left_by` says.

    Example::

        lock = RunDirLock("runs/exp1")
        problem = lock.acquire()          # None, or why not
        lock.moved()                      # None, or the one-line error
    """

    NAME = ".lock"

    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, self.NAME)
        self._fh = None
        self._identity = None
        #: None, or the line to say when the filesystem cannot lock (then the run
        #: goes on without the lock)
        self.unguarded = None
        #: True when acquire() was refused because another process holds the lock
        self.held_elsewhere = False
        #: what .lock held when this process took it (restored when a start that
        #: was refused releases it: the line of a killed run stays for `status`)
        self._previous = ""
        #: set once the run writes its files here: release() then empties .lock
        self.in_use = False

    def acquire(self):
        import fcntl
        # never through a symbolic link: the pid line below would overwrite its target
        # (a file anywhere the user may write, named by whoever made the link)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            if os.path.islink(self.path):
                return (f"{self.path}: the run's lock file is a symbolic link (to "
                        f"{os.readlink(self.path)}), which a run never writes through; "
                        "remove the link")
            return f"{self.path}: cannot open the run's lock file ({exc.strerror or exc})"
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return f"{self.path}: the run's lock file is not a regular file; remove it"
        # (errors="replace": a damaged lock file is still named in the refusal below)
        fh = os.fdopen(fd, "r+", encoding="utf-8", errors="replace")
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in HELD_ERRNOS:
                # a filesystem without file locks (Lustre mounted without flock, an
                # NFS without a lock daemon): the run goes on, unguarded, and says so
                self.unguarded = (
                    f"{os.path.dirname(self.path)}: this filesystem does not lock files "
                    f"({os.strerror(exc.errno) if exc.errno else exc}); a second job started "
                    "on this run directory would not be noticed")
            else:
                fh.seek(0)
                holder = " ".join(fh.read(200).split()) or "a run still starting"
                fh.close()
                self.held_elsewhere = True
                return (f"{os.path.dirname(self.path)}: another run is using this directory "
                        f"({holder}); wait for it to end, or choose another --run-dir")
        fh.seek(0)
        self._previous = fh.read(200).strip()
        try:
            self._write_holder(fh)
        except OSError as exc:
            with contextlib.suppress(OSError):     # (closing flushes the line again)
                fh.close()
            full = disk_full_error(exc, self.path)
            return str(full) if full else f"cannot write {self.path}: {exc.strerror or exc}"
        self._fh = fh
        st = os.fstat(fh.fileno())
        self._identity = (st.st_dev, st.st_ino)
        return None

    def left_by(self):
        """The line to say when the lock was taken over from a run that had not
        released it (killed, its node lost); None when it had, or none held it."""
        if self.unguarded:
            return None
        found = HOLDER_LINE.match(" ".join(self._previous.split()))
        if not found:
            return None     # (released, or written by a version that never cleared it)
        pid, host, since = found.groups()
        what = f"the lock of pid {pid} on {host} since {since}, which never released it"
        if host == os.uname().nodename:
            if _process_exists(int(pid)):
                # it holds no lock here, so its line came with a copy of its directory
                # (or its pid was reused): two runs may now go on from one checkpoint
                return (f"took over {what} here; that process still runs: if this "
                        "directory is a copy of a run still going, both now train on "
                        "from the same checkpoint")
            return f"took over {what} (it was killed or crashed; it holds the lock no more)"
        # (no process id of another host is judged here: the file server released
        # its lock, which it does when that process or its host is gone)
        return (f"took over {what} (killed, or its node lost; a run still going there "
                "would hold it, unless this filesystem does not share locks between "
                "hosts: NFS mounted with local_lock or nolock)")

    @staticmethod
    def _write_holder(fh) -> None:
        """Who holds the lock, for the refusal another start of the run prints."""
        fh.seek(0)
        fh.truncate()
        fh.write(holder_line() + "\n")
        fh.flush()

    def _identity_now(self):
        # the lock file under its name (kept open, its inode cannot be reused: a
        # directory made anew at the old place holds no such file)
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_dev, st.st_ino)

    def moved(self, writing: str = "its files"):
        """None while the locked directory is still there under its name; else the
        one-line error to stop with instead of writing ``writing`` there."""
        if self._identity is None or self._identity_now() == self._identity:
            return None
        return (f"{os.path.dirname(self.path)}: the run directory (or its {self.NAME}) was "
                "removed or moved away "
                f"while this run used it; stopped instead of writing {writing} into a new "
                "directory of that name (if it was moved, move it back and --resume)")

    def release(self) -> None:
        if self._fh is not None:
            # a run that used the directory empties .lock (a line left there says its
            # run never released it); a start refused puts back what was there
            with contextlib.suppress(OSError, ValueError):
                self._fh.seek(0)
                self._fh.truncate()
                if not self.in_use and self._previous:
                    self._fh.write(self._previous + "\n")
                self._fh.flush()
            self._fh.close()          # closing drops the lock
            self._fh, self._identity = None, None


def lock_a_used_run_dir(run_dir):
    """``(lock, problem)``, on rank 0 before anything else about ``run_dir`` is
    judged (its files, its checkpoint's settings): the lock of a directory a run
    has used (its ``.lock`` is there), taken now so that one in use by another run
    is said as that.  ``lock``: held, for :func:`take_run_dir`; None when there is
    no ``.lock`` (no run can hold it: take_run_dir locks the directory) or one that
    cannot be taken for another reason (take_run_dir says it, after the checks).
    ``problem``: the one line when another run holds it."""
    path = os.path.join(run_dir, RunDirLock.NAME)
    if os.path.islink(path) or not os.path.isfile(path):
        return None, None
    lock = RunDirLock(run_dir)
    problem = lock.acquire()
    if problem:
        return None, problem if lock.held_elsewhere else None
    return lock, None


def take_run_dir(comm, run_dir, cfg, *, resume: bool, overwrite: bool, seen=None,
                 lock=None):
    """Rank 0 makes and locks ``run_dir``, checks what another job wrote there since
    ``seen`` (:func:`written_meanwhile`), removes stale temporaries (and with
    ``overwrite`` on a new run the previous run's files) and writes ``cfg`` as
    config.yaml.  Collective: every rank hears rank 0's refusal and raises it as one
    agreed :class:`~mpitrain.train.errors.TrainingError` (a job started on a directory
    in use ends in rank 0's line alone, not in its error and MPI's abort).

    ``lock``: rank 0's lock taken before (:func:`lock_a_used_run_dir`), if any.

    Returns ``(lock, lines)``: rank 0's :class:`RunDirLock` (None elsewhere) and the
    lines to say about what it found.
    """
    lines, problem, made = [], None, False
    if comm.rank != 0:
        lock = None
    else:
        made = not os.path.lexists(run_dir)
        os.makedirs(run_dir, exist_ok=True)
        if lock is None:
            lock = RunDirLock(run_dir)
            problem = lock.acquire()
        problem = problem or written_meanwhile(run_dir, resume=resume,
                                               overwrite=overwrite, seen=seen)
        if not problem:
            # an earlier start's failures and interrupted writes; before the other
            # ranks go on, which may fail at once and write their error files
            # through temporaries of their own
            remove_rank_errors(run_dir)
            stale = remove_stale_temporaries(run_dir)
            if stale:
                lines.append(f"removed {len(stale)} temporary file(s) left by an "
                             "interrupted write: "
                             + ", ".join(os.path.basename(p) for p in stale))
    problem = comm.bcast_obj(problem, root=0)
    if problem:
        if lock is not None:
            lock.release()
            # (not when another job holds the lock: it made the directory between
            # this start's look and its makedirs, and the lock file is its own)
            if made and not lock.held_elsewhere:
                remove_made_directory(run_dir, expected=(RunDirLock.NAME,))
        raise TrainingError(problem, agreed=True)
    if comm.rank == 0:
        lock.in_use = True
        if lock.unguarded:
            lines.append(lock.unguarded)
        if lock.left_by():
            lines.append(lock.left_by())
        if overwrite and not resume:
            removed = clear_run(run_dir)
            if removed:
                lines.insert(0, f"--overwrite: removed the previous run's {len(removed)} "
                                "file(s)")
        try:
            dump_config(cfg, os.path.join(run_dir, "config.yaml"))
        except BaseException:
            lock.release()
            if made:
                remove_made_directory(run_dir, expected=(RunDirLock.NAME,))
            raise
    return lock, lines
