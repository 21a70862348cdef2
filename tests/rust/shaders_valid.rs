//! Every `shaders/*.wgsl` (found by globbing, so a new file is covered, or reported if no op
//! registers it) is expanded with its defaults, each `#variants` line and SUBGROUPS on/off, validated
//! by naga and translated to SPIR-V and MSL, so a shader that only breaks Metal is caught on Linux CI.

use std::collections::BTreeMap;
use std::path::Path;

use qk::gpu::ShaderFile;
use qk::gpu::shaders::{LIBRARY, expand, listed_variants, validate};

/// SPIR-V with naga's default options, which allow every capability (CooperativeMatrixKHR for
/// matmul_coop.wgsl included). naga 30's MSL writer also accepts the cooperative-matrix shader
/// (as simdgroup matrices, MSL ≥ 2.3), but Metal's simdgroup matrices are 8×8 while that shader
/// uses 16×16, so its MSL would not compile on a Mac: the runtime only picks it from an adapter's
/// 16×16 configuration list, which Metal never offers. Its MSL translation is still checked here
/// so a naga change that refuses it is noticed.
fn translate(name: &str, module: &naga::Module, info: &naga::valid::ModuleInfo) -> Result<(), String> {
    naga::back::spv::write_vec(module, info, &naga::back::spv::Options::default(), None)
        .map_err(|e| format!("{name}: SPIR-V: {e}"))?;
    let msl_options = naga::back::msl::Options {
        lang_version: (2, 4),
        ..Default::default()
    };
    for ep in &module.entry_points {
        let pipeline = naga::back::msl::PipelineOptions {
            entry_point: Some((ep.stage, ep.name.clone())),
            ..Default::default()
        };
        naga::back::msl::write_string(module, info, &msl_options, &pipeline)
            .map_err(|e| format!("{name}: MSL: {e}"))?;
    }
    Ok(())
}

#[test]
fn every_shader_validates_and_translates() {
    // The source tree when run where it was built; `./shaders` when the test binary was carried to
    // another machine (the H200 runs it from a copy of the repository root).
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("shaders");
    let dir = if built.is_dir() {
        built
    } else {
        Path::new("shaders").to_path_buf()
    };
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .expect("shaders/ directory")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "wgsl"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no shaders found in {}", dir.display());
    let mut failures = Vec::new();
    let mut kernels = 0;
    let mut included: Vec<String> = Vec::new();
    for path in &files {
        let stem = path
            .file_stem()
            .and_then(|s| s.to_str())
            .expect("utf-8 file name")
            .to_string();
        let text = std::fs::read_to_string(path).expect("readable shader");
        if !text.contains("@compute") {
            // A library file: it must be registered for #include and is validated through the
            // kernels that include it.
            if !LIBRARY.iter().any(|f| f.name == stem) {
                failures.push(format!(
                    "{stem}: has no @compute entry and is not in gpu::shaders::LIBRARY"
                ));
            } else if LIBRARY
                .iter()
                .find(|f| f.name == stem)
                .is_some_and(|f| f.source != text)
            {
                failures.push(format!("{stem}: embedded copy is stale (rebuild)"));
            }
            continue;
        }
        kernels += 1;
        for line in text
            .lines()
            .filter_map(|l| l.trim_start().strip_prefix("#include "))
        {
            included.push(
                line.trim()
                    .trim_matches('"')
                    .trim_end_matches(".wgsl")
                    .to_string(),
            );
        }
        // The text on disk (the test binary may run from a copy of the repository), with the params
        // structs of the op that owns the file.
        let Some(owner) = qk::ops::KERNELS.iter().find(|k| k.name == stem) else {
            failures.push(format!("{stem}: a kernel that qk::ops::KERNELS does not list"));
            continue;
        };
        let file = ShaderFile {
            name: owner.name,
            source: Box::leak(text.clone().into_boxed_str()),
            params: owner.params,
        };
        let mut sets: Vec<BTreeMap<String, String>> = vec![BTreeMap::new()];
        sets.extend(listed_variants(&text));
        for set in sets {
            for subgroups in ["0", "1"] {
                let mut defines = set.clone();
                defines.insert("SUBGROUPS".into(), subgroups.into());
                let label = format!("{stem}{defines:?}");
                let result = expand(&file, &defines)
                    .map_err(|e| e.to_string())
                    .and_then(|wgsl| validate(&label, &wgsl).map_err(|e| e.to_string()))
                    .and_then(|(m, i)| translate(&label, &m, &i));
                if let Err(e) = result {
                    failures.push(e);
                }
            }
        }
    }
    for lib in LIBRARY {
        if !included.iter().any(|i| i == lib.name) && lib.name != "common" {
            failures.push(format!(
                "library {} is included by no kernel, so nothing validates it",
                lib.name
            ));
        }
    }
    assert!(kernels > 0);
    assert!(
        failures.is_empty(),
        "{} shader problems:\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}
