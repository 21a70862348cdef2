// Example kernel of the runtime: y[i] = a * x[i] + b over n floats, plus a workgroup sum written to
// partial[group] (exercises immediates, the 2-D grid and the reduction library).
#include "common.wgsl"
#include "common_reduce.wgsl"
#define WG 64
#variants WG=128

// The immediates, declared with their field docs in rust/gpu/example.rs (ScaleParams).
#params ScaleParams

var<immediate> P: ScaleParams;
@group(0) @binding(0) var<storage, read> X: array<f32>;
@group(0) @binding(1) var<storage, read_write> Y: array<f32>;
@group(0) @binding(2) var<storage, read_write> PARTIAL: array<f32>;

@compute @workgroup_size({{WG}})
fn main(ids: ComputeIds) {
    let group = group_index(ids);
    let i = group * {{WG}}u + ids.lid;
    var v = 0.0;
    if i < P.n {
        v = P.a * X[i] + P.b;
        Y[i] = v;
    }
    let total = wg_sum(v, ids);
    if ids.lid == 0u && group * {{WG}}u < P.n {
        PARTIAL[group] = total;
    }
}
