// Shared helpers for every kernel: the compute built-ins in one struct (subgroup ones only where the
// device has them), the linear workgroup index of a grid split over x and y (Gpu::grid), and an
// invocation's subgroup and lane.

struct ComputeIds {
    @builtin(local_invocation_index) lid: u32,
    @builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
#if SUBGROUPS
    @builtin(subgroup_invocation_id) sg_lane: u32,
    @builtin(subgroup_size) sg_size: u32,
    @builtin(subgroup_id) sg_id: u32,
    @builtin(num_subgroups) n_sg: u32,
#endif
}

// Linear workgroup index when Gpu::grid spread the groups over x and y.
fn group_index(ids: ComputeIds) -> u32 {
    return ids.wid.x + ids.wid.y * ids.nwg.x;
}

// (subgroup index, lane) of this invocation. Without the subgroup built-ins the runtime only picks
// a kernel that calls this on devices whose subgroup size is fixed at `size`, where subgroups are
// consecutive invocation ranges.
fn subgroup_lane(ids: ComputeIds, size: u32) -> vec2<u32> {
#if SUBGROUPS
    return vec2<u32>(ids.sg_id, ids.sg_lane);
#else
    return vec2<u32>(ids.lid / size, ids.lid % size);
#endif
}
