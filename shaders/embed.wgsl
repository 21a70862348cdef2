// Embedding lookup straight from a (possibly quantised) token_embd: OUT[:, t] = row IDS[t·stride] of W,
// dequantised on the fly; no dequantised copy of the table exists. Grid: (ceil(K/8/WG), tokens);
// rows outside this window (table larger than one binding) are left to the window that holds them.
#include "common.wgsl"
#include "common_dequant.wgsl"
#define QTYPE q8_0
#define WG 64
#variants QTYPE=f32
#variants QTYPE=f16
#variants QTYPE=bf16
#variants QTYPE=q4_0
#variants QTYPE=q4_k
#variants QTYPE=q5_k
#variants QTYPE=q6_k
#variants QTYPE=iq4_nl
#variants QTYPE=iq4_xs

// The immediates, declared with their field docs in rust/ops/embed.rs (EmbedParams).
#params EmbedParams

var<immediate> P: EmbedParams;
@group(0) @binding(0) var<storage, read> W: array<u32>;
@group(0) @binding(1) var<storage, read> IDS: array<u32>;
@group(0) @binding(2) var<storage, read_write> OUT: array<vec4<f32>>;

@compute @workgroup_size({{WG}})
fn main(ids: ComputeIds) {
    let g = ids.wid.x * {{WG}}u + ids.lid;
    let t = ids.wid.y;
    let row = IDS[P.ids_offset + t * P.ids_stride];
    if g >= P.k / 8u || row < P.first_row || row >= P.first_row + P.n_rows {
        return;
    }
    let w = dq8_{{QTYPE}}((row - P.first_row) * P.row_bytes, g);
    let o = (P.out_offset + t * P.out_stride) / 4u + 2u * g;
    OUT[o] = w.a;
    OUT[o + 1u] = w.b;
}
