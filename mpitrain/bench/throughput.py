"""Single-rank training throughput: mpitrain against PyTorch and the GEMM bound.

On the CPU (``--device cpu``, the default) or on one GPU (``--device gpu``:
CuPy for mpitrain, PyTorch on CUDA, cuBLAS for the bound, each in the
precision of ``--precision``).

For each model and BLAS thread count, three contenders run in interleaved
rounds within one process (mpitrain, PyTorch, bare GEMMs; the order flips
every round), so that load from other processes on a shared machine hits all
three alike.  Rounds are short (a fraction of a second per contender) and
many; rates are medians over rounds and ratios medians of per-round ratios.
At one thread, rates from the thread's CPU time are kept too: a process that
is preempted does not accrue them.

- mpitrain: the trainer's own step (``TrainingStep`` through
  :class:`~mpitrain.bench.steps.TrainerSteps`) on the objects the trainer
  builds (``build_network``, ``build_optimizer``, ``build_strategy`` with a
  one-rank communicator, the exponential schedule): minibatch indices from a
  shuffled chunk, splicing from unspliced frames, ``forward_backward``, SGD
  with max-change.
- PyTorch: ``nn.Sequential`` of ``Linear`` + ``ReLU``, ``CrossEntropyLoss``
  (summed), ``torch.optim.SGD``, fp32.  Its input is pre-spliced: minibatches
  are contiguous slices of a spliced copy of the chunk (no gather), which
  favours PyTorch.
- GEMM bound: the model's GEMMs at its minibatch size (forward, weight
  gradient for every layer, data gradient for all but the first) run back to
  back with numpy's BLAS; frames/s can be no higher than that GEMM FLOP/s over
  the model FLOPs per frame.  On the GPU they go through ``backend.gemm`` in
  the chosen precision, so with bf16 each includes the conversion of its two
  operands to bf16, as every bf16 product of mpitrain does.

Usage::

    python -m mpitrain.bench.throughput --threads 1,2 --models small,large --json out.json
    python -m mpitrain.bench.throughput --device gpu --models quick,small,large --precision fp32,tf32

Example::

    rows = run(parse_args(["--models", "small", "--threads", "1", "--rounds", "3"]))
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Optional, Sequence

import numpy as np

from mpitrain.files import atomic_open, check_json_option
from mpitrain.data.splice import splice, splice_indices
from mpitrain.words import DefaultsFormatter

from . import machine
from .models import THROUGHPUT_MODELS as MODELS
from .models import ModelSpec, synthetic_chunk, torch_network
# the mpitrain contender is the trainer's step, as every benchmark runs it
from .steps import TrainerSteps as MpitrainSteps

METHODS = ("mpitrain", "torch", "gemm")
SWITCH_PAUSE = 0.2   # seconds between contenders when BLAS runs several threads


# -- FLOP accounting ---------------------------------------------------------------
def layer_gemms(dims: Sequence[int], batch: int) -> list:
    """The (m, k, n) shape of every GEMM of one training step, in execution order.

    Forward ``x (B, in) @ W^T`` per layer, then backward from the last layer:
    data gradient ``dy (B, out) @ W`` (skipped for the first layer, whose input
    needs no gradient) and weight gradient ``dy^T (out, B) @ x``.

    Example::

        layer_gemms([4, 3, 2], 5)
        # [(5, 4, 3), (5, 3, 2), (5, 2, 3), (2, 5, 3), (3, 5, 4)]
    """
    if len(dims) < 2 or min(dims) < 1 or batch < 1:
        raise ValueError(f"need >= 2 positive layer dims and batch >= 1, got {list(dims)}, "
                         f"batch {batch}")
    pairs = list(zip(dims[:-1], dims[1:]))
    gemms = [(batch, i, o) for i, o in pairs]
    for layer in range(len(pairs) - 1, -1, -1):
        i, o = pairs[layer]
        if layer > 0:
            gemms.append((batch, o, i))
        gemms.append((o, batch, i))
    return gemms


def gemm_flops(gemms) -> int:
    """2 m k n summed over (m, k, n) shapes."""
    return sum(2 * m * k * n for m, k, n in gemms)


def flops_per_frame(dims: Sequence[int]) -> int:
    """Model FLOPs per training frame: 2 sum(in*out) forward, the same for the
    weight gradients, and the data gradients of all layers but the first.

    Example::

        flops_per_frame([440, 1024, 1024, 1024, 1024, 2000])   # 32_964_608, ~33 MFLOP
    """
    return gemm_flops(layer_gemms(dims, 1))


# -- results -----------------------------------------------------------------------
def summarize(model: ModelSpec, threads: int, rates: dict, *, cpu_rates: Optional[dict] = None,
              precision: str = "fp32") -> dict:
    """One result row from per-round measurements.

    ``rates`` maps ``"mpitrain"`` and ``"torch"`` to per-round frames/s and
    ``"gemm"`` to per-round FLOP/s, all from wall-clock time; ``"torch"`` may be
    missing (PyTorch not installed).  Rates are medians over rounds; ratios are
    medians of the per-round ratios, so a round slowed by foreign load for all
    three contenders cancels out.  ``cpu_rates`` (same layout, from the thread's
    CPU time, meaningful at one thread) adds ``cpu_*`` ratios.

    Example::

        summarize(MODELS["small"], 1, {"mpitrain": [2500.0], "torch": [2000.0],
                                       "gemm": [9e10]})["mpitrain_vs_torch"]   # 1.25
    """
    fpf = flops_per_frame(model.layer_dims)
    ours, gemm = rates["mpitrain"], rates["gemm"]
    theirs = rates.get("torch") or None
    if len(gemm) != len(ours) or (theirs and len(theirs) != len(ours)):
        raise ValueError("every contender needs one rate per round")
    med = statistics.median
    row = {
        "model": model.name, "layers": model.describe(), "threads": threads,
        "precision": precision,
        "mflop_per_frame": fpf / 1e6,
        "mpitrain_fps": med(ours), "torch_fps": med(theirs) if theirs else None,
        "mpitrain_vs_torch": med(o / t for o, t in zip(ours, theirs)) if theirs else None,
        "gemm_gflops": med(gemm) / 1e9, "gemm_bound_fps": med(gemm) / fpf,
        "fraction_of_bound": med(o * fpf / g for o, g in zip(ours, gemm)),
        # PyTorch's own share of the bound caps what mpitrain/torch can reach
        "torch_fraction_of_bound": med(t * fpf / g for t, g in zip(theirs, gemm))
        if theirs else None,
        "rounds": len(ours),
        "per_round": {k: list(v) for k, v in rates.items()},
    }
    if cpu_rates:
        c_ours, c_theirs, c_gemm = (cpu_rates["mpitrain"], cpu_rates.get("torch"),
                                    cpu_rates["gemm"])
        row["cpu_mpitrain_fps"] = med(c_ours)
        row["cpu_torch_fps"] = med(c_theirs) if c_theirs else None
        row["cpu_gemm_bound_fps"] = med(c_gemm) / fpf
        row["cpu_mpitrain_vs_torch"] = med(o / t for o, t in zip(c_ours, c_theirs)) \
            if c_theirs else None
        row["cpu_fraction_of_bound"] = med(o * fpf / g for o, g in zip(c_ours, c_gemm))
        row["cpu_torch_fraction_of_bound"] = med(t * fpf / g for t, g in zip(c_theirs, c_gemm)) \
            if c_theirs else None
        row["cpu_per_round"] = {k: list(v) for k, v in cpu_rates.items()}
    return row


TABLE_COLUMNS = (
    ("model", "model", "{}"), ("threads", "threads", "{}"), ("precision", "precision", "{}"),
    ("mpitrain fr/s", "mpitrain_fps", "{:,.0f}"), ("torch fr/s", "torch_fps", "{:,.0f}"),
    ("mpitrain/torch", "mpitrain_vs_torch", "{:.2f}"),
    ("GEMM GFLOP/s", "gemm_gflops", "{:.1f}"), ("GEMM bound fr/s", "gemm_bound_fps", "{:,.0f}"),
    ("of bound", "fraction_of_bound", "{:.2f}"),
    ("torch of bound", "torch_fraction_of_bound", "{:.2f}"),
)


def format_table(rows: Sequence[dict], *, markdown: bool = False) -> str:
    """Rows from :func:`summarize` as an aligned text (or Markdown) table.

    A missing value (PyTorch not installed) prints as ``-``.

    Example::

        print(format_table(rows, markdown=True))
    """
    header = [title for title, _, _ in TABLE_COLUMNS]
    body = [[("-" if row.get(key) is None else fmt.format(row[key]))
             for _, key, fmt in TABLE_COLUMNS] for row in rows]
    if markdown:
        lines = ["| " + " | ".join(header) + " |",
                 "|" + "|".join("---" if i < 3 else "---:" for i in range(len(header))) + "|"]
        lines += ["| " + " | ".join(cells) + " |" for cells in body]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h)
              for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(cells, widths)) for cells in body]
    return "\n".join(lines)


# -- the contenders ----------------------------------------------------------------
def step_pieces(stepper: MpitrainSteps, clock=time.perf_counter) -> dict:
    """One step of ``stepper`` taken piece by piece as ``TrainingStep`` takes it
    (eagerly), returning seconds spent in each piece (waiting for the GPU at
    each boundary when there is one).

    Example::

        step_pieces(MpitrainSteps(model, chunk, order))["forward"]
    """
    from mpitrain import backend
    from mpitrain.data.splice import splice_batch_

    def now():
        backend.synchronize(stepper.xp)
        return clock()

    ts = stepper.training_step
    net, strategy, optimizer = stepper.net, stepper.strategy, stepper.optimizer
    t0 = now()
    chunk, idx = stepper.next_batch()
    splice_batch_(chunk.feats, idx, chunk.utt_start, chunk.utt_end, ts.left, ts.right,
                  out=ts.inputs, ctx=ts.ctx)
    labels = chunk.labels[idx]
    t1 = now()
    logits = net.forward(ts.inputs)
    t2 = now()
    net.loss.forward(logits, labels, into=ts.sums)
    dlogits = net.loss.backward()
    t3 = now()
    net.backward(dlogits)
    t4 = now()
    strategy.reduce_gradients(net)
    optimizer.step(stepper.learning_rate())
    stepper.step_count += 1
    strategy.after_update(net, optimizer, stepper.step_count)
    t5 = now()
    return {"splice": t1 - t0, "forward": t2 - t1, "softmax_xent": t3 - t2,
            "backward": t4 - t3, "optimizer": t5 - t4}


class TorchSteps:
    """The same model and step in PyTorch, on pre-spliced contiguous minibatches.

    ``precision``: 'fp32' (TF32 off), 'tf32' (TF32 matmuls) or 'bf16' (autocast
    to bfloat16, fp32 weights), on ``device`` ('cpu' or 'cuda').
    """

    def __init__(self, model: ModelSpec, chunk, perm, *, seed: int = 1, device: str = "cpu",
                 precision: str = "fp32"):
        import torch

        torch.manual_seed(seed)
        self.torch, self.model, self.device, self.precision = torch, model, device, precision
        self.net = torch_network(model).to(device)
        self.loss_fn = torch.nn.CrossEntropyLoss(reduction="sum")
        self.optimizer = torch.optim.SGD(self.net.parameters(), lr=0.002)
        # Splice the chunk once in shuffled order; a minibatch is then a free view.
        b = model.minibatch
        self.batches = min(len(perm) // b, 64)
        order = perm[:self.batches * b]
        idx = splice_indices(order, chunk.utt_start[order], chunk.utt_end[order],
                             model.left_context, model.right_context)
        self.x = torch.from_numpy(np.ascontiguousarray(splice(chunk.feats, idx))).to(device)
        self.y = torch.from_numpy(chunk.labels[order].astype(np.int64)).to(device)
        self.step_count = 0

    def step(self) -> None:
        torch = self.torch
        if self.device == "cuda":
            # set for each step: the rounds interleave contenders of different precision
            _torch_tf32(torch, self.precision == "tf32")
        b = self.model.minibatch
        pos = self.step_count % self.batches
        x, y = self.x[pos * b:(pos + 1) * b], self.y[pos * b:(pos + 1) * b]
        self.optimizer.zero_grad()  # set_to_none: the cheaper default
        if self.precision == "bf16":
            with torch.autocast(device_type=self.device, dtype=torch.bfloat16):
                loss = self.loss_fn(self.net(x), y)
        else:
            loss = self.loss_fn(self.net(x), y)
        loss.backward()
        self.optimizer.step()
        self.step_count += 1

    def synchronize(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()


def _torch_tf32(torch, enabled: bool) -> None:
    """TF32 matmuls on or off, through whichever switch this PyTorch honours."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):      # PyTorch >= 2.9
        matmul.fp32_precision = "tf32" if enabled else "ieee"
    else:
        matmul.allow_tf32 = enabled


