// Device-to-device copy as a compute kernel (16 bytes per invocation and step, grid-stride), so a
// copy can sit inside a compute pass without ending it, and the bandwidth baseline of the bench.
#include "common.wgsl"
#define WG 256

// The immediates, declared with their field docs in rust/gpu/example.rs (CopyParams).
#params CopyParams

var<immediate> P: CopyParams;
@group(0) @binding(0) var<storage, read> SRC: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read_write> DST: array<vec4<u32>>;

@compute @workgroup_size({{WG}})
fn main(ids: ComputeIds) {
    for (var i = group_index(ids) * {{WG}}u + ids.lid; i < P.n; i += P.stride) {
        DST[i] = SRC[i];
    }
}
