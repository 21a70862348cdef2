//! WGSL sources, the small preprocessor that assembles kernel variants from them, and naga
//! validation with readable errors.
//!
//! Directives (a line whose first non-blank characters are `#`; WGSL itself never uses `#`):
//! - `#include "common_x.wgsl"` inserts a library file from [`LIBRARY`] (each at most once);
//! - `#define NAME value` gives a default that the caller's defines override;
//! - `#if NAME`, `#if NAME == v`, `#if NAME != v`, `#else`, `#endif` (nestable); `#if NAME` is
//!   true when NAME is defined and not `0`;
//! - `#params NAME` inserts the WGSL declaration of the params struct NAME, which the kernel's
//!   [`ShaderFile`] names (`shader_file!("matvec", MatvecParams)`; declared once with
//!   [`crate::gpu_params!`]), in the kernel or in a library file it includes;
//! - `#variants A=x B=y` (ignored at expansion) lists one extra define set the validity test covers;
//! - `#for V in A..B` … `#endfor` (nestable) repeats its lines for V = A..B-1, A and B numbers or
//!   defines, with `{{V}}` substituted: an unrolled loop whose indices are constant expressions, so
//!   drivers keep small per-thread arrays in registers (a dynamically indexed one can spill).
//!
//! `{{NAME}}` is replaced by the define's value. `enable …;` lines are hoisted to the top so
//! library files can ask for extensions. The runtime always defines `SUBGROUPS` (1 or 0) from the
//! device, so a kernel guards its subgroup path with `#if SUBGROUPS`.

use std::collections::BTreeMap;

use crate::error::{QkError, Result};

/// One WGSL file: its stem, its text (embedded with `include_str!` by the op that owns it) and the
/// WGSL declarations of the params structs that its `#params` lines (and its includes') insert.
#[derive(Clone, Copy, Debug)]
pub struct ShaderFile {
    pub name: &'static str,
    pub source: &'static str,
    pub params: &'static [&'static str],
}

/// `shader_file!("name")`, or `shader_file!("name", ParamsA, …)` for a kernel whose `#params` lines
/// insert those [`crate::gpu::GpuParams`] structs.
#[macro_export]
macro_rules! shader_file {
    ($name:literal $(, $params:ty)* $(,)?) => {
        $crate::gpu::ShaderFile {
            name: $name,
            source: include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/shaders/", $name, ".wgsl")),
            params: &[$(<$params as $crate::gpu::GpuParams>::WGSL),*],
        }
    };
}

/// Library files that kernels may `#include`; every `shaders/common*.wgsl` must be listed here.
pub const LIBRARY: &[ShaderFile] = &[
    shader_file!("common"),
    shader_file!("common_dequant"),
    shader_file!("common_reduce"),
    shader_file!("common_route"),
    shader_file!("common_matmul"),
    shader_file!("common_attention"),
    shader_file!("common_epilogue"),
    shader_file!("common_head_rms"),
];

pub type Defines = BTreeMap<String, String>;

fn library_file(name: &str) -> Option<&'static ShaderFile> {
    let stem = name.trim_end_matches(".wgsl");
    LIBRARY.iter().find(|f| f.name == stem)
}

fn eval_condition(expr: &str, defines: &Defines, file: &str) -> Result<bool> {
    let expr = expr.trim();
    let truthy = |v: Option<&String>| v.is_some_and(|v| v != "0" && !v.is_empty());
    if let Some((lhs, rhs)) = expr.split_once("==") {
        return Ok(defines.get(lhs.trim()).map(|s| s.as_str()) == Some(rhs.trim()));
    }
    if let Some((lhs, rhs)) = expr.split_once("!=") {
        return Ok(defines.get(lhs.trim()).map(|s| s.as_str()) != Some(rhs.trim()));
    }
    if expr.is_empty() || expr.contains(char::is_whitespace) {
        return Err(QkError::Shader {
            name: file.into(),
            msg: format!("bad #if condition {expr:?}"),
        });
    }
    Ok(truthy(defines.get(expr)))
}

