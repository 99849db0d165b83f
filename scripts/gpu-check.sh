#!/usr/bin/env bash
# Verify a GPU install in one command:
#   1. the GPU tests (MPITRAIN_TEST_GPU=1: a missing GPU is a failure, not a skip);
#   2. 2-rank GPU training on the built-in corpus with every parallel method
#      (ADPSGD lock-step and asynchronous), and model averaging once more with
#      NG-SGD, with CUDA graphs and with bf16 products, each of which must learn
#      (held-out accuracy well above chance), the CUDA-graph run without falling
#      back to eager steps (each run's output is kept in $OUT/train-LABEL.out);
#   3. 2 ranks against 1: per-rank throughput with model averaging every 8
#      minibatches (bench mode), saying whether the ranks share a GPU;
#   4. the throughput table against PyTorch and the cuBLAS GEMM bound, and
#      NG-SGD's step time against SGD's.
# Exits non-zero on any failure.
#
# Environment: PYTHON (default .venv/bin/python, else python3), MPIEXEC (default
# mpiexec or mpirun on PATH), OUT (default runs/gpu-check), NP (default 2);
# TESTS=0 skips the tests, BENCH=0 the measurements (3 and 4).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=$PWD/.venv/bin/python; else PYTHON=$(command -v python3); fi
fi
MPIEXEC=${MPIEXEC:-$(command -v mpiexec || command -v mpirun || true)}
OUT=${OUT:-runs/gpu-check}
NP=${NP:-2}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
failures=()

step() { printf '\n== %s\n' "$*"; }

if [ "${TESTS:-1}" != 0 ]; then
    step "GPU tests"
    if ! MPITRAIN_TEST_GPU=1 "$PYTHON" -m pytest -q -ra -m gpu tests; then failures+=("GPU tests"); fi
fi

step "built-in corpus"
"$PYTHON" -m mpitrain synth "$OUT/data" --hours 0.5 --speakers 40 --shards 4 --overwrite

if [ -z "$MPIEXEC" ]; then
    failures+=("no mpiexec/mpirun on PATH: multi-rank training not checked")
else
    launch=("$MPIEXEC" -n "$NP")
    if "$MPIEXEC" --version 2>&1 | grep -q "Open MPI"; then
        # Open MPI refuses root and more ranks than cores unless told
        launch+=(--oversubscribe -x PYTHONPATH -x PATH)
        [ "$(id -u)" = 0 ] && launch+=(--allow-run-as-root)
    fi
    # label|settings: every method in fp32, then model averaging with NG-SGD,
    # with CUDA graphs and with bf16 products
    runs=(
        "model_averaging|parallel.method=model_averaging"
        "kaldi|parallel.method=kaldi"
        "allreduce|parallel.method=allreduce"
        "bmuf|parallel.method=bmuf"
        "adpsgd|parallel.method=adpsgd"
        "adpsgd-asynchronous|parallel.method=adpsgd parallel.asynchronous=true"
        "param_server|parallel.method=param_server"
        "model_averaging-ngsgd|parallel.method=model_averaging optimizer.name=ngsgd"
        "model_averaging-cuda-graph|parallel.method=model_averaging cuda_graph=true"
        "model_averaging-bf16|parallel.method=model_averaging precision=bf16"
    )
    for run in "${runs[@]}"; do
        label=${run%%|*}
        settings=()
        for setting in ${run#*|}; do settings+=(--set "$setting"); done
        step "$NP-rank GPU training: $label"
        run_dir="$OUT/train-$label"
        rm -rf "$run_dir"
        if "${launch[@]}" "$PYTHON" -m mpitrain train jobs/configs/quickstart.yaml \
                --set device=gpu "${settings[@]}" \
                --set data.train="$OUT/data/train" --set data.dev="$OUT/data/dev" \
                --set training.epochs=1 --run-dir "$run_dir" 2>&1 | tee "$run_dir.out"; then
            # a capture that fails falls back to eager steps, which learn as well:
            # the run's own line is the only sign that graphs were not used
            if [[ "$label" == *cuda-graph* ]] \
                    && grep -q "cuda_graph: \(off\|not used\)" "$run_dir.out"; then
                failures+=("$label ran without CUDA graphs: $(grep -m1 -o \
                    "cuda_graph: \(off\|not used\).*" "$run_dir.out")")
            fi
            if ! "$PYTHON" - "$run_dir/metrics.jsonl" <<'EOF'
import json, sys
records = [json.loads(line) for line in open(sys.argv[1])]
start = next(r for r in records if r.get("type") == "start")
end = next(r for r in records if r.get("type") == "end")
print(f"transport {start.get('transport')} ({start.get('transport_reason') or 'no reason given'}); "
      f"held-out accuracy {end['dev_acc']:.3f} after {end['steps']} steps")
sys.exit(0 if end["dev_acc"] > 0.3 else 1)
EOF
            then failures+=("$label did not learn"); fi
        else
            failures+=("$label failed")
        fi
    done

    if [ "${BENCH:-1}" != 0 ]; then
        step "$NP ranks against 1: per-rank throughput, model averaging every 8 minibatches"
        if "${launch[@]}" "$PYTHON" -m mpitrain bench jobs/configs/bench.yaml --set device=gpu \
                --set data.train="$OUT/data/train" --set data.dev="$OUT/data/dev" \
                --methods model_averaging --phases throughput --steps 400 --warmup-steps 50 \
                --repeats 3 --out "$OUT/bench" --overwrite; then
            if ! "$PYTHON" - "$OUT/bench/bench.json" <<'EOF'
import json, sys
rows = {r["ranks"]: r for r in json.load(open(sys.argv[1]))["throughput"]}
one, many = rows[1], rows[max(rows)]
try:
    import cupy
    gpus = cupy.cuda.runtime.getDeviceCount()
except Exception:               # the figure stands without the count
    gpus = 0
where = f"sharing {gpus} GPU(s)" if 0 < gpus < many["ranks"] else \
    f"{gpus} GPUs" if gpus else "GPU count unknown"
print(f"{many['ranks']} ranks ({where}): {many['frames_per_sec_per_rank']:,.0f} fr/s per rank "
      f"against 1 rank's {one['frames_per_sec_per_rank']:,.0f}: "
      f"{many['frames_per_sec_per_rank'] / one['frames_per_sec_per_rank']:.2f}")
EOF
            then failures+=("per-rank throughput report"); fi
        else
            failures+=("per-rank throughput (bench mode)")
        fi
    fi
fi

if [ "${BENCH:-1}" != 0 ]; then
    step "throughput: mpitrain, PyTorch and the GEMM bound on this GPU"
    if ! "$PYTHON" -m mpitrain.bench.throughput --device gpu --models quick,small,large \
            --precision fp32,tf32,bf16 --rounds 5 --json "$OUT/throughput.json"; then
        failures+=("throughput benchmark")
    fi
    step "NG-SGD against SGD: Kaldi's order, delayed updates, plan threads, CUDA graphs"
    for graphs in "" --cuda-graph; do
        if ! "$PYTHON" -m mpitrain.bench.ngsgd_overhead --device gpu --rounds 7 --steps 16 \
                --delayed-updates --plan-threads 0,4 $graphs \
                --json "$OUT/ngsgd-overhead${graphs:+-graphs}.json"; then
            failures+=("NG-SGD overhead benchmark${graphs:+ with CUDA graphs}")
        fi
    done
fi

if [ ${#failures[@]} -gt 0 ]; then
    printf '\nGPU check FAILED:\n'
    printf '  - %s\n' "${failures[@]}"
    exit 1
fi
printf '\nGPU check passed.\n'
