"""Run configuration: YAML validated into typed dataclasses.

Every field is declared once below with its type, default and allowed range.
``load_config`` rejects unknown keys, wrong types and out-of-range values with
a one-line :class:`ConfigError` that names the file, the dotted key and what was
expected.  YAML itself is read and written by :mod:`mpitrain.files`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, get_type_hints

from .files import Written, parse_yaml, read_yaml, unexpanded_home, write_yaml, yaml_text
from .parallel.registry import METHODS as STRATEGY_METHODS, takes_own_steps
from .words import cut, shown


# float32's smallest normal number: the least value a float32 setting keeps
FLOAT32_TINY = 1.1754943508222875e-38


class ConfigError(ValueError):
    """A bad configuration value; the message is one line naming the key."""


def _opt(default, *, min=None, max=None, min_exclusive=False, max_exclusive=False,
         choices=None, items=int, help=""):
    # items: the type of each element of a tuple (list) field
    meta = {"min": min, "max": max, "min_exclusive": min_exclusive,
            "max_exclusive": max_exclusive, "choices": choices, "items": items, "help": help}
    return field(default=default, metadata=meta)


@dataclass
class DataConfig:
    train: str = _opt("", help="training corpus directory (corpus.yaml + shards)")
    dev: str = _opt("", help="held-out corpus directory; empty: no held-out evaluation")
    left_context: int = _opt(5, min=0, max=100, help="frames spliced before each frame")
    right_context: int = _opt(5, min=0, max=100, help="frames spliced after each frame")
    chunk_frames: int = _opt(200_000, min=1_000,
                             help="frames read from the shards at a time and shuffled")
    prefetch: bool = _opt(True, help="read the next chunk while the current one trains")


@dataclass
class ModelConfig:
    hidden_layers: int = _opt(4, min=0, max=50, help="affine + nonlinearity blocks")
    hidden_dim: int = _opt(1024, min=1, max=65_536, help="output dim of each hidden affine layer")
    nonlinearity: str = _opt("relu", choices=("relu", "sigmoid", "pnorm"), help="hidden nonlinearity")
    pnorm_output_dim: int = _opt(0, min=0, max=65_536,
                                 help="p-norm output dim; hidden_dim must be a multiple")
    pnorm_p: float = _opt(2.0, min=1.0, help="p of the p-norm")
    normalize: bool = _opt(False, help="Kaldi normalize layer after each nonlinearity")
    init_from: str = _opt("", help="RBM stack from `mpitrain pretrain` (its pretrain.h5) that "
                                   "gives the hidden layers; needs nonlinearity sigmoid; "
                                   "empty: random initialisation")
    dropout: float = _opt(0.0, min=0.0, max=1.0, max_exclusive=True,
                          help="dropout proportion on every hidden layer's output during "
                               "training; 0: off")
    dropout_schedule: str = _opt("", help="Kaldi's dropout schedule over the fraction of "
                                          "training, e.g. '0,0.2@0.5,0' (overrides "
                                          "model.dropout); empty: model.dropout throughout")


@dataclass
class NgsgdConfig:
    variant: str = _opt("online", choices=("online", "simple"), help="online low-rank Fisher (Kaldi nnet2/3) or per-minibatch leave-one-out")
    rank_in: int = _opt(20, min=1, help="rank of the input-side Fisher estimate (capped at (in+1)/2)")
    rank_out: int = _opt(80, min=1, help="rank of the output-side Fisher estimate (capped at (out+1)/2)")
    update_period: int = _opt(4, min=1, help="minibatches between Fisher updates (after the first 11, which all update)")
    num_samples_history: float = _opt(2000.0, min=0.0, min_exclusive=True, max=1.0e6, help="frames of memory of the Fisher estimate")
    alpha: float = _opt(4.0, min=0.0, help="smoothing of the Fisher estimate towards the identity")
    reset_on_average: bool = _opt(False, help="fresh preconditioner state after each model "
                                              "average, as each Kaldi job starts fresh (costly "
                                              "when averages are a few minibatches apart)")
    delayed_updates: bool = _opt(False, help="apply each Fisher update at the next updating "
                                             "minibatch, not the next one (Kaldi's): the same "
                                             "estimates, each used update_period - 1 "
                                             "minibatches later; on a GPU the host plans "
                                             "them meanwhile")
    plan_threads: int = _opt(0, min=0, max=64, help="host threads that plan the Fisher updates "
                                                   "(their r x r part) while the GPU goes on; "
                                                   "0: the training thread (same results)")


@dataclass
class OptimizerConfig:
    name: str = _opt("sgd", choices=("sgd", "ngsgd"), help="plain SGD or natural-gradient SGD")
    initial_learning_rate: float = _opt(0.002, min=0.0, min_exclusive=True, help="per-frame rate (the gradient is summed over the minibatch)")
    final_learning_rate: float = _opt(0.0002, min=0.0, min_exclusive=True, help="rate at the end; geometric decay in between")
    momentum: float = _opt(0.0, min=0.0, max=1.0, max_exclusive=True, help="Kaldi-style momentum (steps scaled by 1 - momentum)")
    max_change_per_layer: float = _opt(0.75, min=0.0, help="0 disables")
    max_change_output: float = _opt(1.5, min=0.0, help="output layer's max-change; 0 disables")
    max_change: float = _opt(2.0, min=0.0, help="whole-model max-change; 0 disables")
    max_change_per_sample: float = _opt(
        0.0, min=0.0, help="nnet2's max-change-per-sample (Su & Chen's recipes: 0.075): each "
                           "affine layer's step is scaled so that lr sum_i |x_i| |g_i| <= "
                           "this x minibatch; 0 disables (set the max_change options to 0 for "
                           "nnet2's rule alone)")
    schedule: str = _opt("exponential", choices=("exponential", "hand", "adapt", "search",
                                                 "newbob"),
                         help="learning-rate schedule (docs/user-guide.md, Learning-rate "
                              "schedules); all but exponential start from "
                              "initial_learning_rate and ignore final_learning_rate")
    hand_factor: float = _opt(0.999, min=0.0, max=1.0, min_exclusive=True,
                              help="hand: the rate is multiplied by this after every minibatch")
    # (a K below float32's smallest normal number is 0 in the update, and a
    # parameter without gradient got 0 / 0)
    adapt_k: float = _opt(1.0, min=FLOAT32_TINY,
                          help="adapt: K in gamma / sqrt(K + G) per parameter")
    adapt_decay: float = _opt(0.0, min=0.0, max=1.0, max_exclusive=True,
                              help="adapt: memory of G, G <- decay G + g^2; 0: the current "
                                   "gradient only (You & Xu)")
    search_chunk_frames: int = _opt(360_000, min=1, help="search: frames (summed over ranks) "
                                                         "trained between rate searches")
    search_factors: tuple = _opt((0.5, 1.0, 2.0), min=0.0, min_exclusive=True, items=float,
                                 help="search: the current rate times each of these is tried "
                                      "(one at least must be <= 1)")
    search_trial_fraction: float = _opt(0.03, min=0.0, max=1.0, min_exclusive=True,
                                        help="search: share of a chunk each trial trains on")
    newbob_start_halving: float = _opt(0.005, min=0.0, help="newbob: halve the rate every "
                                       "epoch once an epoch's relative held-out "
                                       "cross-entropy gain is below this")
    newbob_stop: float = _opt(0.001, min=0.0, help="newbob: once halving, stop when an epoch's "
                                                   "held-out frame-accuracy gain is below this")
    l2_regularize: float = _opt(0.0, min=0.0, help="L2 regularization of the hidden affine "
                                                   "layers, per frame, as Kaldi nnet3's "
                                                   "l2-regularize; 2 x the largest rate x "
                                                   "this x training.minibatch must be below "
                                                   "1; 0: off")
    l2_regularize_output: float = _opt(0.0, min=0.0, help="L2 regularization of the output "
                                                          "layer, bounded alike; 0: off")
    ngsgd: NgsgdConfig = field(default_factory=NgsgdConfig)


@dataclass
class EarlyStopConfig:
    patience: int = _opt(0, min=0, help="stop after this many held-out evaluations in a row "
                                        "without a gain of min_delta in training.select_by; "
                                        "0: never stop early")
    min_delta: float = _opt(0.0, min=0.0, help="the least gain that counts (accuracy as a "
                                               "fraction, or cross-entropy per frame)")


@dataclass
class TrainingConfig:
    epochs: float = _opt(3.0, min=0.0, min_exclusive=True, max=1e6,
                         help="passes over each rank's data (may be fractional)")
    minibatch: int = _opt(256, min=1, help="frames per minibatch per rank")
    seed: int = _opt(1, min=0, help="initialisation and shuffling seed")
    max_steps: int = _opt(0, min=0, help="stop after this many steps; 0: no limit")
    log_interval: int = _opt(100, min=1, help="steps between progress lines")
    eval_interval: int = _opt(0, min=0, help="frames per rank between held-out evaluations (bench's "
                                             "--eval-frames counts frames of all ranks); "
                                             "0: at the end of each epoch")
    eval_max_frames: int = _opt(0, min=0, help="cap on held-out frames; 0: all")
    checkpoint_interval: int = _opt(1000, min=0, help="steps between checkpoints; 0: end only")
    checkpoint_minutes: float = _opt(0.0, min=0, help="also a checkpoint at the first point "
                                                      "where one may be written after this "
                                                      "many minutes since the last (rank 0's "
                                                      "clock); 0: off")
    keep_checkpoints: int = _opt(3, min=2, help="newest checkpoints kept in the run directory")
    plot: bool = _opt(False, help="draw curves.png into the run directory at the end "
                                  "(needs matplotlib)")
    tensorboard: bool = _opt(False, help="also write the train and eval scalars as "
                                         "TensorBoard event files in RUN_DIR/tensorboard "
                                         "(needs the tensorboard package)")
    divergence_factor: float = _opt(3.0, min=0.0, help="a log window whose cross-entropy "
                                    "exceeds this factor times the running mean counts as a "
                                    "divergence event; 0: only non-finite losses count")
    max_divergence_events: int = _opt(10, min=0, help="non-finite minibatches and exploding "
                                      "windows tolerated between checkpoints before rolling "
                                      "back to the last good checkpoint")
    max_rollbacks: int = _opt(3, min=0, help="roll backs, each scaling the learning rate by "
                                             "rollback_lr_factor, before the run stops")
    rollback_lr_factor: float = _opt(0.5, min=0.0, max=1.0, min_exclusive=True,
                                     help="learning-rate factor applied at each roll back")
    select_by: str = _opt("acc", choices=("acc", "xent"),
                          help="the held-out figure that picks RUN_DIR/best.h5 (and that "
                               "early_stop watches): frame accuracy or cross-entropy")
    early_stop: EarlyStopConfig = field(default_factory=EarlyStopConfig)
    combine: bool = _opt(False, help="at the end, combine the last snapshots (and the ranks' "
                                     "models) with weights fit on held-out frames, as "
                                     "Kaldi's nnet3-combine")
    combine_models: int = _opt(5, min=1, help="combine: snapshots kept, taken at sync points")
    combine_every: int = _opt(0, min=0, help="combine: steps between snapshots (each at the "
                                             "first sync point after); 0: every sync point")
    combine_frames: int = _opt(5000, min=100, help="combine: held-out frames the weights are "
                                                   "fit on (data.dev, else training data)")


@dataclass
class StragglerConfig:
    ranks: tuple = _opt((), min=0, help="ranks made slow on purpose, e.g. [1]; empty: none")
    slowdown: float = _opt(2.0, min=1.0, help="a slow rank's step takes this many times its "
                                              "measured compute time (it sleeps the rest)")
    jitter: float = _opt(0.0, min=0.0, help="plus a seeded random extra fraction of up to this "
                                            "much of the compute time, per step")


@dataclass
class ParallelConfig:
    method: str = _opt("model_averaging", choices=tuple(STRATEGY_METHODS),
                       help="how ranks combine their models (docs/user-guide.md)")
    average_every: int = _opt(8, min=1, help="minibatches between model averages")
    average_every_frames: int = _opt(0, min=0, help="frames per rank between averages; "
                                                    "overrides average_every when > 0")
    average_momentum: bool = _opt(False, help="model_averaging: average momentum buffers too")
    overlap: bool = _opt(False, help="allreduce: start reducing gradients during backward")
    bucket_mb: float = _opt(25.0, min=0.0, min_exclusive=True,
                            help="allreduce with overlap: MiB of gradients per reduction")
    num_jobs_initial: int = _opt(0, min=0, help="kaldi: active ranks at the start; "
                                  "0: num_jobs_final's (every rank when that is 0 too)")
    num_jobs_final: int = _opt(0, min=0, help="kaldi: active ranks at the end; 0: all")
    jobs_step: int = _opt(1, min=1, help="kaldi: past this many jobs, ramp in multiples of it")
    block_momentum: float = _opt(-1.0, min=-1.0, max=1.0, max_exclusive=True,
                                 help="bmuf: eta_b, in [0, 1); -1: 1 - 1/ranks")
    block_lr: float = _opt(1.0, min=0.0, min_exclusive=True, help="bmuf: zeta")
    nesterov: bool = _opt(True, help="bmuf: Nesterov look-ahead at each block start")
    topology: str = _opt("fixed_ring", choices=("fixed_ring", "random_ring"),
                         help="adpsgd: partners on a fixed ring, or on a ring drawn anew "
                              "each step from training.seed")
    delay_by_one: bool = _opt(False, help="adpsgd: apply each step's gradient one step "
                                          "late: w <- mix(w) - lr g(w of the step before)")
    asynchronous: bool = _opt(False, help="adpsgd: each rank steps at its own pace and "
                                          "mixes without waiting (active/passive pairs); "
                                          "false: lock-step pairs, deterministic")
    hierarchical: bool = _opt(False, help="adpsgd: gradient allreduce inside each node, "
                                          "the ring across nodes (lock-step)")
    ranks_per_node: int = _opt(0, min=0, help="hierarchical adpsgd: ranks per node; 0: "
                                              "the ranks sharing a host")
    servers: int = _opt(1, min=1, help="param_server: server ranks (0..servers-1); the "
                                      "model is split over them by layers, so each link "
                                      "carries a share of every update")
    average_eta: float = _opt(0.01, min=0.0, max=1.0, min_exclusive=True,
                              help="param_server: weight of the newest model in the "
                                   "server's running average, until the uniform average "
                                   "takes over")
    damp_staleness: bool = _opt(True, help="param_server: apply each gradient at the rate "
                                           "/ (1 + its staleness), the updates it is late "
                                           "by; false: at the rate as scheduled")
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    straggler_policy: str = _opt("none", choices=("none", "adapt"),
                                 help="model_averaging: adapt lets a slow rank train fewer "
                                      "minibatches per period (its model weighted by the "
                                      "frames it saw), so it no longer holds up the job")


@dataclass
class PretrainConfig:
    epochs_gaussian: float = _opt(2.0, min=0.0, min_exclusive=True, max=1e6,
                                  help="pretrain: epochs of the first (Gaussian-Bernoulli) RBM")
    epochs_per_layer: float = _opt(1.0, min=0.0, min_exclusive=True, max=1e6,
                                   help="pretrain: epochs of each Bernoulli-Bernoulli RBM")
    minibatch: int = _opt(100, min=1, help="pretrain: frames per minibatch per rank")
    learning_rate_gaussian: float = _opt(0.01, min=0.0, min_exclusive=True,
                                         help="pretrain: CD-1 rate of the Gaussian-Bernoulli "
                                              "RBM (it diverges when too large)")
    learning_rate: float = _opt(0.4, min=0.0, min_exclusive=True,
                                help="pretrain: CD-1 rate of the Bernoulli-Bernoulli RBMs")
    momentum_initial: float = _opt(0.5, min=0.0, max=1.0, max_exclusive=True,
                                   help="pretrain: momentum at the start of each layer")
    momentum_final: float = _opt(0.9, min=0.0, max=1.0, max_exclusive=True,
                                 help="pretrain: momentum after the ramp")
    momentum_ramp_frames: int = _opt(20_000_000, min=0,
                                     help="pretrain: frames per rank over which the momentum "
                                          "rises, in 40 equal steps")
    weight_decay: float = _opt(0.0002, min=0.0, help="pretrain: L2 weight decay of W")
    average_every_frames: int = _opt(10_000, min=1, help="pretrain: frames per rank between "
                                                         "averages of the RBM over ranks")
    divergence_factor: float = _opt(10.0, min=0.0, help="pretrain: stop when a log window's "
                                    "reconstruction error exceeds this factor times the "
                                    "layer's first window's (the Gaussian layer's at most 1, "
                                    "the features' variance, or its error as initialised if "
                                    "larger); 0: only non-finite errors stop")


@dataclass
class RunConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    device: str = _opt("cpu", choices=("cpu", "gpu"), help="gpu: CuPy, one GPU per local rank")
    device_transport: str = _opt("auto", choices=("auto", "nccl", "cuda-aware-mpi", "host-staged"),
                                 help="how GPU buffers travel between ranks; auto: NCCL, else "
                                      "CUDA-aware MPI, else pinned host staging")
    precision: str = _opt("fp32", choices=("fp32", "tf32", "bf16"),
                          help="matrix products: fp32, TF32 tensor cores (GPU), or bf16 "
                               "operands with fp32 accumulation, weights and reductions (on "
                               "the CPU emulated, to preview its accuracy)")
    fused_kernels: bool = _opt(True, help="GPU: fused CUDA kernels for the elementwise work of "
                                          "a step; false: plain CuPy array expressions")
    cuda_graph: bool = _opt(False, help="GPU: replay steps whose work is fixed from a captured "
                                        "CUDA graph (not with the allreduce method or "
                                        "hierarchical adpsgd, nor with dropout)")
    blas_threads: int = _opt(0, min=0, max=1024,
                             help="BLAS threads per rank; 0: the cores this rank may "
                                  "use / the ranks using them too (1 with device: gpu)")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def sync_steps(self) -> int:
        """Minibatches between syncs: ``parallel.average_every_frames`` wins when set."""
        par = self.parallel
        if par.average_every_frames:
            return max(1, par.average_every_frames // self.training.minibatch)
        return par.average_every


# -- validation ----------------------------------------------------------------

def _type_name(tp) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false",
            tuple: "a list of integers"}.get(tp, getattr(tp, "__name__", str(tp)))


def _range_text(meta) -> str:
    lo, hi = meta.get("min"), meta.get("max")
    if lo is None and hi is None:
        return ""
    left = "(" if meta.get("min_exclusive") or lo is None else "["
    right = ")" if meta.get("max_exclusive") or hi is None else "]"
    lo_s = "-inf" if lo is None else f"{lo:g}"
    hi_s = "inf" if hi is None else f"{hi:g}"
    return f" in {left}{lo_s}, {hi_s}{right}"


def _expected_type(tp, meta) -> str:
    if tp is tuple and meta.get("items") is float:
        return "a non-empty list of numbers"
    return _type_name(tp)


#: The largest integer a setting may hold: checkpoints and metrics store them as int64.
LARGEST_INTEGER = 2 ** 63 - 1
#: YAML 1.1 numbers that read as other than they look: a leading zero is octal
#: (010 is 8) and colons count in base 60 (1:30 is 90).
_MISREAD_NUMBER = re.compile(r"[-+]?(0[0-9_]+|[0-9][0-9_]*(:[0-5]?[0-9])+(\.[0-9_]*)?)")


def _unwrap(value):
    """(the value, the text it was written as, or None when not known)."""
    if isinstance(value, Written):
        return value.value, value.text
    return value, None


def _shown(value, depth: int = 0) -> str:
    """A value in an error message, as the user wrote it where that is known
    (``yes``, not True; ``2024-01-01``, not datetime.date(2024, 1, 1))."""
    if isinstance(value, Written):
        plain, text = value.value, value.text
        if not text:
            return "nothing (an empty value)"
        if isinstance(plain, bool) and text.lower() != str(plain).lower():
            return f"{text} (which YAML reads as {str(plain).lower()})"
        return cut(text)
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if isinstance(value, bytes):
        return "binary data"
    if isinstance(value, dict):
        if depth >= 2:          # (a mapping may hold itself through an alias)
            return "{...}"
        parts = [f"{_key_text(k)}: {_shown(v, depth + 1)}" for k, v in value.items()]
        return "{" + ", ".join(parts[:10]) + (", ..." if len(parts) > 10 else "") + "}"
    if isinstance(value, (list, tuple)):
        if depth >= 2:
            return "[...]"
        parts = [_shown(v, depth + 1) for v in value[:11]]
        return "[" + ", ".join(parts[:10]) + (", ..." if len(parts) > 10 else "") + "]"
    return shown(value)


def _key_text(key) -> str:
    """A mapping key as written (``1``, ``true``: keys YAML reads as other than text)."""
    if isinstance(key, Written):
        return cut(key.text)
    return cut(key) if isinstance(key, str) else _shown(key)


def _check_value(key: str, tp, meta, raw, where: str, *, limits: bool = True):
    """``raw`` as a value of type ``tp``; ConfigError naming ``key`` otherwise.
    ``limits``: its range too (a stored config is read without: see
    :func:`config_from_yaml`)."""
    if not limits:
        meta = {k: v for k, v in meta.items() if k not in ("min", "max")}
    value, text = _unwrap(raw)
    expected = _expected_type(tp, meta) + _range_text(meta)
    if meta.get("choices"):
        expected = "one of " + ", ".join(repr(c) for c in meta["choices"])
    bad = ConfigError(f"{where}{key}: expected {expected}, got {_shown(raw)}")
    if tp in (int, float) and text is not None and _MISREAD_NUMBER.fullmatch(text):
        raise ConfigError(f"{where}{key}: expected {expected}, got {cut(text)}, which YAML "
                          f"reads as {value} (a leading 0 is octal, colons count in base "
                          "60); write the number without them")
    if tp is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            # 256.0 is 256; a float beyond 2^53 is no longer an exact integer
            if isinstance(value, float) and value.is_integer() and abs(value) <= 2 ** 53:
                value = int(value)
            else:
                raise bad
        if abs(value) > LARGEST_INTEGER:
            raise ConfigError(f"{where}{key}: expected {expected}, got {_shown(raw)}, "
                              f"beyond the largest integer stored ({LARGEST_INTEGER})")
        value = int(value)
    elif tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        value = float(value)
        if not math.isfinite(value):
            raise bad
    elif tp is str:
        if text is not None and value is not None:
            # a path or a schedule as typed: YAML reads `0.3`, `2024`, `010`, `yes`
            # or `2024-01-01` as other things
            value = text
            bad = ConfigError(f"{where}{key}: expected {expected}, got {shown(value)}")
        elif isinstance(value, (int, float)) and not isinstance(value, bool) \
                and math.isfinite(value):
            value = str(value)
        if not isinstance(value, str):
            raise bad
        if "\0" in value:
            # a double-quoted "\0": no path or name holds one (the OS refuses it
            # later with "embedded null byte", naming nothing)
            raise ConfigError(f"{where}{key}: expected text without a NUL character "
                              f"(\\0), got {shown(value)}")
    elif tp is tuple:
        # a list of integers (or numbers); the field's range applies to each
        items = meta.get("items") or int
        kinds = (int, float) if items is float else (int,)
        if not isinstance(value, (list, tuple)):
            raise bad
        value = [_unwrap(v)[0] for v in value]
        if not value and items is float or any(
                isinstance(v, bool) or not isinstance(v, kinds) or not math.isfinite(v)
                or abs(v) > LARGEST_INTEGER for v in value):
            raise bad
        lo, hi = meta.get("min"), meta.get("max")
        if any((lo is not None and (v < lo or (meta.get("min_exclusive") and v == lo)))
               or (hi is not None and (v > hi or (meta.get("max_exclusive") and v == hi)))
               for v in value):
            raise bad
        return tuple(items(v) for v in value)
    if meta.get("choices") and value not in meta["choices"]:
        raise bad
    lo, hi = meta.get("min"), meta.get("max")
    if lo is not None and (value < lo or (meta.get("min_exclusive") and value == lo)):
        raise bad
    if hi is not None and (value > hi or (meta.get("max_exclusive") and value == hi)):
        raise bad
    return value


def from_dict(cls, data: Any, *, prefix: str = "", where: str = "", limits: bool = True):
    """Build dataclass ``cls`` from a mapping, validating every key (``limits``: its
    range too)."""
    if _unwrap(data)[0] is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}{prefix.rstrip('.') or 'config'}: expected a mapping, "
                          f"got {_shown(data)}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    # (keys YAML reads as numbers or booleans, `1:` or `yes:`, sort as written)
    unknown = sorted((key for key in data if key not in fields), key=_key_text)
    if unknown:
        raise ConfigError(f"{where}{prefix}{_key_text(unknown[0])}: unknown key; expected "
                          f"one of {', '.join(sorted(fields))}")
    kwargs = {}
    for name, f in fields.items():
        if name not in data:
            continue
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = from_dict(tp, data[name], prefix=f"{prefix}{name}.", where=where,
                                     limits=limits)
        else:
            kwargs[name] = _check_value(prefix + name, tp, f.metadata, data[name], where,
                                        limits=limits)
    return cls(**kwargs)


def _cross_checks(cfg: RunConfig, where: str) -> None:
    m = cfg.model
    if m.dropout_schedule:
        # (imported here: the network package is heavy, and most configs have none)
        from .nn.dropout import parse_dropout_schedule
        try:
            parse_dropout_schedule(m.dropout_schedule)
        except ValueError as exc:
            raise ConfigError(f"{where}model.dropout_schedule: {exc}") from None
    if m.nonlinearity == "pnorm":
        if m.pnorm_output_dim < 1 or m.hidden_dim % m.pnorm_output_dim:
            raise ConfigError(f"{where}model.pnorm_output_dim: expected a positive divisor of "
                              f"model.hidden_dim ({m.hidden_dim}), got {m.pnorm_output_dim}")
    par = cfg.parallel
    if cfg.optimizer.max_change_per_sample and par.method == "param_server":
        raise ConfigError(f"{where}optimizer.max_change_per_sample: not available with "
                          "parallel.method param_server (the server applies gradients "
                          "without the rows that bound them)")
    if cfg.optimizer.max_change_per_sample and (
            par.method == "allreduce" or (par.method == "adpsgd" and par.hierarchical)):
        # each rank's bound is its own minibatch's: ranks that share one gradient
        # would scale it differently and drift apart
        raise ConfigError(f"{where}optimizer.max_change_per_sample: not available where "
                          "ranks share an averaged gradient (parallel.method allreduce, "
                          "hierarchical adpsgd); nnet2's rule bounds each job's own step: "
                          "use model_averaging, kaldi, bmuf or adpsgd")
    if cfg.optimizer.final_learning_rate > cfg.optimizer.initial_learning_rate * 1e6:
        raise ConfigError(f"{where}optimizer.final_learning_rate: implausibly larger than "
                          "optimizer.initial_learning_rate")
    if m.init_from and m.nonlinearity != "sigmoid":
        raise ConfigError(f"{where}model.nonlinearity: model.init_from gives RBM (sigmoid) "
                          f"hidden layers; expected 'sigmoid', got {m.nonlinearity!r}")
    if m.init_from and m.normalize:
        raise ConfigError(f"{where}model.normalize: model.init_from gives RBM layers, each "
                          "pretrained on the sigmoid outputs of the one below; a normalize "
                          "layer between them would change their input; set it to false")
    if cfg.training.early_stop.patience and not cfg.data.dev:
        raise ConfigError(f"{where}training.early_stop.patience: early stopping watches "
                          "held-out results; set data.dev")
    par = cfg.parallel
    for key, is_set, method in ONE_METHOD_SETTINGS:
        value = getattr(par, key)
        if is_set(value) and par.method != method:
            shown = str(value).lower() if isinstance(value, bool) else value
            raise ConfigError(f"{where}parallel.{key}: {shown} works with parallel.method "
                              f"{method}, not {par.method}")
    if -1.0 < par.block_momentum < 0.0:
        # (bmuf.py takes any negative value as the default's -1: -0.5 ran at 1 - 1/N)
        raise ConfigError(f"{where}parallel.block_momentum: expected -1 (1 - 1/ranks) or a "
                          f"number in [0, 1), got {par.block_momentum}")
    if par.servers > m.hidden_layers + 1:
        # each server owns whole affine layers (parallel/param_server.py, split_by_layers)
        raise ConfigError(f"{where}parallel.servers: {par.servers} servers for a model of "
                          f"{m.hidden_layers + 1} affine layer(s) (model.hidden_layers + 1); "
                          "at most one server per layer")
    if takes_own_steps(cfg):
        _check_own_steps(cfg, where)
    if par.hierarchical and (par.asynchronous or par.delay_by_one):
        which = "asynchronous" if par.asynchronous else "delay_by_one"
        raise ConfigError(f"{where}parallel.{which}: hierarchical ADPSGD mixes lock-step "
                          f"without delay; set parallel.{which}: false")
    if cfg.precision == "tf32" and cfg.device == "cpu":
        raise ConfigError(f"{where}precision: tf32 needs device: gpu (the CPU computes in "
                          "fp32; bf16 is emulated there)")
    ng = cfg.optimizer.ngsgd
    # (optim/natural_gradient.py's SIMPLE_MIN_ALPHA: smaller ones leave the scatter
    # too close to singular even in float64)
    if cfg.optimizer.name == "ngsgd" and ng.variant == "simple" and not ng.alpha >= 1e-8:
        raise ConfigError(f"{where}optimizer.ngsgd.alpha: the simple variant needs alpha >= "
                          f"1e-08 (its smoothing is what makes the scatter invertible), got "
                          f"{ng.alpha}")
    opt = cfg.optimizer
    if opt.schedule == "search" and min(opt.search_factors) > 1:
        # the rate would rise at every chunk, and a roll back could not lower it
        raise ConfigError(f"{where}optimizer.search_factors: needs a factor of at most 1 "
                          f"(with only larger ones the rate rises at every chunk until the "
                          f"run diverges), got {list(opt.search_factors)}")
    if cfg.optimizer.schedule == "newbob" and not cfg.data.dev:
        raise ConfigError(f"{where}optimizer.schedule: newbob decides on held-out results; "
                          "set data.dev")
    _check_l2_shrink(cfg, where)


def largest_rate(opt: OptimizerConfig) -> tuple:
    """The largest learning rate the schedule sets and its key under ``optimizer``:
    the exponential one's larger end; adapt's gamma / sqrt(K) for a K above 1; the
    others start at the initial rate and only lower it (search tries multiples of it
    in short trials, below :func:`l2_rate_limit`, and goes on at one only where its
    trial did better); Kaldi's J jobs at J times the rate scale the L2 term by 1/J,
    and damped and rolled-back rates are lower.

    Example::

        largest_rate(cfg.optimizer)     # (0.004, 'initial_learning_rate')
    """
    if opt.schedule == "exponential" and opt.final_learning_rate > opt.initial_learning_rate:
        return opt.final_learning_rate, "final_learning_rate"
    if opt.schedule == "adapt" and opt.adapt_k > 1.0:
        # each parameter's rate is gamma / sqrt(K + G), at most gamma / sqrt(K) (a K
        # below 1 raises it only where the step is small: each is under gamma)
        return (opt.initial_learning_rate / math.sqrt(opt.adapt_k),
                "initial_learning_rate / sqrt(optimizer.adapt_k)")
    return opt.initial_learning_rate, "initial_learning_rate"


#: A shrink a step from which an L2 term wears the model down (towards chance, or
#: into divergence): Kaldi's values (1e-5 to 1e-3) take well under 1e-3 of the weights.
STRONG_L2_SHRINK = 0.1


def l2_shrink(cfg: RunConfig, key: str, rate: float | None = None) -> float:
    """The share of the weights ``optimizer.<key>`` (an L2 setting) takes off them a
    step at ``rate`` (default: the largest rate): 2 lr l2 B (optim/sgd.py)."""
    if rate is None:
        rate = largest_rate(cfg.optimizer)[0]
    return 2.0 * rate * getattr(cfg.optimizer, key) * cfg.training.minibatch


def l2_rate_limit(cfg: RunConfig) -> float:
    """The rate at which an L2 term alone takes all of the weights off them a step
    (inf without L2): search's trials, which multiply the rate, stay below it."""
    shrink = max(l2_shrink(cfg, key, 1.0) for key in ("l2_regularize",
                                                       "l2_regularize_output"))
    return 1.0 / shrink if shrink > 0 else math.inf


