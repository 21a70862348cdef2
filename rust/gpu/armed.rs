//! Armed submits (Vulkan): commands submitted before their input exists, held at the GPU by a
//! timeline semaphore that the host signals once it has written the input into persistently
//! mapped memory. A split stage's next decode step then waits on the GPU while the other stage
//! runs, and its submit (wgpu's host work, 30–80 µs for a 24-layer step on the H200) leaves the
//! per-token critical path: what remains there is a memory copy and one signal call.
//!
//! A queued submit cannot be withdrawn, and on NVIDIA it holds back everything submitted after it
//! on its queue: the owner of an [`ArmedInputs`] must be the only submitter on its device, and must
//! fire or retire (fire with harmless input) every armed submit before it submits anything else.

use super::buffers::GpuBuffer;
use super::context::Gpu;
use super::record::{Encoded, Submitted};
use crate::error::{QkError, Result};

#[cfg(any(windows, target_os = "linux", target_os = "android"))]
mod imp {
    use ash::vk;
    use wgpu::hal::Device as _;
    use wgpu::hal::api::Vulkan;

    use super::*;

    /// Two persistently mapped input buffers (a step and the one armed after it use different
    /// ones) and the timeline semaphore armed submits wait on.
    pub struct ArmedInputs {
        raw: ash::Device,
        sem: vk::Semaphore,
        inputs: [GpuBuffer; 2],
        /// The mapping of each input buffer (host-visible memory that gpu-allocator keeps mapped
        /// for the buffer's life), as an address so the engine stays `Send`.
        ptrs: [usize; 2],
        coherent: bool,
        /// The last value an armed submit waits for, and the last one signalled.
        staged: u64,
        signalled: u64,
    }

    impl ArmedInputs {
        /// Input buffers of `bytes` each on `gpu`; None where the device is not Vulkan.
        pub fn new(gpu: &Gpu, bytes: u64) -> Result<Option<ArmedInputs>> {
            // SAFETY: the ash device handle is wgpu's and lives as long as `gpu.device`, which
            // outlives this (the engine holds both, and drops this first).
            let Some(raw) = (unsafe { gpu.device.as_hal::<Vulkan>() }).map(|d| d.raw_device().clone()) else {
                return Ok(None);
            };
            let mut timeline = vk::SemaphoreTypeCreateInfo::default()
                .semaphore_type(vk::SemaphoreType::TIMELINE)
                .initial_value(0);
            let info = vk::SemaphoreCreateInfo::default().push_next(&mut timeline);
            let sem = unsafe { raw.create_semaphore(&info, None) }
                .map_err(|e| QkError::Device(format!("armed steps: timeline semaphore: {e}")))?;
            let make = |i: usize| gpu.mapped_input_buffer(&format!("armed.input{i}"), bytes);
            let inputs = match (make(0), make(1)) {
                (Ok(a), Ok(b)) => [a, b],
                (Err(e), _) | (_, Err(e)) => {
                    unsafe { raw.destroy_semaphore(sem, None) };
                    return Err(e);
                }
            };
            let mut ptrs = [0usize; 2];
            let mut coherent = true;
            {
                let hal_device = unsafe { gpu.device.as_hal::<Vulkan>() }
                    .ok_or_else(|| QkError::Device("armed steps: not a Vulkan device".into()))?;
                for (i, buf) in inputs.iter().enumerate() {
                    let hal_buf = unsafe { buf.buffer.as_hal::<Vulkan>() }
                        .ok_or_else(|| QkError::Device("armed steps: not a Vulkan buffer".into()))?;
                    // SAFETY: a MAP_WRITE buffer's memory is host-visible and gpu-allocator keeps
                    // it mapped while the buffer lives; wgpu never maps it (it is never mapped
                    // through wgpu), so this is the only host access.
                    let mapping = unsafe { hal_device.map_buffer(&hal_buf, 0..buf.size) }
                        .map_err(|e| QkError::Device(format!("armed steps: map input: {e}")))?;
                    ptrs[i] = mapping.ptr.as_ptr() as usize;
                    coherent &= mapping.is_coherent;
                }
            }
            Ok(Some(ArmedInputs {
                raw,
                sem,
                inputs,
                ptrs,
                coherent,
                staged: 0,
                signalled: 0,
            }))
        }

        /// Input buffer `parity` (0 or 1): what an armed step's recorded commands copy from.
        pub fn input(&self, parity: usize) -> &GpuBuffer {
            &self.inputs[parity]
        }

        /// Submit `encoded` to wait for the next semaphore value; returns it with that value.
        pub fn submit(&mut self, gpu: &Gpu, encoded: Encoded) -> Result<(Submitted, u64)> {
            let value = self.staged + 1;
            let barrier = self.host_writes_barrier(gpu)?;
            {
                // The wait applies to the queue's next submit, which is the one below: the owner
                // is the device's only submitter (see the module header).
                let queue = unsafe { gpu.queue.as_hal::<Vulkan>() }
                    .ok_or_else(|| QkError::Device("armed steps: not a Vulkan queue".into()))?;
                queue.add_wait_semaphore(self.sem, Some(value), vk::PipelineStageFlags::ALL_COMMANDS);
            }
            let submitted = encoded.submit_after(gpu, Some(barrier));
            self.staged = value;
            Ok((submitted, value))
        }

