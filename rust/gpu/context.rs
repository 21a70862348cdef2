//! Instance, adapter choice and device creation: features and limits negotiated once, and the
//! usage counters every other runtime part bumps (read by tests and /metrics).

use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{QkError, Result};

/// How to pick and open a device. `from_env` reads `QK_DEVICE`, `QK_NO_SUBGROUPS` and
/// `QK_CHECKED_SHADERS`.
#[derive(Clone, Debug, Default)]
pub struct GpuOptions {
    /// Adapter index (as listed by [`adapters`]) or a case-insensitive substring of its name.
    pub device: Option<String>,
    /// Do not request subgroup operations even where offered (kernels use their shared-memory path).
    pub no_subgroups: bool,
    /// Compile qk's kernels with the checks wgpu adds to every shader by default: an index clamp
    /// on each dynamic array access (workgroup and local arrays too), a counter in every loop, a
    /// guard on every integer division. Off by default: the kernels are qk's own, the host checks
    /// each binding's size before a dispatch, tests require the same bytes either way, and on the
    /// H200 the checks cost 5–50% per kernel (benches/RESULTS.md, 2026-12-02).
    pub checked_shaders: bool,
}

impl GpuOptions {
    pub fn from_env() -> Self {
        let device = std::env::var("QK_DEVICE").ok().filter(|s| !s.trim().is_empty());
        let flag = |name: &str| std::env::var(name).is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("true"));
        GpuOptions {
            device,
            no_subgroups: flag("QK_NO_SUBGROUPS"),
            checked_shaders: flag("QK_CHECKED_SHADERS"),
        }
    }
}

/// What an adapter is, in the terms a user needs to pick one.
#[derive(Clone, Debug)]
pub struct AdapterSummary {
    pub index: usize,
    pub name: String,
    pub backend: String,
    pub device_type: String,
    pub driver: String,
}

/// What the opened device can do; kernels and ops choose variants and sizes from this.
#[derive(Clone, Debug)]
pub struct Caps {
    pub subgroups: bool,
    pub subgroup_min_size: u32,
    pub subgroup_max_size: u32,
    pub shader_f16: bool,
    pub timestamps: bool,
    pub cooperative_matrix: bool,
    /// The cooperative-matrix shapes and types the adapter offers (empty without the feature);
    /// kernels pick a configuration from it rather than assuming one.
    pub cooperative_matrix_configs: Vec<wgpu::CooperativeMatrixProperties>,
    pub max_binding_size: u64,
    pub max_buffer_size: u64,
    pub max_workgroup_storage: u32,
    pub max_invocations: u32,
    pub max_storage_buffers_per_stage: u32,
    pub max_immediate_size: u32,
    pub max_workgroups_per_dim: u32,
    pub storage_offset_alignment: u32,
}