/// Collect `#define` defaults of `src` and of its includes, without overriding `defines`.
fn collect_defaults(src: &str, file: &str, defines: &mut Defines, seen: &mut Vec<String>) -> Result<()> {
    for line in src.lines() {
        let t = line.trim_start();
        if let Some(rest) = t.strip_prefix("#define ") {
            let mut parts = rest.trim().splitn(2, char::is_whitespace);
            let key = parts.next().unwrap_or_default().to_string();
            let value = parts.next().unwrap_or_default().trim().to_string();
            defines.entry(key).or_insert(value);
        } else if let Some(rest) = t.strip_prefix("#include ") {
            let inc = rest.trim().trim_matches('"');
            if !seen.iter().any(|s| s == inc) {
                seen.push(inc.to_string());
                let lib = library_file(inc).ok_or_else(|| QkError::Shader {
                    name: file.into(),
                    msg: format!("#include {inc:?}: not a library file (see gpu::shaders::LIBRARY)"),
                })?;
                collect_defaults(lib.source, lib.name, defines, seen)?;
            }
        }
    }
    Ok(())
}

fn expand_into(
    src: &str,
    file: &str,
    params: &[&str],
    defines: &Defines,
    out: &mut Vec<String>,
    seen: &mut Vec<String>,
) -> Result<()> {
    // Each entry: (this branch active, some branch of this #if already taken).
    let mut stack: Vec<(bool, bool)> = Vec::new();
    let active = |stack: &Vec<(bool, bool)>| stack.iter().all(|(a, _)| *a);
    let mut lines = src.lines().enumerate();
    while let Some((lineno, line)) = lines.next() {
        let t = line.trim_start();
        let err = |msg: String| QkError::Shader {
            name: file.into(),
            msg: format!("line {}: {msg}", lineno + 1),
        };
        if let Some(cond) = t.strip_prefix("#if ") {
            let v = eval_condition(cond, defines, file)?;
            stack.push((v, v));
        } else if t.starts_with("#else") {
            let top = stack.pop().ok_or_else(|| err("#else without #if".into()))?;
            stack.push((!top.1, true));
        } else if t.starts_with("#endif") {
            stack.pop().ok_or_else(|| err("#endif without #if".into()))?;
        } else if !active(&stack) {
            continue;
        } else if let Some(rest) = t.strip_prefix("#include ") {
            let inc = rest.trim().trim_matches('"');
            if seen.iter().any(|s| s == inc) {
                continue;
            }
            seen.push(inc.to_string());
            let lib =
                library_file(inc).ok_or_else(|| err(format!("#include {inc:?}: unknown library file")))?;
            expand_into(lib.source, lib.name, params, defines, out, seen)?;
        } else if let Some(name) = t.strip_prefix("#params ") {
            let decl = params_decl(params, name.trim()).ok_or_else(|| {
                err(format!(
                    "#params {}: the kernel's ShaderFile names no such struct",
                    name.trim()
                ))
            })?;
            out.extend(decl.lines().map(String::from));
        } else if let Some(spec) = t.strip_prefix("#for ") {
            // Collect the body up to the matching #endfor, then expand it once per value.
            let (var, range) = spec
                .split_once(" in ")
                .ok_or_else(|| err(format!("bad #for {spec:?}")))?;
            let (lo, hi) = range
                .trim()
                .split_once("..")
                .ok_or_else(|| err(format!("bad #for range {range:?}")))?;
            let bound = |b: &str| -> Result<u32> {
                let b = b.trim();
                let v = defines.get(b).map(String::as_str).unwrap_or(b);
                v.parse::<u32>()
                    .map_err(|_| err(format!("#for bound {b:?} is not a number")))
            };
            let (lo, hi) = (bound(lo)?, bound(hi)?);
            let mut depth = 1;
            let mut body = Vec::new();
            for (_, inner) in lines.by_ref() {
                let it = inner.trim_start();
                if it.starts_with("#for ") {
                    depth += 1;
                } else if it.starts_with("#endfor") {
                    depth -= 1;
                    if depth == 0 {
                        break;
                    }
                }
                body.push(inner);
            }
            if depth != 0 {
                return Err(err("#for without #endfor".into()));
            }
            let body = body.join("\n");
            for v in lo..hi {
                let mut scoped = defines.clone();
                scoped.insert(var.trim().to_string(), v.to_string());
                expand_into(&body, file, params, &scoped, out, seen)?;
            }
        } else if t.starts_with("#endfor") {
            return Err(err("#endfor without #for".into()));
        } else if t.starts_with("#define") || t.starts_with("#variants") {
            out.push(String::new());
        } else if t.starts_with('#') {
            return Err(err(format!("unknown directive {t:?}")));
        } else {
            out.push(substitute(line, defines).map_err(err)?);
        }
    }
    if !stack.is_empty() {
        return Err(QkError::Shader {
            name: file.into(),
            msg: "unterminated #if".into(),
        });
    }
    Ok(())
}

