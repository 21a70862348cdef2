#!/usr/bin/env bash
# Runs ON the H200 device machine: benches/split_bench.py once per line of a variants file (its
# flags: e.g. --worker-in-process, --spin-wait-us 0), in the background so a run at 48 layers can
# outlast one device call; the engine bench's one stream after them when QK_SPLIT_ENGINE=1.
#   bash benches/h200_split.sh start VARIANTS_FILE [LAYERS]   set up, start; returns at once
#   bash benches/h200_split.sh wait [SECONDS]                 wait for it; print the summaries
# Here, before the device call: benches/device_prepare.sh (the wheel in .device/, gguf-py and the
# vocabulary for the random model). QK_SPLIT_ARGS: the flags every variant shares. Each run's JSON
# is split-<i>.json in $OUT/split.tar.gz (written by `wait`); the log gets one summary line per run.
# QK_SPLIT_AB=1: two builds side by side instead, the wheels in .device/ab/a/ and .device/ab/b/ (as
# benches/h200_ab.sh takes them), each variant run with a, then b (split-<i>-<a|b>.json).
set -uo pipefail
WORK=/tmp/qk-split
case "${1:-}" in
wait)
  deadline=$((SECONDS + ${2:-540}))
  while [ ! -f $WORK/done ] && [ $SECONDS -lt $deadline ]; do sleep 5; done
  cat $WORK/split.log
  # One file (the device tool returns at most eight): every run's JSON and stderr.
  mkdir -p "$OUT" && (cd $WORK && tar -czf "$OUT/split.tar.gz" ./*.json ./*.err 2>/dev/null)
  [ -f $WORK/done ] || echo "== still running"
  exit 0 ;;
start) ;;
*) echo "usage: $0 start VARIANTS_FILE [LAYERS] | wait [SECONDS]"; exit 2 ;;
esac
VARIANTS="${2:?usage: $0 start VARIANTS_FILE [LAYERS]}"
LAYERS="${3:-48}"
[ -f "$VARIANTS" ] || { echo "no variants file $VARIANTS"; exit 2; }
source benches/device_vulkan.sh
rm -rf $WORK /tmp/split-site* && mkdir -p $WORK
if [ "${QK_SPLIT_AB:-0}" = 1 ]; then BUILDS="a b"; else BUILDS="one"; fi
for b in $BUILDS; do
  wheel=.device/qk-*.whl; [ "$b" = one ] || wheel=.device/ab/$b/qk-*.whl
  # shellcheck disable=SC2086  # the wheel's name is a glob
  python3 -m pip install -q --no-index --no-deps --no-compile --target "/tmp/split-site-$b" $wheel || exit 1
done
cp -r benches .device "$WORK"/
grep -v '^#' "$VARIANTS" > $WORK/variants.txt
cat > $WORK/run.sh <<INNER
set -uo pipefail
cd $WORK
export PYTHONPATH=/tmp/split-site-${BUILDS##* }:$WORK/.device/gguf-py PYTHONUNBUFFERED=1
MODEL=/tmp/next80b-$LAYERS.gguf
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
[ -f \$MODEL ] || python3 benches/make_model.py \$MODEL --vocab .device/vocab/ggml-vocab-qwen2.gguf \
  --layers $LAYERS > /tmp/make_model.log 2>&1 || { echo "make_model failed"; exit 1; }
i=0
while IFS= read -r flags; do
  for b in $BUILDS; do
    name=split-\$i tag=""; [ \$b = one ] || { name=split-\$i-\$b; tag=" \$b"; }
    # shellcheck disable=SC2086  # the flags are words to split
    PYTHONPATH=/tmp/split-site-\$b:$WORK/.device/gguf-py python3 benches/split_bench.py \$MODEL \
      ${QK_SPLIT_ARGS:---prompt 512 --decode 64 --ctx 2048 --lanes 1} \$flags > \$name.json 2> \$name.err
    python3 benches/split_summary.py "variant \$i\$tag (\${flags:-defaults})" \$name.json
  done
  i=\$((i + 1))
done < variants.txt
if [ "${QK_SPLIT_ENGINE:-0}" = 1 ]; then
  for flags in "" "--spin-wait-us 0"; do
    python3 benches/engine_bench.py \$MODEL --prompt 512 --decode 64 --slots 1 --ctx 4096 \$flags > engine-\$i.json 2> engine-\$i.err
    python3 benches/run_summary.py "engine one stream (\${flags:-defaults})" engine-\$i.json
    i=\$((i + 1))
  done
fi
date -u
INNER
setsid bash -c "bash $WORK/run.sh > $WORK/split.log 2>&1; touch $WORK/done" < /dev/null > /dev/null 2>&1 &
echo "started: $WORK/run.sh ($LAYERS layers)"
