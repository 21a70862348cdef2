// The kernel bench's read floor: each invocation issues LOADS independent loads of VEC words (all
// before any is used) from a grid that covers its P.threads · LOADS elements once, folds them into
// one word and stores it only if it equals P.never (it never does): the least time any kernel
// reading that many bytes in one dispatch of this grid can take.
#include "common.wgsl"
#define WG 64
#define LOADS 4
#define VEC 1

#params ReadFloorParams

var<immediate> P: ReadFloorParams;
#if VEC == 4
@group(0) @binding(0) var<storage, read> SRC: array<vec4<u32>>;
#else
@group(0) @binding(0) var<storage, read> SRC: array<u32>;
#endif
@group(0) @binding(1) var<storage, read_write> OUT: array<u32>;

@compute @workgroup_size({{WG}})
fn main(ids: ComputeIds) {
    let t = group_index(ids) * {{WG}}u + ids.lid;
#if VEC == 4
    var acc = vec4<u32>(0u);
#else
    var acc = 0u;
#endif
#for j in 0..LOADS
    let v{{j}} = SRC[t + {{j}}u * P.threads];
#endfor
#for j in 0..LOADS
    acc ^= v{{j}};
#endfor
#if VEC == 4
    let folded = acc.x ^ acc.y ^ acc.z ^ acc.w;
#else
    let folded = acc;
#endif
    if folded == P.never {
        OUT[ids.lid] = folded;
    }
}