class GemmSteps:
    """The model's GEMMs at its minibatch, back to back: the bound on frames/s.

    Operands have the layouts a layer sees: ``x @ W.T`` forward, ``dy @ W``
    and ``dy.T @ x`` backward, with ``W`` a C-contiguous (out, in) matrix.  On
    the host numpy's BLAS runs them; on a GPU cuBLAS through
    :func:`mpitrain.backend.gemm`, in the configured precision.
    """

    def __init__(self, model: ModelSpec, *, seed: int = 2, xp=np):
        rng = np.random.default_rng(seed)
        b = model.minibatch
        dims = model.layer_dims
        self.flops = gemm_flops(layer_gemms(dims, b))
        self.xp = xp

        def rand(*shape):
            return xp.asarray(rng.standard_normal(shape, dtype=np.float32))

        self.ops = []
        pairs = list(zip(dims[:-1], dims[1:]))
        acts = [rand(b, d) for d in dims]
        weights = [rand(o, i) for i, o in pairs]
        for layer, w in enumerate(weights):
            self.ops.append((acts[layer], w.T, acts[layer + 1]))
        for layer in range(len(pairs) - 1, -1, -1):
            i, o = pairs[layer]
            dy = rand(b, o)
            if layer > 0:
                self.ops.append((dy, weights[layer], rand(b, i)))
            self.ops.append((dy.T, acts[layer], rand(o, i)))

        self.graph = None

    def _launch_all(self) -> None:
        from mpitrain import backend
        for a, b, out in self.ops:
            # hand cuBLAS the stored matrices with transpose flags, as the layers do
            trans_a, trans_b = not a.flags.c_contiguous, not b.flags.c_contiguous
            backend.gemm(a.T if trans_a else a, b.T if trans_b else b, out,
                         trans_a=trans_a, trans_b=trans_b)

    def step(self) -> None:
        if self.xp is np:
            for a, b, out in self.ops:
                np.matmul(a, b, out=out)
            return
        from mpitrain import backend
        if self.graph is None and backend.fused_kernels(self.xp):
            # The bound is the GPU's time for these GEMMs: replayed from a CUDA
            # graph, so that launching them from Python does not set it.
            previous = self.xp.cuda.get_current_stream()
            # (waits for the stream the operands were uploaded on)
            self.stream = backend.use_own_stream(self.xp)
            try:
                self._launch_all()                 # cuBLAS picks and loads its kernels
                self.graph, _ = backend.capture_graph(self.xp, self._launch_all)
            finally:
                previous.use()                     # the other contenders' stream
            self.graph = self.graph or False       # False: eager launches after all
        if self.graph:
            self.graph.launch(self.stream)
        else:
            self._launch_all()