def _check_l2_shrink(cfg: RunConfig, where: str) -> None:
    """At a shrink of 1 or more a step the L2 term alone zeroes or flips the weights
    (max-change then only slows that)."""
    opt, minibatch = cfg.optimizer, cfg.training.minibatch
    rate, rate_key = largest_rate(opt)
    for key in ("l2_regularize", "l2_regularize_output"):
        l2 = getattr(opt, key)
        shrink = l2_shrink(cfg, key)
        if shrink >= 1.0:
            raise ConfigError(f"{where}optimizer.{key}: {l2:g} shrinks the weights by 2 x "
                              f"{rate:g} (optimizer.{rate_key}, the largest rate) x {l2:g} "
                              f"x {minibatch} (training.minibatch) = {shrink:.3g} of "
                              "themselves a step, "
                              f"which zeroes or flips them; expected below "
                              f"{_rounded_down(1.0 / (2.0 * rate * minibatch))} (Kaldi's values: 1e-5 "
                              "to 1e-3)")
        _check_block_shrink(cfg, key, shrink, where)


def _rounded_down(limit: float) -> str:
    """``limit`` to 3 significant digits, rounded down: a value below the shown one
    is below the limit too (rounded to nearest, it could be refused)."""
    if not math.isfinite(limit) or limit <= 0:
        return f"{limit:.3g}"
    unit = 10.0 ** (math.floor(math.log10(limit)) - 2)
    return f"{math.floor(limit / unit * (1 + 1e-12)) * unit:.3g}"