        /// Commands that make host writes visible to the commands after them: the input is
        /// written after the armed submit, and a queue submit makes visible only the host writes
        /// made before it (Vulkan's host write ordering guarantee); for later ones the spec asks
        /// for a memory barrier whose source is the host. Its own command buffer, ahead of the
        /// step's in the same submit: wgpu lets an encoder be recorded raw or through wgpu, not
        /// both.
        fn host_writes_barrier(&self, gpu: &Gpu) -> Result<wgpu::CommandBuffer> {
            let mut encoder = gpu
                .device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                    label: Some("armed.host_writes"),
                });
            // SAFETY: the raw encoder is only given one barrier; wgpu ends and submits it.
            let recorded = unsafe {
                encoder.as_hal_mut::<Vulkan, _, _>(|raw| {
                    raw.map(|raw| {
                        let barrier = vk::MemoryBarrier::default()
                            .src_access_mask(vk::AccessFlags::HOST_WRITE)
                            .dst_access_mask(vk::AccessFlags::TRANSFER_READ | vk::AccessFlags::SHADER_READ);
                        self.raw.cmd_pipeline_barrier(
                            raw.raw_handle(),
                            vk::PipelineStageFlags::HOST,
                            vk::PipelineStageFlags::TRANSFER | vk::PipelineStageFlags::COMPUTE_SHADER,
                            vk::DependencyFlags::empty(),
                            &[barrier],
                            &[],
                            &[],
                        );
                    })
                })
            };
            recorded.ok_or_else(|| QkError::Device("armed steps: not a Vulkan command encoder".into()))?;
            Ok(encoder.finish())
        }

        /// Write `parts` (byte offset, bytes) into input buffer `parity`, then let the submit
        /// waiting for `value` go.
        pub fn fire(&mut self, gpu: &Gpu, parity: usize, value: u64, parts: &[(u64, &[u8])]) -> Result<()> {
            crate::ensure!(
                value > self.signalled && value <= self.staged,
                QkError::Engine(format!(
                    "armed steps: value {value} is not pending (signalled {}, staged {})",
                    self.signalled, self.staged
                ))
            );
            self.write(gpu, parity, parts)?;
            self.signal(value)
        }

        /// Write `parts` (byte offset, bytes) into input buffer `parity`: for a submit armed on it
        /// (then [`ArmedInputs::fire`]) or one submitted after the write.
        pub fn write(&mut self, gpu: &Gpu, parity: usize, parts: &[(u64, &[u8])]) -> Result<()> {
            let buf = &self.inputs[parity];
            for (offset, bytes) in parts {
                crate::ensure!(
                    offset + bytes.len() as u64 <= buf.size,
                    QkError::Engine(format!(
                        "armed steps: {} bytes at {offset} overrun the input of {}",
                        bytes.len(),
                        buf.size
                    ))
                );
                // SAFETY: in bounds (checked); the GPU reads this buffer only in a step submitted
                // after this write or armed on it (waiting for the signal that follows), and the
                // step before that used it finished before its results were collected.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        bytes.as_ptr(),
                        (self.ptrs[parity] + *offset as usize) as *mut u8,
                        bytes.len(),
                    );
                }
            }
            if !self.coherent {
                let hal_device = unsafe { gpu.device.as_hal::<Vulkan>() }
                    .ok_or_else(|| QkError::Device("armed steps: not a Vulkan device".into()))?;
                let hal_buf = unsafe { buf.buffer.as_hal::<Vulkan>() }
                    .ok_or_else(|| QkError::Device("armed steps: not a Vulkan buffer".into()))?;
                unsafe { hal_device.flush_mapped_ranges(&hal_buf, std::iter::once(0..buf.size)) };
            }
            Ok(())
        }

        fn signal(&mut self, value: u64) -> Result<()> {
            let info = vk::SemaphoreSignalInfo::default()
                .semaphore(self.sem)
                .value(value);
            unsafe { self.raw.signal_semaphore(&info) }
                .map_err(|e| QkError::DeviceLost(format!("armed steps: signal: {e}")))?;
            self.signalled = value;
            Ok(())
        }
    }

    impl Drop for ArmedInputs {
        /// Let an armed submit the owner could not retire go (on whatever its input buffer
        /// holds), and wait for the device before the semaphore it waited on goes.
        fn drop(&mut self) {
            if self.staged > self.signalled {
                let _ = self.signal(self.staged);
            }
            unsafe {
                let _ = self.raw.device_wait_idle();
                self.raw.destroy_semaphore(self.sem, None);
            }
        }
    }
}

#[cfg(not(any(windows, target_os = "linux", target_os = "android")))]
mod imp {
    use super::*;

    /// No Vulkan backend in this build: steps are never armed.
    pub enum ArmedInputs {}

    impl ArmedInputs {
        pub fn new(_gpu: &Gpu, _bytes: u64) -> Result<Option<ArmedInputs>> {
            Ok(None)
        }
        pub fn input(&self, _parity: usize) -> &GpuBuffer {
            match *self {}
        }
        pub fn submit(&mut self, _gpu: &Gpu, _encoded: Encoded) -> Result<(Submitted, u64)> {
            match *self {}
        }
        pub fn fire(
            &mut self,
            _gpu: &Gpu,
            _parity: usize,
            _value: u64,
            _parts: &[(u64, &[u8])],
        ) -> Result<()> {
            match *self {}
        }
        pub fn write(&mut self, _gpu: &Gpu, _parity: usize, _parts: &[(u64, &[u8])]) -> Result<()> {
            match *self {}
        }
    }
}

pub use imp::ArmedInputs;
