// Partial NeoX rotary embedding, in place: for each (token, head) the pairs (i, i + n_rot/2),
// i < n_rot/2, of the first n_rot dims are rotated by pos * base^(-2i/n_rot); the other dims are
// untouched. One invocation per pair. Positions are base + t, or base + positions[t] when
// pos_from_buffer is set (several sequences in one step). For text input the qwen35 IMROPE is
// exactly this (spec model.md §3.5 step 3).

struct RopeParams {
    tokens: u32,
    heads: u32,
    n_rot: u32,
    pos_from_buffer: u32,
    offset: u32,
    token_stride: u32,
    head_stride: u32,
    pos_base: u32,
    theta_base: f32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

const WG: u32 = 64u;
const TWO_PI: f32 = 6.283185307179586;
// 2*pi split into a short head (exactly 201/32, so k * HEAD is exact for k < 2^16) and the rest,
// so the range reduction below stays accurate up to angles of ~4e5 rad (262144 positions * 1).
const TWO_PI_HEAD: f32 = 6.28125;
const TWO_PI_TAIL: f32 = 0.0019353071795864769;

@group(0) @binding(0) var<uniform> params: RopeParams;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read> positions: array<u32>;

@compute @workgroup_size(WG)
fn rope_neox(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_index) lid: u32) {
    let half = params.n_rot / 2u;
    let index = (wid.x + wid.y * nwg.x) * WG + lid;
    if index >= params.tokens * params.heads * half {
        return;
    }
    let i = index % half;
    let h = (index / half) % params.heads;
    let t = index / (half * params.heads);
    var pos = params.pos_base + t;
    if params.pos_from_buffer != 0u {
        pos = params.pos_base + positions[t];
    }
    let theta = exp2(-2.0 * f32(i) / f32(params.n_rot) * log2(params.theta_base));
    // The angle is rounded to f32 like llama.cpp does; only its reduction to [-pi, pi] is done
    // carefully, because Vulkan only bounds sin/cos error inside that range.
    let angle = f32(pos) * theta;
    let k = round(angle / TWO_PI);
    let reduced = (angle - k * TWO_PI_HEAD) - k * TWO_PI_TAIL;
    let c = cos(reduced);
    let s = sin(reduced);
    let base = params.offset + t * params.token_stride + h * params.head_stride + i;
    let x0 = x[base];
    let x1 = x[base + half];
    x[base] = x0 * c - x1 * s;
    x[base + half] = x0 * s + x1 * c;
}
