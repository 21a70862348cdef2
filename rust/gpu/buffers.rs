//! Device buffers: activations/scratch, weights uploaded once (cut into binding-sized windows on
//! row boundaries; the small ones packed into shared arena buffers), and readback to the host.

use std::sync::{Arc, Mutex};

use super::context::{Counters, Gpu};
use crate::error::{QkError, Result};
use crate::gguf::GgmlType;

/// A device buffer with a runtime-unique id (the bind-group cache key). Cheap to clone. It may be
/// a range of a larger wgpu buffer (a weight placed in a [`WeightArena`]): its bytes start at
/// `base` there, and every binding, copy and write of it is relative to that.
#[derive(Clone, Debug)]
pub struct GpuBuffer {
    pub buffer: wgpu::Buffer,
    pub id: u64,
    pub size: u64,
    pub label: Arc<str>,
    pub base: u64,
}

/// A range of a buffer bound to one kernel binding.
#[derive(Clone, Copy, Debug)]
pub struct Binding<'a> {
    pub buffer: &'a GpuBuffer,
    pub offset: u64,
    pub size: u64,
}

impl GpuBuffer {
    /// Bind the whole buffer.
    pub fn all(&self) -> Binding<'_> {
        Binding {
            buffer: self,
            offset: 0,
            size: self.size,
        }
    }

    /// Bind `size` bytes from `offset` (offset must meet `caps.storage_offset_alignment`).
    pub fn range(&self, offset: u64, size: u64) -> Binding<'_> {
        Binding {
            buffer: self,
            offset,
            size,
        }
    }
}

const STORAGE: wgpu::BufferUsages = wgpu::BufferUsages::STORAGE
    .union(wgpu::BufferUsages::COPY_SRC)
    .union(wgpu::BufferUsages::COPY_DST);

/// Small weights packed as aligned ranges of a few shared buffers. wgpu's submit costs the host
/// per distinct buffer its commands reference, not per bind group (kernel bench `host`: 317
/// dispatches over 800 buffers against the same over 800 ranges of 3 buffers), and a decode step
/// references every weight of its layers: packed, a layer's dozen small tensors (norms, the
/// mixer's projections, the router, the shared expert) share one buffer. A tensor over
/// [`ARENA_MAX_TENSOR`] keeps a buffer of its own (the experts' stacks), which bounds an arena
/// buffer's unused tail; only weights go in (read-only bindings: a buffer bound for writing
/// cannot be bound for reading in the same dispatch).
pub struct WeightArena {
    state: Mutex<ArenaState>,
}

#[derive(Default)]
struct ArenaState {
    chunks: Vec<ArenaChunk>,
    /// Bytes of the tensors' own data placed (not their padding, alignment or grids).
    placed: u64,
}

struct ArenaChunk {
    buffer: GpuBuffer,
    used: u64,
}

/// Bytes of an arena buffer at most (the first ones are smaller, see [`Gpu::place`]).
pub const ARENA_CHUNK: u64 = 256 << 20;
/// The largest tensor placed in an arena.
pub const ARENA_MAX_TENSOR: u64 = 32 << 20;

impl WeightArena {
    pub fn new() -> WeightArena {
        WeightArena {
            state: Mutex::new(ArenaState::default()),
        }
    }

    /// Device bytes the arena's buffers hold beyond the data placed in them: alignment, padding,
    /// grids and the buffers' unused tails.
    pub fn overhead(&self) -> u64 {
        self.state.lock().map_or(0, |s| {
            let reserved: u64 = s.chunks.iter().map(|c| c.buffer.size).sum();
            reserved - s.placed
        })
    }

    /// The arena's buffers.
    pub fn buffers(&self) -> usize {
        self.state.lock().map_or(0, |s| s.chunks.len())
    }
}

impl Default for WeightArena {
    fn default() -> Self {
        Self::new()
    }
}

/// One binding-sized piece of a weight tensor: rows `first_row .. first_row + n_rows` (counted
/// over all experts for a 3-D tensor), starting at byte 0 of `buffer`.
#[derive(Clone, Debug)]
pub struct WeightWindow {
    pub buffer: GpuBuffer,
    pub first_row: u64,
    pub n_rows: u64,
    /// Byte offset of the window's first row in `buffer`: non-zero for a tensor that shares its
    /// buffer with others (see [`WeightTensor::split_rows`]).
    pub offset: u64,
}