# -- running -----------------------------------------------------------------------
def _time_round(stepper, steps: int, *, pause: float = 0.0, sync=None) -> tuple:
    """(wall seconds, this thread's CPU seconds) for ``steps`` steps.

    ``sync`` waits for the GPU before the clock starts and before it stops.
    """
    if pause:
        # The other library's idle workers spin for a while before they sleep;
        # on few cores they would steal this round's time.
        time.sleep(pause)
    if sync:
        sync()
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(steps):
        stepper.step()
    if sync:
        sync()
    return time.perf_counter() - wall, time.thread_time() - cpu


TORCH_MISSING = ("PyTorch is not installed, so only mpitrain and the GEMM bound are measured. "
                 "Install it with `pip install torch` (CPU wheel: "
                 "`pip install torch --index-url https://download.pytorch.org/whl/cpu`).")


def measure(model: ModelSpec, threads: int, *, steps: int, rounds: int, warmup: int,
            frames: int, use_torch: bool = True, breakdown: bool = False,
            log=None, device: str = "cpu", precision: str = "fp32",
            cuda_graph: bool = False) -> dict:
    """Interleaved rounds for one model at one thread count (or on the GPU);
    returns a result row.

    At one thread the BLAS of both libraries runs in the calling thread, so
    rates from its CPU time (which a preempted process does not accrue) are
    kept as well.  On the GPU every round starts and ends with the GPU idle.
    """
    from threadpoolctl import threadpool_limits
    from mpitrain import backend

    xp = backend.select(device)
    backend.set_precision(xp, precision)
    torch = machine.import_torch() if use_torch else None
    if torch is not None and device == "gpu" and not torch.cuda.is_available():
        torch = None
    chunk, perm = synthetic_chunk(model, frames)
    steppers = {"mpitrain": MpitrainSteps(model, chunk, perm, xp=xp, cuda_graph=cuda_graph),
                "gemm": GemmSteps(model, xp=xp)}
    if torch is not None:
        steppers["torch"] = TorchSteps(model, chunk, perm, precision=precision,
                                       device="cuda" if device == "gpu" else "cpu")
    sync = None
    if device == "gpu":
        def sync():
            backend.synchronize_device(xp)     # every stream: the contenders use their own
    order = [m for m in METHODS if m in steppers]
    rates = {m: [] for m in order}
    cpu_rates = {m: [] for m in order}
    pieces = None
    if torch is not None:
        torch_threads = torch.get_num_threads()
    with threadpool_limits(limits=threads):
        if torch is not None:
            torch.set_num_threads(threads)
        try:
            for stepper in steppers.values():
                for _ in range(warmup):
                    stepper.step()
            for r in range(rounds):
                for method in (order if r % 2 == 0 else order[::-1]):
                    wall, cpu = _time_round(
                        steppers[method], steps, sync=sync,
                        pause=SWITCH_PAUSE if threads > 1 and device == "cpu" else 0.0)
                    work = steps * (steppers["gemm"].flops if method == "gemm"
                                    else model.minibatch)
                    rates[method].append(work / wall)
                    cpu_rates[method].append(work / max(cpu, 1e-9))
                if log:
                    log(f"  {model.name} {_where(device, threads)} {precision} round "
                        f"{r + 1}/{rounds}: " + ", ".join(
                            f"{m} {rates[m][-1] / (1e9 if m == 'gemm' else 1):,.1f}"
                            f"{' GFLOP/s' if m == 'gemm' else ' fr/s'}" for m in order))
            if breakdown:
                clock = time.thread_time if threads == 1 and device == "cpu" \
                    else time.perf_counter
                pieces = _time_pieces(steppers["mpitrain"], steps * rounds, clock)
        finally:
            if torch is not None:
                torch.set_num_threads(torch_threads)
            backend.set_precision(xp, "fp32")
    one_thread = threads == 1 and device == "cpu"
    row = summarize(model, threads, rates, cpu_rates=cpu_rates if one_thread else None,
                    precision=precision)
    row["device"] = backend.device_name(xp)
    graph = steppers["mpitrain"].training_step.graph
    if graph is not None:
        row["cuda_graph"] = {"replays": graph.replays, "off_because": graph.why_not}
    if pieces is not None:
        # at one thread both are CPU time, so preemption shows in neither
        gemm_rate = statistics.median(cpu_rates["gemm"]) if one_thread \
            else row["gemm_gflops"] * 1e9
        row["mpitrain_pieces_ms"] = pieces
        row["gemm_ms_per_step"] = 1e3 * steppers["gemm"].flops / gemm_rate
    return row


