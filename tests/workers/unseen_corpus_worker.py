"""A command run on ranks of which one cannot read the corpus, as on a node that
does not mount the file system the others see.

Usage: unseen_corpus_worker.py RANK -- COMMAND ARGS...

Runs ``mpitrain COMMAND`` through the command-line entry point, exactly as
``python -m mpitrain`` does; on RANK every corpus manifest is "not found".
Exits with the command's status.
"""

import os
import sys

from mpitrain.cli import main
from mpitrain.data import corpus

blind = int(sys.argv[1])
assert sys.argv[2] == "--", sys.argv
# (the launcher's rank: mpiexec of MPICH or Open MPI)
rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
if rank == blind:
    def load_manifest_unseen(path, *args, **kwargs):
        raise OSError(f"{path}/corpus.yaml: not found on this node")
    corpus.load_manifest = load_manifest_unseen
sys.exit(main(sys.argv[3:]))
