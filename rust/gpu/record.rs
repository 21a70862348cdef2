//! Command recording: many dispatches in one encoder and (between copies) one compute pass,
//! then one submit, optionally with readbacks folded into the same submit.

use super::buffers::{Binding, GpuBuffer};
use super::context::{Counters, Gpu};
use super::pipelines::Pipeline;
use crate::error::{QkError, Result};

/// Records work for one submit. Dispatches share one compute pass until a copy or readback
/// forces the pass to end (dispatches inside one pass cost ~2 µs each on the H200, a pass per
/// dispatch ~78 µs: kernels-perf.md §3.6).
pub struct Recorder<'g> {
    gpu: &'g Gpu,
    encoder: Option<wgpu::CommandEncoder>,
    pass: Option<wgpu::ComputePass<'static>>,
    reads: Vec<(GpuBuffer, u64, u64)>,
}

impl Gpu {
    pub fn recorder(&self) -> Recorder<'_> {
        let encoder = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("qk step"),
            });
        Recorder {
            gpu: self,
            encoder: Some(encoder),
            pass: None,
            reads: Vec::new(),
        }
    }
}

impl Recorder<'_> {
    fn pass(&mut self) -> Result<&mut wgpu::ComputePass<'static>> {
        if self.pass.is_none() {
            let enc = self.encoder.as_mut().ok_or_else(finished)?;
            let pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: None,
                timestamp_writes: None,
            });
            self.pass = Some(pass.forget_lifetime());
        }
        self.pass.as_mut().ok_or_else(finished)
    }

    fn end_pass(&mut self) {
        self.pass = None;
    }

    /// Record one dispatch of `pipe` over `groups` workgroups. `immediates` is the kernel's
    /// `var<immediate>` block (a `#[repr(C)]` Pod struct as bytes), padded with zeros if shorter.
    pub fn dispatch(
        &mut self,
        pipe: &Pipeline,
        bindings: &[Binding<'_>],
        immediates: &[u8],
        groups: [u32; 3],
    ) -> Result<()> {
        let bind_group = self.gpu.bind_group(pipe, bindings)?;
        if immediates.len() as u32 > pipe.immediate_size {
            return Err(QkError::Engine(format!(
                "{}: {} bytes of immediates, kernel declares {}",
                pipe.name,
                immediates.len(),
                pipe.immediate_size
            )));
        }
        let max = self.gpu.caps.max_workgroups_per_dim;
        if groups.iter().any(|&g| g > max) {
            return Err(QkError::Engine(format!(
                "{}: grid {groups:?} exceeds {max} per dimension",
                pipe.name
            )));
        }
        if groups.contains(&0) {
            return Ok(());
        }
        let size = pipe.immediate_size as usize;
        let mut imm = [0u8; 256];
        imm[..immediates.len()].copy_from_slice(immediates);
        let pass = self.pass()?;
        pass.set_pipeline(&pipe.pipeline);
        pass.set_bind_group(0, Some(&bind_group), &[]);
        if size > 0 {
            pass.set_immediates(0, &imm[..size]);
        }
        pass.dispatch_workgroups(groups[0], groups[1], groups[2]);
        Counters::bump(&self.gpu.counters.dispatches);
        Ok(())
    }

    /// Copy bytes between buffers (ends the current compute pass).
    pub fn copy(
        &mut self,
        src: &GpuBuffer,
        src_offset: u64,
        dst: &GpuBuffer,
        dst_offset: u64,
        size: u64,
    ) -> Result<()> {
        if !src_offset.is_multiple_of(4)
            || !dst_offset.is_multiple_of(4)
            || !size.is_multiple_of(4)
            || src_offset + size > src.size
            || dst_offset + size > dst.size
        {
            return Err(QkError::Engine(format!(
                "copy {} -> {}: unaligned or out of range",
                src.label, dst.label
            )));
        }
        self.end_pass();
        let enc = self.encoder.as_mut().ok_or_else(finished)?;
        enc.copy_buffer_to_buffer(&src.buffer, src_offset, &dst.buffer, dst_offset, size);
        Ok(())
    }

    /// Queue a readback of `size` bytes at `offset` of `buf`, taken after all work recorded so
    /// far; returns its index in the vector [`Recorder::finish_and_read`] returns.
    pub fn read(&mut self, buf: &GpuBuffer, offset: u64, size: u64) -> Result<usize> {
        if !offset.is_multiple_of(4) || !size.is_multiple_of(4) || size == 0 || offset + size > buf.size {
            return Err(QkError::Engine(format!(
                "read {}: {size} bytes at {offset} unaligned or out of range",
                buf.label
            )));
        }
        self.reads.push((buf.clone(), offset, size));
        Ok(self.reads.len() - 1)
    }

    /// Submit without waiting (no readbacks allowed).
    pub fn submit(mut self) -> Result<()> {
        if !self.reads.is_empty() {
            return Err(QkError::Engine(
                "submit(): readbacks queued; use finish_and_read()".into(),
            ));
        }
        self.end_pass();
        let enc = self.encoder.take().ok_or_else(finished)?;
        self.gpu.queue.submit([enc.finish()]);
        Counters::bump(&self.gpu.counters.submits);
        Ok(())
    }

    /// Submit, wait, and return the queued readbacks in order (one staging buffer, one map).
    pub fn finish_and_read(mut self) -> Result<Vec<Vec<u8>>> {
        self.end_pass();
        let mut enc = self.encoder.take().ok_or_else(finished)?;
        let total: u64 = self.reads.iter().map(|r| r.2).sum();
        let staging = if total > 0 {
            Some(self.gpu.staging_buffer(total)?)
        } else {
            None
        };
        if let Some(st) = &staging {
            let mut at = 0;
            for (buf, off, size) in &self.reads {
                enc.copy_buffer_to_buffer(&buf.buffer, *off, &st.buffer, at, *size);
                at += size;
            }
        }
        self.gpu.queue.submit([enc.finish()]);
        Counters::bump(&self.gpu.counters.submits);
        let Some(st) = staging else {
            self.gpu.wait()?;
            return Ok(Vec::new());
        };
        let (tx, rx) = std::sync::mpsc::channel();
        st.buffer.slice(..total).map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        self.gpu.wait()?;
        rx.recv()
            .map_err(|_| QkError::DeviceLost("readback: map callback never ran".into()))?
            .map_err(|e| QkError::DeviceLost(format!("readback map failed: {e}")))?;
        let mut out = Vec::with_capacity(self.reads.len());
        {
            let view = st
                .buffer
                .get_mapped_range(..total)
                .map_err(|e| QkError::Engine(format!("readback view: {e}")))?;
            let mut at = 0usize;
            for (_, _, size) in &self.reads {
                out.push(view[at..at + *size as usize].to_vec());
                at += *size as usize;
            }
        }
        st.buffer.unmap();
        self.gpu.return_staging(st);
        Counters::bump(&self.gpu.counters.readbacks);
        Ok(out)
    }
}

fn finished() -> QkError {
    QkError::Engine("recorder already submitted".into())
}
