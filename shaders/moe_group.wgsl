// Groups a batch's expert choices by expert for the grouped MoE mat-mat (common_matmul.wgsl,
// MOE 1), on the GPU so the ids never reach the host. One workgroup: it counts the entries
// (token t, slot s → index t·n_used + s) of every expert, turns the counts into offsets and a
// tile table (each expert's entries cut into tiles of at most TILE_COLS), and scatters the entry
// indices into expert order. The order inside an expert comes from atomics and may differ between
// runs; the mat-mat computes every column the same way wherever it sits, so results do not.
//
// GROUPS layout (u32): [0] tile count; offsets_at + e: first sorted entry of expert e (experts + 1
// values, the last the entry count); tiles_at + 2i, + 2i + 1: expert and first sorted entry of tile
// i; order_at + j: the j-th entry in expert order.
#include "common.wgsl"

// The immediates, declared with their field docs in rust/ops/matmul.rs (GroupParams).
#params GroupParams

const WG = 256u;
// Experts per invocation in the scan (router.wgsl's MAX_EXPERTS = 1024 = 4 × WG).
const PER = 4u;

var<immediate> P: GroupParams;
@group(0) @binding(0) var<storage, read> IDS: array<u32>;
@group(0) @binding(1) var<storage, read_write> GROUPS: array<u32>;

// Counts, then the scatter cursors.
var<workgroup> counts: array<atomic<u32>, 1024>;
// Running (entries, tiles) totals of each invocation's PER experts, scanned.
var<workgroup> scan: array<vec2<u32>, WG>;

@compute @workgroup_size(256)
fn main(ids: ComputeIds) {
    let lid = ids.lid;
    let entries = P.tokens * P.n_used;
    for (var e = lid; e < PER * WG; e += WG) {
        atomicStore(&counts[e], 0u);
    }
    workgroupBarrier();
    for (var i = lid; i < entries; i += WG) {
        let e = IDS[P.ids_offset + i];
        if e < P.experts {
            atomicAdd(&counts[e], 1u);
        }
    }
    workgroupBarrier();
    var mine: array<u32, PER>;
    var total = vec2<u32>(0u);
    for (var q = 0u; q < PER; q++) {
        mine[q] = atomicLoad(&counts[PER * lid + q]);
        total += vec2<u32>(mine[q], (mine[q] + P.tile_cols - 1u) / P.tile_cols);
    }
    scan[lid] = total;
    workgroupBarrier();
    // Inclusive Hillis-Steele scan over the invocations.
    for (var d = 1u; d < WG; d *= 2u) {
        var v = scan[lid];
        if lid >= d {
            v += scan[lid - d];
        }
        workgroupBarrier();
        scan[lid] = v;
        workgroupBarrier();
    }
    var at = vec2<u32>(0u);
    if lid > 0u {
        at = scan[lid - 1u];
    }
    for (var q = 0u; q < PER; q++) {
        let e = PER * lid + q;
        if e < P.experts {
            GROUPS[P.offsets_at + e] = at.x;
            for (var j = 0u; j < mine[q]; j += P.tile_cols) {
                GROUPS[P.tiles_at + 2u * at.y] = e;
                GROUPS[P.tiles_at + 2u * at.y + 1u] = at.x + j;
                at.y += 1u;
            }
        }
        // This invocation's own experts only: nobody else reads these counts any more.
        atomicStore(&counts[e], at.x);
        at.x += mine[q];
    }
    if lid == WG - 1u {
        GROUPS[0] = scan[WG - 1u].y;
        GROUPS[P.offsets_at + P.experts] = scan[WG - 1u].x;
    }
    workgroupBarrier();
    for (var i = lid; i < entries; i += WG) {
        let e = IDS[P.ids_offset + i];
        if e < P.experts {
            GROUPS[P.order_at + atomicAdd(&counts[e], 1u)] = i;
        }
    }
}
