#!/usr/bin/env bash
# Installs qk on this machine (Vulkan driver, venv, the native core as an optimised release build)
# and serves a model over HTTP on 127.0.0.1:8080. With no arguments it serves the built-in demo model
# (random weights: its replies are noise; it shows the whole path working). Any arguments go to
# `python -m qk.serve`, e.g.
#   bash scripts/run.sh --model Qwen3-Next-80B-A3B-Instruct-IQ4_XS.gguf --slots 4
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
qk_system_packages
qk_python_env
qk_build release
phase "qk.serve"
exec python -m qk.serve "$@"
