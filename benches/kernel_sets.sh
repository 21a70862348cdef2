# The kernel micro-benchmark's sets (benches/kernels.rs): the environment each one runs under, for
# benches/h200_engine.sh's foreground `kernels` mode and its background run alike. A name the list
# does not know is an error, not the whole benchmark.
KERNEL_SETS="all decode engine projections prefill moe deltanet attention attention_decode moe_cold gdn_step matvec host read_floor"

kernel_set_clear() {
  unset QK_BENCH_ONLY_DECODE QK_BENCH_ONLY_PREFILL QK_BENCH_NO_ATTENTION QK_BENCH_ONLY_ATTENTION \
    QK_BENCH_ONLY_ATTENTION_DECODE QK_BENCH_ONLY_MOE QK_BENCH_ONLY_MOE_COLD QK_BENCH_ONLY_DELTANET \
    QK_BENCH_ONLY_ENGINE_PROJECTIONS QK_BENCH_ONLY_NORM_PROJECTIONS QK_BENCH_ONLY_GDN_STEP QK_BENCH_ONLY_MATVEC QK_BENCH_ONLY_HOST \
    QK_BENCH_ONLY_READ_FLOOR
}

# kernel_set_env SET: export SET's variables (after clearing every set's).
kernel_set_env() {
  kernel_set_clear
  case $1 in
    all) ;;
    decode) export QK_BENCH_ONLY_DECODE=1 ;;
    engine) export QK_BENCH_ONLY_ENGINE_PROJECTIONS=1 QK_BENCH_NO_ATTENTION=1 ;;
    projections) export QK_BENCH_ONLY_NORM_PROJECTIONS=1 QK_BENCH_NO_ATTENTION=1 ;;
    prefill) export QK_BENCH_ONLY_PREFILL=1 QK_BENCH_NO_ATTENTION=1 ;;
    moe) export QK_BENCH_ONLY_MOE=1 QK_BENCH_NO_ATTENTION=1 ;;
    deltanet) export QK_BENCH_ONLY_DELTANET=1 QK_BENCH_NO_ATTENTION=1 ;;
    attention) export QK_BENCH_ONLY_ATTENTION=1 ;;
    attention_decode) export QK_BENCH_ONLY_ATTENTION_DECODE=1 ;;
    moe_cold) export QK_BENCH_ONLY_MOE_COLD=1 ;;
    gdn_step) export QK_BENCH_ONLY_GDN_STEP=1 ;;
    matvec) export QK_BENCH_ONLY_MATVEC=1 QK_BENCH_TYPES="${QK_BENCH_TYPES:-IQ4_XS,Q8_0,Q6_K,F16}" ;;
    host) export QK_BENCH_ONLY_HOST=1 ;;
    read_floor) export QK_BENCH_ONLY_READ_FLOOR=1 ;;
    *) echo "unknown kernel set '$1' (sets: $KERNEL_SETS)" >&2; return 1 ;;
  esac
}

# kernel_sets_check SETS...: every name known, before any device time is spent.
kernel_sets_check() {
  local s
  for s in "$@"; do
    kernel_set_env "$s" || return 1
  done
  kernel_set_clear
}
