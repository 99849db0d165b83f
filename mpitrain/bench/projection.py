"""Speedup beyond the machine: a stated network model applied to measured figures.

Everything here is a pure function of numbers, so the projection can be checked
by hand.  The model, for N ranks training a model of ``nbytes`` bytes:

- one step of B frames on one rank costs ``compute_seconds`` (measured on one
  rank, where nothing is communicated);
- a strategy exchanges the whole buffer with one ring allreduce every
  ``sync_every`` steps (model averaging and BMUF: the parameters every K steps;
  gradient allreduce: the gradients every step), costing

      2 (N - 1) / N * nbytes / bandwidth + 2 (N - 1) * latency

  seconds, or (ADPSGD, ``exchange="pairwise"``) sends it to one partner and
  receives the partner's, ``latency + nbytes / bandwidth`` whatever N, or
  (hierarchical ADPSGD, ``exchange="hierarchical"``) allreduces the gradients
  over the R ranks of a node, swaps the model between two nodes' first ranks
  (when there are two nodes or more) and broadcasts it on the node, every
  step; no overlap of computing and communicating and no straggler;
- throughput speedup at N = N * compute / (compute + allreduce / sync_every),
  times the share of the N ranks that train on average (1 but for a Kaldi
  job ramp: the mean of its J_i over N, :func:`active_ranks_of`);
- frames needed to reach the target grow as N ** b, with b fitted by least
  squares on log-log axes to the measured sizes and clipped at 0 (more ranks
  are never assumed to need fewer frames);
- time-to-target speedup at N = throughput speedup / N ** b.

:func:`project_method` applies the model to one method's figures as
``mpitrain bench`` measured them.

Example::

    net = NetworkModel(latency_s=5e-6, bandwidth_bytes_per_s=12.5e9)
    throughput_speedup(16, compute_seconds=0.01, nbytes=4e6, sync_every=8, network=net)
"""

from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence

# The one network model, shared with the virtual cluster's clock; re-exported here.
from ..comm.netmodel import NetworkModel, ring_allreduce_seconds  # noqa: F401


#: How each method's ranks exchange the buffer (the rest: one allreduce per sync).
PAIRWISE_METHODS = ("adpsgd",)
EXCHANGES = ("allreduce", "pairwise", "hierarchical")


def exchange_kind(method: str, parallel: dict) -> tuple:
    """(exchange, ranks per node) of ``method`` run with the ``parallel`` settings (a
    dict of the config's section): hierarchical ADPSGD's node allreduce, swap and
    broadcast; ADPSGD's pairwise swap; else one allreduce.

    Example::

        exchange_kind("adpsgd", {"hierarchical": True, "ranks_per_node": 4})
        # ("hierarchical", 4)
    """
    if method not in PAIRWISE_METHODS:
        return "allreduce", 0
    if parallel.get("hierarchical"):
        return "hierarchical", int(parallel.get("ranks_per_node") or 0)
    return "pairwise", 0


def active_ranks_of(method: str, parallel: dict):
    """ranks -> the mean number of ranks that train a step, for ``method`` with the
    ``parallel`` settings (a dict of the config's section); None when all do.  A Kaldi
    job ramp from ``num_jobs_initial`` to ``num_jobs_final`` (each capped at the
    ranks, 0: all) trains the mean of its J_i (over a long run's iterations).

    Example::

        active_ranks_of("kaldi", {"num_jobs_initial": 4, "num_jobs_final": 0,
                                  "jobs_step": 1})(16)      # about 10
    """
    initial, final = int(parallel.get("num_jobs_initial") or 0), \
        int(parallel.get("num_jobs_final") or 0)
    if method != "kaldi" or (not initial and not final):
        return None
    from ..parallel.kaldi_averaging import jobs_schedule
    step = int(parallel.get("jobs_step") or 1)

    def active(ranks: int) -> float:
        last = min(final or ranks, ranks)
        first = min(initial or last, ranks)
        jobs = jobs_schedule(1000, first, last, step)
        return sum(jobs) / len(jobs)
    return active


