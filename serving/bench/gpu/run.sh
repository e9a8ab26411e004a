#!/usr/bin/env bash
# One GPU run of `lengthwise bench engine --preset h200-llama8b`, for a machine that reaches no package registry.
#
#   bash serving/bench/gpu/run.sh OUT_DIR [BENCH FLAGS...]             # on the GPU machine, .gpu-pack beside
#   bash serving/bench/gpu/run.sh OUT_DIR --dry-run [BENCH FLAGS...]   # anywhere: check the pack, print each step
#   bash serving/bench/gpu/run.sh OUT_DIR --cpu-smoke [BENCH FLAGS...]  # here: the whole script on the cpu-smoke preset
#
# BENCH FLAGS are the plan, passed to the bench after the preset (a flag given wins over the preset's), e.g.
#   --rate-factors 1.5,1 --seeds 1,2 --ablation sarathi --compare-predictors oracle --calibration-profile CSV
# The preset's plan: stock, stock again, lengthwise with the trained predictor's predictions, sarathi, the posterior
# policy, then the synthetic noise and the oracle; 1.5x the knee, then the knee; seeds 1, 2, 0 (serving/bench/engine/
# presets.py). The bench runs what fits its budget, in that order of value, and names what it left out.
#
# Steps and their budgets (one command of at most 10 minutes in all):
#   1. install the carried pack (.gpu-pack, built by `make gpu-pack`) into $LENGTHWISE_GPU_SITE   5-7 s measured
#   2. check Python, torch, the GPU and every import the bench needs (serving.bench.gpu.check)     ~31 s, cut at 60
#   3. the bench, given $LENGTHWISE_GPU_BENCH_S seconds (default 530): its plan is sized to that less 20 s (its own
#      --budget-s), and a SIGINT at the full time keeps what finished (a cut at any phase still writes the JSON)
#   4. collect into OUT_DIR: bench_engine.json (+ .png, + .records.json.gz: every request of every replay), bench.log,
#      steps.log, install.log, check.log, step_profile.csv (the calibration: a second command on the same machine
#      passes --calibration-profile OUT_DIR/step_profile.csv --rates R,R --seeds S,S for what the first left out) and
#      work.tar.gz (every engine's log, step profile, job and output)
# Exit status: 2 for a missing pack, a wrong Python or torch, no GPU, or a failed install or import (one line each);
# otherwise the bench's own.
set -u -o pipefail

OUT=${1:-}
shift || true
MODE=run
case "${1:-}" in
    --dry-run|--cpu-smoke) MODE=$1; shift ;;
esac
if [ -z "$OUT" ] || [ "${OUT#-}" != "$OUT" ]; then
    echo "usage: bash serving/bench/gpu/run.sh OUT_DIR [--dry-run|--cpu-smoke] [BENCH FLAGS...]" >&2
    exit 2
fi
PY=${PYTHON:-python3}
PACK=${LENGTHWISE_GPU_PACK:-.gpu-pack}
SITE=${LENGTHWISE_GPU_SITE:-/tmp/lengthwise-site}
BENCH_S=${LENGTHWISE_GPU_BENCH_S:-530}
case "$BENCH_S" in
    ''|*[!0-9]*) echo "gpu run: LENGTHWISE_GPU_BENCH_S must be whole seconds, got '$BENCH_S'" >&2; exit 2 ;;
esac
if [ "$BENCH_S" -le 60 ]; then
    echo "gpu run: LENGTHWISE_GPU_BENCH_S=$BENCH_S leaves no time for one engine start and one replay: give more than 60" >&2
    exit 2
fi
PRESET=h200-llama8b
[ "$MODE" = --cpu-smoke ] && PRESET=cpu-smoke
PLAN=("$@")
case " ${PLAN[*]-} " in
    *" --budget-s "*) ;;
    *) PLAN+=(--budget-s "$(( BENCH_S - 20 ))") ;;
esac
mkdir -p "$OUT"
t0=$(date +%s)
step() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$OUT/steps.log"; }
BENCH=("$PY" -m serving.cli bench engine --preset "$PRESET" --json "$OUT/bench_engine.json" "${PLAN[@]}")

if [ "$MODE" != --cpu-smoke ]; then
    if [ ! -d "$PACK" ] || [ ! -f "$PACK/install.sh" ]; then
        echo "gpu run: no pack at $PACK: run 'make gpu-pack' on the build machine and carry .gpu-pack with the tree" >&2
        exit 2
    fi
    step "pack: $(du -sh "$PACK" | cut -f1) at $PACK; site $SITE; bench given ${BENCH_S} s"
fi

if [ "$MODE" = --dry-run ]; then
    step "dry run: would install: sh $PACK/install.sh $SITE"
    step "dry run: would check: PYTHONPATH=$SITE:\$PWD timeout 60 $PY -m serving.bench.gpu.check --pack $PACK"
    step "dry run: would run: timeout $BENCH_S ${BENCH[*]}"
    for f in "$PACK/manifest.json" "$PACK/sharegpt-first-turns.llama3.csv" \
             docs/results/gpu/sharegpt_first_turns_llama3_predictions.json; do
        [ -f "$f" ] || { echo "gpu run: $f is missing: run 'make gpu-pack' again" >&2; exit 2; }
    done
    step "dry run: pack holds $(ls "$PACK"/wheels/*.whl | wc -l) wheels and $(( $(wc -l <"$PACK/sharegpt-first-turns.llama3.csv") - 1 )) requests"
    exit 0
fi

if [ "$MODE" = run ]; then
    step "install"
    if ! sh "$PACK/install.sh" "$SITE" >"$OUT/install.log" 2>&1; then
        echo "gpu run: installing the pack failed: $(tail -1 "$OUT/install.log")" >&2
        exit 2
    fi
    export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1
    # FlashInfer does not travel (its sampler is off); the bench's requests are greedy, so no sampler needs it.
    export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1

    step "check"
    if ! timeout 60 "$PY" -m serving.bench.gpu.check --pack "$PACK" >"$OUT/check.log" 2>&1; then
        echo "gpu run: $(tail -1 "$OUT/check.log")" >&2
        exit 2
    fi
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >>"$OUT/steps.log" 2>&1 || true
fi

step "bench: ${BENCH[*]}"
timeout --signal=INT --kill-after=20 "$BENCH_S" "${BENCH[@]}" 2>&1 | tee "$OUT/bench.log"
rc=${PIPESTATUS[0]}
step "bench exit $rc"

work=$(grep -o '/tmp/lengthwise-bench-engine-[A-Za-z0-9_]*' "$OUT/bench.log" | head -1)
if [ -z "$work" ]; then
    work=$(ls -dt /tmp/lengthwise-bench-engine-* 2>/dev/null | head -1)
fi
if [ -n "$work" ] && [ -d "$work" ]; then
    tar -czf "$OUT/work.tar.gz" -C "$(dirname "$work")" "$(basename "$work")"
    # the calibration, for a second command on this machine: --calibration-profile OUT_DIR/step_profile.csv
    [ -f "$work/step_profile.csv" ] && cp "$work/step_profile.csv" "$OUT/step_profile.csv"
    step "collected $work ($(du -sh "$OUT/work.tar.gz" | cut -f1))"
fi
exit "$rc"
