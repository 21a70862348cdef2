//! Runtime tests: adapter choice, the example kernel with subgroups on and off, caching counters,
//! readbacks and weight windows. Without an adapter they print a note and pass, unless
//! QK_REQUIRE_GPU=1 (CI), where a missing adapter fails.

use std::sync::OnceLock;

use qk::gpu::{Gpu, GpuOptions, example};

/// The shared test devices (creating one costs ~0.1–1 s on lavapipe): subgroups as offered, and
/// forced off so the shared-memory fallbacks run too.
pub fn test_gpu(no_subgroups: bool) -> Option<&'static Gpu> {
    static ON: OnceLock<Option<Gpu>> = OnceLock::new();
    static OFF: OnceLock<Option<Gpu>> = OnceLock::new();
    let cell = if no_subgroups { &OFF } else { &ON };
    cell.get_or_init(|| {
        let opts = GpuOptions {
            no_subgroups,
            ..GpuOptions::from_env()
        };
        match Gpu::new(&opts) {
            Ok(g) => Some(g),
            Err(e) => {
                assert!(
                    std::env::var("QK_REQUIRE_GPU").as_deref() != Ok("1"),
                    "QK_REQUIRE_GPU=1 but no device: {e}"
                );
                eprintln!("note: skipping GPU test, no device: {e}");
                None
            }
        }
    })
    .as_ref()
}

/// A device whose kernels are compiled with wgpu's runtime checks
/// (`GpuOptions::checked_shaders`), beside [`test_gpu`]'s unchecked ones (the default).
pub fn checked_test_gpu() -> Option<&'static Gpu> {
    static CHECKED: OnceLock<Option<Gpu>> = OnceLock::new();
    test_gpu(false)?;
    CHECKED
        .get_or_init(|| {
            let opts = GpuOptions {
                checked_shaders: true,
                ..GpuOptions::from_env()
            };
            Some(Gpu::new(&opts).expect("a second device on the test adapter"))
        })
        .as_ref()
}

/// Whether two runs gave the same floats bit for bit (pairwise, over the shorter).
pub fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

fn run_scale(gpu: &Gpu, n: u32) {
    let x: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
    let xb = gpu.buffer_from_f32("x", &x).unwrap();
    let yb = gpu.buffer_zeroed("y", u64::from(n) * 4).unwrap();
    let groups = n.div_ceil(example::SCALE_WG);
    let pb = gpu.buffer_zeroed("partial", u64::from(groups) * 4).unwrap();
    let (a, b) = (1.5f32, -0.25f32);
    let mut rec = gpu.recorder();
    example::scale_add(gpu, &mut rec, &xb, &yb, &pb, example::ScaleParams { n, a, b }).unwrap();
    let ty = rec.read(&yb, 0, u64::from(n) * 4).unwrap();
    let tp = rec.read(&pb, 0, u64::from(groups) * 4).unwrap();
    let out = rec.finish_and_read().unwrap();
    let y: Vec<f32> = bytemuck::pod_collect_to_vec(&out[ty]);
    let p: Vec<f32> = bytemuck::pod_collect_to_vec(&out[tp]);
    for (i, (&yi, &xi)) in y.iter().zip(&x).enumerate() {
        // a*x+b in f32 on both sides; FMA contraction may differ by 1 ulp.
        assert!(
            (yi - (a * xi + b)).abs() <= 1e-6,
            "y[{i}] = {yi}, want {}",
            a * xi + b
        );
    }
    for (g, &pg) in p.iter().enumerate() {
        let lo = g * example::SCALE_WG as usize;
        let hi = (lo + example::SCALE_WG as usize).min(n as usize);
        let want: f64 = x[lo..hi].iter().map(|&v| f64::from(a * v + b)).sum();
        // 64 terms of magnitude ≤ 1.75 summed in f32 in a different order: ≤ ~64 ulp of 112.
        assert!(
            (f64::from(pg) - want).abs() < 1e-4,
            "partial[{g}] = {pg}, want {want}"
        );
    }
}

#[test]
fn scale_example_subgroups_on_and_off() {
    for off in [false, true] {
        let Some(gpu) = test_gpu(off) else { return };
        assert_eq!(
            gpu.caps.subgroups && !off,
            gpu.caps.subgroups,
            "no_subgroups must disable subgroups"
        );
        // 1000 is not a multiple of the workgroup size: the tail group must be masked.
        run_scale(gpu, 1000);
    }
}

#[test]
fn repeated_step_creates_no_objects() {
    if test_gpu(false).is_none() {
        return;
    }
    // A private device: the shared ones see other tests' objects concurrently.
    let own = Gpu::new(&GpuOptions::from_env()).unwrap();
    let gpu = &own;
    let n = 4096u32;
    let xb = gpu.buffer_from_f32("x", &vec![1.0; n as usize]).unwrap();
    let yb = gpu.buffer_zeroed("y", u64::from(n) * 4).unwrap();
    let pb = gpu.buffer_zeroed("p", u64::from(n / 64) * 4).unwrap();
    let step = || {
        let mut rec = gpu.recorder();
        for _ in 0..3 {
            let params = example::ScaleParams { n, a: 2.0, b: 1.0 };
            example::scale_add(gpu, &mut rec, &xb, &yb, &pb, params).unwrap();
        }
        let t = rec.read(&pb, 0, 4).unwrap();
        let out = rec.finish_and_read().unwrap();
        assert_eq!(bytemuck::pod_read_unaligned::<f32>(&out[t]), 64.0 * 3.0);
    };
    step();
    let before = gpu.counters();
    step();
    let after = gpu.counters();
    assert_eq!(
        after.pipelines, before.pipelines,
        "pipeline created on a repeated step"
    );
    assert_eq!(
        after.bind_groups, before.bind_groups,
        "bind group created on a repeated step"
    );
    assert_eq!(after.buffers, before.buffers, "buffer created on a repeated step");
    assert_eq!(
        (after.submits, after.readbacks),
        (before.submits + 1, before.readbacks + 1)
    );
    assert_eq!(after.dispatches, before.dispatches + 3);
}

