//! Host side of every kernel: parameters, bindings and dispatch sizes; CPU references for tests.

pub mod embed;
pub mod gdn_step;
pub mod matmul;

// ---- other ops (branch `kernels`): add `pub mod <op>;` lines below this marker ----
pub mod attention;
pub mod conv;
pub mod deltanet;
pub mod elementwise;
pub mod norm;
pub mod rope;
pub mod router;
pub mod topk;

/// Every kernel file with the params structs it inserts (`#params`), for the shader validity test,
/// which expands each file on disk with these.
pub const KERNELS: &[crate::gpu::ShaderFile] = &[
    attention::FILE,
    attention::COOP_FILE,
    conv::FILE,
    deltanet::FILE,
    elementwise::FILE,
    embed::EMBED,
    gdn_step::FILE,
    matmul::MATVEC,
    matmul::MATMUL,
    matmul::MATMUL_COOP,
    matmul::MOE_GROUP,
    matmul::MATMUL_REDUCE,
    norm::FILE,
    router::FILE,
    topk::FILE,
    crate::gpu::example::SCALE,
    crate::gpu::example::COPY,
];