def _where(device: str, threads: int) -> str:
    return "gpu" if device == "gpu" else f"threads={threads}"


def _time_pieces(stepper: MpitrainSteps, steps: int, clock) -> dict:
    samples = [step_pieces(stepper, clock) for _ in range(max(steps, 1))]
    return {k: 1e3 * statistics.median(s[k] for s in samples) for k in samples[0]}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mpitrain.bench.throughput", formatter_class=DefaultsFormatter,
        description="single-rank training frames/s: mpitrain vs PyTorch vs the GEMM bound")
    parser.add_argument("--threads", default="1,2", help="BLAS thread counts, comma-separated")
    parser.add_argument("--models", default="small,large",
                        help=f"comma-separated, from {', '.join(MODELS)}")
    parser.add_argument("--steps", type=int, default=0,
                        help="timed steps per round and contender; 0: the model's default "
                             + ", ".join(f"{m.name} {m.default_steps}" for m in MODELS.values()))
    parser.add_argument("--rounds", type=int, default=11,
                        help="interleaved rounds (short rounds, many of them: each round's "
                             "contenders then see the same foreign load)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before the rounds")
    parser.add_argument("--frames", type=int, default=50_000, help="frames in the synthetic chunk")
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch contender")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time the pieces of the mpitrain step (median ms)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "gpu"),
                        help="gpu: CuPy for mpitrain and cuBLAS for the bound, PyTorch on CUDA "
                             "(thread counts do not apply)")
    parser.add_argument("--precision", default="fp32",
                        help="comma-separated from fp32, tf32, bf16 (GPU): the precision of "
                             "mpitrain's, PyTorch's and the bound's matrix products")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="GPU: mpitrain replays its steps from a captured CUDA graph")
    parser.add_argument("--minibatch", type=int, default=0,
                        help="override the models' minibatch size; 0: the model's own")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_json_option(parser, args.json)
    args.precision = [p.strip() for p in args.precision.split(",") if p.strip()]
    if not args.precision or any(p not in ("fp32", "tf32", "bf16") for p in args.precision):
        parser.error(f"--precision: expected some of fp32, tf32, bf16, got {args.precision}")
    if args.device == "cpu" and args.precision != ["fp32"]:
        parser.error("--precision: tf32 and bf16 need --device gpu")
    if args.cuda_graph and args.device != "gpu":
        parser.error("--cuda-graph needs --device gpu")
    if args.device == "gpu":
        args.threads = "1"   # the host only launches work (and BLAS only tiny matrices)
    if args.minibatch < 0:
        parser.error("--minibatch must be >= 0")
    try:
        args.threads = [int(t) for t in args.threads.split(",") if t.strip()]
    except ValueError:
        parser.error(f"--threads: expected comma-separated integers, got {args.threads!r}")
    if not args.threads or min(args.threads) < 1:
        parser.error("--threads: expected positive thread counts")
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown or not args.models:
        parser.error(f"--models: unknown model {unknown[0] if unknown else '(none)'!r}; "
                     f"expected some of {', '.join(MODELS)}")
    if args.steps < 0 or args.rounds < 1 or args.warmup < 0:
        parser.error("--steps must be >= 0, --rounds >= 1 and --warmup >= 0")
    biggest = args.minibatch or max(MODELS[m].minibatch for m in args.models)
    if args.frames < biggest:
        parser.error(f"--frames: expected at least one minibatch ({biggest}), got {args.frames}")
    return args


