// Workgroup-wide sums and maxima of vec4 values, by subgroup operations where the device has them
// (any subgroup size: lavapipe runs 8 lanes, NVIDIA 32) and by a shared-memory tree otherwise.
// The including kernel defines WG (its workgroup size, a power of two) and includes common.wgsl.
// Every invocation of the workgroup must call these in uniform control flow; all get the result.

// naga needs no `enable` for subgroup built-ins (it rejects `enable subgroups;`): the device
// feature SUBGROUP is what allows them.

var<workgroup> reduce_scratch: array<vec4<f32>, {{WG}}>;

#if SUBGROUPS
fn wg_sum4(v: vec4<f32>, ids: ComputeIds) -> vec4<f32> {
    let s = subgroupAdd(v);
    workgroupBarrier();
    if ids.sg_lane == 0u {
        reduce_scratch[ids.sg_id] = s;
    }
    workgroupBarrier();
    var t = reduce_scratch[0];
    for (var i = 1u; i < ids.n_sg; i++) {
        t += reduce_scratch[i];
    }
    return t;
}

fn wg_max4(v: vec4<f32>, ids: ComputeIds) -> vec4<f32> {
    let s = subgroupMax(v);
    workgroupBarrier();
    if ids.sg_lane == 0u {
        reduce_scratch[ids.sg_id] = s;
    }
    workgroupBarrier();
    var t = reduce_scratch[0];
    for (var i = 1u; i < ids.n_sg; i++) {
        t = max(t, reduce_scratch[i]);
    }
    return t;
}
#else
fn wg_sum4(v: vec4<f32>, ids: ComputeIds) -> vec4<f32> {
    workgroupBarrier();
    reduce_scratch[ids.lid] = v;
    workgroupBarrier();
    for (var s = {{WG}}u / 2u; s > 0u; s >>= 1u) {
        if ids.lid < s {
            reduce_scratch[ids.lid] += reduce_scratch[ids.lid + s];
        }
        workgroupBarrier();
    }
    return reduce_scratch[0];
}

fn wg_max4(v: vec4<f32>, ids: ComputeIds) -> vec4<f32> {
    workgroupBarrier();
    reduce_scratch[ids.lid] = v;
    workgroupBarrier();
    for (var s = {{WG}}u / 2u; s > 0u; s >>= 1u) {
        if ids.lid < s {
            reduce_scratch[ids.lid] = max(reduce_scratch[ids.lid], reduce_scratch[ids.lid + s]);
        }
        workgroupBarrier();
    }
    return reduce_scratch[0];
}
#endif

fn wg_sum(v: f32, ids: ComputeIds) -> f32 {
    return wg_sum4(vec4<f32>(v, 0.0, 0.0, 0.0), ids).x;
}

fn wg_max(v: f32, ids: ComputeIds) -> f32 {
    return wg_max4(vec4<f32>(v), ids).x;
}
