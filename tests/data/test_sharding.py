"""Assignment of shards (and utterance ranges) to ranks."""

import numpy as np
import pytest

from mpitrain.data.corpus import ShardInfo
from mpitrain.data.sharding import ShardSlice, assign_shards, plan_shards


def random_corpus(num_shards, seed):
    """Shards with random utterance lengths: (ShardInfo list, offsets per shard)."""
    rng = np.random.default_rng(seed)
    shards, offsets = [], []
    for i in range(num_shards):
        lengths = rng.integers(1, 500, rng.integers(1, 30))
        off = np.r_[0, np.cumsum(lengths)].astype(np.int64)
        offsets.append(off)
        shards.append(ShardInfo(f"shard-{i:05d}.h5", int(off[-1]), len(lengths)))
    return shards, offsets


def coverage(shards, offsets, plan):
    """How many ranks read each utterance, per shard."""
    seen = [np.zeros(s.utterances, dtype=int) for s in shards]
    for slices in plan:
        for s in slices:
            assert 0 <= s.start_utt < s.end_utt <= shards[s.shard_index].utterances
            assert s.frames == offsets[s.shard_index][s.end_utt] - offsets[s.shard_index][s.start_utt]
            seen[s.shard_index][s.start_utt:s.end_utt] += 1
    return seen


@pytest.mark.parametrize("split", [None, True])
def test_every_frame_goes_to_exactly_one_rank(split):
    combos = 0
    for num_shards in range(1, 9):
        for size in range(1, 13):
            shards, offsets = random_corpus(num_shards, seed=num_shards * 100 + size)
            plan = [assign_shards(shards, r, size, utt_offsets_of=lambda i: offsets[i], split=split)
                    for r in range(size)]
            for seen in coverage(shards, offsets, plan):
                assert (seen == 1).all()
            loads = [sum(s.frames for s in slices) for slices in plan]
            assert sum(loads) == sum(s.frames for s in shards)
            total_utts = sum(s.utterances for s in shards)
            if total_utts >= size:
                assert min(loads) > 0, (num_shards, size, loads)
            combos += 1
    assert combos == 96


def test_split_ranks_get_near_equal_frames():
    shards, offsets = random_corpus(3, seed=7)
    longest = max(int(np.diff(o).max()) for o in offsets)
    for size in (4, 5, 8):
        plan = plan_shards(shards, size, utt_offsets_of=lambda i: offsets[i])
        loads = np.array([sum(s.frames for s in slices) for slices in plan])
        target = sum(s.frames for s in shards) / size
        # Cuts land on the utterance boundary nearest the target.
        assert np.abs(np.cumsum(loads)[:-1] - target * np.arange(1, size)).max() <= longest / 2


def test_whole_shards_longest_first_to_the_lightest_rank():
    shards = [ShardInfo("a", 900, 3), ShardInfo("b", 600, 2), ShardInfo("c", 500, 2),
              ShardInfo("d", 400, 1)]
    assert assign_shards(shards, 0, 2) == [ShardSlice(0, 0, 3, 900), ShardSlice(3, 0, 1, 400)]
    assert assign_shards(shards, 1, 2) == [ShardSlice(1, 0, 2, 600), ShardSlice(2, 0, 2, 500)]


def test_fewer_shards_than_ranks_needs_offsets():
    shards = [ShardInfo("a", 100, 4)]
    with pytest.raises(ValueError, match="utt_offsets_of"):
        assign_shards(shards, 0, 2)
    offsets = np.array([0, 10, 50, 60, 100])
    halves = [assign_shards(shards, r, 2, utt_offsets_of=lambda i: offsets) for r in range(2)]
    assert halves == [[ShardSlice(0, 0, 2, 50)], [ShardSlice(0, 2, 4, 50)]]


def test_fewer_utterances_than_ranks_leaves_extra_ranks_empty():
    shards = [ShardInfo("a", 30, 2)]
    offsets = np.array([0, 10, 30])
    plan = plan_shards(shards, 4, utt_offsets_of=lambda i: offsets)
    assert sum(len(p) for p in plan) == 2
    assert sorted(s.frames for p in plan for s in p) == [10, 20]


def test_inconsistent_offsets_and_bad_rank_are_rejected():
    shards = [ShardInfo("a", 100, 4)]
    with pytest.raises(ValueError, match="manifest says shard a has 4 utterances"):
        assign_shards(shards, 0, 2, utt_offsets_of=lambda i: np.array([0, 50, 90]))
    with pytest.raises(ValueError, match="rank"):
        assign_shards(shards, 2, 2)
    with pytest.raises(ValueError, match="size"):
        assign_shards(shards, 0, 0)