def _check_block_shrink(cfg: RunConfig, key: str, shrink: float, where: str) -> None:
    """BMUF's block step is block_lr times the change of the K local steps between
    syncs (parallel/bmuf.py), whose L2 part takes 1 - (1 - s)^K of the weights off
    them: past block_lr 1 that can reach all of them a block, which zeroes or flips
    them as a step's shrink of 1 would (the block step has no max-change; a run at
    block_lr 3 and a shrink of 0.05 a step, 8 steps a block, ended at chance)."""
    par = cfg.parallel
    if par.method != "bmuf" or par.block_lr <= 1.0 or shrink <= 0.0:
        return
    steps = cfg.sync_steps()
    block = par.block_lr * (1.0 - (1.0 - shrink) ** steps)
    if block >= 1.0:
        every = "average_every_frames" if par.average_every_frames else "average_every"
        l2 = getattr(cfg.optimizer, key)
        # the L2 at which the block's shrink is 1: (1 - s)^K = 1 - 1/block_lr
        below = l2 * (1.0 - (1.0 - 1.0 / par.block_lr) ** (1.0 / steps)) / shrink
        raise ConfigError(f"{where}optimizer.{key}: {l2:g} shrinks the weights by {shrink:.3g} "
                          f"of themselves a step, and BMUF's block step takes "
                          f"{par.block_lr:g} (parallel.block_lr) x (1 - (1 - {shrink:.3g})^"
                          f"{steps} (steps between syncs, parallel.{every})) = {block:.3g} "
                          "of them a block, which zeroes or flips them; expected below "
                          f"{_rounded_down(below)}, or a lower parallel.block_lr")