/// The declaration of `struct NAME { … }` (its doc comments first) among `params`.
fn params_decl<'a>(params: &[&'a str], name: &str) -> Option<&'a str> {
    params.iter().copied().find(|decl| {
        decl.lines()
            .find_map(|line| line.strip_prefix("struct "))
            .and_then(|rest| rest.strip_prefix(name))
            .is_some_and(|rest| rest.starts_with(" {"))
    })
}

fn substitute(line: &str, defines: &Defines) -> std::result::Result<String, String> {
    let mut out = String::with_capacity(line.len());
    let mut rest = line;
    while let Some(start) = rest.find("{{") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let end = after.find("}}").ok_or_else(|| "unclosed {{".to_string())?;
        let key = after[..end].trim();
        let value = defines
            .get(key)
            .ok_or_else(|| format!("{{{{{key}}}}} is not defined"))?;
        out.push_str(value);
        rest = &after[end + 2..];
    }
    out.push_str(rest);
    Ok(out)
}

/// The full define set of a variant: caller values over the files' `#define` defaults.
pub fn resolve_defines(file: &ShaderFile, overrides: &Defines) -> Result<Defines> {
    let mut defines = overrides.clone();
    collect_defaults(file.source, file.name, &mut defines, &mut Vec::new())?;
    Ok(defines)
}

/// Assemble the WGSL text of one variant of `file`.
pub fn expand(file: &ShaderFile, overrides: &Defines) -> Result<String> {
    let defines = resolve_defines(file, overrides)?;
    let mut lines = Vec::new();
    expand_into(
        file.source,
        file.name,
        file.params,
        &defines,
        &mut lines,
        &mut Vec::new(),
    )?;
    let (enables, body): (Vec<String>, Vec<String>) = lines
        .into_iter()
        .partition(|l| l.trim_start().starts_with("enable ") && l.trim_end().ends_with(';'));
    let mut enables_unique: Vec<String> = Vec::new();
    for e in enables {
        if !enables_unique.iter().any(|x| x.trim() == e.trim()) {
            enables_unique.push(e.trim().to_string());
        }
    }
    // Keep line numbers of the body stable-ish for error messages: enables replace nothing.
    let mut text = enables_unique.join("\n");
    text.push('\n');
    text.push_str(&body.join("\n"));
    text.push('\n');
    Ok(text)
}

/// The extra define sets a file lists with `#variants` (for the validity test).
pub fn listed_variants(source: &str) -> Vec<Defines> {
    source
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix("#variants"))
        .map(|rest| {
            rest.split_whitespace()
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        })
        .collect()
}

/// Parse and validate with naga (all capabilities the runtime may enable), returning the module
/// and its info, or a `QkError::Shader` that shows the offending source span.
pub fn validate(name: &str, wgsl: &str) -> Result<(naga::Module, naga::valid::ModuleInfo)> {
    let module = naga::front::wgsl::parse_str(wgsl).map_err(|e| QkError::Shader {
        name: name.into(),
        msg: e.emit_to_string(wgsl),
    })?;
    let caps = naga::valid::Capabilities::IMMEDIATES
        | naga::valid::Capabilities::SUBGROUP
        | naga::valid::Capabilities::SHADER_FLOAT16
        | naga::valid::Capabilities::SHADER_FLOAT16_IN_FLOAT32
        | naga::valid::Capabilities::SHADER_INT64
        | naga::valid::Capabilities::COOPERATIVE_MATRIX;
    let info = naga::valid::Validator::new(naga::valid::ValidationFlags::all(), caps)
        .subgroup_stages(naga::valid::ShaderStages::COMPUTE)
        .subgroup_operations(naga::valid::SubgroupOperationSet::all())
        .validate(&module)
        .map_err(|e| QkError::Shader {
            name: name.into(),
            msg: e.emit_to_string(wgsl),
        })?;
    Ok((module, info))
}
