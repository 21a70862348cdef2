//! The KV cache of the local attention layers: per layer one K and one V buffer with a slot axis
//! (cell layout in ops/attention.rs), split into more buffer pairs only where the device's binding
//! size cannot hold every slot, and the byte ranges a slot's snapshot copies.

use super::config::ModelConfig;
use crate::error::{QkError, Result};
use crate::gpu::{Gpu, GpuBuffer};
use crate::ops::attention::{AttnShape, KvGroup, KvType};

/// One K/V buffer pair of an attention layer, holding slots `first_slot .. first_slot + slots`.
pub struct KvBuffers {
    pub k: GpuBuffer,
    pub v: GpuBuffer,
    pub first_slot: u32,
    pub slots: u32,
}

/// The KV cache of one attention layer for every slot: K and V with a slot axis (layouts in
/// ops/attention.rs), in as few buffer pairs as the device's binding size allows (one where
/// slots × ctx fits; each pair then costs one more split dispatch per decode step).
pub struct KvLayer {
    pub shape: AttnShape,
    pub groups: Vec<KvBuffers>,
}

impl KvLayer {
    pub fn new(gpu: &Gpu, shape: AttnShape, slots: u32, layer: u32) -> Result<KvLayer> {
        shape.validate()?;
        let per_buffer = shape.slots_per_buffer(gpu.caps.max_binding_size, gpu.caps.max_buffer_size)?;
        let ctx = u64::from(shape.ctx);
        let mut groups = Vec::new();
        let mut first = 0;
        while first < slots {
            let n = per_buffer.min(slots - first);
            let cells = u64::from(n) * ctx;
            groups.push(KvBuffers {
                k: gpu.buffer_zeroed(&format!("kv{layer}.k{first}"), cells * shape.k_position_bytes())?,
                v: gpu.buffer_zeroed(&format!("kv{layer}.v{first}"), cells * shape.v_position_bytes())?,
                first_slot: first,
                slots: n,
            });
            first += n;
        }
        Ok(KvLayer { shape, groups })
    }

    pub fn views(&self) -> Vec<KvGroup<'_>> {
        self.groups
            .iter()
            .map(|g| KvGroup {
                k: &g.k,
                v: &g.v,
                first_slot: g.first_slot,
                slots: g.slots,
            })
            .collect()
    }

    /// The K and V byte ranges (buffer, offset, bytes) of `slot`'s positions `0..pos`.
    pub fn slot_ranges(&self, slot: u32, pos: u32) -> Result<[(&GpuBuffer, u64, u64); 2]> {
        let g = self
            .groups
            .iter()
            .find(|g| slot >= g.first_slot && slot - g.first_slot < g.slots)
            .ok_or_else(|| QkError::Engine(format!("KV cache: slot {slot} out of range")))?;
        let local = u64::from(slot - g.first_slot) * u64::from(self.shape.ctx);
        let (kb, vb) = (self.shape.k_position_bytes(), self.shape.v_position_bytes());
        Ok([
            (&g.k, local * kb, u64::from(pos) * kb),
            (&g.v, local * vb, u64::from(pos) * vb),
        ])
    }
}

/// The attention shape of `cfg` with a cache of `ctx` positions in the given types.
pub fn attn_shape(cfg: &ModelConfig, ctx: u32, k_type: KvType, v_type: KvType) -> AttnShape {
    AttnShape {
        heads: cfg.heads,
        kv_heads: cfg.kv_heads,
        head_dim: cfg.head_dim,
        n_rot: cfg.n_rot,
        ctx,
        k_type,
        v_type,
        scale: cfg.attn_scale,
        eps: cfg.eps,
    }
}
