//! Pipeline cache keyed by (file, defines, override constants) and bind-group cache keyed by
//! (pipeline, bound ranges): both are filled on first use, so a repeated step creates nothing.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::buffers::Binding;
use super::context::{Counters, Gpu};
use super::shaders::{self, Defines, ShaderFile};
use crate::error::{QkError, Result};

/// How the kernel declares each `@group(0) @binding(i)`, in binding order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BindingKind {
    StorageRead,
    StorageReadWrite,
    Uniform,
}

/// A compute pipeline plus what the recorder needs to bind and check it.
#[derive(Debug)]
pub struct Pipeline {
    pub name: String,
    pub id: u64,
    pub pipeline: wgpu::ComputePipeline,
    pub layout: wgpu::BindGroupLayout,
    pub bindings: Vec<BindingKind>,
    /// Bytes of the kernel's `var<immediate>` block (0 if none).
    pub immediate_size: u32,
    /// `@workgroup_size` as declared (after override constants); `[0; 3]` if not a literal.
    pub workgroup_size: [u32; 3],
}

type PipelineKey = (&'static str, Vec<(String, String)>, Vec<(String, u64)>);
type BindKey = (u64, Vec<(u64, u64, u64)>);

/// A request exactly as a call site made it (defines in its order), for the allocation-free hit
/// path: ops ask for their pipeline on every dispatch, so a hit must cost a hash, not a map build.
struct Request {
    file: &'static str,
    defines: Vec<(String, String)>,
    constants: Vec<(String, u64)>,
    pipeline: Arc<Pipeline>,
}

impl Request {
    fn matches(&self, file: &ShaderFile, defines: &[(&str, String)], constants: &[(&str, f64)]) -> bool {
        self.file == file.name
            && self.defines.len() == defines.len()
            && self
                .defines
                .iter()
                .zip(defines)
                .all(|((k, v), (k2, v2))| k == k2 && v == v2)
            && self.constants.len() == constants.len()
            && self
                .constants
                .iter()
                .zip(constants)
                .all(|((k, v), (k2, v2))| k == k2 && *v == v2.to_bits())
    }
}

fn request_hash(file: &ShaderFile, defines: &[(&str, String)], constants: &[(&str, f64)]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    file.name.hash(&mut h);
    for (k, v) in defines {
        k.hash(&mut h);
        v.hash(&mut h);
    }
    for (k, v) in constants {
        k.hash(&mut h);
        v.to_bits().hash(&mut h);
    }
    h.finish()
}

#[derive(Default)]
pub(crate) struct Cache {
    pipelines: Mutex<HashMap<PipelineKey, Arc<Pipeline>>>,
    requests: Mutex<HashMap<u64, Vec<Request>>>,
    bind_groups: Mutex<HashMap<BindKey, wgpu::BindGroup>>,
    pub(crate) staging: Mutex<Vec<super::buffers::GpuBuffer>>,
}

fn reflect(module: &naga::Module, name: &str) -> Result<(Vec<BindingKind>, u32)> {
    let mut found: Vec<(u32, BindingKind)> = Vec::new();
    let mut immediate = 0u32;
    let mut layouter = naga::proc::Layouter::default();
    layouter.update(module.to_ctx()).map_err(|e| QkError::Shader {
        name: name.into(),
        msg: format!("layout: {e}"),
    })?;
    for (_, var) in module.global_variables.iter() {
        let kind = match var.space {
            naga::AddressSpace::Storage { access } => {
                if access.contains(naga::StorageAccess::STORE) {
                    BindingKind::StorageReadWrite
                } else {
                    BindingKind::StorageRead
                }
            }
            naga::AddressSpace::Uniform => BindingKind::Uniform,
            naga::AddressSpace::Immediate => {
                immediate = immediate.max(layouter[var.ty].size);
                continue;
            }
            _ => continue,
        };
        let Some(rb) = &var.binding else { continue };
        if rb.group != 0 {
            return Err(QkError::Shader {
                name: name.into(),
                msg: "only @group(0) is supported".into(),
            });
        }
        found.push((rb.binding, kind));
    }
    found.sort_by_key(|(b, _)| *b);
    for (i, (b, _)) in found.iter().enumerate() {
        if *b as usize != i {
            return Err(QkError::Shader {
                name: name.into(),
                msg: "bindings must be numbered 0,1,2… with no gaps".into(),
            });
        }
    }
    // Immediates are 4-byte granular on every backend.
    Ok((
        found.into_iter().map(|(_, k)| k).collect(),
        immediate.div_ceil(4) * 4,
    ))
}

impl Gpu {
    /// The pipeline of `file` with `defines` (overriding the file's `#define` defaults) and WGSL
    /// `override` constants; built and validated on first use, then served from the cache.
    pub fn pipeline(
        &self,
        file: &ShaderFile,
        defines: &[(&str, String)],
        constants: &[(&str, f64)],
    ) -> Result<Arc<Pipeline>> {
        let hash = request_hash(file, defines, constants);
        if let Some(hit) = self
            .cache
            .requests
            .lock()
            .map_err(poisoned)?
            .get(&hash)
            .and_then(|v| v.iter().find(|r| r.matches(file, defines, constants)))
        {
            return Ok(hit.pipeline.clone());
        }
        let pipeline = self.pipeline_by_key(file, defines, constants)?;
        self.cache
            .requests
            .lock()
            .map_err(poisoned)?
            .entry(hash)
            .or_default()
            .push(Request {
                file: file.name,
                defines: defines.iter().map(|(k, v)| (k.to_string(), v.clone())).collect(),
                constants: constants
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_bits()))
                    .collect(),
                pipeline: pipeline.clone(),
            });
        Ok(pipeline)
    }

    /// The pipeline for the canonical key (defines merged with the defaults); built on a miss.
    fn pipeline_by_key(
        &self,
        file: &ShaderFile,
        defines: &[(&str, String)],
        constants: &[(&str, f64)],
    ) -> Result<Arc<Pipeline>> {
        let mut defs: Defines = defines.iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
        defs.entry("SUBGROUPS".into()).or_insert_with(|| {
            if self.caps.subgroups {
                "1".into()
            } else {
                "0".into()
            }
        });
        let key: PipelineKey = (
            file.name,
            defs.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            constants
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_bits()))
                .collect(),
        );
        if let Some(p) = self.cache.pipelines.lock().map_err(poisoned)?.get(&key) {
            return Ok(p.clone());
        }
        let label = format!(
            "{}[{}]",
            file.name,
            defs.iter()
                .filter(|(k, _)| *k != "SUBGROUPS")
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(",")
        );
        let wgsl = shaders::expand(file, &defs)?;
        let (module, _info) = shaders::validate(&label, &wgsl)?;
        let (bindings, immediate_size) = reflect(&module, &label)?;
        if immediate_size > self.caps.max_immediate_size.min(256) {
            return Err(QkError::Shader {
                name: label,
                msg: format!(
                    "{immediate_size} bytes of immediates exceed the device's {} (keep params ≤ 128 bytes)",
                    self.caps.max_immediate_size
                ),
            });
        }
        let ep = module
            .entry_points
            .iter()
            .find(|e| e.stage == naga::ShaderStage::Compute)
            .ok_or_else(|| QkError::Shader {
                name: label.clone(),
                msg: "no @compute entry point".into(),
            })?;
        let entry = ep.name.clone();
        let workgroup_size = ep.workgroup_size;

        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let desc = wgpu::ShaderModuleDescriptor {
            label: Some(&label),
            source: wgpu::ShaderSource::Wgsl(wgsl.into()),
        };
        let shader = if self.unchecked_shaders {
            // SAFETY: the module is one of qk's own kernels (shaders/, validated by naga above) and
            // every binding's size is checked on the host before a dispatch. What the checks
            // guarded against would be a kernel bug either way: a loop that never ends, an index
            // past a workgroup array (now undefined, before clamped), a division by zero (now an
            // unspecified value); tests compare checked and unchecked bytes
            // (GpuOptions::checked_shaders).
            unsafe {
                self.device
                    .create_shader_module_trusted(desc, wgpu::ShaderRuntimeChecks::unchecked())
            }
        } else {
            self.device.create_shader_module(desc)
        };
        let entries: Vec<wgpu::BindGroupLayoutEntry> = bindings
            .iter()
            .enumerate()
            .map(|(i, k)| wgpu::BindGroupLayoutEntry {
                binding: i as u32,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: match k {
                    BindingKind::StorageRead => wgpu::BindingType::Buffer {
                        ty: wgpu::BufferBindingType::Storage { read_only: true },
                        has_dynamic_offset: false,
                        min_binding_size: None,
                    },
                    BindingKind::StorageReadWrite => wgpu::BindingType::Buffer {
                        ty: wgpu::BufferBindingType::Storage { read_only: false },
                        has_dynamic_offset: false,
                        min_binding_size: None,
                    },
                    BindingKind::Uniform => wgpu::BindingType::Buffer {
                        ty: wgpu::BufferBindingType::Uniform,
                        has_dynamic_offset: false,
                        min_binding_size: None,
                    },
                },
                count: None,
            })
            .collect();
        let layout = self
            .device
            .create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                label: Some(&label),
                entries: &entries,
            });
        let pipeline_layout = self
            .device
            .create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                label: Some(&label),
                bind_group_layouts: &[Some(&layout)],
                immediate_size,
            });
        let pipeline = self
            .device
            .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(&label),
                layout: Some(&pipeline_layout),
                module: &shader,
                entry_point: Some(&entry),
                compilation_options: wgpu::PipelineCompilationOptions {
                    constants,
                    // Kernels initialise the workgroup memory they read; skip wgpu's zeroing pass.
                    zero_initialize_workgroup_memory: false,
                },
                cache: None,
            });
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(QkError::Shader {
                name: label,
                msg: e.to_string(),
            });
        }
        Counters::bump(&self.counters.pipelines);
        let p = Arc::new(Pipeline {
            name: label,
            id: self.fresh_id(),
            pipeline,
            layout,
            bindings,
            immediate_size,
            workgroup_size,
        });
        self.cache
            .pipelines
            .lock()
            .map_err(poisoned)?
            .insert(key, p.clone());
        Ok(p)
    }

    /// The bind group of `pipe` over `bindings`, created once per distinct set of ranges.
    pub(crate) fn bind_group(&self, pipe: &Pipeline, bindings: &[Binding<'_>]) -> Result<wgpu::BindGroup> {
        if bindings.len() != pipe.bindings.len() {
            return Err(QkError::Engine(format!(
                "{}: {} bindings given, kernel declares {}",
                pipe.name,
                bindings.len(),
                pipe.bindings.len()
            )));
        }
        let align = u64::from(self.caps.storage_offset_alignment);
        for (i, b) in bindings.iter().enumerate() {
            if b.offset % align != 0 || b.size == 0 || b.size % 4 != 0 || b.size > self.caps.max_binding_size
            {
                return Err(QkError::Engine(format!(
                    "{}: binding {i} range (offset {}, size {}) violates alignment {align} / size limit {}",
                    pipe.name, b.offset, b.size, self.caps.max_binding_size
                )));
            }
        }
        let key: BindKey = (
            pipe.id,
            bindings.iter().map(|b| (b.buffer.id, b.offset, b.size)).collect(),
        );
        let mut cache = self.cache.bind_groups.lock().map_err(poisoned)?;
        if let Some(bg) = cache.get(&key) {
            return Ok(bg.clone());
        }
        let entries: Vec<wgpu::BindGroupEntry> = bindings
            .iter()
            .enumerate()
            .map(|(i, b)| wgpu::BindGroupEntry {
                binding: i as u32,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer: &b.buffer.buffer,
                    offset: b.buffer.base + b.offset,
                    size: std::num::NonZeroU64::new(b.size),
                }),
            })
            .collect();
        let bg = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(&pipe.name),
            layout: &pipe.layout,
            entries: &entries,
        });
        Counters::bump(&self.counters.bind_groups);
        cache.insert(key, bg.clone());
        Ok(bg)
    }

    /// Drop cached bind groups (after freeing buffers they reference, e.g. when a model unloads).
    pub fn clear_bind_groups(&self) {
        if let Ok(mut c) = self.cache.bind_groups.lock() {
            c.clear();
        }
    }
}

fn poisoned<T>(_: std::sync::PoisonError<T>) -> QkError {
    QkError::Engine("gpu cache lock poisoned by a panic in another thread".into())
}