#: parallel.* settings that one method alone takes, refused with the others: (key,
#: whether it is set, the method).
ONE_METHOD_SETTINGS = (
    ("straggler_policy", lambda value: value != "none", "model_averaging"),
    ("servers", lambda value: value > 1, "param_server"),
    ("asynchronous", bool, "adpsgd"),
    ("hierarchical", bool, "adpsgd"),
)


def _check_own_steps(cfg: RunConfig, where: str) -> None:
    """What a method whose ranks take their own numbers of steps cannot do (the
    parameter server, asynchronous ADPSGD): anything that needs a common step."""
    par = cfg.parallel
    method = par.method + (" with parallel.asynchronous" if par.asynchronous else "")
    if par.asynchronous and par.delay_by_one:
        raise ConfigError(f"{where}parallel.delay_by_one: the delay-by-one ring is lock-step;"
                          " set parallel.asynchronous: false or delay_by_one: false")
    if cfg.optimizer.schedule in ("search", "newbob"):
        # (the parameter server's loop never searched nor ended a newbob epoch: the
        # rate stayed initial_learning_rate)
        raise ConfigError(f"{where}optimizer.schedule: {cfg.optimizer.schedule} needs every "
                          f"rank at the same step; not available with parallel.method "
                          f"{method}")
    if cfg.training.combine:
        raise ConfigError(f"{where}training.combine: not available with parallel.method "
                          f"{method} (its ranks take no common sync points)")
    if cfg.training.early_stop.patience:
        raise ConfigError(f"{where}training.early_stop.patience: not available with "
                          f"parallel.method {method} (rank 0 evaluates alone while the "
                          "others train on)")


