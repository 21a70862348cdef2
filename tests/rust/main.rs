//! The one cargo integration-test binary; each area adds a module here.
mod attention_tests;
mod dequant_tests;
mod engine_tests;
mod fused_tests;
mod gguf_tests;
mod gpu_tests;
mod matmul_tests;
mod ops_tests;
mod shaders_valid;
mod transport_tests;
mod worker_tests;
