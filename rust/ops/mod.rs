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
