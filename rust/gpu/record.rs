//! Command recording: many dispatches in one encoder and (between copies) one compute pass,
//! then one submit, optionally with readbacks folded into the same submit. An opt-in profiling
//! recorder also labels every dispatch and, where the adapter has timestamp queries, times each
//! one on the GPU (one pass per dispatch, its begin/end timestamps).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::buffers::{Binding, GpuBuffer};
use super::context::{Counters, Gpu};
use super::pipelines::Pipeline;
use crate::error::{QkError, Result};

/// Records work for one submit. Dispatches share one compute pass until a copy or readback
/// forces the pass to end (dispatches inside one pass cost ~2 µs each on the H200, a pass per
/// dispatch ~78 µs: docs/architecture.md "Dispatch costs").
pub struct Recorder<'g> {
    gpu: &'g Gpu,
    encoder: Option<wgpu::CommandEncoder>,
    pass: Option<wgpu::ComputePass<'static>>,
    reads: Vec<(GpuBuffer, u64, u64)>,
    /// What the dispatches recorded next belong to (a `Copy` of static data: free when not profiling).
    op: OpLabel,
    profile: Option<Box<Profiling>>,
}

/// The op the next dispatches belong to: a name (`"moe.gate_up"`), the model layer (None for the
/// embedding and head), and the bytes of weights (and recurrent state) the op reads, for GB/s.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpLabel {
    pub op: &'static str,
    pub layer: Option<u32>,
    pub bytes: u64,
}

/// One recorded dispatch of a profiled submit.
#[derive(Clone, Debug)]
pub struct DispatchProfile {
    /// Index of the op (one [`Recorder::op`] call) it belongs to.
    pub op_index: usize,
    pub op: OpLabel,
    /// The pipeline's label (shader file and defines).
    pub kernel: String,
    pub groups: [u32; 3],
    /// GPU time between the dispatch's pass begin and end timestamps; None without timestamps.
    pub gpu_ns: Option<f64>,
}

/// What a profiled submit measured: its dispatches in order, the CPU time spent recording (from
/// the recorder's creation to the encoded commands), submitting and waiting, and the GPU span
/// from the first dispatch's begin to the last one's end.
#[derive(Clone, Debug, Default)]
pub struct SubmitProfile {
    pub dispatches: Vec<DispatchProfile>,
    pub timestamps: bool,
    pub record_ns: f64,
    pub submit_ns: f64,
    pub wait_ns: f64,
    pub gpu_span_ns: Option<f64>,
}

/// wgpu's cap on queries per set; a longer step takes several sets.
const QUERIES_PER_SET: u32 = 4096;

struct Profiling {
    started: Instant,
    ops: usize,
    dispatches: Vec<DispatchProfile>,
    query_sets: Vec<wgpu::QuerySet>,
}