/// A weight matrix (or stack of expert matrices) resident on the device in its GGUF block layout.
/// Row r of expert e is global row `e * rows + r`; a window never splits an expert unless one
/// expert alone exceeds a binding.
#[derive(Clone, Debug)]
pub struct WeightTensor {
    pub name: String,
    pub ty: GgmlType,
    /// Inner dimension K (weights per row).
    pub cols: u64,
    /// Rows per expert (the output dimension M).
    pub rows: u64,
    /// 1 for a dense matrix.
    pub experts: u64,
    pub row_bytes: u64,
    pub windows: Vec<WeightWindow>,
}

impl WeightTensor {
    /// Two tensors over this dense one-window tensor's rows `[0, at)` and `[at, rows)`, sharing its
    /// buffer (no copy): a matrix uploaded as one stack of two, for kernels that take the stack in
    /// one product and others that take each part.
    pub fn split_rows(&self, at: u64, names: [&str; 2]) -> Option<[WeightTensor; 2]> {
        let [win] = self.windows.as_slice() else {
            return None;
        };
        if self.experts != 1 || at == 0 || at >= self.rows {
            return None;
        }
        let part = |name: &str, first: u64, rows: u64| WeightTensor {
            name: name.into(),
            ty: self.ty,
            cols: self.cols,
            rows,
            experts: 1,
            row_bytes: self.row_bytes,
            windows: vec![WeightWindow {
                buffer: win.buffer.clone(),
                first_row: 0,
                n_rows: rows,
                offset: win.offset + first * self.row_bytes,
            }],
        };
        Some([part(names[0], 0, at), part(names[1], at, self.rows - at)])
    }

    /// The window holding global row `row`.
    pub fn window_of(&self, row: u64) -> Option<&WeightWindow> {
        self.windows
            .iter()
            .find(|w| row >= w.first_row && row < w.first_row + w.n_rows)
    }
}