/// Monotonic counts of created objects and host syncs; a steady decode step should add only
/// `submits` and `readbacks`.
#[derive(Default, Debug)]
pub(crate) struct Counters {
    pub pipelines: AtomicU64,
    pub bind_groups: AtomicU64,
    pub buffers: AtomicU64,
    pub submits: AtomicU64,
    pub readbacks: AtomicU64,
    pub dispatches: AtomicU64,
    pub spun_waits: AtomicU64,
    pub writes: AtomicU64,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CounterSnapshot {
    pub pipelines: u64,
    pub bind_groups: u64,
    pub buffers: u64,
    pub submits: u64,
    pub readbacks: u64,
    pub dispatches: u64,
    /// Waits that saw the GPU finish while polling, never sleeping in the driver.
    pub spun_waits: u64,
    /// Queue writes into GPU buffers (each a staging buffer and a copy ahead of the next submit).
    pub writes: u64,
}

impl Counters {
    pub fn bump(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> CounterSnapshot {
        let r = |c: &AtomicU64| c.load(Ordering::Relaxed);
        CounterSnapshot {
            pipelines: r(&self.pipelines),
            bind_groups: r(&self.bind_groups),
            buffers: r(&self.buffers),
            submits: r(&self.submits),
            readbacks: r(&self.readbacks),
            dispatches: r(&self.dispatches),
            spun_waits: r(&self.spun_waits),
            writes: r(&self.writes),
        }
    }
}

const INSTALL_HINT: &str = "install a Vulkan driver: on Debian/Ubuntu `apt-get install mesa-vulkan-drivers libvulkan1` \
                            (lavapipe, CPU) or the GPU vendor's driver";

fn instance() -> wgpu::Instance {
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
    desc.backends = wgpu::Backends::VULKAN | wgpu::Backends::METAL;
    // wgpu's default turns on its debug labels and the validation layer whenever debug assertions
    // are (our test profile); serving never wants them. WGPU_DEBUG=1 / WGPU_VALIDATION=1 ask for them.
    desc.flags = wgpu::InstanceFlags::empty().with_env();
    wgpu::Instance::new(desc)
}

fn enumerate(instance: &wgpu::Instance) -> Vec<wgpu::Adapter> {
    pollster::block_on(instance.enumerate_adapters(wgpu::Backends::VULKAN | wgpu::Backends::METAL))
}

fn summary(index: usize, info: &wgpu::AdapterInfo) -> AdapterSummary {
    AdapterSummary {
        index,
        name: info.name.clone(),
        backend: format!("{:?}", info.backend).to_lowercase(),
        device_type: format!("{:?}", info.device_type),
        driver: format!("{} {}", info.driver, info.driver_info).trim().to_string(),
    }
}

/// Every Vulkan/Metal adapter visible, in enumeration order (the index `QK_DEVICE` accepts).
pub fn adapters() -> Vec<AdapterSummary> {
    enumerate(&instance())
        .iter()
        .enumerate()
        .map(|(i, a)| summary(i, &a.get_info()))
        .collect()
}

fn type_rank(t: wgpu::DeviceType) -> u32 {
    match t {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Cpu => 3,
        wgpu::DeviceType::Other => 4,
    }
}

/// Pick by explicit selector (index or name substring), else the best device type.
fn choose(found: Vec<wgpu::Adapter>, selector: Option<&str>) -> Result<wgpu::Adapter> {
    if found.is_empty() {
        return Err(QkError::Device(format!(
            "no Vulkan or Metal adapter found; {INSTALL_HINT}"
        )));
    }
    let names: Vec<String> = found
        .iter()
        .enumerate()
        .map(|(i, a)| format!("{i}: {}", a.get_info().name))
        .collect();
    if let Some(sel) = selector {
        let sel = sel.trim();
        let pick = if let Ok(i) = sel.parse::<usize>() {
            found.into_iter().nth(i)
        } else {
            let needle = sel.to_lowercase();
            found
                .into_iter()
                .find(|a| a.get_info().name.to_lowercase().contains(&needle))
        };
        return pick.ok_or_else(|| {
            QkError::Device(format!(
                "no adapter matches QK_DEVICE={sel:?}; available: {}",
                names.join(", ")
            ))
        });
    }
    let mut found = found;
    found.sort_by_key(|a| type_rank(a.get_info().device_type));
    Ok(found.remove(0))
}

/// The adapter `Gpu::new(opts)` would open, without opening it.
pub fn select_adapter(opts: &GpuOptions) -> Result<AdapterSummary> {
    let instance = instance();
    let found = enumerate(&instance);
    let names: Vec<String> = found.iter().map(|a| a.get_info().name).collect();
    let chosen = choose(found, opts.device.as_deref())?.get_info();
    let index = names.iter().position(|n| *n == chosen.name).unwrap_or(0);
    Ok(summary(index, &chosen))
}

/// The opened device plus the caches of the runtime (see `pipelines.rs`, `buffers.rs`).
pub struct Gpu {
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub adapter: AdapterSummary,
    pub caps: Caps,
    pub(crate) counters: Counters,
    pub(crate) cache: super::pipelines::Cache,
    pub(crate) next_id: AtomicU64,
    /// Kernels compiled without wgpu's runtime checks (not [`GpuOptions::checked_shaders`]).
    pub unchecked_shaders: bool,
}

impl Gpu {
    /// Open the device chosen by `QK_DEVICE` / `QK_NO_SUBGROUPS` / `QK_CHECKED_SHADERS`.
    pub fn from_env() -> Result<Gpu> {
        Gpu::new(&GpuOptions::from_env())
    }