def _names_text(key: str) -> bool:
    """Whether ``key`` (``section.name``) is a text setting of :class:`RunConfig`."""
    cls = RunConfig
    for part in key.split("."):
        if not dataclasses.is_dataclass(cls):
            return False
        hints = get_type_hints(cls)
        if part not in hints:
            return False
        cls = hints[part]
    return cls is str


def parse_overrides(overrides) -> dict:
    """Turn ``["optimizer.momentum=0.9", ...]`` into a nested mapping.

    Values are parsed as YAML scalars, so ``true``, ``3`` and ``1e-3`` get their
    natural types; a text setting (a path, a name) takes the text as typed,
    unless it is quoted.
    """
    nested: dict = {}
    # a single string was taken one character at a time ("--set t: expected KEY=VALUE")
    items = None if isinstance(overrides, (str, bytes, dict)) else list(overrides or ())
    if items is None or not all(isinstance(item, str) for item in items):
        raise TypeError(f"overrides: expected a list of 'KEY=VALUE' strings, e.g. "
                        f"['training.epochs=1'], got {overrides!r}")
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set {cut(item)}: expected KEY=VALUE, e.g. "
                              "optimizer.momentum=0.9")
        key, text = item.split("=", 1)
        if not all(part.strip() for part in key.split(".")):
            raise ConfigError(f"--set {cut(item)}: expected KEY=VALUE with a key such as "
                              "optimizer.momentum, got no key or an empty part of one")
        if _names_text(key.strip()) and text.strip()[:1] not in ("'", '"'):
            # a path or a name as typed: YAML would cut it at ' #' or refuse ': '
            value = text.strip()
        else:
            try:
                value = parse_yaml(text, where=f"--set {key}", as_written=True) \
                    if text.strip() else Written("", "")
            except ValueError:
                raise ConfigError(f"--set {cut(key)}: value {shown(text)} is not a YAML "
                                  "scalar") \
                    from None
        node = nested
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {cut(key)}: {cut(part)} is not a section")
        node[parts[-1]] = value
    return nested


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(path=None, overrides=()) -> RunConfig:
    """Read, merge ``--set`` overrides and validate a YAML run configuration.

    Example::

        cfg = load_config("jobs/configs/quickstart.yaml", ["training.epochs=1"])
        cfg.optimizer.name        # 'sgd'
    """
    data: Any = {}
    where = f"{path}: " if path else ""
    if path is not None:
        try:
            data = read_yaml(path, what="config file", as_written=True)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        data = {} if _unwrap(data)[0] is None else data
        if not isinstance(data, dict):
            plain = _unwrap(data)[0]
            kind = "a list" if isinstance(plain, list) else "text" if isinstance(
                plain, str) else f"the value {_shown(data)}"
            raise ConfigError(f"{path}: expected a mapping of sections (data, model, "
                              f"optimizer, ...) at the top level, got {kind}")
        if {"feat_dim", "num_classes", "shards"} <= set(data):
            # (said as an unknown key 'class_counts' of a run configuration)
            directory = os.path.dirname(os.fspath(path)) or "."
            raise ConfigError(f"{path}: a corpus manifest, not a run configuration; name "
                              f"its directory ({directory}) as data.train or data.dev in "
                              "a config (`mpitrain init` writes one)")
    data = _merge(data, parse_overrides(overrides))
    cfg = from_dict(RunConfig, data, where=where)
    _cross_checks(cfg, where)
    _check_paths(cfg, where)
    return cfg


