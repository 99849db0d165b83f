"""Starting MPI for a command, and the ranks' agreement before any work.

Every rank of a job parses its own command line and reads its own copy of the
configuration.  Two faults are seen by no single rank:

* one rank cannot start (the configuration file is missing on its node, a
  value it reads is bad, its command line alone is wrong) while the others
  can: they would wait in MPI for it forever, and its error would never be
  said;
* the ranks start with different settings (a file edited while the job
  started, an option set per rank in a batch script): their buffers would not
  match (an MPI error naming no setting) or, worse, they would train
  different models and average them.

So, under a launcher with several ranks, an error met before MPI is held, MPI
is started anyway, and the ranks first exchange whether each could start, then
compare their settings with rank 0's (a path spelt otherwise that names the
same place is the same setting, and so is a corpus or stack each rank names
as its own copy holding the same bytes).  Either fault ends every rank with
one line from rank 0 naming the ranks and the error or setting.  A run
without a launcher (or with one rank) says its error at once and never
starts MPI.

Example::

    def prepare():
        cfg = load_config(path)
        return cfg, rank_settings(cfg, args)
    comm, cfg, problem = start_ranks(prepare)
    if problem:
        ...       # rank 0 says `problem`; every rank ends with status 2
"""

from __future__ import annotations

import hashlib
import json
import os
import traceback
from typing import Callable, Optional

#: Errors a rank may meet before MPI starts that are the user's to fix; any other
#: exception is a bug, held all the same (so that no rank waits forever) and its
#: traceback printed by the rank that met it.
USER_ERRORS = (ValueError, OSError, RuntimeError)
#: Distinct problems named in one line at most.
MAX_PROBLEMS_SAID = 3


def several_ranks() -> bool:
    """True when an MPI launcher started this process as one of several (or does
    not say how many): then the ranks must agree before any of them works."""
    from .comm import launched_by_mpi, world_size_from_env
    if not launched_by_mpi():
        return False
    size = world_size_from_env()
    return size is None or size > 1


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def start_ranks(prepare: Callable[[], tuple], *, user_errors=USER_ERRORS):
    """Run ``prepare()`` (the checks made before MPI; it returns ``(cfg, settings)``,
    ``settings`` a flat JSON-able dict of everything that must be equal on every
    rank), start MPI and agree.

    Returns ``(comm, cfg, problem)``: ``problem`` is None when every rank could
    start with rank 0's settings, otherwise the one line rank 0 says (the same
    on every rank).  Without several ranks an error of ``prepare`` is raised as
    it is, before MPI starts.
    """
    from .comm import create_communicator
    if not several_ranks():
        # (one process: an error is said at once, before MPI starts)
        cfg, _ = prepare()
        return create_communicator(device_transport=cfg.device_transport), cfg, None
    cfg, settings, held = None, None, None
    try:
        cfg, settings = prepare()
    except user_errors as exc:
        held = exc
    except Exception as exc:        # a bug: said here, held so that no rank waits
        traceback.print_exc()
        held = exc
    try:
        comm = create_communicator(
            device_transport=cfg.device_transport if cfg is not None else "auto")
    except Exception:
        if held is not None:        # the earlier error is the one to say
            raise held from None
        raise
    if comm.size == 1:
        if held is not None:
            raise held
        return comm, cfg, None
    problems = comm.allgather_obj(None if held is None else _held_text(held, user_errors))
    if any(p is not None for p in problems):
        return comm, cfg, _problems_line(problems)
    return comm, cfg, _settings_problem(comm, settings)


def _held_text(exc: BaseException, user_errors) -> str:
    if isinstance(exc, user_errors):
        return _one_line(exc)
    return f"internal error ({_one_line(exc)}): this is a bug in mpitrain; please " \
           "report it with the traceback that rank printed"


def _rank_list(ranks: list) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    shown = ", ".join(str(r) for r in ranks[:8])
    return f"ranks {shown}" + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def _problems_line(problems: list) -> str:
    """One line for the problems the ranks held (None: that rank could start).
    A problem every rank met is said as it is; otherwise each distinct problem
    with the ranks that met it, and which ranks could start."""
    by_text: dict = {}
    for rank, text in enumerate(problems):
        if text is not None:
            by_text.setdefault(text, []).append(rank)
    if len(by_text) == 1 and all(p is not None for p in problems):
        return next(iter(by_text))
    parts = [f"{_rank_list(ranks)}: {text}"
             for text, ranks in list(by_text.items())[:MAX_PROBLEMS_SAID]]
    if len(by_text) > MAX_PROBLEMS_SAID:
        parts.append(f"and {len(by_text) - MAX_PROBLEMS_SAID} other errors")
    started = [rank for rank, p in enumerate(problems) if p is None]
    return "; ".join(parts) + (f" ({_rank_list(started)} could start)" if started else "")


