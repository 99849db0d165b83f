#!/usr/bin/env bash
# Set up, write the built-in corpus (once), train on 2 MPI ranks, evaluate.
#   bash scripts/quickstart.sh            # 2 ranks
#   NP=1 bash scripts/quickstart.sh       # 1 rank
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
NP=${NP:-2}
[ -f data/synth/train/corpus.yaml ] || python -m mpitrain synth data/synth
python -m mpitrain check data/synth
# a second run of this script trains afresh (a run directory is never reused silently)
again=()
case " $* " in *" --resume "*|*" --overwrite "*) ;;
    *) if [ -e runs/quickstart/config.yaml ]; then again=(--overwrite); fi ;; esac
mpiexec -n "$NP" python -m mpitrain train jobs/configs/quickstart.yaml --run-dir runs/quickstart \
    ${again[@]+"${again[@]}"} "$@"
python -m mpitrain eval runs/quickstart/final.h5 data/synth/dev