#: The settings that name files or directories.
PATH_SETTINGS = ("data.train", "data.dev", "model.init_from")
#: A shell variable as written in a path: $NAME or ${NAME}.
_VARIABLE = re.compile(r"\$(\{|[A-Za-z_])")


#: The most characters of a path setting an error shows (more than a value: a real
#: path may be long, and it is what the user must find).
PATH_SHOWN = 240


def _check_paths(cfg: RunConfig, where: str) -> None:
    """Paths are taken as written: ``~`` and ``$VARIABLES`` left in a path (the shell
    expands neither inside a YAML file), and a path that the locale's encoding
    cannot spell (Japanese under a Latin-1 locale), are named here with their key,
    not as a file not found or by the codec where the path is first used."""
    for key in PATH_SETTINGS:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        try:
            os.fsencode(value)
        except UnicodeEncodeError:
            raise ConfigError(f"{where}{key}: {shown(value, limit=PATH_SHOWN)} cannot be a "
                              "file name in this "
                              f"locale's encoding ({sys.getfilesystemencoding()}); run "
                              "under a UTF-8 locale, e.g. LC_ALL=C.UTF-8") from None
        if _named_in_utf8_alone(value):
            # (a config written where names are UTF-8, run under a Latin-1 locale: the
            # same text names other bytes, and the corpus was "not found")
            raise ConfigError(f"{where}{key}: {cut(value, PATH_SHOWN)}: not found in this "
                              "locale's "
                              f"encoding ({sys.getfilesystemencoding()}), but its UTF-8 "
                              "spelling names a file; run under a UTF-8 locale, e.g. "
                              "LC_ALL=C.UTF-8")
        problem = unexpanded_home(value)
        if problem:
            raise ConfigError(f"{where}{key}: {problem}")
        if _VARIABLE.search(value) and not os.path.exists(value):
            raise ConfigError(f"{where}{key}: {cut(value, PATH_SHOWN)}: does not exist; "
                              "mpitrain does not "
                              "expand $VARIABLES in paths: write the path out (or give it "
                              f"with --set {key}=\"$VARIABLE/...\", which the shell expands)")


