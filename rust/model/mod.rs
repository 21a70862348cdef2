//! The model: hyper-parameters and layer plan, device weights of a layer range, the KV cache, and
//! the forward graph recorded onto the GPU.

pub mod config;
pub mod decode;
pub mod forward;
pub mod kv;
pub mod weights;

pub use config::{Arch, LayerKind, ModelConfig};