#: Settings whose values name files or directories: equal when spelt alike, or,
#: spelt otherwise, when they name the same place from each rank's working
#: directory.
PLACES = ("data.train", "data.dev", "model.init_from", "--run-dir", "--out")
#: Of those, the ones that may name a copy on each node (a corpus staged to the
#: nodes' local disks, a pretrained stack copied there): equal too when what
#: they name holds the same bytes (a corpus's corpus.yaml, whose shard paths
#: are relative to it; a stack file).
COPIES = {"data.train": "corpus.yaml", "data.dev": "corpus.yaml", "model.init_from": ""}
#: Command-line options that are not settings: the configuration file is compared
#: by its content, and --set by the values it sets.
NOT_SETTINGS = ("func", "command", "config", "set")


def rank_settings(cfg, args) -> dict:
    """Everything that must be equal on every rank: the configuration's values
    (``model.hidden_dim``: 512) and the command line's options (``--run-dir``)."""
    from .files import dotted_keys
    settings = {f"--{name.replace('_', '-')}": value for name, value in vars(args).items()
                if name not in NOT_SETTINGS}
    settings.update(dotted_keys(cfg.to_dict()))
    # as every rank sees rank 0's (tuples become lists)
    return json.loads(json.dumps(settings))


def _is_place(key: str) -> bool:
    return key in PLACES


def _place(value) -> Optional[str]:
    return os.path.realpath(value) if isinstance(value, str) and value else None


def settings_differences(rank0: dict, mine: dict, rank0_places: dict) -> tuple:
    """``(differences, copies)``: ``"key: mine (rank 0: theirs)"`` for each setting
    that differs from rank 0's (path settings spelt otherwise are compared by the
    place they name, ``rank0_places``: key -> rank 0's real path), and the keys
    of :data:`COPIES` that name another place than rank 0's, which are equal if
    they hold the same bytes (:func:`copy_digest`)."""
    differences, copies = [], []
    for key in sorted(set(rank0) | set(mine)):
        theirs, ours = rank0.get(key), mine.get(key)
        if theirs == ours:
            continue
        if _is_place(key) and _place(ours) is not None:
            if _place(ours) == rank0_places.get(key):
                continue
            if key in COPIES and _place(theirs) is not None:
                copies.append(key)
                continue
        differences.append(_difference(key, ours, theirs))
    return differences, copies


def _difference(key, ours, theirs) -> str:
    return f"{key}: {ours!r} (rank 0: {theirs!r})"


def copy_digest(key: str, value) -> Optional[str]:
    """SHA-256 of what the path setting ``key`` names (for a corpus, its
    corpus.yaml), or None when it cannot be read here (the run's own checks
    then name the problem on that rank)."""
    if not isinstance(value, str) or not value:
        return None
    path = os.path.join(value, COPIES[key]) if COPIES.get(key) else value
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    except OSError:
        return None
    return digest.hexdigest()


def _settings_problem(comm, settings: dict) -> Optional[str]:
    """None when every rank's ``settings`` are rank 0's, otherwise the line that
    names the first rank that differs and how."""
    places = {key: _place(value) for key, value in settings.items() if _is_place(key)}
    rank0, rank0_places = comm.bcast_obj([settings, places] if comm.rank == 0 else None,
                                         root=0)
    mine, copies = settings_differences(rank0, settings, rank0_places)
    if _any_rank(comm, bool(copies)):        # (a collective: every rank asks)
        # copies on the nodes (rare): rank 0 reads what it names, the others compare
        keys = sorted(set().union(*comm.allgather_obj(copies)))
        theirs = comm.bcast_obj({key: copy_digest(key, rank0.get(key)) for key in keys}
                                if comm.rank == 0 else None, root=0)
        for key in copies:
            ours = copy_digest(key, settings.get(key))
            if None not in (ours, theirs[key]) and ours != theirs[key]:
                mine.append(_difference(key, settings.get(key), rank0.get(key))
                            + ", which holds other content")
    verdicts = comm.allgather_obj([mine[:3], len(mine)] if mine else None)
    differing = [rank for rank, v in enumerate(verdicts) if v]
    if not differing:
        return None
    first = differing[0]
    named, count = verdicts[first]
    more = f" (and {count - len(named)} more)" if count > len(named) else ""
    others = (f"; {_rank_list(differing)} differ from rank 0" if len(differing) > 1 else "")
    return (f"the ranks were started with different settings: rank {first} has "
            + "; ".join(named) + more + others
            + "; every rank must read the same configuration file and options")


def _any_rank(comm, flag: bool) -> bool:
    return bool(comm.allreduce_scalar(int(flag), op="max"))
