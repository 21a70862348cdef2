#!/usr/bin/env bash
# Runs ON the H200 device machine: one wheel's engine bench once per set of engine speed choices
# (engine_bench.py's --decode-shape, --dense-group-cols, --attention-walk, --route-inside-max-rows),
# round after round, so launch shapes are compared in the engine itself and in one lease.
#   bash benches/h200_sweep.sh VARIANTS_FILE [LAYERS] [ROUNDS]
# VARIANTS_FILE: one variant per line, its engine_bench flags (an empty line: the defaults; lines
# starting with # are skipped). Here, before the device call: benches/device_prepare.sh (the wheel in
# .device/, gguf-py and the vocabulary for the random model). QK_BENCH_ARGS: the flags every variant
# shares (default: 8 slots, profiled). QK_SWEEP_MODEL: another model (then nothing is written).
# Each run's JSON (and stderr) goes into $OUT/sweep.tar.gz as sweep-<variant>-<round>.json (one file:
# the device tool returns at most eight); stdout gets one summary line per run.
set -uo pipefail
VARIANTS="${1:?usage: $0 VARIANTS_FILE [LAYERS] [ROUNDS]}"
LAYERS="${2:-12}"
ROUNDS="${3:-2}"
[ -f "$VARIANTS" ] || { echo "no variants file $VARIANTS"; exit 2; }
source benches/device_vulkan.sh
mkdir -p "$OUT"
rm -rf /tmp/sweep-site && mkdir -p /tmp/sweep-site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/sweep-site .device/qk-*.whl || exit 1
MODEL="${QK_SWEEP_MODEL:-/tmp/next80b-$LAYERS.gguf}"
[ -f "$MODEL" ] || PYTHONPATH=.device/gguf-py python3 benches/make_model.py "$MODEL" \
  --vocab .device/vocab/ggml-vocab-qwen2.gguf --layers "$LAYERS" > /tmp/make_model.log 2>&1 || exit 1
RUNS=/tmp/sweep-runs
rm -rf "$RUNS" && mkdir -p "$RUNS"
mapfile -t lines < <(grep -v '^#' "$VARIANTS")
for round in $(seq 1 "$ROUNDS"); do
  for i in "${!lines[@]}"; do
    flags="${lines[$i]}"
    json="$RUNS/sweep-$i-$round.json"
    # shellcheck disable=SC2086  # the flags are words to split
    PYTHONPATH="/tmp/sweep-site:.device/gguf-py" python3 benches/engine_bench.py "$MODEL" \
      ${QK_BENCH_ARGS:---prompt 512 --decode 64 --slots 8 --ctx 4096 --profile --top 3} $flags \
      > "$json" 2> "$RUNS/sweep-$i-$round.err"
    python3 benches/run_summary.py "variant $i (${flags:-defaults}) round $round" "$json"
  done
done
tar -C "$RUNS" -czf "$OUT/sweep.tar.gz" .
