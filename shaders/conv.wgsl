// Causal depthwise conv1d + SiLU over the GDN channels (docs/numerics.md "Gated DeltaNet" step 3), for one token
// (decode) or many (prefill), updating the (K-1)-row conv state in place. Three modes, one arithmetic:
// MODE=serial: one invocation owns one channel and walks the tokens in order with a sliding window
// (few tokens: one dispatch, the state update needs no synchronisation). MODE=outputs: one invocation
// per (channel, token) reads its K-1 predecessors from the piece or the old state (a prefill piece's
// tokens in parallel; the state is only read), then MODE=state advances the state in a second
// dispatch. Every output is the same sum in the same order in each mode, so results do not depend
// on the mode, and so not on how a prompt is cut into calls.
//
// Layouts: WEIGHT[c*K + j] is tap j of channel c (tap 0 = oldest input, tap K-1 = current token);
// STATE[state_offset + j*channels + c] is the j-th oldest of the last K-1 pre-conv inputs of channel c.
#include "common.wgsl"
#define WG 64
#define MODE serial
#variants MODE=outputs
#variants MODE=state

// The immediates, declared with their field docs in rust/ops/conv.rs (ConvParams).
#params ConvParams

// Largest K supported (the models use 4).
const MAX_TAPS: u32 = 8u;

var<immediate> P: ConvParams;
@group(0) @binding(0) var<storage, read> SRC: array<f32>;
@group(0) @binding(1) var<storage, read> WEIGHT: array<f32>;
@group(0) @binding(2) var<storage, read_write> STATE: array<f32>;
@group(0) @binding(3) var<storage, read_write> DST: array<f32>;

fn silu(x: f32) -> f32 {
    return x / (1.0 + exp(-x));
}

// The input `back` tokens before token t (1 ≤ back ≤ K-1) of channel c: from the piece, or from
// the state when it precedes the piece.
fn input_before(c: u32, t: u32, back: u32) -> f32 {
    let hist = P.taps - 1u;
    if t >= back {
        return SRC[P.src_offset + (t - back) * P.src_token_stride + c];
    }
    return STATE[P.state_offset + (hist - (back - t)) * P.channels + c];
}

@compute @workgroup_size({{WG}})
fn main(ids: ComputeIds) {
#if MODE == outputs
    let c = ids.wid.x * {{WG}}u + ids.lid;
    let t = ids.wid.y;
    if c >= P.channels || t >= P.tokens {
        return;
    }
    let hist = P.taps - 1u;
    // As the serial walk: the current input's tap first, then the window oldest first.
    var acc = WEIGHT[c * P.taps + hist] * SRC[P.src_offset + t * P.src_token_stride + c];
    for (var j = 0u; j < hist; j++) {
        acc += WEIGHT[c * P.taps + j] * input_before(c, t, hist - j);
    }
    DST[P.dst_offset + t * P.dst_token_stride + c] = silu(acc);
#else
    let c = group_index(ids) * {{WG}}u + ids.lid;
    if c >= P.channels {
        return;
    }
    let hist = P.taps - 1u;
#if MODE == state
    // The new window is the last K-1 of (old window ‖ the piece's inputs). Ascending j reads old
    // entries at j + tokens > j, which this invocation has not overwritten yet.
    for (var j = 0u; j < hist; j++) {
        let v = input_before(c, P.tokens, hist - j);
        STATE[P.state_offset + j * P.channels + c] = v;
    }
#else
    var window: array<f32, MAX_TAPS>;
    var taps: array<f32, MAX_TAPS>;
    for (var j = 0u; j < hist; j++) {
        window[j] = STATE[P.state_offset + j * P.channels + c];
    }
    for (var j = 0u; j < P.taps; j++) {
        taps[j] = WEIGHT[c * P.taps + j];
    }
    for (var t = 0u; t < P.tokens; t++) {
        let current = SRC[P.src_offset + t * P.src_token_stride + c];
        var acc = taps[hist] * current;
        for (var j = 0u; j < hist; j++) {
            acc += taps[j] * window[j];
        }
        DST[P.dst_offset + t * P.dst_token_stride + c] = silu(acc);
        for (var j = 0u; j + 1u < hist; j++) {
            window[j] = window[j + 1u];
        }
        if hist > 0u {
            window[hist - 1u] = current;
        }
    }
    for (var j = 0u; j < hist; j++) {
        STATE[P.state_offset + j * P.channels + c] = window[j];
    }
#endif
#endif
}
