#!/usr/bin/env bash
# Installs everything (system Vulkan driver, Python deps, the llama.cpp oracle, qk itself) and runs
# every check: formatting and lints, the Rust tests (GPU kernels on lavapipe) and the Python tests.
# QK_REQUIRE_GPU=1 (set by .ci/run) turns a missing GPU adapter into a failure instead of a skip.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
qk_system_packages
qk_python_env
qk_oracle
qk_build

phase "lint (cargo fmt, clippy, ruff)"
cargo fmt --check
cargo clippy -q --all-targets --no-default-features -- -D warnings
cargo clippy -q --lib -- -D warnings
ruff check python tests scripts benches
ruff format --check python tests scripts benches

phase "rust tests (core and GPU kernels, without Python)"
# One test at a time: engines of one process share one device and its counters, and the tests that
# count a step's submits would count a neighbour's too (lavapipe: ~30 s instead of ~20).
cargo test -q --no-default-features -- --test-threads=1

phase "python tests"
python -m pytest -q -p no:cacheprovider

phase_end
