#!/usr/bin/env bash
# A split chain over two vendors' adapters on the H200 machine: the head on the H200 through NVIDIA's
# Vulkan driver, the worker on Mesa's lavapipe (the CPU), both ICDs visible to both processes and
# --device choosing per process (README "Splitting a model across machines"). Two phases:
#   bash benches/h200_mixed.sh fetch          HERE: download the Vulkan loader and the Mesa driver debs
#                                              and pack lavapipe with the libraries it needs into .mesa/
#   bash benches/h200_mixed.sh fixture        ON the H200: the tiny fixture, fast and --precise
#   bash benches/h200_mixed.sh model [LAYERS] ON the H200: a random 80B-shaped model cut to LAYERS
#                                              layers (default 4), written there
# The H200 phases carry .mesa, .device/qk-*.whl and .device/gguf-py (benches/device_prepare.sh builds
# the last two); each fits one device call, and on a warm machine the second reuses the first's
# set-up and Mesa's shader cache. Each prints the adapters, then benches/split_bench.py's JSON (tokens
# against unsplit on each adapter; ms/token unsplit on the H200 and split across the two) and a
# one-line verdict. Results land in $OUT.
#
# Why a packed subset and not the debs themselves: the debs (driver, LLVM 15, Z3, ICU, X and
# compression libraries) come to 51 MB, which with the 19 MB tree and the 3.5 MB wheel passes the
# device tool's 64 MiB; lavapipe's own closure, xz -9e, is 40 MB. `run` unpacks it under /tmp (a
# private prefix, never /) and puts only the libraries the machine lacks on LD_LIBRARY_PATH.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

# What lavapipe (Debian 12's mesa-vulkan-drivers) needs beyond glibc and the C++ runtime.
DEBS="libvulkan1 mesa-vulkan-drivers libllvm15 libz3-4 libicu72 libxml2 libedit2 libbsd0 libmd0 libtinfo6
  libffi8 libdrm2 libexpat1 libzstd1 libxcb1 libx11-xcb1 libxcb-dri3-0 libxcb-present0 libxcb-xfixes0
  libxcb-sync1 libxcb-randr0 libxcb-shm0 libxshmfence1 libwayland-client0 libxau6 libxdmcp6 liblzma5 zlib1g"
# Provided by every machine's own C and C++ runtime: never packed, never shadowed.
SYSTEM='^(libc|libm|libpthread|libdl|librt|libstdc\+\+|libgcc_s|ld-linux-x86-64)\.so'

