#!/usr/bin/env bash
# One GPU run of `lengthwise bench engine --preset h200-llama8b`, for a machine that reaches no package registry.
#
#   bash serving/bench/gpu/run.sh OUT_DIR            # on the GPU machine, from the repository root, .gpu-pack beside
#   bash serving/bench/gpu/run.sh OUT_DIR --dry-run  # anywhere: check the pack and print each step, run nothing
#
# Steps and their budgets (one command of at most 10 minutes in all):
#   1. install the carried pack (.gpu-pack, built by `make gpu-pack`) into $LENGTHWISE_GPU_SITE   5-7 s measured
#   2. check Python, torch, the GPU and every import the bench needs (serving.bench.gpu.check)     ~31 s, cut at 60
#   3. the bench: calibrate, simulate the knee, replay stock / lengthwise / sarathi / the oracle     ~9-10 min, cut at
#      $LENGTHWISE_GPU_BENCH_S (default 500 s) so the outputs are always collected; a cut bench keeps what finished
#      (four engine starts of ~60 s and eight replays of 33-41 s: the cut falls on the oracle, the last arm)
#   4. collect into OUT_DIR: bench_engine.json (+ .png), bench.log, steps.log, install.log, check.log and work.tar.gz
#      (every engine's log, step profile, job and output, so a cut run still has what it replayed)
# Exit status: 2 for a missing pack, a wrong Python or torch, no GPU, or a failed install or import (one line each);
# otherwise the bench's own.
set -u -o pipefail

OUT=${1:-}
MODE=${2:-run}
if [ -z "$OUT" ] || { [ "$MODE" != run ] && [ "$MODE" != --dry-run ]; }; then
    echo "usage: bash serving/bench/gpu/run.sh OUT_DIR [--dry-run]" >&2
    exit 2
fi
PY=${PYTHON:-python3}
PACK=${LENGTHWISE_GPU_PACK:-.gpu-pack}
SITE=${LENGTHWISE_GPU_SITE:-/tmp/lengthwise-site}
BENCH_S=${LENGTHWISE_GPU_BENCH_S:-500}
mkdir -p "$OUT"
t0=$(date +%s)
step() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$OUT/steps.log"; }

if [ ! -d "$PACK" ] || [ ! -f "$PACK/install.sh" ]; then
    echo "gpu run: no pack at $PACK: run 'make gpu-pack' on the build machine and carry .gpu-pack with the tree" >&2
    exit 2
fi
step "pack: $(du -sh "$PACK" | cut -f1) at $PACK; site $SITE; bench cut at ${BENCH_S} s"

if [ "$MODE" = --dry-run ]; then
    step "dry run: would install: sh $PACK/install.sh $SITE"
    step "dry run: would check: PYTHONPATH=$SITE:\$PWD timeout 60 $PY -m serving.bench.gpu.check --pack $PACK"
    step "dry run: would run: timeout $BENCH_S $PY -m serving.cli bench engine --preset h200-llama8b --json $OUT/bench_engine.json"
    for f in "$PACK/manifest.json" "$PACK/sharegpt-first-turns.llama3.csv"; do
        [ -f "$f" ] || { echo "gpu run: the pack lacks $f: run 'make gpu-pack' again" >&2; exit 2; }
    done
    step "dry run: pack holds $(ls "$PACK"/wheels/*.whl | wc -l) wheels and $(( $(wc -l <"$PACK/sharegpt-first-turns.llama3.csv") - 1 )) requests"
    exit 0
fi

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

step "bench"
timeout --signal=INT --kill-after=20 "$BENCH_S" "$PY" -m serving.cli bench engine --preset h200-llama8b \
    --json "$OUT/bench_engine.json" 2>&1 | tee "$OUT/bench.log"
rc=${PIPESTATUS[0]}
step "bench exit $rc"

work=$(grep -o '/tmp/lengthwise-bench-engine-[A-Za-z0-9_]*' "$OUT/bench.log" | head -1)
if [ -z "$work" ]; then
    work=$(ls -dt /tmp/lengthwise-bench-engine-* 2>/dev/null | head -1)
fi
if [ -n "$work" ] && [ -d "$work" ]; then
    tar -czf "$OUT/work.tar.gz" -C "$(dirname "$work")" "$(basename "$work")"
    step "collected $work ($(du -sh "$OUT/work.tar.gz" | cut -f1))"
fi
exit "$rc"