impl Gpu {
    fn step_encoder(&self) -> wgpu::CommandEncoder {
        self.device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("qk step"),
            })
    }

    pub fn recorder(&self) -> Recorder<'_> {
        Recorder {
            gpu: self,
            encoder: Some(self.step_encoder()),
            pass: None,
            reads: Vec::new(),
            op: OpLabel::default(),
            profile: None,
        }
    }

    /// A recorder that labels every dispatch and (with `caps.timestamps`) gives each its own
    /// timestamped pass: slower, and it creates query sets and buffers, so only for profiles.
    pub fn profiling_recorder(&self) -> Recorder<'_> {
        let mut rec = self.recorder();
        rec.profile = Some(Box::new(Profiling {
            started: Instant::now(),
            ops: 0,
            dispatches: Vec::new(),
            query_sets: Vec::new(),
        }));
        rec
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

    /// Name the op the following dispatches belong to (see [`OpLabel`]); a plain store when not
    /// profiling.
    pub fn op(&mut self, op: &'static str, layer: Option<u32>, bytes: u64) {
        self.op = OpLabel { op, layer, bytes };
        if let Some(p) = self.profile.as_mut() {
            p.ops += 1;
        }
    }

    /// The op named last ([`Recorder::op`]).
    pub fn op_name(&self) -> &'static str {
        self.op.op
    }

    pub fn is_profiling(&self) -> bool {
        self.profile.is_some()
    }

    /// Profiling: the pass for dispatch number `index`, with its begin/end timestamps when the
    /// adapter has them.
    fn timed_pass(&mut self, index: usize) -> Result<&mut wgpu::ComputePass<'static>> {
        self.end_pass();
        let timestamps = self.gpu.caps.timestamps;
        let (set, slot) = (
            index as u32 / (QUERIES_PER_SET / 2),
            index as u32 % (QUERIES_PER_SET / 2),
        );
        let prof = self.profile.as_mut().ok_or_else(finished)?;
        if timestamps && prof.query_sets.len() <= set as usize {
            prof.query_sets
                .push(self.gpu.device.create_query_set(&wgpu::QuerySetDescriptor {
                    label: Some("qk profile"),
                    ty: wgpu::QueryType::Timestamp,
                    count: QUERIES_PER_SET,
                }));
        }
        let writes = prof
            .query_sets
            .get(set as usize)
            .filter(|_| timestamps)
            .map(|qs| wgpu::ComputePassTimestampWrites {
                query_set: qs,
                beginning_of_pass_write_index: Some(2 * slot),
                end_of_pass_write_index: Some(2 * slot + 1),
            });
        let enc = self.encoder.as_mut().ok_or_else(finished)?;
        let pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: None,
            timestamp_writes: writes,
        });
        self.pass = Some(pass.forget_lifetime());
        self.pass.as_mut().ok_or_else(finished)
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
        let index = match self.profile.as_mut() {
            Some(p) => {
                p.dispatches.push(DispatchProfile {
                    op_index: p.ops.saturating_sub(1),
                    op: self.op,
                    kernel: pipe.name.clone(),
                    groups,
                    gpu_ns: None,
                });
                Some(p.dispatches.len() - 1)
            }
            None => None,
        };
        let pass = match index {
            Some(i) => self.timed_pass(i)?,
            None => self.pass()?,
        };
        pass.set_pipeline(&pipe.pipeline);
        pass.set_bind_group(0, Some(&bind_group), &[]);
        if size > 0 {
            pass.set_immediates(0, &imm[..size]);
        }
        pass.dispatch_workgroups(groups[0], groups[1], groups[2]);
        if index.is_some() {
            // One pass per dispatch, so its timestamps bracket this dispatch alone.
            self.end_pass();
        }
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
        enc.copy_buffer_to_buffer(
            &src.buffer,
            src.base + src_offset,
            &dst.buffer,
            dst.base + dst_offset,
            size,
        );
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

    /// Submit what is recorded so far and go on recording into a new encoder, so the GPU starts on
    /// the first part of a long recording while the rest is recorded (queued readbacks stay for
    /// the final submit, which still waits for everything). No-op for a profiling recorder, whose
    /// timestamps are resolved in its one encoder.
    pub fn flush(&mut self) -> Result<()> {
        if self.profile.is_some() {
            return Ok(());
        }
        self.submit_encoder()?;
        self.encoder = Some(self.gpu.step_encoder());
        Ok(())
    }

    /// End the pass and submit the encoder's commands, leaving the recorder without one.
    fn submit_encoder(&mut self) -> Result<()> {
        self.end_pass();
        let enc = self.encoder.take().ok_or_else(finished)?;
        self.gpu.queue.submit([enc.finish()]);
        Counters::bump(&self.gpu.counters.submits);
        Ok(())
    }

    /// Submit without waiting (no readbacks allowed).
    pub fn submit(mut self) -> Result<()> {
        if !self.reads.is_empty() {
            return Err(QkError::Engine(
                "submit(): readbacks queued; use finish_and_read()".into(),
            ));
        }
        self.submit_encoder()
    }

    /// Submit, wait, and return the queued readbacks in order (one staging buffer, one map).
    pub fn finish_and_read(self) -> Result<Vec<Vec<u8>>> {
        Ok(self.finish_and_read_timed()?.0)
    }

    /// [`Recorder::finish_and_read`], plus when encoding ended, the submit returned and the
    /// results were in, and what a profiling recorder measured.
    pub fn finish_and_read_timed(self) -> Result<(Vec<Vec<u8>>, Finished)> {
        let gpu = self.gpu;
        self.finish()?.submit(gpu).wait(gpu)
    }

    /// Encode everything recorded (the readbacks' copies into a staging buffer included) without
    /// submitting: the commands can be submitted later, e.g. a decode step recorded while the
    /// previous one runs on the GPU. Buffer writes made before the submit still come first.
    pub fn finish(mut self) -> Result<Encoded> {
        self.end_pass();
        let mut profile = self.profile.take();
        let mut enc = self.encoder.take().ok_or_else(finished)?;
        let timestamps = match profile.as_mut() {
            Some(p) if !p.query_sets.is_empty() => Some(resolve_timestamps(self.gpu, &mut enc, p)?),
            _ => None,
        };
        let sizes: Vec<u64> = self.reads.iter().map(|r| r.2).collect();
        let total: u64 = sizes.iter().sum();
        let staging = if total > 0 {
            Some(self.gpu.staging_buffer(total)?)
        } else {
            None
        };
        if let Some(st) = &staging {
            let mut at = 0;
            for (buf, off, size) in &self.reads {
                enc.copy_buffer_to_buffer(&buf.buffer, buf.base + *off, &st.buffer, at, *size);
                at += size;
            }
        }
        Ok(Encoded {
            commands: enc.finish(),
            staging,
            sizes,
            profile,
            timestamps,
            encoded: Instant::now(),
        })
    }
}

