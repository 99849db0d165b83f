"""`mpitrain` through the command line on each rank, writing the rank's exit
status to STATUS_DIR/rank-N (mpiexec's own status is only the worst of them).

Usage: cli_status_worker.py STATUS_DIR [--cd DIR] [mpitrain arguments ...]

"{rank}" in an argument (and in DIR) is replaced by the rank, for ranks started
otherwise; an argument "{rank=N}TEXT" is TEXT on rank N and left out on the
others; --cd runs the rank in DIR.
"""

import os
import sys

from mpitrain import cli
from mpitrain.comm import rank_from_env

status_dir = os.path.abspath(sys.argv[1])
rank = rank_from_env()
argv = []
for arg in sys.argv[2:]:
    if arg.startswith("{rank="):
        only, _, arg = arg[len("{rank="):].partition("}")
        if int(only) != rank:
            continue
    argv.append(arg.replace("{rank}", str(rank)))
if argv[:1] == ["--cd"]:
    os.chdir(argv[1])
    argv = argv[2:]
try:
    status = cli.main(argv)
except SystemExit as exc:          # argparse's own exit
    status = exc.code
with open(os.path.join(status_dir, f"rank-{rank_from_env()}"), "w", encoding="utf-8") as fh:
    fh.write(f"{status}\n")
sys.exit(status)
