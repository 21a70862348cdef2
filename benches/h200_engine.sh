#!/usr/bin/env bash
# Runs ON the H200 device machine (see benches/device_prepare.sh, which fills .device/ and packs
# llama.cpp's source into .ref.tar.xz). One command does the whole
# measurement: llama-bench (CUDA) builds while the random 80B-shaped model is written, then the GPU
# kernel tests and the engine tests against the committed goldens run (a fast number is never a wrong
# one), then qk and llama.cpp are measured side by side on the same file.
# usage: bash benches/h200_engine.sh [LAYERS]   (12 by default: the iteration size)
# env: QK_SKIP_TESTS=1, QK_SKIP_QK=1, QK_SKIP_LLAMA=1 leave a part out; QK_REUSE=1 adds the turn-2 TTFT
# bench, QK_SPLIT=1 the unsplit-vs-2-stage loopback bench (benches/split_bench.py), QK_KERNELS=1 the
# kernel micro-benchmark (cooperative matrix on and off).
set -uo pipefail
LAYERS="${1:-12}"
OUT="${OUT:-/tmp/qk-out}"; mkdir -p "$OUT"
exec > >(tee -a "$OUT/engine.log") 2>&1
# llama.cpp's trimmed source may travel packed (.ref.tar.xz) to stay inside the device tool's carry limit.
[ -d .ref/llama.cpp ] || [ ! -f .ref.tar.xz ] || python3 -c 'import tarfile; tarfile.open(".ref.tar.xz").extractall()'
for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig
[ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ] \
  && export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device/qk-*.whl || exit 1
# The package's Python sources come from this tree (newer than the wheel when only Python changed),
# its native module from the wheel.
cp /tmp/site/qk/_qk*.so python/qk/
export PYTHONPATH=$PWD/python:/tmp/site:$PWD/.device/gguf-py
MODEL=/tmp/next80b-$LAYERS.gguf
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader

B=/tmp/llb
[ "${QK_SKIP_LLAMA:-0}" = 1 ] || ( cmake -S .ref/llama.cpp -B $B -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DCMAKE_BUILD_TYPE=Release > /tmp/llb-cfg.log 2>&1 \
  && cmake --build $B -j "$(nproc)" --target llama-bench > /tmp/llb-build.log 2>&1
  rc=$?; echo "llama-bench build rc=$rc"; [ $rc = 0 ] || tail -n 25 /tmp/llb-cfg.log /tmp/llb-build.log ) &
BUILD=$!
( python3 benches/make_model.py $MODEL --vocab .device/vocab/ggml-vocab-qwen2.gguf --layers "$LAYERS" \
  > /tmp/make_model.log 2>&1; echo "model rc=$? $(tail -1 /tmp/make_model.log)" ) &
MAKE=$!

which cmake ninja nvcc
[ "${QK_SKIP_TESTS:-0}" = 1 ] || {
echo "== GPU kernel tests (cargo test binary)"
QK_REQUIRE_GPU=1 QK_REQUIRE_COOP=1 .device/rust-tests --test-threads=1 2>&1 | grep -E "^test result|FAILED|panicked|failures" | head -20
echo "== cooperative-matrix mat-mat against the CPU reference"
QK_REQUIRE_GPU=1 QK_REQUIRE_COOP=1 .device/rust-tests matmul_cooperative --test-threads=1 --nocapture 2>&1 | grep -iE "coop|exercised|test result"
echo "== engine tests against the committed goldens (no llama.cpp here)"
QK_VOCAB_QWEN2=$PWD/.device/vocab/ggml-vocab-qwen2.gguf QK_REQUIRE_GPU=1 \
  python3 -m pytest -q -p no:cacheprovider -m "not oracle" tests/test_engine*.py 2>&1 | tail -5
}
[ "${QK_KERNELS:-0}" = 1 ] && [ -x .device/kernels-bench ] && {
  echo "== kernel micro-benchmark (mat-mat lines show the tiled and cooperative kernels side by side)"
  .device/kernels-bench 2>&1 | tee "$OUT/kernels-bench.txt"
}
wait $MAKE
[ "${QK_SKIP_QK:-0}" = 1 ] || {
echo "== qk engine"
python3 benches/engine_bench.py $MODEL --prompt 512 --decode 64 --slots 2 --profile --top 20 | tee "$OUT/qk-bench.json"
}
if [ "${QK_REUSE:-0}" = 1 ]; then
  echo "== cross-turn reuse: turn-2 time to first token, 8k tokens of history"
  python3 benches/reuse_ttft.py --model $MODEL --history 8192 2>&1 | grep -v "^qk: layer" | tee "$OUT/reuse.txt"
fi
if [ "${QK_SPLIT:-0}" = 1 ]; then
  echo "== split serving on one GPU: unsplit vs head + worker over loopback"
  python3 benches/split_bench.py $MODEL --prompt 512 --decode 64 --ctx 2048 2>&1 | grep -v "^qk: layer" \
    | tee "$OUT/split.txt"
fi
[ "${QK_SKIP_LLAMA:-0}" = 1 ] && exit 0
wait $BUILD
echo "== llama.cpp CUDA (llama-bench, -fa 1)"
tail -3 /tmp/llb-build.log
$B/bin/llama-bench -m $MODEL -ngl 99 -fa 1 -p 512 -n 64 -r 2 -o md 2>&1 | tee "$OUT/llama-bench.md"