/// Commands encoded and not submitted yet (see [`Recorder::finish`]).
pub struct Encoded {
    commands: wgpu::CommandBuffer,
    staging: Option<GpuBuffer>,
    sizes: Vec<u64>,
    profile: Option<Box<Profiling>>,
    timestamps: Option<wgpu::Buffer>,
    encoded: Instant,
}

/// Submitted commands whose readbacks are being mapped.
pub struct Submitted {
    index: wgpu::SubmissionIndex,
    staging: Option<GpuBuffer>,
    sizes: Vec<u64>,
    mapped: Option<std::sync::mpsc::Receiver<std::result::Result<(), wgpu::BufferAsyncError>>>,
    profile: Option<Box<Profiling>>,
    timestamps: Option<wgpu::Buffer>,
    encoded: Instant,
    submitted: Instant,
    /// Set by the queue once everything submitted up to these commands has finished: what a
    /// spinning wait watches.
    done: Arc<AtomicBool>,
}

impl Encoded {
    /// Submit, and ask for the readbacks to be mapped once the GPU is done.
    pub fn submit(self, gpu: &Gpu) -> Submitted {
        self.submit_after(gpu, None)
    }

    /// [`Encoded::submit`], with `first` (if any) ahead of these commands in the same submit.
    pub fn submit_after(self, gpu: &Gpu, first: Option<wgpu::CommandBuffer>) -> Submitted {
        let index = gpu.queue.submit(first.into_iter().chain([self.commands]));
        Counters::bump(&gpu.counters.submits);
        let done = Arc::new(AtomicBool::new(false));
        {
            let done = Arc::clone(&done);
            gpu.queue
                .on_submitted_work_done(move || done.store(true, Ordering::Release));
        }
        let submitted = Instant::now();
        let total: u64 = self.sizes.iter().sum();
        let mapped = self.staging.as_ref().map(|st| {
            let (tx, rx) = std::sync::mpsc::channel();
            st.buffer.slice(..total).map_async(wgpu::MapMode::Read, move |r| {
                let _ = tx.send(r);
            });
            rx
        });
        Submitted {
            index,
            staging: self.staging,
            sizes: self.sizes,
            mapped,
            profile: self.profile,
            timestamps: self.timestamps,
            encoded: self.encoded,
            submitted,
            done,
        }
    }

    /// Drop the commands unsubmitted, keeping their staging buffer for the next readback.
    pub fn discard(self, gpu: &Gpu) {
        if let Some(st) = self.staging {
            gpu.return_staging(st);
        }
    }
}

impl Submitted {
    /// The submission these commands went in with (to wait for them without taking the results).
    pub fn index(&self) -> wgpu::SubmissionIndex {
        self.index.clone()
    }

    /// Wait for these commands (and so everything submitted before them; not what was submitted
    /// since) and return the readbacks in order.
    pub fn wait(self, gpu: &Gpu) -> Result<(Vec<Vec<u8>>, Finished)> {
        self.wait_spinning(gpu, Duration::ZERO)
    }

    /// [`Submitted::wait`], polling the device without sleeping for up to `spin` before blocking:
    /// a blocking wait sleeps in the driver and wakes some time after the GPU is done, which a
    /// decode step that must read its result back before the next one pays every token.
    pub fn wait_spinning(self, gpu: &Gpu, spin: Duration) -> Result<(Vec<Vec<u8>>, Finished)> {
        if !spin.is_zero() {
            // A spin too long for the clock polls until the work is done.
            let deadline = Instant::now().checked_add(spin);
            while !self.done.load(Ordering::Acquire) && deadline.is_none_or(|d| Instant::now() < d) {
                gpu.poll_once()?;
                std::hint::spin_loop();
            }
            if self.done.load(Ordering::Acquire) {
                Counters::bump(&gpu.counters.spun_waits);
            }
        }
        // Done by now, or the spin ran out: returns at once in the first case (and runs the map
        // callbacks if the poll that saw the work done had not yet).
        gpu.wait_for(self.index)?;
        let mut out = Vec::with_capacity(self.sizes.len());
        if let (Some(st), Some(rx)) = (self.staging, self.mapped) {
            rx.recv()
                .map_err(|_| QkError::DeviceLost("readback: map callback never ran".into()))?
                .map_err(|e| QkError::DeviceLost(format!("readback map failed: {e}")))?;
            let total: u64 = self.sizes.iter().sum();
            {
                let view = st
                    .buffer
                    .get_mapped_range(..total)
                    .map_err(|e| QkError::Engine(format!("readback view: {e}")))?;
                let mut at = 0usize;
                for size in &self.sizes {
                    out.push(view[at..at + *size as usize].to_vec());
                    at += *size as usize;
                }
            }
            st.buffer.unmap();
            gpu.return_staging(st);
            Counters::bump(&gpu.counters.readbacks);
        }
        let done = Instant::now();
        let profile = finish_profile(
            gpu,
            self.profile,
            self.timestamps,
            self.encoded,
            self.submitted,
            done,
        )?;
        Ok((
            out,
            Finished {
                encoded: self.encoded,
                submitted: self.submitted,
                done,
                profile,
            },
        ))
    }
}

