//! qk core: GGUF reader, wgpu runtime and kernels, model, engine and stage transport. No Python here
//! except under `py/`, compiled only with the `python` feature.

pub mod engine;
pub mod error;
pub mod gguf;
pub mod gpu;
pub mod model;
pub mod ops;
pub mod transport;

#[cfg(feature = "python")]
mod py;

pub use error::{QkError, Result};