fetch() {
  local tmp lib
  tmp=$(mktemp -d)
  mkdir -p "$tmp/debs" "$tmp/x" "$tmp/pack/lib" /tmp/amd64/partial
  local o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
  apt-get $o update -qq || return 1
  # shellcheck disable=SC2086
  (cd "$tmp/debs" && apt-get $o download $DEBS) >/dev/null || return 1
  for f in "$tmp"/debs/*.deb; do dpkg -x "$f" "$tmp/x"; done
  lib="$tmp/x/usr/lib/x86_64-linux-gnu"
  # lavapipe and the closure of its NEEDED libraries, found in the unpacked debs.
  local todo=(libvulkan_lvp.so) seen=" " n p
  while [ ${#todo[@]} -gt 0 ]; do
    n=${todo[0]}; todo=("${todo[@]:1}")
    [[ "$seen" == *" $n "* ]] && continue
    seen="$seen$n "
    p=$(ls "$lib/$n" "$tmp/x/lib/x86_64-linux-gnu/$n" 2>/dev/null | head -1)
    [ -n "$p" ] || { echo "fetch: $n is in none of the debs" >&2; return 1; }
    cp -L "$p" "$tmp/pack/lib/$n"
    for need in $(readelf -d "$p" | awk '/NEEDED/ {gsub(/[][]/, "", $5); print $5}'); do
      [[ "$need" =~ $SYSTEM ]] || todo+=("$need")
    done
  done
  rm -rf .mesa && mkdir -p .mesa
  cp "$tmp"/debs/libvulkan1_*.deb .mesa/
  tar -C "$tmp/pack" -cf - lib | xz -9e -T2 > .mesa/lavapipe.tar.xz
  for f in "$tmp"/debs/*.deb; do dpkg-deb -W --showformat='${Package}=${Version}\n' "$f"; done > .mesa/SOURCES
  ls "$tmp/pack/lib" > .mesa/LIBS
  rm -rf "$tmp"
  du -sh .mesa/*
  grep -qx '/.mesa/' "$(git rev-parse --git-common-dir)/info/exclude" 2>/dev/null \
    || echo "note: add /.mesa/ to $(git rev-parse --git-common-dir)/info/exclude so it never travels by accident"
}

# Lavapipe under /tmp/qk-mesa, an ICD file naming it, and the libraries this machine lacks linked
# into one folder for LD_LIBRARY_PATH (the machine's own copies of the rest stay in charge).
install_lavapipe() {
  local prefix=/tmp/qk-mesa missing n round
  rm -rf $prefix && mkdir -p $prefix/need
  # Python's tarfile, not tar -J: the machine's image need not carry xz.
  python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' .mesa/lavapipe.tar.xz $prefix \
    || return 1
  cat > $prefix/lvp_icd.json <<EOF
{"file_format_version": "1.0.0", "ICD": {"library_path": "$prefix/lib/libvulkan_lvp.so", "api_version": "1.1.230"}}
EOF
  for round in 1 2 3 4 5 6; do
    missing=$(LD_LIBRARY_PATH=$prefix/need ldd $prefix/lib/libvulkan_lvp.so | awk '/not found/ {print $1}')
    [ -z "$missing" ] && break
    for n in $missing; do ln -sf $prefix/lib/"$n" $prefix/need/"$n"; done
  done
  echo "lavapipe: libraries this machine lacked: $(ls $prefix/need | tr '\n' ' ')"
  LD_LIBRARY_PATH=$prefix/need ldd $prefix/lib/libvulkan_lvp.so | grep "not found" && return 1
  export LD_LIBRARY_PATH=$prefix/need${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  LVP_ICD=$prefix/lvp_icd.json
}

verdict() {  # one line from a split_bench JSON: tokens per reference adapter, ms/token
  python3 - "$1" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
refs = ", ".join(f"{a}: {'identical' if ok else 'DIFFERENT'}" for a, ok in r["tokens_identical_per_reference"].items())
s = r.get("split_lanes1", {})
print(f"verdict {r['model']} precise={r['precise']}: head {r['adapter']} -> worker {r['worker_adapter']}; "
      f"tokens vs unsplit on {refs}; unsplit {r['unsplit']['single_ms_per_token']} ms/token, "
      f"mixed split {s.get('single_ms_per_token')} ms/token, 2-slot {s.get('two_slot_aggregate_tok_s')} tok/s")
for adapter, diffs in r.get("differences", {}).items():
    for run, d in list(diffs.items())[:4]:
        print(f"  {adapter} {run}: {d}")
EOF
}

setup() {
  local nv=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
  OUTDIR="${OUT:-/tmp/qk-mixed-out}"
  mkdir -p "$OUTDIR"
  if [ -d .gl ]; then for f in .gl/*.deb; do dpkg -x "$f" /; done; else dpkg -x .mesa/libvulkan1_*.deb /; fi
  ldconfig
  install_lavapipe || { echo "lavapipe could not be installed"; return 1; }
  [ -f $nv ] || nv=$(ls /usr/share/vulkan/icd.d/nvidia_icd*.json /etc/vulkan/icd.d/nvidia_icd*.json 2>/dev/null | head -1)
  export VK_DRIVER_FILES="$nv:$LVP_ICD" VK_ICD_FILENAMES="$nv:$LVP_ICD"
  mkdir -p /tmp/site
  [ -f /tmp/site/qk/__init__.py ] \
    || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device/qk-*.whl || return 1
  cp /tmp/site/qk/_qk*.so python/qk/
  export PYTHONPATH=$ROOT/python:/tmp/site:$ROOT/.device/gguf-py PYTHONUNBUFFERED=1
  date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; echo "cpus: $(nproc)"
  python3 -c 'from qk import _qk; [print("adapter", a) for a in _qk.adapters()]' | tee "$OUTDIR/adapters.txt"
}

# split_bench.py with the head on the H200 and the worker on lavapipe; NAME.json, NAME.err in $OUTDIR.
mixed() {
  local name=$1 limit=$2 model=$3; shift 3
  timeout "$limit" python3 benches/split_bench.py "$model" --device nvidia --worker-device llvmpipe \
    --lanes 1 "$@" > "$OUTDIR/$name.json" 2> "$OUTDIR/$name.err"
  echo "rc=$? ($name)"
  grep -v "^qk: layer" "$OUTDIR/$name.err" | tail -12
  cat "$OUTDIR/$name.json"
  verdict "$OUTDIR/$name.json"
}

fixture() {
  setup || return 1
  local fx=tests/fixtures/tiny-qwen3next-f32.gguf
  mixed fixture 270 $fx --prompt 80 --decode 16 --ctx 512
  mixed fixture-precise 270 $fx --prompt 80 --decode 16 --ctx 512 --precise
}

model() {
  setup || return 1
  local layers="$1" model=/tmp/next80b-$1.gguf
  # The fixture's 465-token vocabulary: the layers are the real model's, the LM head is small.
  [ -f "$model" ] || timeout 120 python3 benches/make_model.py "$model" --vocab tests/fixtures/tiny-qwen3next-f32.gguf \
    --layers "$layers" > /tmp/make_model.log 2>&1
  echo "model: $(tail -1 /tmp/make_model.log 2>/dev/null)"
  mixed "next80b-$layers" 480 "$model" --prompt 80 --decode 12 --ctx 512
}

case "${1:-}" in
fetch) fetch ;;
fixture) fixture ;;
model) model "${2:-4}" ;;
*) echo "usage: $0 fetch | fixture | model [LAYERS]"; exit 2 ;;
esac
