"""Benchmarks: each runs the trainer's own step and differs only in what it times.

The benchmarks (each ``python -m mpitrain.bench.NAME``, docs/benchmarks.md):

- ``throughput``: one rank's step against PyTorch and the GEMM bound;
- ``ngsgd_overhead``: the NG-SGD step against the SGD step;
- ``scaling``: 1 rank against N ranks, per parallel method;
- ``ddp_compare``: mpitrain's parallel methods against PyTorch DDP;
- ``collectives``: our allreduce against the bare mpi4py call;
- ``convergence``: SGD and NG-SGD training runs, learning-rate sweeps;
- ``precondition``: the NG preconditioner alone, next to a GEMM;
- ``soak``: whether a long run's memory and step time stayed flat (reads its
  ``metrics.jsonl``).

``mpitrain bench`` (speedup curves from the trainer itself): ``options``
(what to measure), ``mode`` (the runner), ``phases`` (throughput and time to
accuracy on one group), ``projection`` (the network model beyond the
machine), ``report`` (bench.json, bench.md, the plots).

What they share: ``models`` (named model specs, the synthetic chunk),
``steps`` (the trainer's step on that chunk), ``rounds`` (interleaved timed
rounds over ranks), ``idle`` (sleeping ranks), ``machine`` (what it ran on).

Example::

    python -m mpitrain.bench.throughput --threads 1 --models small --rounds 5
"""