/// When a submit's phases ended on the host (plain clock reads), and a profiling recorder's
/// measurements.
pub struct Finished {
    /// Commands encoded (wgpu validates and translates the passes by here).
    pub encoded: Instant,
    /// `queue.submit` returned.
    pub submitted: Instant,
    /// The GPU finished and the readbacks were copied out.
    pub done: Instant,
    pub profile: Option<SubmitProfile>,
}

/// Resolve every query set into a mappable buffer (copied there in the same submit).
fn resolve_timestamps(gpu: &Gpu, enc: &mut wgpu::CommandEncoder, p: &Profiling) -> Result<wgpu::Buffer> {
    let set_bytes = u64::from(QUERIES_PER_SET) * 8;
    let total = set_bytes * p.query_sets.len() as u64;
    let resolve = gpu.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("qk profile resolve"),
        size: total,
        usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: false,
    });
    let read = gpu.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("qk profile read"),
        size: total,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let n = p.dispatches.len() as u64;
    for (i, qs) in p.query_sets.iter().enumerate() {
        let first = i as u64 * u64::from(QUERIES_PER_SET / 2);
        let used = (n - first.min(n)).min(u64::from(QUERIES_PER_SET / 2)) as u32;
        if used > 0 {
            enc.resolve_query_set(qs, 0..2 * used, &resolve, i as u64 * set_bytes);
        }
    }
    enc.copy_buffer_to_buffer(&resolve, 0, &read, 0, total);
    Ok(read)
}

/// Attach the timestamps (read after the submit finished) and CPU times to the profile.
fn finish_profile(
    gpu: &Gpu,
    profile: Option<Box<Profiling>>,
    timestamps: Option<wgpu::Buffer>,
    encoded: Instant,
    submitted: Instant,
    done: Instant,
) -> Result<Option<SubmitProfile>> {
    let Some(p) = profile else { return Ok(None) };
    let ns = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e9;
    let mut out = SubmitProfile {
        timestamps: timestamps.is_some(),
        record_ns: ns(p.started, encoded),
        submit_ns: ns(encoded, submitted),
        wait_ns: ns(submitted, done),
        dispatches: p.dispatches,
        gpu_span_ns: None,
    };
    if let Some(read) = timestamps {
        let (tx, rx) = std::sync::mpsc::channel();
        read.slice(..).map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        gpu.wait()?;
        rx.recv()
            .map_err(|_| QkError::DeviceLost("profile: map callback never ran".into()))?
            .map_err(|e| QkError::DeviceLost(format!("profile map failed: {e}")))?;
        let period = f64::from(gpu.queue.get_timestamp_period());
        {
            let view = read
                .get_mapped_range(..)
                .map_err(|e| QkError::Engine(format!("profile view: {e}")))?;
            let ticks: &[u64] = bytemuck::cast_slice(&view);
            let (mut first, mut last) = (u64::MAX, 0u64);
            for (i, d) in out.dispatches.iter_mut().enumerate() {
                let (b, e) = (ticks[2 * i], ticks[2 * i + 1]);
                // Ticks are monotonic within a submit; a reversed pair means the driver wrote no
                // valid value, which is reported as missing rather than as a made-up time.
                if e >= b && b > 0 {
                    d.gpu_ns = Some((e - b) as f64 * period);
                    first = first.min(b);
                    last = last.max(e);
                }
            }
            if last >= first && first != u64::MAX {
                out.gpu_span_ns = Some((last - first) as f64 * period);
            }
        }
        read.unmap();
    }
    Ok(Some(out))
}

fn finished() -> QkError {
    QkError::Engine("recorder already submitted".into())
}