def run(args: argparse.Namespace, *, log=None) -> list:
    """Measure every model at every thread count; returns the result rows."""
    import dataclasses
    rows = []
    device = getattr(args, "device", "cpu")
    for name in args.models:
        model = MODELS[name]
        if getattr(args, "minibatch", 0):
            model = dataclasses.replace(model, minibatch=args.minibatch)
        steps = args.steps or (model.default_steps * (20 if device == "gpu" else 1))
        for threads in args.threads:
            for precision in getattr(args, "precision", ["fp32"]):
                rows.append(measure(model, threads, steps=steps, rounds=args.rounds,
                                    warmup=args.warmup, frames=args.frames,
                                    use_torch=not args.no_torch, breakdown=args.breakdown,
                                    log=log, device=device, precision=precision,
                                    cuda_graph=getattr(args, "cuda_graph", False)))
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    problem = machine.device_problem(args.device)
    if problem:                           # no CuPy or no GPU: say so, no traceback
        print(f"python -m mpitrain.bench.throughput: error: {problem}", file=sys.stderr)
        return 2
    info = machine.machine_info(args.device)
    if info["torch"] is None and not args.no_torch:
        print(TORCH_MISSING, file=sys.stderr)
    blas = info["numpy_blas"] or {}
    print(f"# {info['cpu']}, {info['cores']} cores; numpy {info['numpy']} with "
          f"{blas.get('internal_api')} {blas.get('version')}; torch {info['torch']}")
    if args.device == "gpu":
        print(f"# GPU {info.get('gpu')}, driver {info.get('driver')}, CUDA runtime "
              f"{info.get('cuda_runtime')}, CuPy {info.get('cupy')}")
    print("# PyTorch input: pre-spliced contiguous minibatches (no gather)")

    def log(line):
        print(line, file=sys.stderr, flush=True)

    from mpitrain import backend
    try:
        rows = run(args, log=log)
    except backend.UnsupportedSetting as exc:      # (bf16 or tf32 on a GPU without it)
        print(f"python -m mpitrain.bench.throughput: error: --precision: {exc}",
              file=sys.stderr)
        return 2
    print(format_table(rows))
    for row in rows:
        graph = row.get("cuda_graph")
        if graph is not None and not graph["replays"]:
            # asked for and off (a capture that failed, an old cuBLAS): eager figures
            print(f"# {row['model']} {row['precision']}: CUDA graphs not used: "
                  f"{graph['off_because'] or 'no step was replayed'}")
    for row in rows:
        if row.get("cpu_fraction_of_bound") is not None:
            print(f"# {row['model']} threads=1 on thread CPU time: mpitrain "
                  f"{row['cpu_mpitrain_fps']:,.0f} fr/s ({row['cpu_fraction_of_bound']:.2f} of "
                  f"the bound {row['cpu_gemm_bound_fps']:,.0f})"
                  + ("" if row["cpu_torch_fps"] is None else
                     f", torch {row['cpu_torch_fps']:,.0f} fr/s "
                     f"({row['cpu_torch_fraction_of_bound']:.2f}), mpitrain/torch "
                     f"{row['cpu_mpitrain_vs_torch']:.2f}"))
    for row in rows:
        if "mpitrain_pieces_ms" in row:
            parts = ", ".join(f"{k} {v:.1f}" for k, v in row["mpitrain_pieces_ms"].items())
            print(f"# {row['model']} threads={row['threads']} mpitrain step (ms): {parts}; "
                  f"GEMMs alone {row['gemm_ms_per_step']:.1f}")
    if args.json:
        with atomic_open(args.json) as f:
            json.dump({"machine": info, "args": {k: v for k, v in vars(args).items()},
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
