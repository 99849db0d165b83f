"""Command line: ``python -m mpitrain <command> ...``.

Each command is a few lines that call the library; heavy imports happen
inside the command so ``--help`` is instant.  This is the one place where
concrete classes are chosen from the user's words.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shlex
import signal
import sys
import time
import traceback
import warnings

from .process import (NamedStdout, fill_closed_standard_descriptors, interrupt_held,
                      silence_stdout, stop_signals_kept)
from .words import DefaultsFormatter, plural, shown as shown_value, words_cut


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit status 2."""


class _SaidByRank0(Exception):
    """An error every rank of the job meets alike, on a rank other than 0: rank 0
    says it, this rank ends with exit status 2 without a word."""


#: Commands that run under mpiexec (or srun), one process per rank.
MPI_COMMANDS = ("train", "pretrain", "bench", "synth")
#: Of those, the ones whose ranks agree before any work (mpitrain/launch.py).
AGREEING_COMMANDS = ("train", "pretrain", "bench")
#: How long a silent rank waits before it exits: Open MPI's mpiexec ends the
#: whole job as soon as one rank exits with a failure, which could cut rank 0
#: off before it prints the error.
QUIET_EXIT_DELAY_S = 2.0


def _launcher_rank() -> int:
    """This process's rank as the MPI launcher set it (0 without one), read before
    MPI starts."""
    from .comm import rank_from_env
    return rank_from_env()


@contextlib.contextmanager
def _before_mpi():
    """Checks made before MPI starts that every rank meets alike (the command
    line): rank 0 says the error, the others end with exit status 2 silently
    (mpiexec still reports the job failed).  Checks that may differ between
    ranks (the configuration each one reads) go through :func:`_start_ranks`.
    """
    try:
        yield
    except (UsageError, ValueError, OSError, RuntimeError) as exc:
        if _launcher_rank() > 0:
            raise _SaidByRank0() from exc
        raise


def _refuse_virtual_under_a_launcher() -> None:
    """``--virtual`` simulates every rank in one process: under mpiexec each rank
    would run the whole simulation into the same run directory or report."""
    from .comm import world_size_from_env
    size = world_size_from_env()
    if size and size > 1:
        raise UsageError(f"--virtual simulates every rank in this one process; run it "
                         f"without mpiexec or srun (this is one of {size} processes)")


#: The arguments that name files or directories, as usage names them.
_PATH_ARGUMENTS = (("config", "CONFIG"), ("run_dir", "--run-dir"), ("out_dir", "OUT_DIR"),
                   ("dir", "DIR"), ("corpus", "--corpus"), ("train", "--train"),
                   ("dev", "--dev"), ("model", "MODEL"), ("corpus_dir", "CORPUS_DIR"),
                   ("run_dirs", "RUN_DIR"), ("parts", "PART_DIR"), ("out", "--out"))


def _refuse_unexpanded_home(args) -> None:
    """A path given as ``~/x`` (quoted, or after ``--option=``, where the shell
    leaves it): read, it is not found; written, it makes a directory ``~`` here."""
    from .files import unexpanded_home
    for name, shown in _PATH_ARGUMENTS:
        values = getattr(args, name, None)
        for value in values if isinstance(values, list) else [values]:
            problem = unexpanded_home(value) if isinstance(value, str) else None
            if problem:
                raise UsageError(f"{shown} {problem}")


#: The output path of commands that would write into the working directory when
#: it is empty (a variable left unset in a script), with what to name instead.
_EMPTY_OUTPUT = {
    "synth": ("out_dir", "OUT_DIR", "the directory to write train/ and dev/ into "
                                    "(. for this one)"),
    "merge": ("out_dir", "OUT_DIR", "the merged corpus directory (. for this one)"),
    "prepare": ("out", "--out", "the corpus directory to write (. for this one)"),
    "plot": ("out", "--out", "the PNG file, or leave the option out for "
                             "RUN_DIR/curves.png"),
}


def _refuse_empty_output(args) -> None:
    """An empty output path is not the working directory nor a default."""
    name, shown, what = _EMPTY_OUTPUT.get(args.command, (None, None, None))
    value = getattr(args, name, None) if name else None
    if isinstance(value, str) and not value.strip():
        raise UsageError(f"{shown} is empty; name {what}")


def _one_process_only(command: str) -> None:
    """A command that is not an MPI one, started as one of several processes by
    mpiexec or srun: every process would do the whole work (and write the same
    files at once).  Rank 0 says so; every process ends with status 2."""
    from .comm import world_size_from_env
    from .launch import several_ranks
    if not several_ranks():
        return
    if _launcher_rank() > 0:
        raise _SaidByRank0()
    size = world_size_from_env()
    raise UsageError(f"{command} runs as one process; start it without mpiexec or srun"
                     + (f" (this is one of {size} processes)" if size else ""))


def _end_quietly() -> int:
    """Exit status 2 of a rank whose error rank 0 says."""
    _status_settled()
    time.sleep(QUIET_EXIT_DELAY_S)
    return 2


def _status_settled() -> None:
    """Every rank of a job of several stopped at the same error (a refused
    setting, a run directory that cannot be used): a stop signal from here on, in
    the wait above or in MPI's finalize, would end the job with the signal's
    status instead of 2.  Only in the program's own process: a caller that runs
    the command line in its process keeps its handlers."""
    from .process import process_is_the_command_lines
    from .train.stop import ignore_from_now_on
    if process_is_the_command_lines():
        ignore_from_now_on()


# -- commands ----------------------------------------------------------------------

def cmd_synth(args) -> int:
    from .comm import create_communicator
    from .data.synthetic import synthesize
    # under mpiexec rank 0 writes and the others wait for its verdict
    comm = create_communicator()
    info, problem = None, None
    if comm.rank == 0:
        try:
            info = synthesize(args.out_dir, hours=args.hours, speakers=args.speakers,
                              shards=args.shards, seed=args.seed, dev_hours=args.dev_hours,
                              dev_speakers=args.dev_speakers, overwrite=args.overwrite,
                              seen_dev_hours=args.seen_dev_hours)
        except (ValueError, OSError, RuntimeError, MemoryError) as exc:
            problem = exc
    failed = comm.bcast_obj(problem is not None if comm.rank == 0 else None, root=0)
    if comm.rank != 0:
        return 2 if failed else 0
    if problem is not None:
        raise problem
    for warning in info["warnings"]:
        print(f"mpitrain synth: warning: {warning}", file=sys.stderr)
    print(f"train: {info['train_dir']}: {info['train_frames']} frames, "
          f"{plural(info['train_utterances'], 'utterance')}, "
          f"{plural(len(info['train_speakers']), 'speaker')}")
    print(f"dev:   {info['dev_dir']}: {info['dev_frames']} frames, "
          f"{plural(info['dev_utterances'], 'utterance')}, "
          f"{plural(len(info['dev_speakers']), 'unseen speaker')}")
    if info.get("seen_dev_dir"):
        print(f"dev_seen: {info['seen_dev_dir']}: {info['seen_dev_frames']} frames of the "
              "training speakers")
    print(f"{info['feat_dim']}-dim features, {info['num_classes']} classes; "
          f"written in {info['seconds']:.1f} s")
    return 0


def cmd_init(args) -> int:
    from .starter import run_command, write_starter
    path = write_starter(args.dir, corpus=args.corpus, train=args.train, dev=args.dev,
                         example=args.example, overwrite=args.overwrite,
                         warn=lambda message: print(message, file=sys.stderr))
    how = run_command(args.example).replace("\n#  ", "")
    print(f"wrote {path}; run it with: cd {shlex.quote(args.dir)} && {how}")
    return 0


def cmd_prepare(args) -> int:
    from .data.kaldi import import_kaldi
    report = import_kaldi(args.feats, args.ali, args.out, shards=args.shards,
                          num_classes=args.num_classes, overwrite=args.overwrite,
                          utt2spk=args.utt2spk, cmvn=args.cmvn, norm_vars=args.norm_vars,
                          length_tolerance=args.length_tolerance,
                          scp_commands=args.scp_commands)
    for warning in report.warnings:
        print(f"mpitrain prepare: warning: {warning}", file=sys.stderr)
    print(report.summary())
    return 0 if report.imported else 1


def cmd_merge(args) -> int:
    from .data.merge import merge_corpora
    manifest = merge_corpora(args.out_dir, args.parts, num_classes=args.num_classes,
                             overwrite=args.overwrite)
    print(f"{args.out_dir}: {plural(manifest.num_utterances, 'utterance')}, "
          f"{manifest.num_frames} frames in {plural(len(manifest.shards), 'shard')} from "
          f"{plural(len(args.parts), 'part')} "
          f"(feat_dim {manifest.feat_dim}, {manifest.num_classes} classes)")
    return 0


def _unreadable_dir(path: str) -> bool:
    return os.path.isdir(path) and not os.access(path, os.R_OK | os.X_OK)


