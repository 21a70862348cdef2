//! The wgpu runtime: device and adapter choice, buffers, pipeline cache, command recording.
