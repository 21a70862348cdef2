// Small fused element-wise ops on f32 rows: SiLU(gate)*up, residual add, sigmoid gating, row copy
// (e.g. V rows into the KV cache), and the MoE combine (weighted expert outputs plus the shared
// expert times sigmoid(gate logit), optionally accumulated into the residual stream).
// Operand X of row r, element i sits at x_offset + r * x_stride + i. One invocation per element.

struct EwParams {
    rows: u32,
    n: u32,
    a_offset: u32,
    a_stride: u32,
    b_offset: u32,
    b_stride: u32,
    out_offset: u32,
    out_stride: u32,
    // moe_combine: expert weights of row r at weights_offset + r * weights_stride + e.
    weights_offset: u32,
    weights_stride: u32,
    // moe_combine: experts per row; their outputs are n apart within a row of a.
    experts: u32,
    // moe_combine: 1 adds the result to out instead of overwriting it.
    accumulate: u32,
    // moe_combine: shared-expert gate logit of row r at gate_offset + r * gate_stride.
    gate_offset: u32,
    gate_stride: u32,
    _pad0: u32,
    _pad1: u32,
}

const WG: u32 = 64u;

@group(0) @binding(0) var<uniform> params: EwParams;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<storage, read> weights: array<f32>;
@group(0) @binding(5) var<storage, read> gate: array<f32>;

fn element(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> u32 {
    return (wid.x + wid.y * nwg.x) * WG + lid;
}

fn sigmoid(x: f32) -> f32 {
    return 1.0 / (1.0 + exp(-x));
}

@compute @workgroup_size(WG)
fn silu_mul(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    let idx = element(wid, nwg, lid);
    if idx >= params.rows * params.n {
        return;
    }
    let r = idx / params.n;
    let i = idx % params.n;
    let g = a[params.a_offset + r * params.a_stride + i];
    out[params.out_offset + r * params.out_stride + i] = g * sigmoid(g) * b[params.b_offset + r * params.b_stride + i];
}

@compute @workgroup_size(WG)
fn add(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
       @builtin(local_invocation_index) lid: u32) {
    let idx = element(wid, nwg, lid);
    if idx >= params.rows * params.n {
        return;
    }
    let r = idx / params.n;
    let i = idx % params.n;
    out[params.out_offset + r * params.out_stride + i] =
        a[params.a_offset + r * params.a_stride + i] + b[params.b_offset + r * params.b_stride + i];
}

@compute @workgroup_size(WG)
fn mul_sigmoid(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let idx = element(wid, nwg, lid);
    if idx >= params.rows * params.n {
        return;
    }
    let r = idx / params.n;
    let i = idx % params.n;
    out[params.out_offset + r * params.out_stride + i] =
        a[params.a_offset + r * params.a_stride + i] * sigmoid(b[params.b_offset + r * params.b_stride + i]);
}

@compute @workgroup_size(WG)
fn copy_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_index) lid: u32) {
    let idx = element(wid, nwg, lid);
    if idx >= params.rows * params.n {
        return;
    }
    let r = idx / params.n;
    let i = idx % params.n;
    out[params.out_offset + r * params.out_stride + i] = a[params.a_offset + r * params.a_stride + i];
}

@compute @workgroup_size(WG)
fn moe_combine(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let idx = element(wid, nwg, lid);
    if idx >= params.rows * params.n {
        return;
    }
    let r = idx / params.n;
    let i = idx % params.n;
    var acc = 0.0;
    for (var e = 0u; e < params.experts; e++) {
        acc += weights[params.weights_offset + r * params.weights_stride + e]
            * a[params.a_offset + r * params.a_stride + e * params.n + i];
    }
    acc += sigmoid(gate[params.gate_offset + r * params.gate_stride]) * b[params.b_offset + r * params.b_stride + i];
    let o = params.out_offset + r * params.out_stride + i;
    if params.accumulate != 0u {
        acc += out[o];
    }
    out[o] = acc;
}
