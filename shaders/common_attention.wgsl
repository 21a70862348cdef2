// What the attention kernels over the cache (attention.wgsl's decode, prefill and merge,
// attention_coop.wgsl) share: their parameters (immediates P), the split plan of a row or tile,
// where a (row, head, split) partial lives, and the stand-in for -inf.

struct CoreParams {
    // Rows of the dispatch; with rows_from_buffer = 0 row r is (slot, pos + r).
    rows: u32,
    rows_from_buffer: u32,
    slot: u32,
    pos: u32,
    heads: u32,
    kv_heads: u32,
    // Positions per slot in the cache, and the slots [first_slot, first_slot + slots) it holds.
    ctx: u32,
    first_slot: u32,
    slots: u32,
    // Prepared q (f32): row r head h at q_offset + r * q_row_stride + h * HEAD_DIM.
    q_offset: u32,
    q_row_stride: u32,
    // Gate logits (merge): row r head h dim d at gate_offset + r * gate_row_stride + h * gate_head_stride + d.
    gate_offset: u32,
    gate_row_stride: u32,
    gate_head_stride: u32,
    gated: u32,
    // Output: row r head h at out_offset + r * out_row_stride + h * HEAD_DIM.
    out_offset: u32,
    out_row_stride: u32,
    // Partial entries per (row, head), and the split plan.
    split_stride: u32,
    min_split: u32,
    max_splits: u32,
    // Rows per query tile (prefill TT; decode 1): the merge recomputes its tile's plan.
    tile_rows: u32,
    scale: f32,
}

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
