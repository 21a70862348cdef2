//! The wgpu runtime: device and adapter choice, buffers, pipeline cache, command recording.
//!
//! Typical use by an op (see `example::scale_add`):
//! ```ignore
//! let gpu = Gpu::from_env()?;                                   // once
//! let pipe = gpu.pipeline(&FILE, &[("WG", "64".into())], &[])?; // cached by (file, defines, consts)
//! let mut rec = gpu.recorder();                                  // one encoder + compute pass
//! rec.dispatch(&pipe, &[x.all(), y.all()], bytemuck::bytes_of(&params), gpu.grid(groups))?;
//! let out = { let t = rec.read(&y, 0, bytes)?; rec.finish_and_read()?.swap_remove(t) }; // one submit
//! ```

pub mod armed;
pub mod buffers;
pub mod context;
pub mod example;
pub mod params;
pub mod pipelines;
pub mod record;
pub mod shaders;

pub use buffers::{ARENA_MAX_TENSOR, Binding, GpuBuffer, WeightArena, WeightTensor, WeightWindow};
pub use context::{AdapterSummary, Caps, CounterSnapshot, Gpu, GpuOptions, adapters, select_adapter};
pub use params::GpuParams;
pub use pipelines::{BindingKind, Pipeline};
pub use record::Recorder;
pub use shaders::ShaderFile;