def cmd_check(args) -> int:
    from .data.check import check_corpus
    from .data.corpus import manifest_path
    dirs = [args.corpus_dir]
    if not os.path.exists(manifest_path(args.corpus_dir)):
        # a synth output directory: check its splits
        # (a split that cannot be read is checked too, so that it is reported)
        subs = [os.path.join(args.corpus_dir, s) for s in sorted(os.listdir(args.corpus_dir))
                if os.path.exists(manifest_path(os.path.join(args.corpus_dir, s)))
                or _unreadable_dir(os.path.join(args.corpus_dir, s))] \
            if os.path.isdir(args.corpus_dir) else []
        dirs = subs or dirs
    problems = []
    for d in dirs:
        found = check_corpus(d)
        problems += found
        if not found:
            print(f"{d}: OK")
    for p in problems:
        print(f"mpitrain check: {p}", file=sys.stderr)
    return 1 if problems else 0


def _require_training_corpus(cfg, config: str) -> None:
    """A config without ``data.train`` (a variable left unset in ``--set
    data.train=$DIR``) is named by its file before MPI starts."""
    if not cfg.data.train:
        raise UsageError(f"{config}: data.train: no training corpus given (set data.train "
                         "in the config or with --set data.train=DIR)")


def _refuse_a_config_one_rank_would_take(config) -> None:
    """Under a launcher every rank reads the configuration itself: a pipe
    (``train <(sed ... cfg.yaml)``, ``/dev/stdin``) is taken by one rank, and the
    others read nothing (said as a config without data.train) or wait for a writer
    that never comes (a named pipe).  A regular file, or a link to one, is read."""
    from .files import special_file
    from .launch import several_ranks
    if config is not None and several_ranks() and special_file(config):
        raise UsageError(f"{config}: not a regular file (a pipe or a device), and under an "
                         "MPI launcher every rank reads the config itself: write it to a "
                         "file and name that")


def cmd_train(args) -> int:
    from .config import load_config
    if args.virtual is not None:      # (--virtual 0 is refused by its range, not run on real ranks)
        with _before_mpi():
            cfg = load_config(args.config, args.set)
            _require_training_corpus(cfg, args.config)
            _refuse_virtual_under_a_launcher()
        return _train_virtual(args, cfg)
    from .train.trainer import Trainer
    return _run_on_ranks("train", Trainer, args, default_suffix="")


def cmd_pretrain(args) -> int:
    from .train.pretrain import Pretrainer
    return _run_on_ranks("pretrain", Pretrainer, args, default_suffix="-pretrain")


def _start_ranks(args, checks=None, load=None):
    """Load the configuration (``load(args)``, default: as written, with ``--set``),
    make the other ``checks`` before MPI, start MPI and
    agree with the other ranks (mpitrain/launch.py); returns ``(comm, cfg)``.
    Raises UsageError on rank 0 and _SaidByRank0 elsewhere when any rank could
    not start or the ranks' settings differ."""
    from .config import load_config
    from .launch import rank_settings, start_ranks

    def prepare():
        _refuse_a_config_one_rank_would_take(args.config)
        cfg = load(args) if load is not None else load_config(args.config, args.set)
        _require_training_corpus(cfg, args.config)
        if checks is not None:
            checks()
        return cfg, rank_settings(cfg, args)
    with _before_mpi():
        comm, cfg, problem = start_ranks(prepare, user_errors=(UsageError, ValueError,
                                                               OSError, RuntimeError))
    if problem:     # (only with several ranks)
        _status_settled()
        if comm.rank != 0:
            raise _SaidByRank0()
        raise UsageError(problem)
    return comm, cfg


def _run_on_ranks(command: str, runner_class, args, *, default_suffix: str) -> int:
    """Run a Trainer-like class (``run()``, ``close()``) on this job's MPI ranks.

    The run directory is judged by rank 0 and every rank hears the verdict, so
    all stop together or none; an error every rank reached together is one line
    from rank 0, an error on one rank aborts the job so the others do not wait.
    A stop signal from the start on (MPI's start, the ranks' agreement, the
    checks) is kept for the run (train/stop.py).
    """
    from .train.stop import keep_stop_signals
    with keep_stop_signals():
        return _start_and_run(command, runner_class, args, default_suffix=default_suffix)


def _start_and_run(command: str, runner_class, args, *, default_suffix: str) -> int:
    from .comm.abort import install_abort_hook
    from .files import working_directory

    def checks():
        _refuse_virtual_only_options(args)
        _refuse_empty_run_dir(args)
    comm, cfg = _start_ranks(args, checks)
    install_abort_hook(comm)
    _limit_blas_threads(cfg, comm)
    run_dir = args.run_dir or os.path.join(
        "runs", os.path.splitext(os.path.basename(args.config))[0] + default_suffix)
    lock, problem = _judge_run_dir(run_dir, args) if comm.rank == 0 else (None, None)
    try:
        problem, root_cwd = comm.bcast_obj((problem, working_directory()), root=0)
        if comm.rank != 0:
            run_dir = _as_rank_0_names_it(run_dir, root_cwd)
        if problem:
            if comm.size > 1:
                _status_settled()
            if comm.rank != 0:
                return 2
            raise UsageError(problem)
        return _run_judged(command, runner_class, args, comm, cfg, run_dir, lock)
    finally:
        if lock is not None:
            lock.release()      # (the runner released it already, unless it failed to start)


def _judge_run_dir(run_dir: str, args):
    """Rank 0's ``(lock, problem)`` of the run directory: a directory that another run
    is using is said as that, before its files or its checkpoint are judged (the
    lock is then held for the run: train/run_dir.py)."""
    from .train.run_dir import lock_a_used_run_dir, run_dir_problem
    problem = run_dir_problem(run_dir, resume=args.resume, overwrite=args.overwrite)
    if problem and not os.path.isdir(run_dir):
        return None, problem
    lock, held = lock_a_used_run_dir(run_dir) if os.path.isdir(run_dir) else (None, None)
    return lock, held or problem


def _run_judged(command: str, runner_class, args, comm, cfg, run_dir: str, lock) -> int:
    from .train.stop import EXIT_STOPPED, ignore_from_now_on, stop_on_signals
    try:
        # SIGTERM, SIGUSR1, SIGUSR2, SIGHUP: a checkpoint at the next point where the ranks
        # agree, then exit status EXIT_STOPPED on every rank (train/stop.py)
        with stop_on_signals():
            runner = runner_class(cfg, run_dir=run_dir, comm=comm, resume=args.resume,
                                  overwrite=args.overwrite, accept_changes=args.accept_changes,
                                  lock=lock)
            try:
                if args.dry_run:
                    result = {}
                    # (before rank 0 prints: a print that fails must not leave rank 0
                    # out of the collective freeing that close then does)
                    runner.dry_run_done()
                    if comm.rank == 0:
                        print("\n".join(runner.dry_run_lines() + [_dry_run_line(run_dir)]),
                              flush=True)
                else:
                    result = runner.run()
            finally:
                runner.close()
        # every rank returns after rank 0 has written everything: a launcher may end
        # the others once one rank exits with a non-zero status, and a rank that had
        # returned (its signal handlers gone) and waited in MPI's finalize for rank 0
        # to write final.h5 died of a stop signal then, and the launcher with it
        # ended rank 0 before it had (status 143, no final.h5, nothing to requeue)
        comm.barrier()
        if comm.size > 1:
            # a stop signal while this rank waits in MPI's finalize for the others
            # would fail the finished job
            ignore_from_now_on()
        if result.get("stopped"):
            return EXIT_STOPPED
    except (ValueError, OSError, RuntimeError, MemoryError) as exc:
        if getattr(exc, "agreed", False) or comm.size == 1:
            return _stopped_together(exc, comm, args.config)
        from .comm.base import PeerLost
        from .train.errors import error_message     # (a MemoryError says nothing)
        advice = ("; the job ends: --resume continues from the newest checkpoint"
                  if isinstance(exc, PeerLost) else "")
        print(f"mpitrain {command}: rank {comm.rank}: error: {error_message(exc)}{advice}",
              file=sys.stderr, flush=True)
        comm.abort(2)           # (the line above says why: no second copy of it)
    except BaseException as exc:
        _end_every_rank(comm, command, exc)
        raise
    return 0


def _as_rank_0_names_it(run_dir: str, root_cwd: str) -> str:
    """A relative run directory is the one under rank 0's working directory on
    every rank: the others read its checkpoints and write their error records
    there (a rank started in another directory, by mpiexec -wdir or a node's
    own cd, found no checkpoint to resume from and left its error record in a
    directory of its own, where status never looks)."""
    from .files import working_directory
    if os.path.isabs(run_dir) or not root_cwd or working_directory() == root_cwd:
        return run_dir
    return os.path.join(root_cwd, run_dir)


