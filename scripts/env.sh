# Sourced by the run/test scripts: installs what qk needs on a fresh Debian machine (system Vulkan
# driver, a venv with the Python deps, the llama.cpp oracle wheel built once per machine, qk itself)
# and leaves the venv active. Every step is idempotent, so a warm machine pays seconds.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
export QK_CACHE="${QK_CACHE:-$HOME/.cache/qk}"
# Prints the time the previous phase took, then the new phase's name.
_qk_phase_name=""; _qk_phase_start=$SECONDS; _qk_run_start=$SECONDS
phase() {
  if [ -n "$_qk_phase_name" ]; then
    printf '== %s took %ds\n' "$_qk_phase_name" $((SECONDS - _qk_phase_start))
  fi
  _qk_phase_name="$1"; _qk_phase_start=$SECONDS
  [ -n "$1" ] && printf '\n== %s (%s)\n' "$1" "$(date +%T)"
  return 0
}
phase_end() { phase ""; printf '== all phases: %ds\n' $((SECONDS - _qk_run_start)); }

qk_system_packages() {
  phase "system packages"
  local need=()
  for p in mesa-vulkan-drivers libvulkan1; do
    dpkg -s "$p" >/dev/null 2>&1 || need+=("$p")
  done
  if [ ${#need[@]} -gt 0 ]; then
    local sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
    $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
  fi
}

qk_python_env() {
  phase "python environment"
  [ -x "$ROOT/.venv/bin/python" ] || python3 -m venv "$ROOT/.venv"
  # shellcheck disable=SC1091
  . "$ROOT/.venv/bin/activate"
  python -m pip install -q --upgrade pip >/dev/null
  python -m pip install -q "maturin>=1.8,<2" numpy tokenizers starlette uvicorn jinja2 prometheus-client \
    pytest pytest-timeout hypothesis ruff httpx anthropic openai mypy
}

qk_oracle() {
  phase "oracle (llama-cpp-python 0.3.36 from its sdist, built once per machine)"
  python "$ROOT/scripts/sdist.py" root >/dev/null
  python -c "import gguf, sys; sys.exit(0 if hasattr(gguf.MODEL_ARCH, 'QWEN3NEXT') else 1)" 2>/dev/null \
    || python -m pip install -q "$(python "$ROOT/scripts/sdist.py" gguf-py)"
  python -c "import llama_cpp" 2>/dev/null \
    || python -m pip install -q --no-deps "$(python "$ROOT/scripts/sdist.py" wheel)" diskcache typing-extensions
}

# qk_build [dev|release]: the test command builds the dev profile (shared with cargo test: fast to
# compile, wgpu fully optimised); serving and benchmarks build release.
qk_build() {
  local profile="${1:-dev}" flags=()
  [ "$profile" = release ] && flags=(--release)
  phase "build (maturin develop, $profile profile)"
  # pipefail makes a failed build fail here; only maturin's progress lines are dropped.
  (cd "$ROOT" && maturin develop -q "${flags[@]}" 2>&1 | { grep -vE '^(📦|✏️|🛠|🔗|🐍)' || true; }) >&2
  python -c "import qk._qk"
}
