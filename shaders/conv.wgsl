// Causal depthwise conv1d + SiLU over the GDN channels (spec model.md §3.2 step 3), for one token
// (decode) or many (prefill), updating the (K-1)-row conv state in place. One invocation owns one
// channel and walks the tokens in order with a sliding window, so decode and prefill are the same
// kernel and the state update needs no synchronisation.
//
// Layouts: weight[c*K + j] is tap j of channel c (tap 0 = oldest input, tap K-1 = current token);
// state[j*channels + c] is the j-th oldest of the last K-1 pre-conv inputs of channel c.

struct ConvParams {
    tokens: u32,
    channels: u32,
    taps: u32,
    _pad0: u32,
    src_offset: u32,
    src_token_stride: u32,
    dst_offset: u32,
    dst_token_stride: u32,
}

const WG: u32 = 64u;
// Largest K supported (the models use 4).
const MAX_TAPS: u32 = 8u;

@group(0) @binding(0) var<uniform> params: ConvParams;
@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read> weight: array<f32>;
@group(0) @binding(3) var<storage, read_write> state: array<f32>;
@group(0) @binding(4) var<storage, read_write> dst: array<f32>;

fn silu(x: f32) -> f32 {
    return x / (1.0 + exp(-x));
}

@compute @workgroup_size(WG)
fn conv_silu(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_index) lid: u32) {
    let c = (wid.x + wid.y * nwg.x) * WG + lid;
    if c >= params.channels {
        return;
    }
    let hist = params.taps - 1u;
    var window: array<f32, MAX_TAPS>;
    var taps: array<f32, MAX_TAPS>;
    for (var j = 0u; j < hist; j++) {
        window[j] = state[j * params.channels + c];
    }
    for (var j = 0u; j < params.taps; j++) {
        taps[j] = weight[c * params.taps + j];
    }
    for (var t = 0u; t < params.tokens; t++) {
        let current = src[params.src_offset + t * params.src_token_stride + c];
        var acc = taps[hist] * current;
        for (var j = 0u; j < hist; j++) {
            acc += taps[j] * window[j];
        }
        dst[params.dst_offset + t * params.dst_token_stride + c] = silu(acc);
        for (var j = 0u; j + 1u < hist; j++) {
            window[j] = window[j + 1u];
        }
        if hist > 0u {
            window[hist - 1u] = current;
        }
    }
    for (var j = 0u; j < hist; j++) {
        state[j * params.channels + c] = window[j];
    }
}
