#!/usr/bin/env bash
# Runs ON the H200 device machine (benches/device_prepare.sh fills .device/ and packs llama.cpp's
# source into .ref.tar.xz; .gl/ holds the Vulkan loader debs). One script, two phases, so a device
# call never runs past its limit:
#   bash benches/h200_engine.sh start [LAYERS]   set up, then in the background: build llama.cpp
#                                                 (CUDA) while the random model is written, run the
#                                                 GPU tests, then qk and llama.cpp side by side
#   bash benches/h200_engine.sh wait [SECONDS]   wait for the background run; print its log
#   bash benches/h200_engine.sh kernels [SETS]   only the kernel micro-benchmark (no model, no
#                                                 llama.cpp), in the foreground: kernels-<set>.txt
#                                                 (the sets: benches/kernel_sets.sh)
# Results land in $OUT (engine.log, qk-bench.json, llama-bench.md, llama-batched.txt, kernels.txt).
# env: QK_SKIP_TESTS=1, QK_TEST_FILTER (a cargo test filter), QK_SKIP_LLAMA=1, QK_KERNELS=1 (kernel micro-benchmark;
#      QK_KERNEL_SETS picks its parts),
#      QK_BENCH_ARGS (extra engine_bench.py flags), QK_BENCH_ARGS_B (a second engine bench in the
#      same lease with these flags, e.g. an engine option's other value: qk-bench-b.json),
#      QK_WHEEL_B (that run with another build's wheel, e.g. the base of a change; its flags
#      QK_BENCH_ARGS_B, else QK_BENCH_ARGS), QK_KERNELS_BENCH_B (each kernel set also run by
#      another kernels-bench binary: kernels-<set>-b.txt),
#      QK_SPLIT=1 (the split bench), QK_DEEP=N (one stream decoding after an N-token prompt,
#      benches/deep_context.py, its flags QK_DEEP_ARGS: deep.json),
#      QK_LLAMA_DEPTHS (llama-bench -d, default 8192,32000), QK_LLAMA_PREFILL_ONLY=1 (llama.cpp: pp512, pp4096, tg128 and pp32768 only: a prefill change's
#      side by side in less device time), QK_AB_CHECKED=1 (every kernel bench set and the engine
#      bench run again with wgpu's shader checks, QK_CHECKED_SHADERS=1: kernels-<set>-checked.txt,
#      qk-bench-checked.json).
set -uo pipefail
WORK=/tmp/qk-bench
case "${1:-start}" in
wait)
  deadline=$((SECONDS + ${2:-540}))
  while [ ! -f $WORK/done ] && [ $SECONDS -lt $deadline ]; do sleep 5; done
  cat $WORK/engine.log
  mkdir -p "$OUT" && cp $WORK/*.json $WORK/*.md $WORK/*.txt $WORK/engine.log "$OUT"/ 2>/dev/null
  [ -f $WORK/done ] || echo "== still running"
  exit 0 ;;
kernels)
  source benches/device_vulkan.sh
  source benches/kernel_sets.sh
  kernel_sets_check ${2:-decode} || exit 2
  mkdir -p "$OUT"
  for set in ${2:-decode}; do
    kernel_set_env $set
    echo "== kernel micro-benchmark ($set)"
    .device/kernels-bench > "$OUT/kernels-$set.txt" 2>&1; grep -v "^adapter\|^counters" "$OUT/kernels-$set.txt" | tail -150
    if [ -n "${QK_KERNELS_BENCH_B:-}" ]; then
      echo "== kernel micro-benchmark ($set), $QK_KERNELS_BENCH_B"
      "$QK_KERNELS_BENCH_B" > "$OUT/kernels-$set-b.txt" 2>&1; grep -v "^adapter\|^counters" "$OUT/kernels-$set-b.txt" | tail -150
    fi
    if [ "${QK_AB_CHECKED:-0}" = 1 ]; then
      echo "== kernel micro-benchmark ($set), checked shaders"
      QK_CHECKED_SHADERS=1 .device/kernels-bench > "$OUT/kernels-$set-checked.txt" 2>&1
      grep -v "^adapter\|^counters" "$OUT/kernels-$set-checked.txt" | tail -150
    fi
  done
  kernel_set_clear
  exit 0 ;;
start) ;;
*) echo "usage: $0 start [LAYERS] | wait [SECONDS] | kernels [SETS]"; exit 2 ;;
esac
LAYERS="${2:-48}"
if [ "${QK_KERNELS:-0}" = 1 ]; then
  source benches/kernel_sets.sh
  kernel_sets_check ${QK_KERNEL_SETS:-all} || exit 2
fi
rm -rf $WORK && mkdir -p $WORK /tmp/site
# The background run below inherits VK_DRIVER_FILES from here.
source benches/device_vulkan.sh
[ -d /tmp/llama.cpp ] || python3 -c 'import tarfile; tarfile.open(".ref.tar.xz").extractall("/tmp")'
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device/qk-*.whl || exit 1
# The package's Python sources come from this tree (newer than the wheel when only Python changed),
# its native module from the wheel.
cp /tmp/site/qk/_qk*.so python/qk/
if [ -n "${QK_WHEEL_B:-}" ]; then
  rm -rf /tmp/site-b $WORK/python-b && mkdir -p /tmp/site-b
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-b "$QK_WHEEL_B" || exit 1
  cp -r python $WORK/python-b && cp /tmp/site-b/qk/_qk*.so $WORK/python-b/qk/
  : "${QK_BENCH_ARGS_B:=${QK_BENCH_ARGS:---prompt 512 --decode 128 --slots 8 --ctx 4096 --profile --top 12}}"
fi
cp -r benches python .device "$WORK"/
cat > $WORK/run.sh <<EOF
set -uo pipefail
cd $WORK
export PYTHONPATH=$WORK/python:/tmp/site:$WORK/.device/gguf-py PYTHONUNBUFFERED=1
MODEL=/tmp/next80b-$LAYERS.gguf
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
B=/tmp/llb
( [ "${QK_SKIP_LLAMA:-0}" = 1 ] || [ -x \$B/bin/llama-bench ] || {
  cmake -S /tmp/llama.cpp -B \$B -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TOOLS=ON -DCMAKE_BUILD_TYPE=Release > /tmp/llb-cfg.log 2>&1 \
  && cmake --build \$B -j "\$(nproc)" --target llama-bench llama-batched-bench > /tmp/llb-build.log 2>&1
  echo "llama.cpp build rc=\$?"; } ) &
BUILD=\$!
( [ -f \$MODEL ] || python3 benches/make_model.py \$MODEL --vocab .device/vocab/ggml-vocab-qwen2.gguf \
  --layers $LAYERS > /tmp/make_model.log 2>&1; echo "model: \$(tail -1 /tmp/make_model.log)" ) &
MAKE=\$!
if [ "${QK_SKIP_TESTS:-0}" != 1 ]; then
  echo "== GPU tests (cargo test binary; subgroup 32, cooperative matrix, big bindings)"
  QK_REQUIRE_GPU=1 QK_REQUIRE_COOP=1 .device/rust-tests ${QK_TEST_FILTER:-} --test-threads=1 2>&1 \
    | grep -E "^test result|FAILED|panicked|failures:" | head -20
fi
if [ "${QK_KERNELS:-0}" = 1 ]; then
  # QK_KERNEL_SETS: any of benches/kernel_sets.sh's sets ("all" by default); kernels-<set>.txt each.
  source benches/kernel_sets.sh
  for set in ${QK_KERNEL_SETS:-all}; do
    echo "== kernel micro-benchmark (\$set)"
    kernel_set_env \$set
    .device/kernels-bench > kernels-\$set.txt 2>&1; grep -v "^adapter\\|^counters" kernels-\$set.txt | tail -80
    if [ -n "${QK_KERNELS_BENCH_B:-}" ]; then
      echo "== kernel micro-benchmark (\$set), ${QK_KERNELS_BENCH_B:-}"
      ${QK_KERNELS_BENCH_B:-} > kernels-\$set-b.txt 2>&1; grep -v "^adapter\\|^counters" kernels-\$set-b.txt | tail -80
    fi
  done
  kernel_set_clear
fi
wait \$MAKE
# qk's host side (recording, Python) must not share the CPUs with llama.cpp's 16-way compile (the
# engine figures up to 2026-12-02 were taken while that build could still be running).
wait \$BUILD
echo "== qk engine (release wheel), $LAYERS layers"
python3 benches/engine_bench.py \$MODEL ${QK_BENCH_ARGS:---prompt 512 --decode 128 --depths 8192,32000 --long 4096,32768 --slots 8 --ctx 33792 --profile --top 12} \
  > qk-bench.json 2> qk-bench.err; echo "rc=\$?"; grep -v "^qk: layer" qk-bench.err | tail -80; cat qk-bench.json
if [ -n "${QK_BENCH_ARGS_B:-}" ]; then
  echo "== qk engine (release wheel), $LAYERS layers, second run: ${QK_BENCH_ARGS_B:-}"
  PYTHONPATH=${QK_WHEEL_B:+$WORK/python-b:/tmp/site-b:}\$PYTHONPATH python3 benches/engine_bench.py \$MODEL ${QK_BENCH_ARGS_B:-} \
    > qk-bench-b.json 2> qk-bench-b.err; echo "rc=\$?"
  grep -v "^qk: layer" qk-bench-b.err | tail -40; cat qk-bench-b.json
fi
if [ "${QK_AB_CHECKED:-0}" = 1 ]; then
  echo "== qk engine (release wheel), $LAYERS layers, checked shaders"
  QK_CHECKED_SHADERS=1 python3 benches/engine_bench.py \$MODEL ${QK_BENCH_ARGS:---prompt 512 --decode 128 --depths 8192,32000 --long 4096,32768 --slots 8 --ctx 33792 --profile --top 12} \
    > qk-bench-checked.json 2> qk-bench-checked.err; echo "rc=\$?"; grep -v "^qk: layer" qk-bench-checked.err | tail -40; cat qk-bench-checked.json
fi
if [ -n "${QK_DEEP:-}" ]; then
  echo "== one stream at depth ${QK_DEEP:-}"
  python3 benches/deep_context.py \$MODEL --depth ${QK_DEEP:-} ${QK_DEEP_ARGS:-} > deep.json 2> deep.err
  echo "rc=\$?"; grep -v "^qk: layer" deep.err | tail -20; cat deep.json
fi
if [ "${QK_SPLIT:-0}" = 1 ]; then
  echo "== split serving on one GPU"
  python3 benches/split_bench.py \$MODEL --prompt 512 --decode 64 --ctx 2048 2>&1 | grep -v "^qk: layer" | tee split.txt
fi
wait \$BUILD
if [ "${QK_SKIP_LLAMA:-0}" != 1 ]; then
  echo "== llama.cpp CUDA: llama-bench -fa 1"
  \$B/bin/llama-bench -m \$MODEL -ngl 99 -fa 1 -p 512,4096 -n 128 -r 2 -o md 2>&1 | tee llama-bench.md
  [ "${QK_LLAMA_PREFILL_ONLY:-0}" = 1 ] \
    || \$B/bin/llama-bench -m \$MODEL -ngl 99 -fa 1 -p 0 -n 128 -d ${QK_LLAMA_DEPTHS:-8192,32000} -r 2 -o md 2>&1 | tee -a llama-bench.md
  \$B/bin/llama-bench -m \$MODEL -ngl 99 -fa 1 -p 32768 -n 0 -r 1 -o md 2>&1 | tee -a llama-bench.md
  if [ "${QK_LLAMA_PREFILL_ONLY:-0}" != 1 ]; then
    echo "== llama.cpp CUDA: llama-batched-bench, 8 streams"
    \$B/bin/llama-batched-bench -m \$MODEL -ngl 99 -fa on -c 16384 -npp 64 -ntg 128 -npl 1,2,8 2>&1 \
      | grep -E "^\|" | tee llama-batched.txt
  fi
fi
date -u
EOF
setsid bash -c "bash $WORK/run.sh > $WORK/engine.log 2>&1; touch $WORK/done" < /dev/null > /dev/null 2>&1 &
echo "started: $WORK/run.sh ($LAYERS layers)"
