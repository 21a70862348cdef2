//! Partial NeoX rotary embedding: the frequency table the attention prepare kernel reads
//! (shaders/attn_prepare.wgsl applies the rotation) and its CPU reference.

/// theta_i = base^(-2i/n_rot) for i < n_rot/2, evaluated in f64 and rounded once (the FREQS
/// binding; upload once per model).
pub fn freq_table(n_rot: u32, theta_base: f64) -> Vec<f32> {
    (0..n_rot / 2)
        .map(|i| theta_base.powf(-2.0 * i as f64 / n_rot as f64) as f32)
        .collect()
}

pub mod reference {
    /// Rotates the first `n_rot` dims of one head row in place: pairs (i, i + n_rot/2) by the
    /// f32 product pos * freqs[i] (as llama.cpp and the shader round it), cos and sin in f64.
    pub fn rotate(x: &mut [f64], n_rot: u32, pos: u32, freqs: &[f32]) {
        let half = (n_rot / 2) as usize;
        for i in 0..half {
            let angle = f64::from(pos as f32 * freqs[i]);
            let (s, c) = angle.sin_cos();
            let (x0, x1) = (x[i], x[i + half]);
            x[i] = x0 * c - x1 * s;
            x[i + half] = x0 * s + x1 * c;
        }
    }
}
