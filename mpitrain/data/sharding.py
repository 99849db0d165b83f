"""Which rank reads which frames: pure functions of (shards, rank, size).

Every rank computes the same plan from the manifest, so no communication is
needed to agree on it.  Two ways to cut:

- whole shards, longest first, each to the rank with the fewest frames so
  far (LPT).  Used when there are at least as many non-empty shards as ranks.
- contiguous utterance ranges: all utterances, shard after shard, cut into
  ``size`` runs of near-equal frames at utterance boundaries.  Used when there
  are fewer non-empty shards than ranks, or when asked with ``split=True``;
  needs each shard's ``utt_offsets`` through the ``utt_offsets_of`` callback.

Either way every frame goes to exactly one rank, and no rank is left empty
while there are at least as many utterances as ranks.

Example::

    slices = assign_shards(manifest.shards, rank, size,
                           utt_offsets_of=lambda i: ShardReader(manifest.shard_path(i)).utt_offsets)
    for s in slices:
        feats, labels, offsets = reader_of(s.shard_index).read(s.start_utt, s.end_utt)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from .corpus import ShardInfo


@dataclass(frozen=True)
class ShardSlice:
    """Utterances ``start_utt:end_utt`` of shard ``shard_index``, holding ``frames`` frames.

    Example::

        ShardSlice(shard_index=0, start_utt=0, end_utt=120, frames=36000)
    """

    shard_index: int
    start_utt: int
    end_utt: int
    frames: int


def _check_rank(rank: int, size: int) -> None:
    if not isinstance(size, (int, np.integer)) or size < 1:
        raise ValueError(f"size must be a positive int, got {size!r}")
    if not isinstance(rank, (int, np.integer)) or not 0 <= rank < size:
        raise ValueError(f"rank must be an int in [0, {size}), got {rank!r}")


def _whole_shard_plan(shards: Sequence[ShardInfo], size: int) -> list[list[ShardSlice]]:
    loads = [0] * size
    plan: list[list[ShardSlice]] = [[] for _ in range(size)]
    # Ties broken by index so that every rank computes the same plan.
    order = sorted(range(len(shards)), key=lambda i: (-shards[i].frames, i))
    for i in order:
        rank = min(range(size), key=lambda r: (loads[r], r))
        loads[rank] += shards[i].frames
        plan[rank].append(ShardSlice(i, 0, shards[i].utterances, shards[i].frames))
    for slices in plan:
        slices.sort(key=lambda s: s.shard_index)
    return plan


def _checked_offsets(shards, utt_offsets_of, i) -> np.ndarray:
    offsets = np.asarray(utt_offsets_of(i), dtype=np.int64)
    if (offsets.ndim != 1 or offsets.shape[0] != shards[i].utterances + 1
            or offsets[0] != 0 or offsets[-1] != shards[i].frames):
        raise ValueError(
            f"utt_offsets_of({i}) returned {offsets.shape[0] if offsets.ndim == 1 else offsets.shape}"
            f" offsets ending at {offsets[-1] if offsets.size else None}; the manifest says shard "
            f"{shards[i].path} has {shards[i].utterances} utterances and {shards[i].frames} frames")
    return offsets


def _split_plan(shards: Sequence[ShardInfo], size: int,
                utt_offsets_of: Callable[[int], np.ndarray]) -> list[list[ShardSlice]]:
    offsets = [_checked_offsets(shards, utt_offsets_of, i) for i in range(len(shards))]
    utt_counts = np.array([s.utterances for s in shards], dtype=np.int64)
    utt_base = np.concatenate([[0], np.cumsum(utt_counts)])        # global index of utt 0
    num_utts = int(utt_base[-1])
    # Cumulative frames at every global utterance boundary (num_utts + 1 entries).
    frame_base = np.concatenate([[0], np.cumsum([s.frames for s in shards])])
    cum = np.concatenate([[0]] + [offsets[i][1:] + frame_base[i] for i in range(len(shards))])
    total = int(cum[-1])

    cuts = [0]
    for k in range(1, size):
        target = total * k / size
        j = int(np.searchsorted(cum, target))
        if j > 0 and (j > num_utts or target - cum[j - 1] <= cum[j] - target):
            j -= 1                                              # nearer boundary below
        # Keep at least one utterance for this rank and for each rank after it.
        low = cuts[-1] + 1 if num_utts >= size else cuts[-1]
        high = num_utts - (size - k) if num_utts >= size else num_utts
        cuts.append(int(min(max(j, low), max(high, low))))
    cuts.append(num_utts)

    plan: list[list[ShardSlice]] = [[] for _ in range(size)]
    for rank in range(size):
        first, last = cuts[rank], cuts[rank + 1]
        for i in range(len(shards)):
            lo = max(first, int(utt_base[i]))
            hi = min(last, int(utt_base[i + 1]))
            if lo < hi:
                start, end = lo - int(utt_base[i]), hi - int(utt_base[i])
                frames = int(offsets[i][end] - offsets[i][start])
                plan[rank].append(ShardSlice(i, start, end, frames))
    return plan


def plan_shards(shards: Sequence[ShardInfo], size: int, *,
                utt_offsets_of: Callable[[int], np.ndarray] | None = None,
                split: bool | None = None) -> list[list[ShardSlice]]:
    """The slices of every rank: ``plan[rank]`` is what :func:`assign_shards` returns.

    ``split=None`` cuts shards only when there are fewer non-empty shards
    than ranks; ``True`` always cuts into near-equal contiguous runs;
    ``False`` never cuts (ranks may then be left empty).

    Example::

        plan = plan_shards(manifest.shards, 4, utt_offsets_of=offsets_of)
        [sum(s.frames for s in slices) for slices in plan]    # near-equal
    """
    _check_rank(0, size)
    nonempty = sum(1 for s in shards if s.frames > 0)
    if split is None:
        split = nonempty < size
    if not split:
        return _whole_shard_plan(shards, size)
    if utt_offsets_of is None:
        raise ValueError(f"{size} ranks share {nonempty} non-empty shard(s): shards must be cut "
                         "into utterance ranges, which needs utt_offsets_of(shard_index); "
                         "or write the corpus with at least as many shards as ranks")
    return _split_plan(shards, size, utt_offsets_of)


def assign_shards(shards: Sequence[ShardInfo], rank: int, size: int, *,
                  utt_offsets_of: Callable[[int], np.ndarray] | None = None,
                  split: bool | None = None) -> list[ShardSlice]:
    """The shard slices that ``rank`` of ``size`` reads, ordered by shard index.

    Example::

        shards = [ShardInfo("shard-00000.h5", 900, 3), ShardInfo("shard-00001.h5", 600, 2),
                  ShardInfo("shard-00002.h5", 500, 2)]
        assign_shards(shards, 0, 2)     # [ShardSlice(0, 0, 3, 900)]
        assign_shards(shards, 1, 2)     # shards 1 and 2, 1100 frames
    """
    _check_rank(rank, size)
    return plan_shards(shards, size, utt_offsets_of=utt_offsets_of, split=split)[rank]