impl Gpu {
    fn create_buffer(
        &self,
        label: &str,
        size: u64,
        usage: wgpu::BufferUsages,
        mapped: bool,
    ) -> Result<GpuBuffer> {
        if size > self.caps.max_buffer_size {
            return Err(QkError::OutOfMemory(format!(
                "{label}: {size} bytes exceeds the device's largest buffer ({} bytes)",
                self.caps.max_buffer_size
            )));
        }
        // Storage bindings and copies work in whole u32s.
        let padded = size.max(4).div_ceil(4) * 4;
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let buffer = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: padded,
            usage,
            mapped_at_creation: mapped,
        });
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(QkError::OutOfMemory(format!("{label}: {padded} bytes: {e}")));
        }
        Counters::bump(&self.counters.buffers);
        Ok(GpuBuffer {
            buffer,
            id: self.fresh_id(),
            size: padded,
            label: label.into(),
            base: 0,
        })
    }

    /// A host-visible buffer the GPU copies from (MAP_WRITE | COPY_SRC): an armed step's input,
    /// written by the host through a mapping wgpu does not know of (gpu/armed.rs).
    pub(crate) fn mapped_input_buffer(&self, label: &str, size: u64) -> Result<GpuBuffer> {
        // Mapped at creation (zeros) and unmapped: wgpu then counts it initialised, where it would
        // otherwise clear it before its first use as a copy source, over what the host wrote.
        let buf = self.create_buffer(
            label,
            size,
            wgpu::BufferUsages::MAP_WRITE | wgpu::BufferUsages::COPY_SRC,
            true,
        )?;
        buf.buffer.unmap();
        Ok(buf)
    }

    /// A zero-filled storage buffer (activations, scratch, outputs).
    pub fn buffer_zeroed(&self, label: &str, size: u64) -> Result<GpuBuffer> {
        self.create_buffer(label, size, STORAGE, false)
    }

    /// A storage buffer holding `bytes` (padded with zeros to a multiple of 4).
    pub fn buffer_from_bytes(&self, label: &str, bytes: &[u8]) -> Result<GpuBuffer> {
        self.buffer_from_parts(label, bytes, &[])
    }

    /// `head` padded with zeros to a multiple of 4, then `tail`, in one storage buffer.
    fn buffer_from_parts(&self, label: &str, head: &[u8], tail: &[u8]) -> Result<GpuBuffer> {
        let at = head.len().div_ceil(4) * 4;
        let buf = self.create_buffer(label, (at + tail.len()) as u64, STORAGE, true)?;
        {
            let mut view = buf
                .buffer
                .get_mapped_range_mut(..)
                .map_err(|e| QkError::Engine(format!("{label}: map at creation failed: {e}")))?;
            view.slice(..head.len()).copy_from_slice(head);
            view.slice(at..at + tail.len()).copy_from_slice(tail);
        }
        buf.buffer.unmap();
        Ok(buf)
    }

    /// `head` padded to a multiple of 4, then `tail`, as a range of one of `arena`'s buffers when
    /// there is an arena and the whole fits [`ARENA_MAX_TENSOR`]; else in a buffer of its own.
    pub fn place(
        &self,
        arena: Option<&WeightArena>,
        label: &str,
        head: &[u8],
        tail: &[u8],
    ) -> Result<GpuBuffer> {
        let at = head.len().div_ceil(4) as u64 * 4;
        let size = (at + tail.len() as u64).max(4).div_ceil(4) * 4;
        let Some(arena) = arena.filter(|_| size <= ARENA_MAX_TENSOR) else {
            return self.buffer_from_parts(label, head, tail);
        };
        let align = u64::from(self.caps.storage_offset_alignment).max(4);
        let mut state = arena
            .state
            .lock()
            .map_err(|_| QkError::Engine("weight arena poisoned".into()))?;
        let fits = |c: &ArenaChunk| c.used.div_ceil(align) * align + size <= c.buffer.size;
        let i = match state.chunks.iter().position(fits) {
            Some(i) => i,
            None => {
                // Each buffer twice the last, from 1 MiB (a tiny model holds no 256 MiB) up to
                // ARENA_CHUNK; first-fit fills the tails the bigger tensors leave.
                let last = state.chunks.last().map_or(0, |c| c.buffer.size);
                let bytes = (2 * last)
                    .clamp(1 << 20, ARENA_CHUNK)
                    .min(self.caps.max_buffer_size)
                    .max(size);
                let buffer = self.create_buffer("weights.arena", bytes, STORAGE, false)?;
                state.chunks.push(ArenaChunk { buffer, used: 0 });
                state.chunks.len() - 1
            }
        };
        state.placed += head.len() as u64;
        let chunk = &mut state.chunks[i];
        let base = chunk.used.div_ceil(align) * align;
        chunk.used = base + size;
        let view = GpuBuffer {
            buffer: chunk.buffer.buffer.clone(),
            id: self.fresh_id(),
            size,
            label: label.into(),
            base: chunk.buffer.base + base,
        };
        drop(state);
        // Whole words: the head's last one padded with zeros, as a buffer of its own would be.
        let mut words = Vec::with_capacity(size as usize);
        words.extend_from_slice(head);
        words.resize(at as usize, 0);
        words.extend_from_slice(tail);
        words.resize(size as usize, 0);
        self.write(&view, 0, &words)?;
        Ok(view)
    }

    pub fn buffer_from_f32(&self, label: &str, data: &[f32]) -> Result<GpuBuffer> {
        self.buffer_from_bytes(label, bytemuck::cast_slice(data))
    }

    pub fn buffer_from_u32(&self, label: &str, data: &[u32]) -> Result<GpuBuffer> {
        self.buffer_from_bytes(label, bytemuck::cast_slice(data))
    }

    /// Overwrite part of a buffer (queued; ordered before the next submit).
    pub fn write(&self, buf: &GpuBuffer, offset: u64, bytes: &[u8]) -> Result<()> {
        if !offset.is_multiple_of(4)
            || !bytes.len().is_multiple_of(4)
            || offset + bytes.len() as u64 > buf.size
        {
            return Err(QkError::Engine(format!(
                "{}: write of {} bytes at {offset} is unaligned or out of range ({} bytes)",
                buf.label,
                bytes.len(),
                buf.size
            )));
        }
        self.queue.write_buffer(&buf.buffer, buf.base + offset, bytes);
        Counters::bump(&self.counters.writes);
        Ok(())
    }

    /// Upload a weight tensor given in GGUF layout: `experts` matrices of `rows` × `cols` of
    /// type `ty`, back to back. Windows hold whole rows (whole experts where one fits) and each
    /// fits one binding; an IQ1/IQ2/IQ3 window ends with its type's grid (`gguf::grids::grid_of`).
    pub fn upload_weight(
        &self,
        name: &str,
        ty: GgmlType,
        cols: u64,
        rows: u64,
        experts: u64,
        bytes: &[u8],
    ) -> Result<WeightTensor> {
        self.upload_weight_windowed(name, ty, cols, rows, experts, bytes, u64::MAX, None)
    }

    /// As [`Gpu::upload_weight`] with windows of at most `max_window_bytes` (tests use this to
    /// exercise windowing without 128 MiB tensors), small ones placed in `arena` if given
    /// ([`Gpu::place`]).
    #[allow(clippy::too_many_arguments)]
    pub fn upload_weight_windowed(
        &self,
        name: &str,
        ty: GgmlType,
        cols: u64,
        rows: u64,
        experts: u64,
        bytes: &[u8],
        max_window_bytes: u64,
        arena: Option<&WeightArena>,
    ) -> Result<WeightTensor> {
        let unsupported = || QkError::UnsupportedType {
            tensor: name.into(),
            ty: ty.name().into(),
        };
        let row_bytes = ty.bytes_for(cols).ok_or_else(unsupported)?;
        if !cols.is_multiple_of(8) {
            // Kernels consume 8 weights per step and 4-byte words of F16/BF16 rows.
            return Err(QkError::Engine(format!(
                "{name}: inner dimension {cols} is not a multiple of 8"
            )));
        }
        let total_rows = rows * experts;
        if total_rows * row_bytes != bytes.len() as u64 {
            return Err(QkError::Engine(format!(
                "{name}: {} bytes given, {experts}×{rows}×{cols} {ty} needs {}",
                bytes.len(),
                total_rows * row_bytes
            )));
        }
        // IQ1/IQ2/IQ3 windows end with their type's grid, which the kernels read from there.
        let grid: &[u8] = crate::gguf::grids::grid_of(ty).map_or(&[], bytemuck::cast_slice);
        let cap = self
            .caps
            .max_binding_size
            .min(self.caps.max_buffer_size)
            .min(max_window_bytes)
            .saturating_sub(grid.len() as u64 + 3);
        let max_rows = cap / row_bytes;
        if max_rows == 0 {
            return Err(QkError::Engine(format!(
                "{name}: one row of {row_bytes} bytes exceeds a binding ({cap})"
            )));
        }
        // Cut on expert boundaries when an expert fits, so an expert's rows share one binding.
        let rows_per_window = if experts > 1 && rows <= max_rows {
            (max_rows / rows) * rows
        } else {
            max_rows
        };
        let mut windows = Vec::new();
        let mut first = 0u64;
        while first < total_rows {
            let n = rows_per_window.min(total_rows - first);
            let lo = (first * row_bytes) as usize;
            let hi = ((first + n) * row_bytes) as usize;
            let label = format!("{name}[{first}..{}]", first + n);
            let buffer = self.place(arena, &label, &bytes[lo..hi], grid)?;
            windows.push(WeightWindow {
                buffer,
                first_row: first,
                n_rows: n,
                offset: 0,
            });
            first += n;
        }
        Ok(WeightTensor {
            name: name.into(),
            ty,
            cols,
            rows,
            experts,
            row_bytes,
            windows,
        })
    }

    /// Read `size` bytes from `offset` of `buf` (one submit and one map; waits for the GPU).
    pub fn read_bytes(&self, buf: &GpuBuffer, offset: u64, size: u64) -> Result<Vec<u8>> {
        let mut rec = self.recorder();
        let ticket = rec.read(buf, offset, size)?;
        let mut out = rec.finish_and_read()?;
        Ok(std::mem::take(&mut out[ticket]))
    }

    pub fn read_f32(&self, buf: &GpuBuffer, offset: u64, count: usize) -> Result<Vec<f32>> {
        let bytes = self.read_bytes(buf, offset, count as u64 * 4)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    pub fn read_u32(&self, buf: &GpuBuffer, offset: u64, count: usize) -> Result<Vec<u32>> {
        let bytes = self.read_bytes(buf, offset, count as u64 * 4)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    /// A mappable buffer of at least `size` bytes, reused across readbacks so a steady step
    /// creates none.
    pub(crate) fn staging_buffer(&self, size: u64) -> Result<GpuBuffer> {
        if let Ok(mut pool) = self.cache.staging.lock()
            && let Some(i) = pool.iter().position(|b| b.size >= size)
        {
            return Ok(pool.swap_remove(i));
        }
        // Grow geometrically so a slowly growing read does not allocate each time.
        let size = size
            .max(1 << 16)
            .next_power_of_two()
            .min(self.caps.max_buffer_size)
            .max(size);
        self.create_buffer(
            "readback",
            size,
            wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            false,
        )
    }

    /// Keep a staging buffer for the next readback: a few, so a step recorded ahead has its own
    /// while the previous step's is mapped.
    pub(crate) fn return_staging(&self, buf: GpuBuffer) {
        if let Ok(mut pool) = self.cache.staging.lock() {
            if pool.len() >= 4 {
                pool.remove(0);
            }
            pool.push(buf);
        }
    }
}
