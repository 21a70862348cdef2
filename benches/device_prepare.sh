#!/usr/bin/env bash
# Run HERE (the build machine) before a device run: builds what the H200 machine cannot (it has no
# Rust and no registry) into .device/ (git-ignored; carried by the device tool):
#   qk-*.whl          the abi3 wheel, release profile (what users run; every figure is taken with it)
#   rust-tests        the cargo integration-test binary (GPU kernel tests, run there on real hardware;
#                     test profile)
#   kernels-bench     the kernel micro-benchmark (benches/kernels.rs, release profile)
#   link-bench        the split's transport alone (benches/link.rs, release profile; no GPU)
#   gguf-py/          llama.cpp's gguf-py from the sdist (benches/make_model.py writes the model with it)
#   vocab/            the qwen2 vocabulary GGUF from the sdist
# and .ref.tar.xz: llama.cpp's source from the same sdist, cut to what llama-bench and
# llama-batched-bench need with the CUDA backend (the side-by-side reference, built there).
# The Vulkan loader debs live in .gl/ (the device tool's instructions).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/env.sh"
cd "$ROOT"
qk_python_env >/dev/null
rm -rf .device && mkdir -p .device/vocab
maturin build -q --release -o .device 2>&1 | { grep -v '^📦' || true; }
# The executable cargo built for target NAME, from cargo's JSON messages on stdin.
executable_of() {
  python -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == sys.argv[1]:
        print(m["executable"])' "$1"
}
cp "$(cargo test --no-default-features --no-run --message-format=json 2>/dev/null | executable_of rust)" \
  .device/rust-tests
cp "$(cargo build --release --no-default-features --bench kernels --message-format=json 2>/dev/null | executable_of kernels)" \
  .device/kernels-bench
cp "$(cargo build --release --no-default-features --bench link --message-format=json 2>/dev/null | executable_of link)" \
  .device/link-bench
strip .device/rust-tests .device/kernels-bench .device/link-bench
cp -r "$(python scripts/sdist.py gguf-py)" .device/gguf-py
cp "$(python scripts/sdist.py llama.cpp)/models/ggml-vocab-qwen2.gguf" .device/vocab/
# llama.cpp for the side-by-side numbers: the library, ggml with its CPU and CUDA backends, and the two
# bench tools; the other backends and tools stay behind (the device tool carries at most 64 MiB).
LL="$(python scripts/sdist.py llama.cpp)"
REF=$(mktemp -d)/llama.cpp
mkdir -p "$REF/tools"
cp -r "$LL"/{ggml,src,include,common,vendor,cmake,CMakeLists.txt} "$REF/"
cp -r "$LL/tools/llama-bench" "$LL/tools/batched-bench" "$REF/tools/"
printf 'add_subdirectory(llama-bench)\nadd_subdirectory(batched-bench)\n' > "$REF/tools/CMakeLists.txt"
for b in sycl cann musa opencl hip metal zdnn hexagon openvino vulkan webgpu zendnn blas et virtgpu; do
  rm -rf "$REF/ggml/src/ggml-$b"
done
tar -C "$(dirname "$REF")" -cJf .ref.tar.xz llama.cpp
du -sh .device .ref.tar.xz
