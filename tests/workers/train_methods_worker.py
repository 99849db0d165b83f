"""Train the same configuration with several parallel methods under ``mpiexec -n N``.

Usage: train_methods_worker.py CONFIG OUT_DIR METHOD[,METHOD...] [KEY=VALUE ...]

For each method the trainer runs into OUT_DIR/METHOD exactly as
``mpitrain train CONFIG --set parallel.method=METHOD --set KEY=VALUE ...``
would (one launch for all methods saves the start-up of the ranks).  Run by
tests/train/test_virtual.py, which trains the same on virtual ranks and
compares the models.
"""

import os
import sys

from mpitrain.comm import create_communicator
from mpitrain.comm.abort import install_abort_hook
from mpitrain.config import load_config
from mpitrain.train.trainer import Trainer

config, out_dir, methods, *settings = sys.argv[1:]
comm = create_communicator("auto")
install_abort_hook(comm)
for method in methods.split(","):
    cfg = load_config(config, list(settings) + [f"parallel.method={method}"])
    run_dir = os.path.join(out_dir, method)
    trainer = Trainer(cfg, run_dir=run_dir, comm=comm)
    try:
        trainer.run()
    finally:
        trainer.close()
    if comm.rank == 0:
        print(f"trained {method} on {comm.size} ranks", flush=True)