def _named_in_utf8_alone(path: str) -> bool:
    """Whether ``path`` (text) names nothing as this locale spells file names, but
    its UTF-8 bytes name something: the locale is not UTF-8, the names on disk are."""
    if not path or os.path.exists(path):
        return False
    try:
        utf8 = path.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return utf8 != os.fsencode(path) and os.path.exists(utf8)


def config_from_dict(data: dict) -> RunConfig:
    """Validate a mapping (e.g. the config stored in a checkpoint)."""
    cfg = from_dict(RunConfig, data)
    _cross_checks(cfg, "")
    return cfg


def dump_config(cfg: RunConfig, path) -> None:
    write_yaml(path, cfg.to_dict())


def config_to_yaml(cfg: RunConfig) -> str:
    return yaml_text(cfg.to_dict())


#: Settings added with a default that changes what an older run did, and the value
#: that gives the older behaviour: a checkpoint written before the setting existed
#: holds none, and its run is compared with the config as having had this one.
_BEFORE_ADDED = {("parallel", "damp_staleness"): False}


def config_from_yaml(text: str) -> RunConfig:
    """The configuration stored in a checkpoint: types checked, not ranges nor the
    settings' cross-checks, which a later version may have tightened (a run started
    with `training.epochs: 2e6` resumes, its settings compared with the config's)."""
    try:
        data = parse_yaml(text, where="stored config")
    except ValueError as exc:
        # (its readers say "the stored config:" before the reason)
        raise ValueError(str(exc).removeprefix("stored config: ")) from None
    if isinstance(data, dict):
        for (section, key), value in _BEFORE_ADDED.items():
            if isinstance(data.get(section), dict) and key not in data[section]:
                data[section][key] = value
    return from_dict(RunConfig, data, limits=False)


def reference_markdown() -> str:
    """A Markdown table of every config key, its default and meaning (for the docs)."""
    lines = ["| key | default | allowed | meaning |", "|---|---|---|---|"]

    def walk(cls, prefix):
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{f.name}.")
                continue
            meta = f.metadata
            allowed = ", ".join(meta["choices"]) if meta.get("choices") else \
                (_expected_type(tp, meta) + _range_text(meta)).replace("an integer", "integer") \
                .replace("a number", "number").replace("a string", "string")
            default = list(f.default) if isinstance(f.default, tuple) else \
                f.default if f.default != "" else '""'
            lines.append(f"| `{prefix}{f.name}` | `{default}` | {allowed} | {meta.get('help', '')} |")

    walk(RunConfig, "")
    return "\n".join(lines)