def _dry_run_line(run_dir: str) -> str:
    return (f"dry run: the configuration, the corpus and the plan hold (a run would start "
            f"as above); nothing was trained or written ({run_dir})")


def _end_every_rank(comm, command: str, exc: BaseException) -> None:
    """An interrupt or a bug on one rank ends the whole job: a rank that just
    returned would leave the others waiting in their next collective forever
    (a rank spinning inside MPI never sees its own interrupt)."""
    if comm.size == 1 or isinstance(exc, SystemExit):
        return
    if isinstance(exc, KeyboardInterrupt):
        print(f"mpitrain {command}: rank {comm.rank}: interrupted", file=sys.stderr, flush=True)
        comm.abort(130, "interrupted")
        return      # (an abort may take a moment to end this process)
    traceback.print_exc()
    print(f"mpitrain {command}: rank {comm.rank}: internal error: this is a bug in mpitrain; "
          "please report it with the traceback above", file=sys.stderr, flush=True)
    comm.abort(1, "internal error")


def _train_virtual(args, cfg) -> int:
    """``train --virtual N``: N virtual ranks in this process, on a simulated clock."""
    from .train.virtual import MAX_VIRTUAL_RANKS
    if not 1 <= args.virtual <= MAX_VIRTUAL_RANKS:
        raise UsageError(f"--virtual: expected a number of ranks in [1, {MAX_VIRTUAL_RANKS}] "
                         f"(each is a thread of this process with its own model), got "
                         f"{args.virtual}")
    _refuse_empty_run_dir(args)
    _refuse_sleeping_stragglers(args, cfg, args.virtual)
    run_dir = args.run_dir or os.path.join(
        "runs", os.path.splitext(os.path.basename(args.config))[0])
    lock, problem = _judge_run_dir(run_dir, args)
    try:
        if problem:
            raise UsageError(problem)
        return _train_virtual_judged(args, cfg, run_dir, lock)
    finally:
        if lock is not None:
            lock.release()      # (rank 0's trainer released it already, unless it failed)


def _train_virtual_judged(args, cfg, run_dir: str, lock) -> int:
    from .train.stop import EXIT_STOPPED, stop_on_signals
    from .train.virtual import plan_virtual, train_virtual
    try:
        # (before a dry run too, which would say the plan holds; a step time still to
        # be measured is measured by train_virtual, after its own checks)
        network = _network_model(args)
        compute = _compute_model(args, cfg, args.virtual)
        if args.dry_run:
            lines = plan_virtual(cfg, size=args.virtual, run_dir=run_dir,
                                 resume=args.resume, overwrite=args.overwrite,
                                 accept_changes=args.accept_changes, lock=lock)
            print("\n".join(lines + [_dry_run_line(run_dir)]), flush=True)
            return 0
        # a stop signal: a checkpoint at the next step where the ranks agree, as on
        # real ranks (train/stop.py); the virtual ranks read the one flag of the process
        with stop_on_signals():
            result = train_virtual(cfg, size=args.virtual, run_dir=run_dir,
                                   network=network, compute=compute,
                                   resume=args.resume, overwrite=args.overwrite,
                                   accept_changes=args.accept_changes, lock=lock)
        if result.get("stopped"):
            return EXIT_STOPPED
    except (ValueError, RuntimeError) as exc:
        if getattr(exc, "exit_status", None) == EXIT_STOPPED:
            # param_server's stop: its server wrote the checkpoint, said so and
            # ended the job as on real ranks, by an abort of this status
            return EXIT_STOPPED
        # a setting these ranks cannot run: named with its file, as on real ranks
        if getattr(exc, "setting", False) and args.config:
            raise UsageError(f"{args.config}: {exc}") from None
        raise
    return 0


def _network_model(args):
    """The network model of --latency-us, --bandwidth-gbit and --allreduce-algorithm,
    a bad value named by its flag (the model itself names its fields in seconds and
    bytes, not what was typed)."""
    from .comm.netmodel import NetworkModel
    if not 0 <= args.latency_us < math.inf:
        raise UsageError(f"--latency-us: expected a latency in microseconds >= 0, "
                         f"got {args.latency_us:g}")
    if not 0 < args.bandwidth_gbit < math.inf:
        raise UsageError(f"--bandwidth-gbit: expected a bandwidth in Gbit/s > 0, "
                         f"got {args.bandwidth_gbit:g}")
    return NetworkModel(latency_s=args.latency_us * 1e-6,
                        bandwidth_bytes_per_s=args.bandwidth_gbit * 1e9 / 8,
                        allreduce_algorithm=args.allreduce_algorithm)


def _refuse_empty_run_dir(args) -> None:
    """``--run-dir ''`` (a variable left unset in a batch script) is not the default."""
    if args.run_dir is not None and not args.run_dir.strip():
        raise UsageError("--run-dir is empty; name a directory, or leave the option out "
                         "for runs/<config name>")


def _refuse_virtual_only_options(args) -> None:
    """Options that only shape virtual ranks must not pass silently on real ones."""
    if getattr(args, "slowdown", "").strip() or getattr(args, "jitter", 0.0):
        raise UsageError("--slowdown and --jitter slow virtual ranks (--virtual); real ranks "
                         "are slowed by parallel.straggler in the configuration")


def _refuse_sleeping_stragglers(args, cfg, ranks: int) -> None:
    """``parallel.straggler`` on virtual ranks: its sleep passes on the wall clock,
    not on the simulated one that times every rank, so it would change nothing but
    the wall time of the run (``ranks``: the most virtual ranks there will be).  A
    rank outside the job is left to the straggler's own check, which names it."""
    slow = [r for r in cfg.parallel.straggler.ranks if 0 <= r < ranks]
    if not slow:
        return
    factor = cfg.parallel.straggler.slowdown
    where = f"{args.config}: " if args.config else ""
    raise UsageError(f"{where}parallel.straggler.ranks: virtual ranks keep a simulated "
                     "clock, which a slow rank's sleep does not advance (it would slow "
                     "only the wall clock); slow virtual ranks with --slowdown "
                     f"{','.join(f'{r}={factor:g}' for r in slow)} (and --jitter) and "
                     "leave parallel.straggler.ranks empty")


def _compute_model(args, cfg, ranks: int):
    """The virtual ranks' step times from --compute-ms, --slowdown and --jitter
    (``ranks``: the most virtual ranks there will be); without --compute-ms a
    function that measures them, called after the checks (it may take minutes)."""
    from .train.virtual import compute_model
    slowdown = {}
    for item in (i.strip() for i in args.slowdown.split(",")):
        if not item:
            continue
        rank, _, factor = item.partition("=")
        try:
            rank, factor = int(rank), float(factor)
        except ValueError:
            raise UsageError(f"--slowdown: expected RANK=FACTOR[,RANK=FACTOR...], e.g. 3=2.0; "
                             f"got {shown_value(args.slowdown)}") from None
        if rank in slowdown:
            # (the last one was taken without a word: a typo for another rank)
            raise UsageError(f"--slowdown: rank {rank} is given twice, in {shown_value(args.slowdown)}; "
                             "give each rank one factor")
        slowdown[rank] = factor
    outside = sorted(r for r in slowdown if not 0 <= r < ranks)
    if outside:
        raise UsageError(f"--slowdown: rank {outside[0]} is not one of the {ranks} virtual "
                         f"ranks (0 to {ranks - 1})")
    # (compute_model checks the factors and the jitter, naming these options)
    return compute_model(cfg, step_ms=args.compute_ms, slowdown=slowdown, jitter=args.jitter,
                         seed=args.jitter_seed, measure_later=True)


def _add_virtual_options(p, *, network: bool) -> None:
    """The virtual cluster's compute and (``network``) network model options."""
    if network:
        p.add_argument("--latency-us", type=float, default=5.0,
                       help="network model: latency per link")
        p.add_argument("--bandwidth-gbit", type=float, default=100.0,
                       help="network model: bandwidth per link in Gbit/s")
        p.add_argument("--compute-ms", type=float, default=0.0,
                       help="virtual ranks: compute time per step in ms (e.g. a GPU's); "
                            "0: measured once on this machine")
    p.add_argument("--allreduce-algorithm", default="ring", choices=("ring", "tree", "auto"),
                   help="network model: allreduce cost (auto: the cheaper per buffer)")
    p.add_argument("--slowdown", default="", metavar="RANK=FACTOR,...",
                   help="virtual ranks: step-time factors, e.g. 3=2.0 (rank 3 takes twice as "
                        "long; below 1 a faster rank); empty: none")
    p.add_argument("--jitter", type=float, default=0.0,
                   help="virtual ranks: log-normal noise of each step time (sigma of its log)")
    p.add_argument("--jitter-seed", type=int, default=0, help="virtual ranks: seed of the jitter")


def _number_list(text: str, flag: str, kind=int) -> tuple:
    if not text:
        return ()
    try:
        return tuple(kind(item) for item in text.split(",") if item.strip())
    except ValueError:
        raise UsageError(f"{flag}: expected comma-separated numbers, e.g. 1,2,4; "
                         f"got {shown_value(text)}") from None


