#!/usr/bin/env bash
# Runs ON the H200 device machine: the engine bench of two builds of qk in one lease, alternating
# A, B, A, B (figures move with the lease and the clocks; only a side by side compares them).
#   bash benches/h200_ab.sh [LAYERS] [ROUNDS]
# Here, before the device call: the two release wheels in .device/ab/a/ and .device/ab/b/ (besides
# what benches/device_prepare.sh puts in .device/: gguf-py and the vocabulary for the random model).
# QK_BENCH_ARGS: engine_bench.py's flags. Each run's JSON goes to $OUT/ab-<a|b>-<round>.json; stdout
# gets one summary line per run.
set -uo pipefail
LAYERS="${1:-12}"
ROUNDS="${2:-2}"
source benches/device_vulkan.sh
mkdir -p "$OUT"
for b in a b; do
  rm -rf "/tmp/ab-$b" && mkdir -p "/tmp/ab-$b"
  python3 -m pip install -q --no-index --no-deps --no-compile --target "/tmp/ab-$b" .device/ab/$b/qk-*.whl || exit 1
done
MODEL=/tmp/next80b-$LAYERS.gguf
[ -f "$MODEL" ] || PYTHONPATH=.device/gguf-py python3 benches/make_model.py "$MODEL" \
  --vocab .device/vocab/ggml-vocab-qwen2.gguf --layers "$LAYERS" > /tmp/make_model.log 2>&1 || exit 1
for round in $(seq 1 "$ROUNDS"); do
  for b in a b; do
    json="$OUT/ab-$b-$round.json"
    PYTHONPATH="/tmp/ab-$b:.device/gguf-py" python3 benches/engine_bench.py "$MODEL" \
      ${QK_BENCH_ARGS:---prompt 512 --decode 64 --slots 8 --ctx 4096 --profile --top 3} > "$json" 2> "$OUT/ab-$b-$round.err"
    python3 benches/run_summary.py "$b round $round" "$json"
  done
done
