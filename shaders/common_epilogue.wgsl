// The output stage EPI of the decode products (matvec.wgsl and matmul_coop.wgsl): store, add the
// residual (EPI=add: RES), accumulate into Y (EPI=accumulate), or, for EPI=conv, the GDN conv
// epilogue: one channel of one column's causal conv1d over the product and its slot's history,
// SiLU, and the history moved on by one, as shaders/conv.wgsl computes it. The includer declares Y
// (read_write), RES with EPI=add, and with EPI=conv CONV_W, STATE, SLOTS and a P with conv_rows,
// taps, state_stride and slots_offset.

#if EPI == conv
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
#endif

// Output o, row m of activation column n, whose finished product is y, as EPI says (rows from
// P.conv_rows on are stored as they are under EPI=conv).
fn store_out(o: u32, m: u32, n: u32, y: f32) {
#if EPI == add
    Y[o] = RES[o] + y;
#else
#if EPI == accumulate
    Y[o] += y;
#else
#if EPI == conv
    if m < P.conv_rows {
        Y[o] = conv_epilogue(m, n, y);
    } else {
        Y[o] = y;
    }
#else
    Y[o] = y;
#endif
#endif
#endif
}