def _load_bench_config(args):
    """``(cfg, note)``: the configuration a benchmark runs.  Each of its runs takes
    one of ``--methods`` as ``parallel.method``, so the config's own method (not
    benchmarked) does not decide which settings it may hold: one that another
    method refuses (ADPSGD's ``parallel.hierarchical`` on a model-averaging config)
    is read with the first method benchmarked that takes it; whether every method
    benchmarked takes it is checked with the groups
    (:func:`mpitrain.bench.phases.check_groups`).  The settings of the config's own
    method, when it is not benchmarked, are left out (those given,
    :func:`mpitrain.bench.phases.without_own_method_settings`), said in ``note``."""
    from .bench.options import bench_methods
    from .bench.phases import without_own_method_settings
    from .config import ConfigError, load_config
    methods = tuple(dict.fromkeys(m.strip() for m in args.methods.split(",") if m.strip())) \
        or bench_methods()
    try:
        cfg = load_config(args.config, args.set)
    except ConfigError as exc:
        mine = exc
    else:
        run_cfg, left_out = without_own_method_settings(cfg, methods)
        return run_cfg, (f"bench: {', '.join(left_out)}: a setting of parallel.method "
                         f"{cfg.parallel.method}, which the benchmark does not run (it runs "
                         f"{', '.join(methods)}): left out of its runs" if left_out else "")
    errors = []
    for method in methods:
        try:
            return load_config(args.config,
                               list(args.set or []) + [f"parallel.method={method}"]), ""
        except ConfigError as exc:
            errors.append(exc)
    if all(str(e) == str(mine) for e in errors):
        raise mine          # (not a matter of the method)
    # every method benchmarked refuses it: said of the first of them, not of the
    # config's own method, which the benchmark does not run
    raise ConfigError(f"{errors[0]}; the benchmark runs the config with parallel.method "
                      f"{methods[0]} (--methods {','.join(methods)}): benchmark a method "
                      "that takes the setting, or leave it out") from None


def _bench_options(args, virtual_sizes):
    from .bench.options import BenchOptions
    return BenchOptions(
        sizes=virtual_sizes or _number_list(args.sizes, "--sizes"),
        methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()),
        target_accuracy=args.target_accuracy,
        phases=tuple(p.strip() for p in args.phases.split(",") if p.strip()),
        throughput_steps=args.steps, warmup_steps=args.warmup_steps, repeats=args.repeats,
        eval_frames=args.eval_frames, max_steps=args.max_steps, max_frames=args.max_frames,
        max_seconds=args.max_seconds, project_to=_number_list(args.project_to, "--project-to"),
        network=_network_model(args),
        compute_seconds=args.compute_ms * 1e-3, lr_scale=args.lr_scale)


def _say_cleared(removed: list, out_dir: str) -> None:
    if removed:
        print(f"--overwrite: removed the earlier benchmark's {len(removed)} output(s) "
              f"from {out_dir}", flush=True)


def _partial_report_writer(out_dir: str, dpi: int):
    """Writes bench.json and bench.md of the sizes done so far (no plots): a
    benchmark stopped halfway, by a time limit or by hand, keeps them."""
    from .bench.report import write_report

    def write(report: dict) -> None:
        write_report(report, out_dir, dpi=dpi, plots=False)
        done = report["partial"]["sizes_measured"]
        print(f"partial report (sizes {', '.join(map(str, done))}): "
              f"{os.path.join(out_dir, 'bench.json')}", flush=True)
    return write


def _check_corpus_feeds(cfg, config: str, sizes, options) -> None:
    """Refuse, before the first measurement and before anything is written, a
    corpus that cannot be read (the first run found it, after it had made its run
    directory and log) and a group the training corpus cannot give an utterance,
    or a complete minibatch, per data rank (found only when that size came).  The
    held-out corpus only where the time-to-accuracy phase runs: the throughput
    runs read none."""
    from .data.batcher import plan_chunks
    from .data.corpus import load_manifest
    from .train.setup import balanced_plan
    _require_training_corpus(cfg, config)
    for key in ("data.train", "data.dev") if options.measures_accuracy else ("data.train",):
        corpus = getattr(cfg.data, key.split(".")[1])
        try:
            loaded = load_manifest(corpus) if corpus else None
        except (ValueError, OSError) as exc:
            raise UsageError(f"{config}: {key}: {' '.join(str(exc).split())}") from None
        if key == "data.train":
            manifest = loaded
    utterances = manifest.num_utterances
    servers = cfg.parallel.servers if "param_server" in (options.methods or ()) else 0
    ranks = max(sizes)
    readers = ranks - servers
    if utterances < readers:
        group = f"{readers} ranks" if readers == ranks else \
            f"{readers} data ranks ({ranks} with the servers)"
        raise UsageError(f"{config}: data.train {cfg.data.train} has {utterances} "
                         f"utterance(s), fewer than the {group} of the largest group; "
                         "give smaller group sizes")
    # every rank of a group takes the steps of the one with the least data: a rank
    # without a whole minibatch stopped the benchmark at that size, the sizes before
    # it measured
    batch = cfg.training.minibatch
    for size in sorted(set(sizes), reverse=True):
        if size - servers < 1:
            continue
        try:
            plan = balanced_plan(manifest, size - servers)
        except (ValueError, OSError):
            return              # the runs name what is wrong with the corpus
        steps = [sum(chunk.frames // batch
                     for chunk in plan_chunks(manifest, slices, cfg.data.chunk_frames))
                 for slices in plan]
        if min(steps) == 0:
            raise UsageError(f"{config}: data.train {cfg.data.train}: a group of {size} "
                             f"ranks leaves rank {steps.index(0) + servers} no complete "
                             f"minibatch of {batch} frames; give smaller group sizes, lower "
                             "training.minibatch or raise data.chunk_frames")


def _print_projection(report) -> None:
    """The projection on the console, labelled as such (real or virtual ranks alike)."""
    from .bench.report import projection_lines
    print("\n".join(["projection model:"] + [f"  {a}" for a in report["assumptions"]]
                    + projection_lines(report)))


