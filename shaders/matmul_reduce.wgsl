// Second pass of a split-K mat-mat (common_matmul.wgsl): Y[:, n] = Σ_z PART[z][:, n], the splits
// added in index order, so the result depends on the split count only, never on scheduling.
#include "common.wgsl"

// The immediates, declared with their field docs in rust/ops/matmul.rs (ReduceParams).
#params ReduceParams

var<immediate> P: ReduceParams;
@group(0) @binding(0) var<storage, read> PART: array<f32>;
@group(0) @binding(1) var<storage, read_write> Y: array<f32>;

@compute @workgroup_size(256)
fn main(ids: ComputeIds) {
    let m = ids.gid.x;
    let n = ids.wid.y;
    if m >= P.rows || n >= P.n {
        return;
    }
    let at = n * P.rows + m;
    var sum = PART[at];
    for (var z = 1u; z < P.splits; z++) {
        sum += PART[z * P.split_stride + at];
    }
    Y[P.y_offset + n * P.y_stride + m] = sum;
}
