// The head RMS norm of the decode products' PRE=head_rms (matvec.wgsl, matmul_coop.wgsl): each
// head's scale finished from the sums of squares an earlier kernel wrote (shaders/gdn_step.wgsl).
// The includer declares SQ, HD4 (vec4s per head) and a P with sq_offset, sq_stride, head_parts and
// eps.

// 1/sqrt(mean of squares + eps) of head h of activation column col: its head_parts partial sums
// in order.
fn head_rms_inv(col: u32, h: u32) -> f32 {
    let at = P.sq_offset + col * P.sq_stride + h * P.head_parts;
    var sum = 0.0;
    for (var g = 0u; g < P.head_parts; g++) {
        sum += SQ[at + g];
    }
    return inverseSqrt(sum / f32(4u * {{HD4}}u) + P.eps);
}