def cmd_bench(args) -> int:
    from .bench.mode import run_bench
    from .bench.options import BenchSettingsError
    from .bench.phases import check_bench
    from .bench.report import clear_earlier_bench, out_dir_problem, write_report
    with _before_mpi():
        virtual_sizes = _number_list(args.virtual or "", "--virtual")
        if args.virtual is not None and not virtual_sizes:
            # (an empty list, a variable left unset in a script: not a benchmark of
            # real ranks in its place)
            raise UsageError(f"--virtual: expected group sizes, e.g. 1,2,4; got "
                             f"{shown_value(args.virtual)}")
    options = None

    def checks():
        nonlocal options
        if args.dpi < 1:
            # the plots are drawn at the end: a bad resolution would waste the run
            raise UsageError(f"--dpi must be a positive resolution, got {args.dpi}")
        if args.out is not None and not args.out.strip():
            # (a variable left unset in a batch script) not the default directory
            raise UsageError("--out is empty; name a directory, or leave the option out "
                             "for runs/bench-<config name>")
        if virtual_sizes and args.sizes.strip():
            raise UsageError("--sizes and --virtual both give the group sizes; with virtual "
                             "ranks give them as --virtual 1,2,4,...")
        try:
            options = _bench_options(args, virtual_sizes)
        except ValueError as exc:
            # the group sizes came from --virtual: name it
            raise UsageError(str(exc).replace("--sizes", "--virtual", 1) if virtual_sizes
                             else str(exc)) from None
        if virtual_sizes:
            from .train.virtual import MAX_VIRTUAL_RANKS
            if max(virtual_sizes) > MAX_VIRTUAL_RANKS:
                raise UsageError(f"--virtual: at most {MAX_VIRTUAL_RANKS} ranks (each is a "
                                 f"thread of this process with its own model), got "
                                 f"{max(virtual_sizes)}")
            _refuse_virtual_under_a_launcher()
        else:
            _refuse_virtual_only_options(args)
    out_dir = args.out or os.path.join(
        "runs", "bench-" + os.path.splitext(os.path.basename(args.config))[0])
    notes = []

    def load(args):
        cfg, note = _load_bench_config(args)
        notes[:] = [note] if note else []
        return cfg
    if virtual_sizes:
        with _before_mpi():
            cfg = load(args)
            checks()
            for note in notes:
                print(note, flush=True)
            _refuse_sleeping_stragglers(args, cfg, max(virtual_sizes))
        from .bench.virtual import run_virtual_bench
        compute = _compute_model(args, cfg, max(virtual_sizes))     # (its options checked)
        _check_corpus_feeds(cfg, args.config, virtual_sizes, options)
        sizes = tuple(sorted(set(options.sizes))) or (1,)
        try:                        # before an earlier benchmark is cleared (--overwrite)
            check_bench(cfg, options, sizes, options.resolve(max(sizes))[1])
        except BenchSettingsError as exc:
            raise UsageError(f"{args.config}: {exc}") from None
        problem = out_dir_problem(out_dir, overwrite=args.overwrite)
        if problem:
            raise UsageError(problem)
        _say_cleared(clear_earlier_bench(out_dir) if args.overwrite else [], out_dir)
        if callable(compute):       # measured now that the checks hold
            compute = compute()
        report = run_virtual_bench(cfg, out_dir=out_dir, options=options, compute=compute,
                                   on_size_done=_partial_report_writer(out_dir, args.dpi))
        paths = write_report(report, out_dir, dpi=args.dpi)
        _print_projection(report)
        print("wrote " + ", ".join(paths.values()))
        return 0
    from .comm.abort import install_abort_hook
    comm, cfg = _start_ranks(args, checks, load=load)
    install_abort_hook(comm)
    for note in notes if comm.rank == 0 else ():
        print(note, flush=True)
    _limit_blas_threads(cfg, comm)
    if options.sizes and max(options.sizes) > comm.size:
        if comm.rank != 0:          # every rank knows it alike: rank 0 says it
            return 2
        raise UsageError(f"--sizes: {max(options.sizes)} ranks asked for, but the job has "
                         f"{comm.size} (mpiexec -n {max(options.sizes)} or more)")
    try:                            # before an earlier benchmark is cleared (--overwrite)
        check_bench(cfg, options, *options.resolve(comm.size))
    except BenchSettingsError as exc:
        if comm.rank != 0:          # found alike on every rank: rank 0 says it
            return 2
        raise UsageError(f"{args.config}: {exc}") from None
    try:
        _check_corpus_feeds(cfg, args.config, options.resolve(comm.size)[0], options)
        problem = None
    except UsageError as exc:
        problem = f"rank {comm.rank}: {exc}" if comm.rank else str(exc)
    # every rank reads the manifests, which a node may not see as rank 0 does: all
    # stop, or none, and rank 0 says the first rank's problem
    problem = next((p for p in comm.allgather_obj(problem) if p), None)
    if problem:
        if comm.rank != 0:
            return 2
        raise UsageError(problem)
    # rank 0 judges the output directory and every rank hears it: all stop, or none
    problem = comm.bcast_obj(out_dir_problem(out_dir, overwrite=args.overwrite)
                             if comm.rank == 0 else None, root=0)
    if problem:
        if comm.rank != 0:
            return 2
        raise UsageError(problem)
    try:
        if comm.rank == 0 and args.overwrite:
            _say_cleared(clear_earlier_bench(out_dir), out_dir)
        report = run_bench(cfg, comm, out_dir=out_dir, options=options,
                           on_size_done=_partial_report_writer(out_dir, args.dpi))
        if comm.rank == 0:
            paths = write_report(report, out_dir, dpi=args.dpi)
            _print_projection(report)
            print("wrote " + ", ".join(paths.values()))
    except (ValueError, OSError, RuntimeError, MemoryError) as exc:
        if getattr(exc, "agreed", False) or comm.size == 1:
            return _stopped_together(exc, comm, args.config)
        print(f"mpitrain bench: rank {comm.rank}: error: {_one_line(exc)}", file=sys.stderr,
              flush=True)
        comm.abort(2)           # (the line above says why: no second copy of it)
    except BaseException as exc:
        _end_every_rank(comm, "bench", exc)
        raise
    return 0


def _stopped_together(exc, comm, config) -> int:
    """An error every rank met at the same point (or the only rank's): rank 0 raises
    it for the one line, the others end with status 2."""
    from .train.stop import ignore_from_now_on
    if comm.size > 1:
        # the job's status is settled (2): a stop signal while a rank waits in
        # MPI's finalize would replace it with the signal's
        ignore_from_now_on()
    if comm.rank != 0:        # every rank stopped here: rank 0 says why
        return 2
    if getattr(exc, "setting", False) and config:
        raise UsageError(f"{config}: {exc}") from None
    raise exc


def _model_file(path: str, command: str, *, stream=None) -> str:
    """The model a command reads: a file as given, or a run directory's best.h5
    (else final.h5), saying which."""
    from .nn.model_file import model_in_run_dir
    try:
        found, why = model_in_run_dir(path)
    except FileNotFoundError as exc:
        raise UsageError(str(exc)) from None
    if why:
        print(f"mpitrain {command}: {why}", file=stream or sys.stdout)
    return found


def cmd_eval(args) -> int:
    from .nn.model_file import load_model
    from .train.evaluate import evaluate_chunks, iter_eval_chunks, overflow_site
    if args.max_frames < 0:     # (before "using RUN/best.h5" is said)
        raise UsageError(f"--max-frames must be >= 0 (0: all frames), got {args.max_frames}")
    args.model = _model_file(args.model, "eval")
    net, _ = load_model(args.model)
    # every corpus is checked before any is scored: a bad one is said before a
    # long scoring of the others, not after it
    manifests = [_eval_corpus(corpus_dir, net, args.model) for corpus_dir in args.corpus_dir]
    for corpus_dir, manifest in zip(args.corpus_dir, manifests):
        # one chunk in memory at a time: a test set of any size scores in flat memory
        total, correct, frames = evaluate_chunks(net, iter_eval_chunks(
            manifest, net, max_frames=args.max_frames))
        if frames == 0:
            raise UsageError(f"{corpus_dir}: no frames to evaluate")
        if not math.isfinite(total):
            site = overflow_site(net, iter_eval_chunks(manifest, net,
                                                       max_frames=args.max_frames))
            if site is not None:
                # the corpus' features were checked finite: the model is the cause
                raise UsageError(f"{args.model}: the model's outputs overflow (inf or NaN) at "
                                 f"{site}, on {corpus_dir}'s finite features and on inputs "
                                 "within the range it was trained on alike; the file holds "
                                 "weights no training gives; no score")
            raise UsageError(f"{corpus_dir}: the model's output is not finite on some frames "
                             "(features far outside the range it was trained on?); "
                             "no score")
        where = f"{corpus_dir}: " if len(manifests) > 1 else ""
        print(f"{where}frames {frames} xent {total / frames:.4f} acc {correct / frames:.4f}",
              flush=True)
    return 0


def _eval_corpus(corpus_dir: str, net, model: str):
    """The manifest of ``corpus_dir`` once it is known to fit ``net`` (UsageError)."""
    from .data.corpus import load_manifest, speaker_cmvn_kind
    from .data.validate import validate_corpus
    manifest = load_manifest(corpus_dir)
    if manifest.feat_dim != net.feat_dim or manifest.num_classes != net.num_classes:
        # a corpus of fewer classes may only lack the highest pdfs: prepared again
        # with the model's count it fits; one of more classes does not
        hint = (f"; prepare it with --num-classes {net.num_classes} (the number of pdfs)"
                if manifest.feat_dim == net.feat_dim
                and manifest.num_classes < net.num_classes else "")
        raise UsageError(f"{corpus_dir}/corpus.yaml: feat_dim {manifest.feat_dim}, "
                         f"num_classes {manifest.num_classes}; the model {model} "
                         f"expects {net.feat_dim} and {net.num_classes}{hint}")
    if speaker_cmvn_kind(manifest.speaker_cmvn) != speaker_cmvn_kind(net.speaker_cmvn):
        raise UsageError(f"{corpus_dir}/corpus.yaml: "
                         f"{speaker_cmvn_kind(manifest.speaker_cmvn)}, but the model "
                         f"{model} was trained with "
                         f"{speaker_cmvn_kind(net.speaker_cmvn)}; prepare the corpus alike")
    # the checks train makes of its held-out set: a NaN frame, a label outside the
    # model's classes or a shard of another width is named, not scored
    problems = validate_corpus(manifest, num_classes=net.num_classes)
    if problems:
        more = (f" ({len(problems) - 1} more problem(s): run `mpitrain check` on the corpus)"
                if len(problems) > 1 else "")
        raise UsageError(" ".join(problems[0].split()) + more)
    return manifest


def cmd_export(args) -> int:
    from .export import check_prior_scale, export_loglikes
    if args.batch < 1:
        raise UsageError(f"--batch must be >= 1 (frames per forward pass), got {args.batch}")
    # log posteriors use no priors: a scale or a corpus for them would be ignored silently
    if args.no_priors and (args.prior_scale is not None or args.corpus is not None):
        given = "--prior-scale" if args.prior_scale is not None else "--corpus"
        raise UsageError(f"{given}: gives the priors, which --no-priors leaves out; "
                         "give one or the other")
    if args.prior_scale is not None:
        try:
            check_prior_scale(args.prior_scale)     # (before "using RUN/best.h5" is said)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    args.model = _model_file(args.model, "export", stream=sys.stderr)
    n = export_loglikes(args.model, args.feats, args.out, corpus_dir=args.corpus,
                        batch=args.batch,
                        prior_scale=1.0 if args.prior_scale is None else args.prior_scale,
                        priors=not args.no_priors, utt2spk=args.utt2spk, cmvn=args.cmvn,
                        scp_commands=args.scp_commands)
    # stderr: stdout may be the archive itself (--out ark:-)
    what = "log posteriors" if args.no_priors else "pseudo log-likelihoods"
    print(f"wrote {what} of {plural(n, 'utterance')} to {args.out}", file=sys.stderr)
    return 0


