#!/usr/bin/env bash
# Installs qk on this machine and runs its main job. Until the HTTP server lands, that is
# `python -m qk.info` on a model: pass a GGUF path, or get the committed tiny fixture.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
qk_system_packages
qk_python_env
qk_build
phase "qk.info"
model="${1:-$ROOT/tests/fixtures/tiny-qwen3next-f32.gguf}"
python -m qk.info "$model"
