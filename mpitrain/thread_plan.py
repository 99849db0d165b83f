"""``python -m mpitrain.thread_plan CONFIG [--set KEY=VALUE ...] [other options]``:
the BLAS threads per rank that ``train`` or ``bench`` of that config will use in
this environment, printed as one number, for a batch script's banner (the
policy is mpitrain.threads'; a script that repeated it in shell said the
cores per task on a GPU, where each rank uses one thread).

The options of ``train`` and ``bench`` other than ``--set`` are passed over, so
a script hands on its whole command line.  A config that does not load is one
line on standard error, exit status 2.

Example::

    $ OMP_NUM_THREADS=8 python -m mpitrain.thread_plan run.yaml --set device=gpu --resume
    1
"""

from __future__ import annotations

import argparse
import sys

from .config import load_config
from .threads import planned_blas_threads, ranks_on_node_from_env


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpitrain.thread_plan",
                                     allow_abbrev=False)
    parser.add_argument("config")
    parser.add_argument("--set", action="append", default=[])
    args, _ = parser.parse_known_args(argv)
    try:
        cfg = load_config(args.config, args.set)
    except (ValueError, OSError) as exc:
        print(f"mpitrain.thread_plan: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print(planned_blas_threads(cfg.blas_threads, device=cfg.device,
                               ranks_on_node=ranks_on_node_from_env() or 1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
