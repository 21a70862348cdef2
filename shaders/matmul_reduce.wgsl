// Second pass of a split-K mat-mat (common_matmul.wgsl): Y[:, n] = Σ_z PART[z][:, n], the splits
// added in index order, so the result depends on the split count only, never on scheduling.
#include "common.wgsl"

struct ReduceParams {
    // Rows per column, columns, splits, floats between splits in PART (column n of split z starts
    // at z · split_stride + n · rows).
    rows: u32,
    n: u32,
    splits: u32,
    split_stride: u32,
    // Y[y_offset + n * y_stride + m].
    y_offset: u32,
    y_stride: u32,
}

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