#[test]
fn bad_device_selector_is_a_device_error() {
    if test_gpu(false).is_none() {
        return;
    }
    let opts = GpuOptions {
        device: Some("no-such-adapter-xyz".into()),
        ..GpuOptions::from_env()
    };
    match Gpu::new(&opts) {
        Err(qk::QkError::Device(msg)) => assert!(msg.contains("available"), "{msg}"),
        Err(e) => panic!("wrong error kind: {e}"),
        Ok(_) => panic!("a nonsense selector picked an adapter"),
    }
}

#[test]
fn adapters_are_listed() {
    let list = qk::gpu::adapters();
    if list.is_empty() {
        assert!(
            std::env::var("QK_REQUIRE_GPU").as_deref() != Ok("1"),
            "QK_REQUIRE_GPU=1 but no adapter listed"
        );
        return;
    }
    assert!(list.iter().all(|a| !a.name.is_empty() && !a.backend.is_empty()));
}

#[test]
fn binding_misuse_is_an_error_not_a_panic() {
    let Some(gpu) = test_gpu(false) else { return };
    let xb = gpu.buffer_zeroed("x", 256).unwrap();
    let pipe = gpu
        .pipeline(&example::SCALE, &[("WG", "64".into())], &[])
        .unwrap();
    let mut rec = gpu.recorder();
    assert!(matches!(
        rec.dispatch(&pipe, &[xb.all()], &[], [1, 1, 1]),
        Err(qk::QkError::Engine(_))
    ));
    // An offset that is not a multiple of the storage alignment is rejected before wgpu sees it.
    let bad = xb.range(4, 64);
    let r = rec.dispatch(&pipe, &[bad, xb.all(), xb.all()], &[], [1, 1, 1]);
    assert!(gpu.caps.storage_offset_alignment == 4 || r.is_err());
}

#[test]
fn shader_errors_name_the_file() {
    let Some(gpu) = test_gpu(false) else { return };
    let broken = qk::gpu::ShaderFile {
        name: "broken",
        source: "@compute @workgroup_size(1) fn main() { let x: u32 = 1.5; }",
        params: &[],
    };
    match gpu.pipeline(&broken, &[], &[]) {
        Err(qk::QkError::Shader { name, msg }) => assert!(name.starts_with("broken") && !msg.is_empty()),
        other => panic!("expected a shader error, got {other:?}"),
    }
}

#[test]
fn preprocessor_defines_conditionals_and_unrolled_loops() {
    use qk::gpu::shaders::{Defines, expand};
    let file = qk::gpu::ShaderFile {
        name: "pp",
        source: "#define N 3\n#define MODE a\n#if MODE == a\nlet m = 1;\n#else\nlet m = 2;\n#endif\n\
                 #for i in 0..N\nx[{{i}}] = {{i}};\n#endfor\nenable f16;\n",
        params: &[],
    };
    let text = expand(&file, &Defines::new()).unwrap();
    assert!(
        text.starts_with("enable f16;"),
        "enable lines are hoisted: {text}"
    );
    assert!(text.contains("let m = 1;") && !text.contains("let m = 2;"));
    for i in 0..3 {
        assert!(text.contains(&format!("x[{i}] = {i};")), "{text}");
    }
    assert!(!text.contains("x[3]"));
    let overridden: Defines = [
        ("MODE".to_string(), "b".to_string()),
        ("N".to_string(), "1".to_string()),
    ]
    .into();
    let text = expand(&file, &overridden).unwrap();
    assert!(text.contains("let m = 2;") && text.contains("x[0] = 0;") && !text.contains("x[1]"));
    let bad = qk::gpu::ShaderFile {
        name: "bad",
        source: "#for i in 0..2\nx;\n",
        params: &[],
    };
    assert!(matches!(
        expand(&bad, &Defines::new()),
        Err(qk::QkError::Shader { .. })
    ));
}

qk::gpu_params! {
    /// A params struct for the preprocessor test.
    struct PpParams {
        n: u32,
        /// The factor.
        scale: f32,
    }
}

#[test]
fn params_structs_are_declared_once_for_both_sides() {
    use qk::gpu::GpuParams;
    use qk::gpu::shaders::{Defines, expand};
    assert_eq!(
        PpParams::WGSL,
        "// A params struct for the preprocessor test.\nstruct PpParams {\n    n: u32,\n    // The factor.\n    scale: f32,\n}"
    );
    let file = qk::gpu::ShaderFile {
        name: "pp",
        source: "#params PpParams\nvar<immediate> P: PpParams;\n",
        params: &[PpParams::WGSL],
    };
    let text = expand(&file, &Defines::new()).unwrap();
    assert!(
        text.contains(PpParams::WGSL) && text.contains("var<immediate> P: PpParams;"),
        "{text}"
    );
    // The kernel's ShaderFile must name the struct; a prefix of another struct's name is not it.
    for (source, params) in [
        ("#params PpParams\n", &[][..]),
        ("#params Pp\n", &[PpParams::WGSL][..]),
    ] {
        let file = qk::gpu::ShaderFile {
            name: "pp",
            source,
            params,
        };
        assert!(matches!(
            expand(&file, &Defines::new()),
            Err(qk::QkError::Shader { .. })
        ));
    }
    assert_eq!(std::mem::size_of::<PpParams>(), 8);
}