def exchange_seconds(ranks: int, nbytes: float, network: NetworkModel,
                     exchange: str = "allreduce", ranks_per_node: int = 0) -> float:
    """One exchange of the buffer among ``ranks`` ranks: a ring allreduce, a
    pairwise swap with one partner (both directions at once), or hierarchical
    ADPSGD's step (gradient allreduce over a node of ``ranks_per_node`` ranks,
    a swap between two nodes, the model broadcast on the node).

    Example::

        exchange_seconds(16, 4e6, NetworkModel(), "pairwise")   # one p2p message's time
        exchange_seconds(16, 4e6, NetworkModel(), "hierarchical", ranks_per_node=4)
    """
    if exchange == "pairwise":
        return network.p2p_seconds(nbytes) if ranks > 1 else 0.0
    if exchange == "hierarchical":
        if ranks_per_node < 1:
            raise ValueError("parallel.ranks_per_node: the hierarchical exchange's cost "
                             f"needs the ranks per node (>= 1), got {ranks_per_node}")
        node = min(ranks_per_node, ranks)
        swap = network.p2p_seconds(nbytes) if ranks > ranks_per_node else 0.0
        return network.allreduce_seconds(nbytes, node) + swap \
            + network.bcast_seconds(nbytes, node)
    if exchange != "allreduce":
        raise ValueError(f"exchange must be one of {', '.join(EXCHANGES)}, got {exchange!r}")
    return network.allreduce_seconds(nbytes, ranks)


def step_seconds(ranks: int, *, compute_seconds: float, nbytes: float, sync_every: int,
                 network: NetworkModel, exchange: str = "allreduce",
                 ranks_per_node: int = 0) -> float:
    """Projected wall time of one step: compute plus the exchange's share.

    Example::

        step_seconds(8, compute_seconds=0.01, nbytes=4e6, sync_every=1, network=NetworkModel())
    """
    if sync_every < 1:
        raise ValueError(f"sync_every must be >= 1, got {sync_every}")
    return compute_seconds + exchange_seconds(ranks, nbytes, network, exchange,
                                              ranks_per_node) / sync_every


def throughput_speedup(ranks: int, *, compute_seconds: float, nbytes: float, sync_every: int,
                       network: NetworkModel, exchange: str = "allreduce",
                       ranks_per_node: int = 0) -> float:
    """Frames per second on ``ranks`` ranks over frames per second on one.

    Example::

        throughput_speedup(16, compute_seconds=0.01, nbytes=4e6, sync_every=8,
                           network=NetworkModel())
    """
    if compute_seconds <= 0:
        raise ValueError(f"compute_seconds must be > 0, got {compute_seconds}")
    return ranks * compute_seconds / step_seconds(
        ranks, compute_seconds=compute_seconds, nbytes=nbytes, sync_every=sync_every,
        network=network, exchange=exchange, ranks_per_node=ranks_per_node)


def fit_frames_exponent(frames_to_target: Mapping[int, float]) -> Optional[float]:
    """b in frames(N) = frames(1) * N ** b, by least squares through the origin of
    log(frames(N) / frames(1)) against log N, clipped at 0.

    Needs size 1 and at least one larger size; returns None otherwise.

    Example::

        fit_frames_exponent({1: 100.0, 2: 120.0, 4: 150.0})   # about 0.29
    """
    base = frames_to_target.get(1)
    points = [(math.log(n), math.log(f / base)) for n, f in frames_to_target.items()
              if n > 1 and f and base]
    if not base or not points:
        return None
    b = sum(x * y for x, y in points) / sum(x * x for x, _ in points)
    return max(0.0, b)


def frames_exponent_range(frames_to_target: Mapping[int, float]) -> Optional[tuple]:
    """(lowest, highest) b over refits that each leave out one measured size > 1.

    The spread of b when one noisy point is dropped: how far the projection
    can be trusted.  None with fewer than two sizes above 1 (nothing to drop).

    Example::

        frames_exponent_range({1: 100.0, 2: 120.0, 4: 200.0})   # (0.26, 0.5)
    """
    larger = [n for n, f in frames_to_target.items() if n > 1 and f]
    if not frames_to_target.get(1) or len(larger) < 2:
        return None
    fits = [fit_frames_exponent({n: f for n, f in frames_to_target.items() if n != drop})
            for drop in larger]
    full = fit_frames_exponent(frames_to_target)
    fits = [b for b in fits + [full] if b is not None]
    return min(fits), max(fits)


