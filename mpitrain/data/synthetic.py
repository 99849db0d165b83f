"""The built-in synthetic corpus: HMM-like phone sequences rendered as log-mel frames.

It is a small but real learning problem, built so that one frame is
ambiguous and its context resolves most of the ambiguity:

- 40 phone-like units (unit 0 is silence), 3 states each: 120 state classes.
- Each non-silence unit glides from one of a few shared "base" spectra to
  another (state 1 near the first, state 3 near the second, state 2 half
  way), plus a small unit-specific bump.  Units sharing a base look alike
  frame by frame; the direction of the glide, visible only across frames,
  tells them apart.
- Unit sequences come from a sparse bigram, so neighbours predict each other.
- State durations are 1 + Poisson(lambda) frames, lambda per state and per
  speaker speaking rate.
- Each speaker stretches the frequency axis (vocal-tract length), adds a
  smooth spectral offset and speaks at its own rate; dev speakers are never
  seen in training.
- Coarticulation: the spectral targets are smoothed across state boundaries,
  additive noise is large, and each utterance has a gain and a slow channel
  drift.

Everything derives from ``seed``: the same arguments give the same corpus,
byte for byte in the arrays.

Example::

    info = synthesize("data/synth", hours=1.0, speakers=40, shards=4, seed=1)
    info["train_dir"], info["dev_dir"], info["train_frames"]
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass

import numpy as np

from .writer import CorpusWriter
from .splice import splice_indices

NUM_UNITS = 40
STATES_PER_UNIT = 3
NUM_CLASSES = NUM_UNITS * STATES_PER_UNIT
FEAT_DIM = 40
FRAMES_PER_SECOND = 100
#: a set must give each speaker this many frames (about one utterance) ...
MIN_FRAMES_PER_SPEAKER = 100
#: ... once it has more speakers than this
MAX_SPEAKERS_ANYWAY = 64
SILENCE = 0


@dataclass(frozen=True)
class SyntheticParams:
    """Knobs of the generator; the defaults are the tuned built-in corpus.

    Example::

        synthesize("data/easy", hours=0.2, params=SyntheticParams(noise=0.5))
    """

    num_bases: int = 12            # shared base spectra that units glide between
    bumps_per_base: int = 3        # formant-like Gaussian bumps per base spectrum
    unit_bump: float = 0.45        # amplitude of the unit-specific bump (separability)
    bigram_concentration: float = 0.1   # Dirichlet alpha: smaller = more predictable
    pause_probability: float = 0.04     # silence inside an utterance
    mean_state_frames: tuple = (1.5, 4.5)   # range of Poisson lambda per state
    edge_silence_frames: float = 12.0       # lambda of leading/trailing silence states
    units_per_utterance: tuple = (10, 36)   # uniform range of non-silence units
    warp: float = 0.22             # speaker frequency stretch in [1-warp, 1+warp]
    speaker_offset: float = 0.5    # amplitude of the smooth speaker spectral offset
    rate: tuple = (0.8, 1.25)      # speaker speaking-rate factor range
    coarticulation: tuple = (0.1, 0.2, 0.4, 0.2, 0.1)   # smoothing kernel over frames
    noise: float = 0.5             # std of additive white noise per bin
    utterance_gain: float = 0.4    # std of a per-utterance level shift
    drift: float = 0.3             # amplitude of a slow per-utterance channel drift

    def __post_init__(self):
        if self.num_bases < 2 or self.num_bases ** 2 < NUM_UNITS - 1:
            raise ValueError(f"num_bases must give at least {NUM_UNITS - 1} distinct "
                             f"(start, end) pairs, got {self.num_bases}")
        if self.noise < 0 or self.warp < 0 or not 0 <= self.pause_probability < 1:
            raise ValueError("noise and warp must be >= 0 and pause_probability in [0, 1)")
        if len(self.coarticulation) % 2 != 1:
            raise ValueError("coarticulation must be a kernel of odd length")


def _bumps(freqs, centres, widths, amps):
    """Sum of Gaussian bumps: (..., K) parameters on (F,) frequencies -> (..., F)."""
    d = freqs[None, :] - centres[..., None]
    return (amps[..., None] * np.exp(-0.5 * (d / widths[..., None]) ** 2)).sum(axis=-2)


class _World:
    """The language: units, their spectra, durations and the bigram (shared by all speakers)."""

    def __init__(self, rng: np.random.Generator, params: SyntheticParams):
        p = params
        nb, kb = p.num_bases, p.bumps_per_base
        base_centres = np.sort(rng.uniform(0.05, 0.95, (nb, kb)), axis=1)
        base_widths = rng.uniform(0.03, 0.09, (nb, kb))
        base_amps = rng.uniform(1.0, 2.5, (nb, kb))

        # Each non-silence unit glides between two bases; pairs are distinct.
        pairs = rng.choice(nb * nb, size=NUM_UNITS - 1, replace=False)
        start, end = pairs // nb, pairs % nb
        mix = np.array([0.85, 0.5, 0.15])                      # weight of the start base
        # Per state: the bumps of both bases (weighted) plus one unit-specific bump.
        n_states = NUM_CLASSES
        k = 2 * kb + 1
        self.centres = np.zeros((n_states, k))
        self.widths = np.ones((n_states, k))
        self.amps = np.zeros((n_states, k))
        self.level = np.zeros(n_states)
        unit_level = rng.uniform(0.5, 1.5, NUM_UNITS)
        for u in range(1, NUM_UNITS):
            a, b = start[u - 1], end[u - 1]
            for s in range(STATES_PER_UNIT):
                c = u * STATES_PER_UNIT + s
                self.centres[c, :kb], self.centres[c, kb:2 * kb] = base_centres[a], base_centres[b]
                self.widths[c, :kb], self.widths[c, kb:2 * kb] = base_widths[a], base_widths[b]
                self.amps[c, :kb] = mix[s] * base_amps[a]
                self.amps[c, kb:2 * kb] = (1 - mix[s]) * base_amps[b]
                self.level[c] = unit_level[u]
        unit_states = slice(STATES_PER_UNIT, None)
        self.centres[unit_states, -1] = rng.uniform(0.0, 1.0, n_states - STATES_PER_UNIT)
        self.widths[unit_states, -1] = rng.uniform(0.04, 0.1, n_states - STATES_PER_UNIT)
        self.amps[unit_states, -1] = (rng.choice([-1.0, 1.0], n_states - STATES_PER_UNIT)
                                      * rng.uniform(0.6, 1.0, n_states - STATES_PER_UNIT)
                                      * p.unit_bump)
        # Silence: low level, faint bumps.
        sil = slice(0, STATES_PER_UNIT)
        self.centres[sil] = rng.uniform(0.0, 1.0, (STATES_PER_UNIT, k))
        self.widths[sil] = rng.uniform(0.1, 0.3, (STATES_PER_UNIT, k))
        self.amps[sil] = rng.uniform(0.0, 0.15, (STATES_PER_UNIT, k))
        self.level[sil] = -1.0

        # Sparse bigram over units, with occasional pauses (silence).
        speech = rng.dirichlet(np.full(NUM_UNITS - 1, p.bigram_concentration), NUM_UNITS)
        bigram = np.zeros((NUM_UNITS, NUM_UNITS))
        bigram[:, 1:] = speech * (1 - p.pause_probability)
        bigram[:, SILENCE] = p.pause_probability
        bigram[SILENCE, SILENCE] = 0.0
        bigram /= bigram.sum(axis=1, keepdims=True)
        self.bigram_cdf = np.cumsum(bigram, axis=1)
        self.initial_cdf = np.cumsum(np.r_[0.0, np.full(NUM_UNITS - 1, 1.0 / (NUM_UNITS - 1))])
        self.mean_frames = rng.uniform(*p.mean_state_frames, NUM_CLASSES)

    def spectra(self, warp: float) -> np.ndarray:
        """(NUM_CLASSES, FEAT_DIM) state spectra seen through a frequency stretch."""
        freqs = (np.arange(FEAT_DIM) + 0.5) / FEAT_DIM * warp
        return self.level[:, None] + _bumps(freqs, self.centres, self.widths, self.amps)


@dataclass
class _Speaker:
    name: str
    spectra: np.ndarray      # (NUM_CLASSES, FEAT_DIM), warped, with the speaker offset
    rate: float


def _make_speaker(world: _World, params: SyntheticParams, seed: int, index: int) -> _Speaker:
    rng = np.random.default_rng([seed, 1, index])
    warp = rng.uniform(1 - params.warp, 1 + params.warp)
    bins = np.arange(FEAT_DIM) / FEAT_DIM
    offset = rng.normal(0, 0.5) * params.speaker_offset
    for harmonic in (1, 2):                                 # smooth across bins
        offset = offset + params.speaker_offset * rng.normal(0, 0.6) * np.cos(
            np.pi * harmonic * bins + rng.uniform(0, np.pi))
    rate = rng.uniform(*params.rate)
    return _Speaker(f"spk{index:04d}", world.spectra(warp) + offset[None, :], rate)


def _sample_units(world: _World, rng, lengths: np.ndarray) -> list[np.ndarray]:
    """Bigram unit sequences, one per utterance, framed by silence."""
    count, longest = lengths.shape[0], int(lengths.max())
    seqs = np.zeros((count, longest), dtype=np.int64)
    prev = np.searchsorted(world.initial_cdf, rng.random(count), side="right")
    prev = np.clip(prev, 1, NUM_UNITS - 1)
    seqs[:, 0] = prev
    for j in range(1, longest):
        u = rng.random(count)
        nxt = (world.bigram_cdf[prev] < u[:, None]).sum(axis=1)
        prev = np.minimum(nxt, NUM_UNITS - 1)
        seqs[:, j] = prev
    return [np.r_[SILENCE, seqs[i, :lengths[i]], SILENCE] for i in range(count)]


def _render_batch(world: _World, params: SyntheticParams, speakers: list[_Speaker],
                  rng: np.random.Generator, count: int):
    """``count`` utterances of the given speakers (cycled): list of (speaker, feats, labels)."""
    p = params
    lengths = rng.integers(p.units_per_utterance[0], p.units_per_utterance[1] + 1, count)
    units = _sample_units(world, rng, lengths)
    spk_of_utt = np.arange(count) % len(speakers)

    # Expand units to states and states to frames, all utterances at once.
    unit_flat = np.concatenate(units)
    utt_of_unit = np.repeat(np.arange(count), [len(u) for u in units])
    states = (unit_flat[:, None] * STATES_PER_UNIT + np.arange(STATES_PER_UNIT)).ravel()
    utt_of_state = np.repeat(utt_of_unit, STATES_PER_UNIT)
    lam = world.mean_frames[states] / np.array([s.rate for s in speakers])[spk_of_utt[utt_of_state]]
    unit_start = np.r_[0, np.cumsum([len(u) for u in units])]
    edge = np.zeros(len(unit_flat), dtype=bool)
    edge[unit_start[:-1]] = True                            # leading silence
    edge[unit_start[1:] - 1] = True                         # trailing silence
    lam = np.where(np.repeat(edge, STATES_PER_UNIT), p.edge_silence_frames / STATES_PER_UNIT, lam)
    durations = 1 + rng.poisson(lam)
    labels = np.repeat(states, durations).astype(np.int32)
    utt_of_frame = np.repeat(utt_of_state, durations)
    frames_per_utt = np.bincount(utt_of_frame, minlength=count)
    offsets = np.r_[0, np.cumsum(frames_per_utt)]
    total = int(offsets[-1])

    # Spectral targets of each frame's state, as the utterance's speaker says it.
    table = np.stack([s.spectra for s in speakers]).reshape(-1, FEAT_DIM)
    spk_of_frame = spk_of_utt[utt_of_frame]
    targets = table[spk_of_frame * NUM_CLASSES + labels]

    # Coarticulation: smooth targets across state boundaries, within each utterance.
    kernel = np.asarray(p.coarticulation, dtype=np.float64)
    kernel = kernel / kernel.sum()
    half = len(kernel) // 2
    idx = splice_indices(np.arange(total), offsets[utt_of_frame], offsets[utt_of_frame + 1],
                         half, half)
    feats = np.zeros((total, FEAT_DIM))
    for k, weight in enumerate(kernel):
        feats += weight * targets[idx[:, k]]

    # Channel: per-utterance gain and a slow drift smooth across bins; then noise.
    bins = np.arange(FEAT_DIM) / FEAT_DIM
    gain = rng.normal(0, p.utterance_gain, count)
    drift_shape = rng.normal(0, p.drift, (count, 1)) * np.cos(
        np.pi * bins[None, :] + rng.uniform(0, np.pi, (count, 1)))
    position = (np.arange(total) - offsets[utt_of_frame]) / frames_per_utt[utt_of_frame] - 0.5
    feats += gain[utt_of_frame, None] + position[:, None] * drift_shape[utt_of_frame]
    feats += rng.normal(0, p.noise, feats.shape)
    feats = feats.astype(np.float32)

    return [(speakers[spk_of_utt[i]], feats[offsets[i]:offsets[i + 1]],
             labels[offsets[i]:offsets[i + 1]]) for i in range(count)]


def _write_split(out_dir: str, *, world, params, speakers, seed_seq, target_frames: int,
                 shards: int, source: dict, overwrite: bool, utt_tag: str = "") -> dict:
    rng = np.random.default_rng(seed_seq)
    written = {s.name: 0 for s in speakers}
    frames = utts = 0
    with CorpusWriter(out_dir, feat_dim=FEAT_DIM, num_classes=NUM_CLASSES, num_shards=shards,
                      source=source, overwrite=overwrite) as writer:
        while frames < target_frames:
            # A batch cycles through all speakers, so each gets a similar share.
            batch = _render_batch(world, params, speakers, rng,
                                  len(speakers) * -(-64 // len(speakers)))
            for speaker, feats, labels in batch:
                writer.add(f"{speaker.name}-{utt_tag}{written[speaker.name]:04d}", feats,
                           labels)
                written[speaker.name] += 1
                frames += feats.shape[0]
                utts += 1
                if frames >= target_frames:
                    break
    empty = sum(1 for shard in writer.manifest.shards if not shard.utterances)
    return {"frames": frames, "utterances": utts, "empty_shards": empty,
            "speakers": sorted(name for name, n in written.items() if n)}


def _option(name: str) -> str:
    """The command-line spelling of a synthesize() keyword (errors reach `mpitrain synth`)."""
    return "--" + name.replace("_", "-")


def synthesize(out_dir: str, *, hours: float = 1.0, speakers: int = 40, shards: int = 4,
               seed: int = 1, dev_hours: float = 0.1, dev_speakers: int = 8,
               seen_dev_hours: float = 0.0, params: SyntheticParams | None = None,
               overwrite: bool = False) -> dict:
    """Write the synthetic corpus to ``out_dir/train`` and ``out_dir/dev``.

    ``hours`` of training speech at 100 frames/s from ``speakers`` speakers in
    ``shards`` shards; ``dev_hours`` of held-out speech (one shard) from
    ``dev_speakers`` other speakers.  With ``seen_dev_hours`` > 0, also
    ``out_dir/dev_seen``: that much held-out speech (one shard) of the
    training speakers, new utterances from a random stream of its own (ids
    ``spkNNNN-devNNNN``); train and dev are the same with or without it.
    Returns a summary dict (``warnings``: lines to show, e.g. of shards left
    empty).

    Example::

        info = synthesize("data/synth", hours=0.1, dev_hours=0.02, seed=3)
        info["num_classes"]       # 120
        info = synthesize("data/seen", hours=0.1, seen_dev_hours=0.02)
        info["seen_dev_dir"], info["seen_dev_frames"]
    """
    params = params or SyntheticParams()
    for name, value, least in (("hours", hours, 1), ("dev_hours", dev_hours, 1),
                               ("seen_dev_hours", seen_dev_hours, 0)):
        # at least one frame (100 frames/s) of each set asked for, and a finite amount
        # (an optional set asked for too: checked before any set is written)
        optional = not least
        if optional and value > 0:
            least = 1
        if not (math.isfinite(value) and value >= 0
                and value * 3600 * FRAMES_PER_SECOND >= least):
            raise ValueError(f"{_option(name)} ({name}=): must be a finite number of "
                             f"hours giving at least 1 frame (100 frames/s)"
                             f"{' or 0' if optional else ''}, got {value}")
    if isinstance(seed, bool) or int(seed) != seed or seed < 0:
        raise ValueError(f"--seed (seed=): must be an integer >= 0, got {seed!r}")
    for name, value in (("speakers", speakers), ("dev_speakers", dev_speakers),
                        ("shards", shards)):
        if int(value) != value or value < 1:
            raise ValueError(f"{_option(name)} ({name}=): expected a positive int, "
                             f"got {value!r}")
    # every speaker is built up front (about half a megabyte each) and each batch
    # gives every speaker an utterance: more speakers than a set can hold is a mistake
    for name, count, amount, hours_name in (("speakers", speakers, hours, "hours"),
                                            ("dev_speakers", dev_speakers, dev_hours,
                                             "dev_hours")):
        frames = amount * 3600 * FRAMES_PER_SECOND
        if count > MAX_SPEAKERS_ANYWAY and count * MIN_FRAMES_PER_SPEAKER > frames:
            raise ValueError(f"{_option(name)} {count}: {_option(hours_name)} {amount:g} "
                             f"gives {int(frames)} frames, under {MIN_FRAMES_PER_SPEAKER} a "
                             f"speaker; give more {_option(hours_name)} or fewer "
                             f"{_option(name)}")
    # an utterance has at least units_per_utterance[0] units of STATES_PER_UNIT frames:
    # more shards than utterances would be written empty
    most_utterances = int(hours * 3600 * FRAMES_PER_SECOND) // (
        params.units_per_utterance[0] * STATES_PER_UNIT)
    most_utterances = max(1, most_utterances)
    if shards > most_utterances:
        raise ValueError(f"--shards {shards}: --hours {hours:g} gives at most "
                         f"{most_utterances} utterance(s), and a shard holds whole "
                         f"utterances; give fewer --shards or more --hours")
    started = time.perf_counter()
    root = np.random.SeedSequence(seed)
    world_seq, train_seq, dev_seq = root.spawn(3)
    world = _World(np.random.default_rng(world_seq), params)
    train_speakers = [_make_speaker(world, params, seed, i) for i in range(speakers)]
    dev_pool = [_make_speaker(world, params, seed, speakers + i) for i in range(dev_speakers)]

    source = {"kind": "synthetic", "seed": int(seed), "hours": float(hours),
              "speakers": int(speakers), "dev_hours": float(dev_hours),
              "dev_speakers": int(dev_speakers), "units": NUM_UNITS,
              "states_per_unit": STATES_PER_UNIT,
              "params": {k: list(v) if isinstance(v, tuple) else v
                         for k, v in asdict(params).items()}}
    train_dir, dev_dir = os.path.join(out_dir, "train"), os.path.join(out_dir, "dev")
    train = _write_split(train_dir, world=world, params=params, speakers=train_speakers,
                         seed_seq=train_seq, target_frames=int(hours * 3600 * FRAMES_PER_SECOND),
                         shards=int(shards), source={**source, "split": "train"},
                         overwrite=overwrite)
    dev = _write_split(dev_dir, world=world, params=params, speakers=dev_pool,
                       seed_seq=dev_seq, target_frames=int(dev_hours * 3600 * FRAMES_PER_SECOND),
                       shards=1, source={**source, "split": "dev"}, overwrite=overwrite)
    info = {"train_dir": train_dir, "dev_dir": dev_dir, "num_classes": NUM_CLASSES,
            "feat_dim": FEAT_DIM, "train_frames": train["frames"],
            "train_utterances": train["utterances"], "train_speakers": train["speakers"],
            "dev_frames": dev["frames"], "dev_utterances": dev["utterances"],
            "dev_speakers": dev["speakers"], "warnings": []}
    if train["empty_shards"]:
        # (the bound checked above is the shortest utterances'; longer ones are fewer)
        info["warnings"].append(
            f"{train_dir}: {train['empty_shards']} of {shards} shards hold no utterance "
            f"({train['utterances']} written); --shards {train['utterances']} or fewer "
            "leaves none empty")
    if seen_dev_hours > 0:
        # a fourth child of the root: the first three (world, train, dev) are unchanged
        seen_seq = root.spawn(1)[0]
        seen_dir = os.path.join(out_dir, "dev_seen")
        seen = _write_split(seen_dir, world=world, params=params, speakers=train_speakers,
                            seed_seq=seen_seq,
                            target_frames=int(seen_dev_hours * 3600 * FRAMES_PER_SECOND),
                            shards=1, overwrite=overwrite, utt_tag="dev",
                            source={**source, "split": "dev_seen",
                                    "seen_dev_hours": float(seen_dev_hours)})
        info.update(seen_dev_dir=seen_dir, seen_dev_frames=seen["frames"],
                    seen_dev_utterances=seen["utterances"], seen_dev_speakers=seen["speakers"])
    info["seconds"] = time.perf_counter() - started
    return info