def cmd_convert(args) -> int:
    from .convert import convert_model
    args.model = _model_file(args.model, "convert")
    out = convert_model(args.model, args.to, args.out)
    print(f"wrote {args.to} model to {out}")
    return 0


def cmd_status(args) -> int:
    from .train.status import run_status
    failed = False
    for run_dir in args.run_dirs:
        try:
            lines = run_status(run_dir)
        except (ValueError, OSError) as exc:
            # one run that cannot be read does not hide the others
            print(f"mpitrain status: error: {_one_line(exc)}", file=sys.stderr, flush=True)
            failed = True
            continue
        # (flushed: an error line after it, on standard error, stays in its place; a
        # reader that left, as in `status runs/* | head`, ends the command quietly)
        print("\n".join(lines), flush=True)
    return 2 if failed else 0


def cmd_plot(args) -> int:
    from .plotting import labels_with_settings, plot_runs
    from .train.run_dir import NEUTRAL_SETTINGS, unused_settings
    out = args.out or (os.path.join(args.run_dirs[0], "curves.png")
                       if len(args.run_dirs) == 1 else "curves.png")
    # a directory is found before drawing: the rename at the end said only
    # "Is a directory", or "Not a directory" of a name ending in a slash
    if os.path.isdir(out) or (args.out and out.endswith(("/", os.sep))):
        raise UsageError(f"--out {out}: names a directory; name the PNG file to write, e.g. "
                         f"{os.path.join(out, 'curves.png')}" if args.out else
                         f"{out}: is a directory; name the PNG file to write with --out")
    # several runs (a sweep): each named with the settings it differs in that
    # change what is trained
    labels = labels_with_settings(args.run_dirs, ignore=NEUTRAL_SETTINGS,
                                  unused=unused_settings) if len(args.run_dirs) > 1 else None

    def warn(message):
        # a sweep's job that has only just started is left out, said on stderr
        print(f"mpitrain plot: warning: {message}", file=sys.stderr)
    print(f"wrote {plot_runs(args.run_dirs, out, x=args.x, labels=labels, warn=warn)}")
    return 0


def _limit_blas_threads(cfg, comm) -> None:
    """Apply ``blas_threads`` with the one thread policy (mpitrain.threads).

    Collective: the ranks compare their CPU affinities, so a rank bound to
    cores of its own (srun's task binding, Intel MPI's pinning) keeps them all
    and ranks that share their cores split them.
    """
    import socket
    from .threads import apply_blas_threads, cgroup_cpu_limit, cores_per_rank, cpu_affinity
    affinity = cpu_affinity()
    host = socket.gethostname()
    everyone = comm.allgather_obj([host, sorted(affinity) if affinity else []])
    node = [set(cpus) for other, cpus in everyone if other == host]
    cores = cores_per_rank(affinity, node, ranks_on_node=comm.local_size,
                           quota=cgroup_cpu_limit())
    apply_blas_threads(cfg.blas_threads, device=cfg.device, ranks_on_node=comm.local_size,
                       cores=cores)


# -- parser ----------------------------------------------------------------------

class _HeldParseError(Exception):
    """A bad command line of a command whose ranks agree before any work
    (mpitrain/launch.py): held until every rank has said whether it parsed."""

    def __init__(self, prog: str, message: str, usage: str):
        super().__init__(f"{prog}: {message}")
        self.prog, self.message, self.usage = prog, message, usage


class _Parser(argparse.ArgumentParser):
    """An argument parser that can leave its errors to rank 0 (``quiet``: this
    process is another rank of an MPI job, which parses the same command line),
    or hold them for the ranks' agreement (``hold``)."""

    quiet = False
    hold = False

    #: the command parsers by name (the top-level parser's)
    commands: dict = {}

    def parse_args(self, args=None, namespace=None):
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            # said by the command's own parser (`mpitrain train: error:`, its usage),
            # not by the top level's, which names no command
            command = self.commands.get(getattr(parsed, "command", None), self)
            command.error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed

    def error(self, message):
        # argparse quotes a bad value whole ("invalid int value: '...'"): a value of
        # megabytes (a variable holding a file) would fill the screen; cut where no
        # path is that long (a stray path's end, its file name, is what the user reads)
        message = words_cut(message, LONGEST_WORD)
        if self.hold:
            raise _HeldParseError(self.prog, message, self.format_usage())
        if self.quiet:
            raise SystemExit(_end_quietly())
        super().error(message)


MODEL_HELP = ("a model file (best.h5, final.h5 or a checkpoint) or a run directory "
              "(its best.h5, else its final.h5)")


