// What the attention kernels over the cache (attention.wgsl's decode, prefill and merge,
// attention_coop.wgsl) share: their parameters (immediates P), the split plan of a row or tile,
// where a (row, head, split) partial lives, and the stand-in for -inf.

// The immediates, declared with their field docs in rust/ops/attention.rs (CoreParams).
#params CoreParams

// Stands in for -inf: exp(MASKED - finite) is exactly 0 and never a NaN.
const MASKED: f32 = -3.0e38;

// The partial entry of row r, head h, split `split` (PART_O holds HEAD_DIM floats per entry,
// PART_ML one (max, sum) pair).
fn part_index(r: u32, h: u32, split: u32) -> u32 {
    return (r * P.heads + h) * P.split_stride + split;
}

// (split length, splits) for `n` keys.
fn plan(n: u32) -> vec2<u32> {
    var len = P.min_split;
    while len * P.max_splits < n {
        len *= 2u;
    }
    return vec2<u32>(len, (n + len - 1u) / len);
}