    pub fn new(opts: &GpuOptions) -> Result<Gpu> {
        let instance = instance();
        let found = enumerate(&instance);
        let indexed: Vec<(usize, String)> = found
            .iter()
            .enumerate()
            .map(|(i, a)| (i, a.get_info().name))
            .collect();
        let adapter = choose(found, opts.device.as_deref())?;
        let info = adapter.get_info();
        let index = indexed
            .iter()
            .find(|(_, n)| *n == info.name)
            .map_or(0, |(i, _)| *i);

        let offered = adapter.features();
        if !offered.contains(wgpu::Features::IMMEDIATES) {
            // Every kernel takes its shape parameters as immediates (Vulkan push constants), which
            // all native Vulkan/Metal/DX12 drivers provide.
            return Err(QkError::Device(format!(
                "adapter {} lacks immediates (push constants)",
                info.name
            )));
        }
        let mut wanted = wgpu::Features::IMMEDIATES
            | wgpu::Features::SHADER_F16
            | wgpu::Features::SUBGROUP
            | wgpu::Features::TIMESTAMP_QUERY
            | wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX;
        if opts.no_subgroups {
            wanted.remove(wgpu::Features::SUBGROUP);
        }
        let features = wanted & offered;

        let a = adapter.limits();
        let limits = wgpu::Limits {
            max_storage_buffer_binding_size: a.max_storage_buffer_binding_size,
            max_buffer_size: a.max_buffer_size,
            max_compute_workgroup_storage_size: a.max_compute_workgroup_storage_size,
            max_compute_invocations_per_workgroup: a.max_compute_invocations_per_workgroup,
            max_compute_workgroup_size_x: a.max_compute_workgroup_size_x,
            max_compute_workgroup_size_y: a.max_compute_workgroup_size_y,
            max_compute_workgroup_size_z: a.max_compute_workgroup_size_z,
            max_compute_workgroups_per_dimension: a.max_compute_workgroups_per_dimension,
            max_storage_buffers_per_shader_stage: a.max_storage_buffers_per_shader_stage,
            max_immediate_size: a.max_immediate_size,
            min_storage_buffer_offset_alignment: a.min_storage_buffer_offset_alignment,
            min_uniform_buffer_offset_alignment: a.min_uniform_buffer_offset_alignment,
            max_bindings_per_bind_group: a.max_bindings_per_bind_group,
            ..wgpu::Limits::default()
        };
        let experimental = if features.contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX) {
            // SAFETY: the only experimental feature requested is cooperative matrix, used solely by
            // kernels that check `caps.cooperative_matrix`.
            unsafe { wgpu::ExperimentalFeatures::enabled() }
        } else {
            wgpu::ExperimentalFeatures::disabled()
        };
        let desc = wgpu::DeviceDescriptor {
            label: Some("qk"),
            required_features: features,
            required_limits: limits.clone(),
            experimental_features: experimental,
            memory_hints: wgpu::MemoryHints::Performance,
            trace: wgpu::Trace::Off,
        };
        let (device, queue) = pollster::block_on(adapter.request_device(&desc))
            .map_err(|e| QkError::Device(format!("{}: request_device failed: {e}", info.name)))?;
        device.on_uncaptured_error(std::sync::Arc::new(|e: wgpu::Error| {
            // Errors outside an error scope would otherwise panic inside wgpu; scoped calls
            // (pipelines, buffers) report through QkError instead.
            eprintln!("qk: uncaptured wgpu error: {e}");
        }));
        let caps = Caps {
            subgroups: features.contains(wgpu::Features::SUBGROUP),
            subgroup_min_size: info.subgroup_min_size,
            subgroup_max_size: info.subgroup_max_size,
            shader_f16: features.contains(wgpu::Features::SHADER_F16),
            timestamps: features.contains(wgpu::Features::TIMESTAMP_QUERY),
            cooperative_matrix: features.contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX),
            cooperative_matrix_configs: if features.contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX)
            {
                adapter.cooperative_matrix_properties()
            } else {
                Vec::new()
            },
            max_binding_size: limits.max_storage_buffer_binding_size,
            max_buffer_size: limits.max_buffer_size,
            max_workgroup_storage: limits.max_compute_workgroup_storage_size,
            max_invocations: limits.max_compute_invocations_per_workgroup,
            max_storage_buffers_per_stage: limits.max_storage_buffers_per_shader_stage,
            max_immediate_size: limits.max_immediate_size,
            max_workgroups_per_dim: limits.max_compute_workgroups_per_dimension,
            storage_offset_alignment: limits.min_storage_buffer_offset_alignment,
        };
        Ok(Gpu {
            device,
            queue,
            adapter: summary(index, &info),
            caps,
            counters: Counters::default(),
            cache: Default::default(),
            next_id: AtomicU64::new(1),
            unchecked_shaders: !opts.checked_shaders,
        })
    }

    /// Counts of created pipelines, bind groups, buffers, submits and readbacks so far.
    pub fn counters(&self) -> CounterSnapshot {
        self.counters.snapshot()
    }

    pub(crate) fn fresh_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Split `n` workgroups over x and y so neither exceeds the per-dimension limit; kernels
    /// rebuild the linear index as `wid.x + wid.y * nwg.x` and skip indices ≥ n.
    pub fn grid(&self, n: u32) -> [u32; 3] {
        let max = self.caps.max_workgroups_per_dim.max(1);
        if n <= max {
            [n.max(1), 1, 1]
        } else {
            let y = n.div_ceil(max);
            [n.div_ceil(y), y, 1]
        }
    }

    /// Block until submission `index` has finished on the GPU (and its callbacks ran).
    pub fn wait_for(&self, index: wgpu::SubmissionIndex) -> Result<()> {
        self.device
            .poll(wgpu::PollType::Wait {
                submission_index: Some(index),
                timeout: None,
            })
            .map(|_| ())
            .map_err(|e| QkError::DeviceLost(format!("poll: {e}")))
    }

    /// Check once, without blocking, what the GPU has finished, and run the callbacks due.
    pub fn poll_once(&self) -> Result<()> {
        self.device
            .poll(wgpu::PollType::Poll)
            .map(|_| ())
            .map_err(|e| QkError::DeviceLost(format!("poll: {e}")))
    }

    /// Block until all submitted work is done.
    pub fn wait(&self) -> Result<()> {
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map(|_| ())
            .map_err(|e| QkError::DeviceLost(format!("poll: {e}")))
    }
}