def build_parser(*, quiet_errors: bool = False,
                 hold_errors: bool = False) -> argparse.ArgumentParser:
    """The command line parser; ``quiet_errors``: a bad command line ends this
    process with exit status 2 and no message (another rank prints it);
    ``hold_errors``: it raises :class:`_HeldParseError` instead."""
    fmt = DefaultsFormatter
    parser = _Parser(
        prog="mpitrain", formatter_class=fmt,
        description="Train DNN acoustic models on many MPI ranks "
                    "(e.g. mpiexec -n 4 python -m mpitrain train run.yaml).")
    parser.add_argument("--version", action="version", version=f"mpitrain {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("synth", formatter_class=fmt,
                       help="write the built-in synthetic corpus (train and dev splits)")
    p.add_argument("out_dir", help="output directory; gets train/ and dev/ corpora")
    p.add_argument("--hours", type=float, default=1.0, help="hours of training speech")
    p.add_argument("--speakers", type=int, default=40, help="training speakers")
    p.add_argument("--shards", type=int, default=4, help="HDF5 shards of the train split")
    p.add_argument("--seed", type=int, default=1,
                   help="random seed: the same seed writes the same corpus")
    p.add_argument("--dev-hours", type=float, default=0.1, help="hours of held-out speech")
    p.add_argument("--dev-speakers", type=int, default=8, help="held-out (unseen) speakers")
    p.add_argument("--seen-dev-hours", type=float, default=0.0,
                   help="also write OUT_DIR/dev_seen: this many hours of new utterances of "
                        "the training speakers (a held-out set like Kaldi's valid set)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing corpus")
    p.set_defaults(func=cmd_synth)

    p = sub.add_parser("init", formatter_class=fmt,
                       help="write DIR/mpitrain.yaml, a starter config with corpus paths "
                            "filled in")
    p.add_argument("dir", help="directory to write mpitrain.yaml into (created if needed)")
    p.add_argument("--corpus", default=None,
                   help="directory holding train/ and dev/ corpora (as synth writes them; "
                        "default: data/synth)")
    p.add_argument("--train", default=None, help="training corpus (default: CORPUS/train)")
    p.add_argument("--dev", default=None,
                   help="held-out corpus (default: CORPUS/dev; for --example speech "
                        "CORPUS/dev_seen where it exists)")
    p.add_argument("--example", default="quickstart",
                   help="example configuration to start from (quickstart, ngsgd, bench, ...)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing mpitrain.yaml")
    p.set_defaults(func=cmd_init)

    p = sub.add_parser("prepare", formatter_class=fmt,
                       help="import Kaldi features and per-frame alignments into a corpus")
    p.add_argument("--feats", required=True, help="features rspecifier, e.g. scp:data/feats.scp")
    p.add_argument("--ali", required=True,
                   help="per-frame pdf ids, e.g. ark:ali.ark (ali-to-pdf output) or ark,t:ali.txt")
    p.add_argument("--out", required=True, help="corpus directory to write")
    p.add_argument("--shards", type=int, default=1,
                   help="HDF5 shards to write (a multiple of the training ranks balances best)")
    p.add_argument("--num-classes", type=int, default=None,
                   help="number of pdfs (default: largest label + 1)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing corpus")
    p.add_argument("--length-tolerance", type=int, default=0, metavar="FRAMES",
                   help="import utterances whose features and alignment differ by at most "
                        "FRAMES frames, both cut to the shorter (default 0: skip them)")
    p.add_argument("--utt2spk", default=None, metavar="FILE",
                   help="Kaldi utt2spk (a file, or ark:FILE as Kaldi's tools take it): "
                        "apply per-speaker CMVN to the stored features, with "
                        "stats computed per speaker unless --cmvn gives them")
    p.add_argument("--cmvn", default=None, metavar="RSPECIFIER",
                   help="Kaldi CMVN stats, e.g. scp:data/train/cmvn.scp (by speaker with "
                        "--utt2spk, else by utterance)")
    p.add_argument("--norm-vars", action="store_true",
                   help="with per-speaker CMVN also normalise variances (as apply-cmvn)")
    p.add_argument("--scp-commands", action="store_true",
                   help="run the entries of scp files that are commands ('utt cmd |'), as Kaldi "
                        "does; without it they are refused: give it only for scp files you trust")
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("merge", formatter_class=fmt,
                       help="list the shards of part corpora (e.g. from a job array) "
                            "in one corpus.yaml")
    p.add_argument("out_dir", help="merged corpus directory; the parts lie inside it")
    p.add_argument("parts", nargs="+", metavar="PART_DIR", help="part corpus directories")
    p.add_argument("--num-classes", type=int, default=None,
                   help="number of pdfs (default: the largest of the parts')")
    p.add_argument("--overwrite", action="store_true", help="replace an existing corpus.yaml")
    p.set_defaults(func=cmd_merge)

    p = sub.add_parser("check", formatter_class=fmt, help="validate a corpus directory")
    p.add_argument("corpus_dir", help="a corpus directory, or synth's output directory "
                                      "(each split is checked)")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("train", formatter_class=fmt, help="train a model (under mpiexec for many ranks)")
    p.add_argument("config", help="YAML run configuration (see jobs/configs/)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set optimizer.name=ngsgd")
    p.add_argument("--run-dir", default=None, help="default: runs/<config name>")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest good checkpoint in the run directory")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run already in the run directory")
    p.add_argument("--accept-changes", action="store_true",
                   help="with --resume: apply settings that differ from the checkpoint's "
                        "and change the result (each is listed in the log)")
    p.add_argument("--dry-run", action="store_true",
                   help="check the configuration, the corpus, the run directory (and with "
                        "--resume the checkpoint) on these ranks, print the plan, train and "
                        "write nothing")
    p.add_argument("--virtual", type=int, default=None, metavar="N",
                   help="train as N virtual ranks in this process, on a simulated clock "
                        "(same results as mpiexec -n N; docs/parallel.md)")
    _add_virtual_options(p, network=True)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("pretrain", formatter_class=fmt,
                       help="RBM pretraining of the hidden layers (under mpiexec for many "
                            "ranks); train reads the result with model.init_from")
    p.add_argument("config", help="YAML run configuration (sections pretrain, model, data)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set pretrain.learning_rate=0.2")
    p.add_argument("--run-dir", default=None, help="default: runs/<config name>-pretrain; "
                   "the stack is written to RUN_DIR/pretrain.h5")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest good checkpoint in the run directory")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run already in the run directory")
    p.add_argument("--accept-changes", action="store_true",
                   help="with --resume: apply settings that differ from the checkpoint's")
    p.add_argument("--dry-run", action="store_true",
                   help="check everything a run checks before its first step, print the "
                        "plan, train and write nothing")
    p.set_defaults(func=cmd_pretrain)

    from .bench.options import bench_methods
    p = sub.add_parser("bench", formatter_class=fmt,
                       help="speedup curves: throughput and time to accuracy per group size "
                            "and method, projected to more ranks (under mpiexec)")
    p.add_argument("config", help="YAML run configuration (see jobs/configs/bench.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set training.minibatch=512")
    p.add_argument("--sizes", default="", help="group sizes, e.g. 1,2,4 (must include 1); "
                   "empty: powers of two up to the number of ranks, and that number "
                   "(1,2,4,6 on 6)")
    p.add_argument("--methods", default="", help="comma-separated parallel methods; "
                   f"empty: all ({', '.join(bench_methods())})")
    p.add_argument("--target-accuracy", type=float, default=None,
                   help="held-out frame accuracy for time to accuracy; without it that "
                        "phase is skipped")
    p.add_argument("--out", default=None, help="output directory; empty: runs/bench-<config name>")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier benchmark in --out (its report files and runs/ "
                        "entries are removed before the first measurement)")
    p.add_argument("--phases", default="throughput,accuracy", help="which measurements to run")
    p.add_argument("--steps", type=int, default=40, help="throughput: measured steps per run")
    p.add_argument("--warmup-steps", type=int, default=10, help="throughput: steps not measured")
    p.add_argument("--repeats", type=int, default=1,
                   help="throughput: runs per method and size, in rotating order; the "
                        "median run kept (of an even count, the slower middle one); on "
                        "virtual ranks with --jitter each its own draw of step times")
    p.add_argument("--eval-frames", type=int, default=0,
                   help="frames of all ranks together between held-out evaluations (unlike "
                        "training.eval_interval, which counts frames per rank); 0: "
                        "training.eval_interval taken as that total (the frames one rank "
                        "sees), or 1/20 of an epoch")
    p.add_argument("--max-steps", type=int, default=0,
                   help="time to accuracy: steps per rank at most (besides the epochs); 0: no cap")
    p.add_argument("--max-frames", type=int, default=0,
                   help="time to accuracy: frames (all ranks) at most; 0: no cap")
    p.add_argument("--max-seconds", type=float, default=0.0,
                   help="time to accuracy: training seconds per run, looked at each held-out "
                        "evaluation (the run ends at the first one past it); 0: no cap")
    p.add_argument("--project-to", default="16,32,64,128", help="rank counts to project to")
    p.add_argument("--latency-us", type=float, default=5.0, help="network model: latency per link")
    p.add_argument("--bandwidth-gbit", type=float, default=100.0,
                   help="network model: bandwidth per link in Gbit/s")
    p.add_argument("--compute-ms", type=float, default=0.0,
                   help="projection: compute time per step in ms; 0: measured on one rank")
    p.add_argument("--lr-scale", default="none", choices=("none", "linear", "sqrt"),
                   help="learning rates of N ranks: the config's x1, xN or x sqrt(N) (on top "
                        "of the method's own rule: kaldi already scales by its jobs)")
    p.add_argument("--dpi", type=int, default=100, help="resolution of the PNG plots")
    p.add_argument("--virtual", default=None, metavar="1,2,4,...",
                   help="simulate these group sizes as virtual ranks in this process "
                        "(no mpiexec; --compute-ms is then each step's time, 0: measured)")
    _add_virtual_options(p, network=False)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("eval", formatter_class=fmt,
                       help="held-out cross-entropy and frame accuracy of a model")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("corpus_dir", nargs="+",
                   help="corpus directories (e.g. dev and test sets): one line each")
    p.add_argument("--max-frames", type=int, default=0,
                   help="frames per corpus at most; 0: all frames")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("export", formatter_class=fmt,
                       help="write pseudo log-likelihoods for Kaldi's decoders",
                       description="Write log p(x|s) = log p(s|x) - prior_scale * log p(s) "
                                   "(up to a constant) for every frame and pdf s, as a Kaldi "
                                   "matrix archive; p(s) is the pdf's frequency in training. "
                                   "Pdfs never seen in training get a very low score, as in "
                                   "Kaldi, and a warning on stderr. Messages go to stderr, so "
                                   "--out ark:- pipes into latgen-faster-mapped.")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--feats", required=True, help="features rspecifier, e.g. scp:feats.scp")
    p.add_argument("--out", required=True, help="wspecifier, e.g. ark:loglikes.ark")
    p.add_argument("--corpus", default=None,
                   help="corpus whose class counts give the priors (default: the model's)")
    p.add_argument("--prior-scale", type=float, default=None,
                   help="scale of log p(s) in log p(s|x) - scale * log p(s) (default: 1)")
    p.add_argument("--no-priors", action="store_true",
                   help="write log posteriors log p(s|x) (no prior division)")
    p.add_argument("--batch", type=int, default=4096, help="frames per forward pass")
    p.add_argument("--utt2spk", default=None, metavar="FILE",
                   help="needed by a model trained with per-speaker CMVN: the speakers of "
                        "--feats (a file, or ark:FILE as Kaldi's tools take it; stats "
                        "computed from them unless --cmvn gives them)")
    p.add_argument("--cmvn", default=None, metavar="RSPECIFIER",
                   help="Kaldi CMVN stats for --feats, e.g. scp:data/test/cmvn.scp")
    p.add_argument("--scp-commands", action="store_true",
                   help="run the entries of scp files that are commands ('utt cmd |'), as Kaldi "
                        "does; without it they are refused: give it only for scp files you trust")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("convert", formatter_class=fmt,
                       help="write a model as ONNX (needs the onnx package) or as a PyTorch "
                            "module with .npz weights (no pickle); docs/model-format.md")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--to", required=True, choices=("onnx", "torch"), help="the format to write")
    p.add_argument("out", help="onnx: the .onnx file; torch: a directory for model.py and "
                               "weights.npz")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("plot", formatter_class=fmt,
                       help="PNG of held-out and training accuracy and cross-entropy of runs")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories to compare")
    p.add_argument("--out", default=None,
                   help="PNG to write (default: RUN_DIR/curves.png for one run, "
                        "else ./curves.png)")
    p.add_argument("--x", default="frames", choices=("frames", "time", "seconds"),
                   help="frames seen (all ranks), wall seconds since the start, or "
                        "training seconds (simulated ones for --virtual runs)")
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser("status", formatter_class=fmt,
                       help="where runs stand: ended, stopped or running, progress, held-out "
                            "figures, the checkpoint a resume takes")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories")
    p.set_defaults(func=cmd_status)
    for each in (parser, *sub.choices.values()):
        each.quiet, each.hold = quiet_errors, hold_errors
    parser.commands = dict(sub.choices)
    return parser


