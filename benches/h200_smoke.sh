#!/usr/bin/env bash
# Runs ON the H200 device machine, from the repo root, with `.gl` and `.device` carried (built here by
# benches/device_prepare.sh). Sets up the Vulkan loader as the device README says, installs the qk
# wheel, enumerates adapters, runs the cargo test binary (GPU kernel tests take paths lavapipe never
# does there: subgroup size 32, bindings over 128 MiB, cooperative matrix), then the kernel benchmark.
# Everything it prints also lands in $OUT/smoke.log.
set -uo pipefail
OUT="${OUT:-/tmp/qk-out}"; mkdir -p "$OUT"
exec > >(tee -a "$OUT/smoke.log") 2>&1
source benches/device_vulkan.sh
echo "== host"; date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device/qk-*.whl || exit 1
export PYTHONPATH=/tmp/site
echo "== adapters"
python3 -c 'import qk._qk as q; [print(a) for a in q.adapters()]'
echo "== cargo test binary (all Rust tests; GPU ones on this adapter)"
QK_REQUIRE_GPU=1 .device/rust-tests --test-threads=1 2>&1 | tail -40
if [ -x .device/kernels-bench ]; then
  echo "== kernel micro-benchmark"
  .device/kernels-bench 2>&1 | tee "$OUT/kernels-bench.txt"
fi
