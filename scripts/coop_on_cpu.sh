#!/usr/bin/env bash
# Runs the cooperative-matrix kernels' tests on this machine's CPU: Mesa's lavapipe from Debian's
# unstable suite offers 8×8×8 f16 matrices (stable's does not), so the matrix kernels run their
# F = 8 form here instead of only on a GPU with tensor cores. Unstable's driver needs its own C
# library, so the test binary runs under unstable's loader, unpacked beside the system (nothing is
# installed). Usage: bash scripts/coop_on_cpu.sh [Rust test filters, default "coop tensor_core"], or with
# Python test files (e.g. tests/test_engine_fast.py: the fast engine's gates), run by the .venv that
# scripts/test.sh builds. Slow: lavapipe compiles each cooperative pipeline for up to minutes.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
QK_CACHE="${QK_CACHE:-$HOME/.cache/qk}"
DIR="$QK_CACHE/lavapipe-unstable"
LIB="$DIR/root/usr/lib/x86_64-linux-gnu"
FILTER="${1:-coop}"
# Rust test filters (libtest runs the tests matching any of them).
if [ $# -gt 0 ]; then filters=("$@"); else filters=(coop tensor_core); fi

if [ ! -e "$LIB/libvulkan_lvp.so" ]; then
  echo "unpacking Mesa's lavapipe from Debian unstable into $DIR" >&2
  rm -rf "$DIR" && mkdir -p "$DIR"/{state/lists/partial,cache/archives/partial,debs,root}
  # The system's own Debian mirror, with the unstable suite.
  mirror=$(grep -rshoE '(URIs:|deb) +[a-z]+://[^ ]+/debian/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d \
    | awk 'NR == 1 {print $2}' || true)
  [ -n "$mirror" ] || { echo "no Debian mirror in /etc/apt sources" >&2; exit 1; }
  echo "deb $mirror sid main" >"$DIR/sources.list"
  apt_opts=(-o "Dir::Etc::SourceList=$DIR/sources.list" -o Dir::Etc::SourceParts=/dev/null
    -o "Dir::State=$DIR/state" -o "Dir::State::Lists=$DIR/state/lists" -o "Dir::Cache=$DIR/cache"
    -o APT::Sandbox::User=root)
  apt-get "${apt_opts[@]}" update -qq >&2
  # The driver and everything it loads, the C library included.
  mapfile -t pkgs < <(apt-cache "${apt_opts[@]}" depends --recurse --no-recommends --no-suggests \
    --no-conflicts --no-breaks --no-replaces --no-enhances mesa-vulkan-drivers | grep -v '^ ' | grep -v '<' | sort -u)
  (cd "$DIR/debs" && apt-get "${apt_opts[@]}" download "${pkgs[@]}" >&2)
  for deb in "$DIR"/debs/*.deb; do dpkg-deb -x "$deb" "$DIR/root"; done
fi
icd="$DIR/lvp_icd.json"
sed "s#\"library_path\": \"[^\"]*\"#\"library_path\": \"$LIB/libvulkan_lvp.so\"#" \
  "$DIR/root/usr/share/vulkan/icd.d/lvp_icd.json" >"$icd"

cd "$ROOT"
log="$DIR/last-run.log"
under_unstable=(env VK_ICD_FILENAMES="$icd" QK_REQUIRE_GPU=1 "$LIB/ld-linux-x86-64.so.2" --library-path "$LIB")
if [[ "$FILTER" == *.py ]]; then
  # Only in-process engines see this driver: a test's subprocesses start under the system's loader.
  "${under_unstable[@]}" "$ROOT/.venv/bin/python" -m pytest -q -s -p no:cacheprovider "$@" 2>&1 | tee "$log"
  grep -q " passed" "$log" || { echo "no test ran" >&2; exit 1; }
  exit 0
fi
# The Rust test binary, built here against the system's C library (the newer one runs it).
bin=$(cargo test -q --no-default-features --test rust --no-run --message-format=json 2>/dev/null \
  | python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "rust":
        print(m["executable"])')
[ -n "$bin" ] || { echo "no test binary built" >&2; exit 1; }
"${under_unstable[@]}" "$bin" --test-threads=1 --nocapture "${filters[@]}" 2>&1 | tee "$log"
# Passing is not enough: the cooperative kernels must have run (the tests skip what a driver lacks).
grep -qE "\((f32|f16) accumulators|cooperative prefill attention .* worst row nmse" "$log" \
  || { echo "no cooperative kernel ran on lavapipe" >&2; exit 1; }
