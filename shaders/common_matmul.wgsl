// What the mat-mat kernels (matmul.wgsl, matmul_coop.wgsl) share: their parameters and bindings,
// and which columns a workgroup's column tile covers. Dense (MOE 0): tile y holds activation
// columns y·TN… of X and Y. Grouped MoE (MOE 1): tile y is entry y of the tile table that
// moe_group.wgsl wrote into GROUPS (one expert's columns, at most TN of them, sorted by expert);
// its workgroup multiplies that expert's rows, reads X column token·x_col_token + slot·x_col_slot
// of each (token, slot) entry and writes Y column token·n_used + slot (the mat-vec's layout).
// Split K (dense only): workgroup z sums K range [z·k_split, (z + 1)·k_split) and writes its partial
// sums split_stride floats after split z − 1's; matmul_reduce.wgsl adds the splits in order.

// The immediates, declared with their field docs in rust/ops/matmul.rs (MatmulParams).
#params MatmulParams

var<immediate> P: MatmulParams;
@group(0) @binding(0) var<storage, read> W: array<u32>;
@group(0) @binding(1) var<storage, read> X: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> Y: array<f32>;
#if MOE
@group(0) @binding(3) var<storage, read> GROUPS: array<u32>;
#endif

var<workgroup> col_tile_wg: vec3<u32>;

// A workgroup's column tile: the byte offset in W of its matrix, its first column (dense) or first
// sorted entry (MOE), and how many columns it has (0: nothing to do).
struct ColTile {
    w_base: u32,
    first: u32,
    cols: u32,
}

// Invocation 0 works out tile `tile` (MOE: from the table) for col_tile to share; every invocation
// calls this, then col_tile.
fn col_tile_read(lid: u32, tile: u32, tn: u32) {
    if lid == 0u {
#if MOE
        // (expert within the window, first sorted entry, columns)
        var v = vec3<u32>(0u);
        if tile < GROUPS[0] {
            let e = GROUPS[P.tiles_at + 2u * tile];
            let start = GROUPS[P.tiles_at + 2u * tile + 1u];
            if e >= P.expert_first && e < P.expert_first + P.expert_count {
                v = vec3<u32>(e - P.expert_first, start, min(tn, GROUPS[P.offsets_at + e + 1u] - start));
            }
        }
        col_tile_wg = v;
#else
        let n0 = tile * tn;
        col_tile_wg = vec3<u32>(0u, n0, min(tn, P.n - min(n0, P.n)));
#endif
    }
}

// The tile, shared through workgroupUniformLoad: it derives from no invocation or workgroup index,
// so naga sees it as uniform, and skipping the work when cols is 0 keeps the kernels' barriers and
// cooperative-matrix operations in uniform control flow.
fn col_tile() -> ColTile {
    let v = workgroupUniformLoad(&col_tile_wg);
    return ColTile(P.w_offset + v.x * P.rows * P.row_bytes, v.y, v.z);
}

// This workgroup's K range [x, y): its split's.
fn k_range(split: u32) -> vec2<u32> {
    let k0 = min(P.k, split * P.k_split);
    return vec2<u32>(k0, min(P.k, k0 + P.k_split));
}

// The float index in Y where column j of the tile starts, within split `split`'s outputs.
fn y_col_start(t: ColTile, j: u32, split: u32) -> u32 {
    return P.y_offset + split * P.split_stride + y_col(t, j) * P.y_stride;
}

// The Y column of column j of the tile.
fn y_col(t: ColTile, j: u32) -> u32 {
#if MOE
    return GROUPS[P.order_at + t.first + j];
#else
    return t.first + j;
#endif
}

// The float index in X where column j of the tile starts.
fn x_col_start(t: ColTile, j: u32) -> u32 {
#if MOE
    let entry = y_col(t, j);
    let col = (entry / P.n_used) * P.x_col_token + (entry % P.n_used) * P.x_col_slot;
#else
    let col = t.first + j;
#endif
    return P.x_offset + col * P.x_stride;
}