def project_speedups(sizes: Sequence[int], *, compute_seconds: float, nbytes: float,
                     sync_every: int, network: NetworkModel,
                     frames_exponent: Optional[float],
                     exponent_range: Optional[tuple] = None,
                     exchange: str = "allreduce", ranks_per_node: int = 0,
                     active=None) -> list:
    """Projected speedups at each size: one dict per size.

    ``time_to_target`` is None when no frames exponent could be fitted;
    ``time_to_target_range`` is (low, high) from ``exponent_range``, or None.

    Example::

        project_speedups([16, 32], compute_seconds=0.01, nbytes=4e6, sync_every=8,
                         network=NetworkModel(), frames_exponent=0.2)
    """
    rows = []
    for n in sizes:
        thr = throughput_speedup(n, compute_seconds=compute_seconds, nbytes=nbytes,
                                 sync_every=sync_every, network=network, exchange=exchange,
                                 ranks_per_node=ranks_per_node)
        if active is not None:          # ranks sitting steps out (a Kaldi job ramp)
            thr *= active(n) / n
        frames_ratio = None if frames_exponent is None else n ** frames_exponent
        rows.append({
            "ranks": int(n),
            "step_seconds": step_seconds(n, compute_seconds=compute_seconds, nbytes=nbytes,
                                         sync_every=sync_every, network=network,
                                         exchange=exchange, ranks_per_node=ranks_per_node),
            # (named for the usual case: the one exchange's time, pairwise for ADPSGD)
            "allreduce_seconds": exchange_seconds(n, nbytes, network, exchange,
                                                  ranks_per_node),
            "throughput_speedup": thr,
            "frames_ratio": frames_ratio,
            "time_to_target_speedup": None if frames_ratio is None else thr / frames_ratio,
            # a larger b means more frames, so the high b gives the low speedup
            "time_to_target_range": None if exponent_range is None else
            (thr / n ** exponent_range[1], thr / n ** exponent_range[0]),
        })
    return rows


def project_method(sizes: Sequence[int], *, measured_compute_seconds: float, num_params: int,
                   sync_every: int, frames_to_target: Mapping[int, float],
                   network: NetworkModel, compute_seconds: float = 0.0,
                   exchange: str = "allreduce", ranks_per_node: int = 0,
                   active=None) -> dict:
    """One method's projection from its measured figures, with what it assumed.

    ``measured_compute_seconds``: compute per step on one rank;
    ``compute_seconds`` > 0 replaces it (e.g. an assumed GPU step).  The
    allreduce moves 4 bytes per parameter; the frames exponent is fitted to
    ``frames_to_target`` (ranks -> frames, the sizes that reached the target).

    Example::

        project_method([1, 2, 16], measured_compute_seconds=0.015, num_params=812_664,
                       sync_every=8, frames_to_target={1: 1e5, 2: 1.1e5},
                       network=NetworkModel())["rows"][-1]["throughput_speedup"]
    """
    compute = compute_seconds or measured_compute_seconds
    exponent = fit_frames_exponent(frames_to_target)
    spread = frames_exponent_range(frames_to_target)
    nbytes = 4 * num_params
    return {"compute_seconds_per_step": compute,
            "compute_seconds_source": "option" if compute_seconds else "measured on one rank",
            "bytes_per_allreduce": nbytes, "sync_every_steps": sync_every,
            "exchange": exchange, "ranks_per_node": int(ranks_per_node),
            "frames_exponent": exponent, "frames_exponent_range": spread,
            "fitted_sizes": sorted(int(n) for n, f in frames_to_target.items() if f),
            "rows": project_speedups(sizes, compute_seconds=compute, nbytes=nbytes,
                                     sync_every=sync_every, network=network,
                                     frames_exponent=exponent, exponent_range=spread,
                                     exchange=exchange, ranks_per_node=ranks_per_node,
                                     active=active)}


def assumptions(network: NetworkModel, compute_seconds: float = 0.0) -> list:
    """The model's assumptions as short sentences (printed, plotted, stored);
    ``compute_seconds`` > 0: the per-step compute time was given, not measured.

    Example::

        print("\\n".join(assumptions(NetworkModel())))
    """
    compute = (f"Per-step compute time: {1e3 * compute_seconds:g} ms as given "
               "(--compute-ms); the same at every N." if compute_seconds else
               "Per-step compute time: as measured on one rank of this machine; the same "
               "at every N.")
    return [
        f"Network: {network.describe()}; one link per rank.",
        compute,
        "One allreduce of the whole buffer (4 bytes per parameter) every sync period of "
        "the method (gradients every step for allreduce; for adpsgd one swap of the "
        "parameters with one partner per step, whatever N; for hierarchical adpsgd a "
        "gradient allreduce and a broadcast over a node's ranks plus one swap between "
        "nodes per step); no overlap with compute, no stragglers.",
        "Throughput speedup = N * compute / (compute + allreduce / sync period), times "
        "the mean share of ranks training a step under a Kaldi job ramp.",
        "Frames to target grow as N^b, b fitted to the measured sizes (least squares on "
        "log-log, clipped at 0); time-to-target speedup = throughput speedup / N^b.",
        "Projections are a model's output, not measurements: the range after a "
        "time-to-target figure is that of refits leaving out one measured size each; a fit "
        "on few noisy points beyond the measured sizes can be far off.",
    ]