#: Longer than any path a user gives: a run of characters this long in an error is
#: a value nothing cut short (a file name of megabytes from a variable gone wrong).
LONGEST_WORD = 1024


def _one_line(exc: BaseException) -> str:
    return words_cut(" ".join(str(exc).split()), LONGEST_WORD) or type(exc).__name__


def _tell(line: str) -> None:
    """A line on standard error; one that cannot be written (standard error on a
    full disk) is dropped, and the exit status still says what happened."""
    with contextlib.suppress(OSError, ValueError):
        print(line, file=sys.stderr, flush=True)


def _parse_error_agreed(exc: _HeldParseError, command: str) -> int:
    """Take part in the ranks' first exchange (mpitrain/launch.py) with this
    rank's bad command line, then end: rank 0 says it (as argparse would when
    every rank's is the same), the others end quietly."""
    from .launch import start_ranks

    def prepare():
        raise UsageError(str(exc))
    comm, _, problem = start_ranks(prepare, user_errors=(UsageError,))
    if comm.rank != 0:
        return _end_quietly()
    if problem == str(exc):
        sys.stderr.write(exc.usage)
        print(f"{exc.prog}: error: {exc.message}", file=sys.stderr, flush=True)
    else:
        print(f"mpitrain {command}: error: {problem}", file=sys.stderr, flush=True)
    return 2


def _version() -> str:
    from . import __version__
    return __version__


USAGE = """usage: mpiexec -n N python -m mpitrain train CONFIG.yaml [--set key=value ...]
   or: mpiexec -n N python -m mpitrain      (trains ./mpitrain.yaml; see `mpitrain init`)
   or: python -m mpitrain --help            (every command)"""


def main(argv=None) -> int:
    stdout = sys.stdout
    if stdout is not None:      # (None: started with standard output closed)
        sys.stdout = NamedStdout(stdout)
    try:
        return _main(argv)
    finally:
        if isinstance(sys.stdout, NamedStdout):
            sys.stdout = stdout


def _main(argv) -> int:
    try:
        with stop_signals_kept(sys.argv[1:] if argv is None else list(argv)):
            with interrupt_held():
                started = _read_command_line(argv)
            if isinstance(started, int):
                return started
            return _run_command(*started)
    except KeyboardInterrupt:
        # Ctrl-C before the command's own handling: while Python loads the modules it
        # needs (before MPI starts) or reads the command line
        words = sys.argv[1:] if argv is None else list(argv)
        command = f" {words[0]}" if words and not words[0].startswith("-") else ""
        print(f"mpitrain{command}: interrupted", file=sys.stderr, flush=True)
        if argv is None:
            # the command line's process ends by the signal, as Python ends on an
            # interrupt it leaves alone, but without the interpreter's clean up:
            # an MPI launcher ends the other ranks (a rank that exits with a status
            # before MPI starts leaves them waiting)
            with contextlib.suppress(Exception):
                sys.stdout.flush()
            with contextlib.suppress(ValueError):     # (not the main thread)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGINT)
            os._exit(130)
        return 130


def _read_command_line(argv):
    """``(args, usage_on_error)`` of the command line, or the exit status of one
    that was wrong or only asked for help."""
    argv = sys.argv[1:] if argv is None else list(argv)
    fill_closed_standard_descriptors()
    from .plotting import keep_matplotlib_quiet
    keep_matplotlib_quiet()     # (a compute node's HOME may be read-only)
    # the plots are drawn off screen (Agg), whatever backend MPLBACKEND asks pyplot
    # for; a name matplotlib does not know would fail its import, after a bench's
    # measurements or at the start of a run with training.plot
    os.environ.pop("MPLBACKEND", None)
    usage_on_error = False
    if not argv:
        # `mpirun -np 32 python -m mpitrain`: the config of the current directory
        from .launch import several_ranks
        from .starter import DEFAULT_CONFIG
        if not os.path.isfile(DEFAULT_CONFIG) and not several_ranks():
            print(USAGE, file=sys.stderr)
            return 2
        # (under a launcher every rank goes on, so that a node lacking the file is
        # said by rank 0 instead of leaving the others waiting for it)
        argv, usage_on_error = ["train", DEFAULT_CONFIG], True
    elif argv[0].startswith("-") and not _top_level_option(argv[0]):
        # `python -m mpitrain --set k=v`: argparse would take the option's value for
        # an unknown command; the bare form takes no options, `train` does
        return _bare_form_with_options(argv)
    # a command line every rank of an MPI job parses alike: rank 0 says what is
    # wrong; for the commands whose ranks agree before any work, a rank whose
    # command line alone is wrong is said too (instead of the others waiting)
    from .launch import several_ranks
    agreeing = argv[0] in AGREEING_COMMANDS and several_ranks()
    parser = build_parser(quiet_errors=argv[0] in MPI_COMMANDS and _launcher_rank() > 0,
                          hold_errors=agreeing)
    try:
        args = parser.parse_args(argv)
    except _HeldParseError as exc:
        return _parse_error_agreed(exc, argv[0])
    return args, usage_on_error


def _top_level_option(word: str) -> bool:
    """Whether ``word`` is -h, --help or --version, or an abbreviation argparse takes
    for one (--vers)."""
    return word == "-h" or (len(word) > 2 and any(
        option.startswith(word.split("=")[0]) for option in ("--help", "--version")))


def _bare_form_with_options(argv) -> int:
    """Exit status 2, and on rank 0 one line naming the `train` command that takes
    these options."""
    from .starter import DEFAULT_CONFIG
    if _launcher_rank() > 0:
        return _end_quietly()
    words = " ".join(shlex.quote(word) for word in argv)
    print(f"mpitrain: error: a bare `python -m mpitrain` takes no options (it trains "
          f"./{DEFAULT_CONFIG} as it is); give them to train: python -m mpitrain train "
          f"{DEFAULT_CONFIG} {words}", file=sys.stderr, flush=True)
    return 2


def _run_command(args, usage_on_error) -> int:
    from .launch import several_ranks
    # Numerical trouble is counted and reported by the program (see
    # train/divergence.py); numpy's own warnings would only repeat it unclearly.
    warnings.simplefilter("ignore", RuntimeWarning)
    try:
        if args.command not in MPI_COMMANDS:
            _one_process_only(args.command)
        with _before_mpi():
            _refuse_unexpanded_home(args)
            _refuse_empty_output(args)
        status = args.func(args)
        if sys.stdout is not None:      # (None: started with standard output closed)
            sys.stdout.flush()  # a closed reader shows here, not at interpreter exit
        return status
    except _SaidByRank0:
        return _end_quietly()
    except UsageError as exc:
        if usage_on_error and "config file not found" in str(exc):
            _tell(USAGE)
        _tell(f"mpitrain {args.command}: error: {_one_line(exc)}")
        return 2
    except BrokenPipeError:
        # `mpitrain ... | head`: the reader of our output went away.  As a Unix tool
        # that SIGPIPE ends: no message, status 141 (the output pipes the program
        # writes itself, export's, report their failures in their own words)
        silence_stdout()
        return 141
    except (ValueError, OSError, RuntimeError) as exc:
        # ConfigError, CorpusError, TrainingError and files that cannot be read or
        # written (OSError names the file): one clear line
        _tell(f"mpitrain {args.command}: error: {_one_line(exc)}")
        return 2
    except MemoryError:
        advice = (" (use fewer ranks per node, a smaller data.chunk_frames or a smaller "
                  "model)" if args.command in ("train", "pretrain", "bench") else "")
        _tell(f"mpitrain {args.command}: error: out of memory{advice}")
        return 2
    except KeyboardInterrupt:
        if args.command in MPI_COMMANDS and several_ranks():
            # (an interrupt before the run's own guard, e.g. while the ranks start:
            # the others would wait for this rank in MPI forever)
            _tell(f"mpitrain {args.command}: rank {_launcher_rank()}: interrupted")
            from .comm import abort_job_interrupted
            abort_job_interrupted()
        _tell(f"mpitrain {args.command}: interrupted")
        return 130
    except Exception:
        with contextlib.suppress(OSError, ValueError):
            traceback.print_exc()
        _tell(f"mpitrain {args.command}: internal error: this is a bug in mpitrain; please "
              "report it with the traceback above")
        return 1
