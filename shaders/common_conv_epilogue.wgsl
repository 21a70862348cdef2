// The GDN conv epilogue of the decode products (matvec.wgsl and matmul_coop.wgsl with EPI=conv):
// one channel of one column's causal conv1d over the product and its slot's history, SiLU, and the
// history moved on by one, as shaders/conv.wgsl computes it. The includer declares CONV_W, STATE,
// SLOTS and a P with conv_rows, taps, state_stride and slots_offset.

// Channel ch (< P.conv_rows) of activation column col, whose product is y: the conv's output. The
// current input's tap first, then the history, oldest first; each channel of each column has one
// owner, so its state moves on without synchronisation.
fn conv_epilogue(ch: u32, col: u32, y: f32) -> f32 {
    let st = SLOTS[P.slots_offset + col] * P.state_stride + ch;
    let hist = P.taps - 1u;
    var acc = CONV_W[ch * P.taps + hist] * y;
    for (var j = 0u; j < hist; j++) {
        let v = STATE[st + j * P.conv_rows];
        acc += CONV_W[ch * P.taps + j] * v;
        if j > 0u {
            STATE[st + (j - 1u) * P.conv_rows] = v;
        }
    }
    if hist > 0u {
        STATE[st + (hist - 1u) * P.conv_rows] = y;
    }
    return acc / (1.0 + exp(-acc));
}
