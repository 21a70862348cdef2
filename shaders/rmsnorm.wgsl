// Row normalisations of f32 activations: RMSNorm (optionally on x + residual, writing the sum too),
// gated RMSNorm (times SiLU(z)) and L2 norm. One workgroup per row; a row is (token t, head h) and
// lives at offset + t*token_stride + h*head_stride, so per-head norms over interleaved layouts
// (q/gate of full attention, q/k of the DeltaNet conv output) need no copy. The weight (length n)
// is shared by every head. Reductions use workgroup memory only, so no subgroup feature is needed.

struct NormParams {
    tokens: u32,
    heads: u32,
    n: u32,
    _pad0: u32,
    src_offset: u32,
    src_token_stride: u32,
    src_head_stride: u32,
    _pad1: u32,
    dst_offset: u32,
    dst_token_stride: u32,
    dst_head_stride: u32,
    _pad2: u32,
    eps: f32,
    // Multiplies the result (the 1/sqrt(dk) query scale of the DeltaNet L2 norm; 1 elsewhere).
    scale: f32,
    _pad3: u32,
    _pad4: u32,
}

const WG: u32 = 64u;

@group(0) @binding(0) var<uniform> params: NormParams;
@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read> weight: array<f32>;
@group(0) @binding(3) var<storage, read_write> dst: array<f32>;
// rms_norm_residual: the residual added to src; rms_norm_gated: the gate z (same layout as src).
@group(0) @binding(4) var<storage, read> other: array<f32>;
// rms_norm_residual: receives src + other.
@group(0) @binding(5) var<storage, read_write> sum_out: array<f32>;

var<workgroup> partial: array<f32, WG>;

fn row_index(wid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return wid.x + wid.y * nwg.x;
}

fn src_base(row: u32) -> u32 {
    let t = row / params.heads;
    let h = row % params.heads;
    return params.src_offset + t * params.src_token_stride + h * params.src_head_stride;
}

fn dst_base(row: u32) -> u32 {
    let t = row / params.heads;
    let h = row % params.heads;
    return params.dst_offset + t * params.dst_token_stride + h * params.dst_head_stride;
}

// Sum of `value` over the workgroup; every invocation gets the total.
fn workgroup_sum(lid: u32, value: f32) -> f32 {
    partial[lid] = value;
    workgroupBarrier();
    for (var width = WG / 2u; width > 0u; width = width / 2u) {
        if lid < width {
            partial[lid] = partial[lid] + partial[lid + width];
        }
        workgroupBarrier();
    }
    let total = partial[0];
    // Keeps a following call from overwriting partial[0] before everyone has read it.
    workgroupBarrier();
    return total;
}

fn silu(x: f32) -> f32 {
    return x / (1.0 + exp(-x));
}

@compute @workgroup_size(WG)
fn rms_norm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    let row = row_index(wid, nwg);
    if row >= params.tokens * params.heads {
        return;
    }
    let s = src_base(row);
    var sq = 0.0;
    for (var i = lid; i < params.n; i += WG) {
        let v = src[s + i];
        sq += v * v;
    }
    let total = workgroup_sum(lid, sq);
    let inv = inverseSqrt(total / f32(params.n) + params.eps) * params.scale;
    let d = dst_base(row);
    for (var i = lid; i < params.n; i += WG) {
        dst[d + i] = src[s + i] * inv * weight[i];
    }
}

@compute @workgroup_size(WG)
fn rms_norm_residual(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                     @builtin(local_invocation_index) lid: u32) {
    let row = row_index(wid, nwg);
    if row >= params.tokens * params.heads {
        return;
    }
    let s = src_base(row);
    var sq = 0.0;
    for (var i = lid; i < params.n; i += WG) {
        let v = src[s + i] + other[s + i];
        sum_out[s + i] = v;
        sq += v * v;
    }
    let total = workgroup_sum(lid, sq);
    let inv = inverseSqrt(total / f32(params.n) + params.eps) * params.scale;
    let d = dst_base(row);
    for (var i = lid; i < params.n; i += WG) {
        // Recomputed rather than read back from sum_out: another invocation wrote most of it.
        let v = src[s + i] + other[s + i];
        dst[d + i] = v * inv * weight[i];
    }
}

@compute @workgroup_size(WG)
fn rms_norm_gated(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_index) lid: u32) {
    let row = row_index(wid, nwg);
    if row >= params.tokens * params.heads {
        return;
    }
    let s = src_base(row);
    var sq = 0.0;
    for (var i = lid; i < params.n; i += WG) {
        let v = src[s + i];
        sq += v * v;
    }
    let total = workgroup_sum(lid, sq);
    let inv = inverseSqrt(total / f32(params.n) + params.eps) * params.scale;
    let d = dst_base(row);
    for (var i = lid; i < params.n; i += WG) {
        dst[d + i] = src[s + i] * inv * weight[i] * silu(other[s + i]);
    }
}

@compute @workgroup_size(WG)
fn l2_norm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) lid: u32) {
    let row = row_index(wid, nwg);
    if row >= params.tokens * params.heads {
        return;
    }
    let s = src_base(row);
    var sq = 0.0;
    for (var i = lid; i < params.n; i += WG) {
        let v = src[s + i];
        sq += v * v;
    }
    let total = workgroup_sum(lid, sq);
    // llama.cpp form x / max(|x|, eps) (spec model.md §3.2 step 5).
    let inv = params.scale / max(sqrt(total), params.eps);
    let d = dst_base(row);
    for (var i = lid; i < params.n; i += WG) {
        dst[d + i] = src[s + i] * inv;
    }
}
