#!/usr/bin/env bash
# Run HERE (the build machine) before a device run: builds what the H200 machine cannot (it has no
# Rust and no registry) into .device/ (git-ignored; carried by the device tool):
#   qk-*.whl          the abi3 wheel (same dev profile as every other build)
#   rust-tests        the cargo integration-test binary (GPU kernel tests, run there on real hardware)
#   kernels-bench     the kernel micro-benchmark (benches/kernels.rs)
#   gguf-py/          llama.cpp's gguf-py from the sdist (writes the random 80B-shaped model)
#   vocab/            the qwen2 vocabulary GGUF from the sdist
#   make_big.py       ../shared/tools' random 80B-shaped model writer
# The Vulkan loader debs live in .gl/ (see the device README).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/env.sh"
cd "$ROOT"
qk_python_env >/dev/null
rm -rf .device && mkdir -p .device/vocab
maturin build -q -o .device 2>&1 | grep -v '^📦' || true
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
cp "$(cargo build --no-default-features --bench kernels --message-format=json 2>/dev/null | executable_of kernels)" \
  .device/kernels-bench
strip .device/rust-tests .device/kernels-bench
cp -r "$(python scripts/sdist.py gguf-py)" .device/gguf-py
cp "$(python scripts/sdist.py llama.cpp)/models/ggml-vocab-qwen2.gguf" .device/vocab/
# The random full-size model writer is a shared tool beside the checkout (shared/ does not travel).
cp "$ROOT/../shared/tools/make_big.py" .device/
du -sh .device
