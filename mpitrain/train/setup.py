"""What a run sets up before its first step, shared by ``train`` and ``pretrain``:
the device with its precision, the corpus manifests every rank must read alike,
the ranks' shares of the shards, and the error when a share holds no minibatch.

Example::

    xp = select_device(cfg, comm)
    manifest, dev = load_manifests(comm, cfg.data.train, cfg.data.dev)
    slices = balanced_plan(manifest, comm.size)[comm.rank]
"""

from __future__ import annotations

import os

from .. import backend
from ..data.corpus import load_manifest
from ..data.sharding import plan_shards
from ..files import working_directory
from .errors import TrainingError, some_ranks
from .evaluate import shard_offsets_reader
from .selection import held_out_identity
from ..words import plural


# Whole shards per rank unless that leaves ranks more than this far apart in frames:
# every rank takes the smallest rank's number of steps, so imbalance is lost data.
MAX_SHARD_IMBALANCE = 1.05


def balanced_plan(manifest, size: int) -> list:
    """Every rank's shard slices: whole shards when balanced, else utterance ranges."""
    offsets = shard_offsets_reader(manifest)
    plan = plan_shards(manifest.shards, size, utt_offsets_of=offsets)
    frames = [sum(s.frames for s in slices) for slices in plan]
    if size > 1 and max(frames) > MAX_SHARD_IMBALANCE * max(min(frames), 1):
        plan = plan_shards(manifest.shards, size, utt_offsets_of=offsets, split=True)
    return plan


def load_manifests(comm, train: str, dev: str = "") -> tuple:
    """(training manifest, held-out manifest or None), read on every rank.

    All ranks should read the same files, so a wrong ``data.train`` or
    ``data.dev`` fails on all of them together: then it is one line from rank 0
    (an agreed error).  A rank that alone cannot read them (a file system
    missing on one node) raises an error of its own, which aborts the job.  A
    rank that reads another corpus than rank 0 (a relative path from another
    working directory, a stale copy on one node's disk) stops every rank: each
    would train on its own data.
    """
    error, manifests = None, None
    try:
        manifests = (load_manifest(train), load_manifest(dev) if dev else None)
    except (ValueError, OSError) as exc:
        error = exc
    seen = None if manifests is None else [
        [held_out_identity(m), m.num_frames, m.num_utterances] if m is not None else None
        for m in manifests]
    views = comm.allgather_obj([working_directory(), seen])
    failed = sum(1 for _, other in views if other is None)
    if error is not None:
        raise TrainingError(str(error) + _working_directory_note(
            views, comm.rank, [train, dev]), agreed=failed == comm.size) from None
    if failed:
        return manifests        # the failing ranks abort the job
    for index, (key, path) in enumerate((("data.train", train), ("data.dev", dev))):
        ours = views[0][1][index]
        others = [rank for rank, (_, other) in enumerate(views)
                  if other[index] != ours]
        if not others:
            continue
        rank = others[0]
        theirs = views[rank][1][index]

        def size(seen):
            return f"{seen[1]:,} frames in {seen[2]:,} utterances"
        what = f"{size(theirs)} there, {size(ours)} on rank 0" \
            if theirs[1:] != ours[1:] else \
            "the same sizes, other labels or features"
        raise TrainingError(
            f"{key}: {path}: rank {rank} reads another corpus than rank 0 ({what})"
            f"{_working_directory_note(views, rank, [path])}; every rank must read the "
            "same corpus (a copy on each node's disk must be the same files)",
            agreed=True, setting=True)
    return manifests


def _working_directory_note(views, rank: int, paths) -> str:
    """Where a relative path leads rank ``rank`` if it runs in another directory
    than rank 0 (mpiexec -wdir, a batch script's cd on one node); else ''."""
    here, there = views[rank][0], views[0][0]
    if here == there or not (here and there) or \
            not any(p and not os.path.isabs(p) for p in paths):
        return ""
    return (f" (a relative path: rank {rank} runs in {here}, rank 0 in {there}; "
            "give absolute paths or start every rank in one directory)")


def no_minibatch_error(manifest, comm, local_steps: int, minibatch: int,
                       key: str, *, trains: bool = True, trainers: int = 0) -> TrainingError:
    """The error when some rank's share holds no complete minibatch, the same on
    every rank (all ranks call this together) and naming what would help.

    ``trains``: whether this rank has a share (a parameter server has none);
    ``trainers``: how many ranks have one (0: every rank)."""
    empty = trains and local_steps == 0
    rank = int(comm.allreduce_scalar(comm.rank if empty else comm.size, op="min"))
    where = f"{manifest.directory}: rank {rank} has no complete minibatch of {minibatch} frames"
    trainers = trainers or comm.size
    utterances = manifest.num_utterances
    if utterances < trainers:
        servers = comm.size - trainers
        if not servers:
            return TrainingError(f"{where}: the corpus has {utterances} "
                                 f"utterance(s) for {comm.size} ranks; use at most "
                                 f"{plural(utterances, 'rank')}", agreed=True)
        # a parameter server's ranks train on no share
        return TrainingError(f"{where}: the corpus has {utterances} utterance(s) for "
                             f"{trainers} client ranks; use at most {utterances + servers} "
                             f"ranks ({servers} server{'s' if servers > 1 else ''} and "
                             f"{utterances} client{'s' if utterances > 1 else ''})",
                             agreed=True)
    if minibatch > manifest.num_frames:
        # fewer shards would not help: the whole corpus is smaller than a minibatch
        return TrainingError(f"{where}: the whole corpus holds "
                             f"{plural(manifest.num_frames, 'frame')}; lower {key}", agreed=True)
    largest = max((shard.frames for shard in manifest.shards), default=0)
    if minibatch > largest:
        return TrainingError(f"{where}: minibatches never cross shards, and the largest "
                             f"shard holds {plural(largest, 'frame')}; lower {key}, or prepare the "
                             "corpus in fewer shards", agreed=True)
    return TrainingError(f"{where}; lower {key}, raise data.chunk_frames, or use fewer ranks",
                         agreed=True)


def select_device(cfg, comm):
    """The run's array module, with its precision and fused kernels
    (backend.select_for_run).  On GPUs, collective: a setting that some rank's
    GPU cannot run (``precision: bf16`` or ``tf32`` before compute capability
    8.0), or a rank without CuPy or a GPU, stops every rank together, before
    anything else is set up."""
    refusal, of_a_setting = None, False
    try:
        xp = backend.select_for_run(cfg.device, comm.device_rank, precision=cfg.precision,
                                    fused_kernels=cfg.fused_kernels)
    except backend.UnsupportedSetting as exc:
        xp, refusal, of_a_setting = None, str(exc), True
    except backend.DeviceError as exc:
        if cfg.device != "gpu":     # (tf32 on the CPU: the same on every rank)
            raise TrainingError(str(exc), agreed=True, setting=True) from None
        # no CuPy or no GPU, on some ranks or all: said once, not by each rank
        xp, refusal = None, str(exc)
    if cfg.device == "gpu":         # (every rank's config says the same)
        refusals = comm.allgather_obj((refusal, of_a_setting))
        refused = [rank for rank, (reason, _) in enumerate(refusals) if reason]
        if refused:
            reason, setting = refusals[refused[0]]
            raise TrainingError(reason + some_ranks(refused, comm.size), agreed=True,
                                setting=setting)
    return xp
