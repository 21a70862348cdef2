//! GGUF: the mmap reader, split shards, ggml block formats and CPU dequantisation.
//!
//! `GgufFile::open` maps every shard of a model, validates the header and the tensor table of each
//! (reader.rs) and serves metadata, the tensor index and zero-copy tensor bytes.

pub mod dequant;
pub mod grids;
pub mod reader;
pub mod split;
pub mod types;
pub mod value;

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use sha2::{Digest, Sha256};

pub use reader::TensorInfo;
pub use types::{GgmlType, TypeLayout};
pub use value::{Array, Value};

use crate::error::{QkError, Result};

/// One file of a model: its mapping and where its data section starts.
struct Shard {
    path: PathBuf,
    map: Mmap,
    header_len: usize,
}

/// An open GGUF model (one file or all shards of a split model).
pub struct GgufFile {
    path: PathBuf,
    version: u32,
    alignment: u64,
    metadata: Vec<(String, Value)>,
    metadata_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    shards: Vec<Shard>,
    header_only: bool,
    fingerprint: [u8; 32],
}

fn display(path: &Path) -> String {
    path.display().to_string()
}

/// Maps `path` read-only.
fn map_file(path: &Path) -> Result<Mmap> {
    let io = |source| QkError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = File::open(path).map_err(io)?;
    // SAFETY: the mapping is read-only and lives as long as `GgufFile`. As with every mmap reader,
    // another process truncating or rewriting the file while it is open is outside what we guard.
    unsafe { Mmap::map(&file) }.map_err(io)
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("shards", &self.shards.len())
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("header_only", &self.header_only)
            .finish()
    }
}

impl GgufFile {
    /// Opens a model: a single file, or the first shard `NAME-00001-of-0000N.gguf` of a split model
    /// (the other shards are found next to it). Every tensor must lie inside its file.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        Self::open_with(path.as_ref(), false)
    }

    /// Reads only metadata and tensor tables: the files may be truncated after the tensor table
    /// (planning a split without the weights). Tensor data access then fails.
    pub fn open_header_only(path: impl AsRef<Path>) -> Result<GgufFile> {
        Self::open_with(path.as_ref(), true)
    }

    fn open_with(path: &Path, header_only: bool) -> Result<GgufFile> {
        let file = display(path);
        let map = map_file(path)?;
        let first = reader::parse_header(&map, &file, 0, !header_only)?;
        let mut shards = vec![Shard {
            path: path.to_path_buf(),
            map,
            header_len: first.header_len,
        }];
        let mut tensors = first.tensors;

        let split_count = first
            .metadata_index
            .get(split::KEY_SPLIT_COUNT)
            .map(|&i| &first.metadata[i].1);
        let count = match split_count {
            None => 1,
            Some(v) => v.as_u64().ok_or_else(|| {
                QkError::gguf(
                    &file,
                    format!("{} is not a non-negative integer: {v:?}", split::KEY_SPLIT_COUNT),
                )
            })?,
        };
        if count > 1 {
            let no = first
                .metadata_index
                .get(split::KEY_SPLIT_NO)
                .map(|&i| &first.metadata[i].1);
            match no.and_then(Value::as_u64) {
                Some(0) => {}
                Some(k) => {
                    return Err(QkError::gguf(
                        &file,
                        format!(
                            "this is shard {} of {count}: open the first shard (-00001-of-…)",
                            k + 1
                        ),
                    ));
                }
                None => {
                    return Err(QkError::gguf(
                        &file,
                        format!("split model without a valid {}", split::KEY_SPLIT_NO),
                    ));
                }
            }
            let paths = split::shard_paths(path, count).ok_or_else(|| {
                QkError::gguf(
                    &file,
                    format!(
                        "{} = {count} but the file name does not end in {}",
                        split::KEY_SPLIT_COUNT,
                        split::shard_file_name("", 0, count)
                    ),
                )
            })?;
            for (index, shard_path) in paths.iter().enumerate().skip(1) {
                let shard_file = display(shard_path);
                if !shard_path.exists() {
                    return Err(QkError::gguf(
                        &file,
                        format!("missing shard {} of {count}: {shard_file}", index + 1),
                    ));
                }
                let map = map_file(shard_path)?;
                let parsed = reader::parse_header(&map, &shard_file, index, !header_only)?;
                let key = |k: &str| {
                    parsed
                        .metadata_index
                        .get(k)
                        .and_then(|&i| parsed.metadata[i].1.as_u64())
                };
                let shown = |v: Option<u64>| v.map_or_else(|| "absent".to_string(), |v| v.to_string());
                if key(split::KEY_SPLIT_NO) != Some(index as u64)
                    || key(split::KEY_SPLIT_COUNT) != Some(count)
                {
                    return Err(QkError::gguf(
                        &shard_file,
                        format!(
                            "expected {} = {index} and {} = {count}, found {} and {}",
                            split::KEY_SPLIT_NO,
                            split::KEY_SPLIT_COUNT,
                            shown(key(split::KEY_SPLIT_NO)),
                            shown(key(split::KEY_SPLIT_COUNT))
                        ),
                    ));
                }
                tensors.extend(parsed.tensors);
                shards.push(Shard {
                    path: shard_path.clone(),
                    map,
                    header_len: parsed.header_len,
                });
            }
        }

        let mut tensor_index = HashMap::with_capacity(tensors.len());
        for (i, t) in tensors.iter().enumerate() {
            if tensor_index.insert(t.name.clone(), i).is_some() {
                return Err(QkError::gguf(
                    display(&shards[t.shard].path),
                    format!("tensor '{}' appears in more than one shard", t.name),
                ));
            }
        }

        // SHA-256 over each shard's header and tensor table (length-prefixed, in shard order): the
        // same model gives the same fingerprint whether opened fully or header-only.
        let mut hasher = Sha256::new();
        for s in &shards {
            hasher.update((s.header_len as u64).to_le_bytes());
            hasher.update(&s.map[..s.header_len]);
        }
        let fingerprint = hasher.finalize().into();

        Ok(GgufFile {
            path: path.to_path_buf(),
            version: first.version,
            alignment: first.alignment,
            metadata: first.metadata,
            metadata_index: first.metadata_index,
            tensors,
            tensor_index,
            shards,
            header_only,
            fingerprint,
        })
    }

    /// The path given to `open` (the first shard of a split model).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The paths of every shard, in order (one for an unsplit model).
    pub fn shard_paths(&self) -> Vec<&Path> {
        self.shards.iter().map(|s| s.path.as_path()).collect()
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    /// Data alignment of the first file (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    pub fn is_header_only(&self) -> bool {
        self.header_only
    }

    /// Metadata in file order (of the first shard: gguf-split puts all metadata there).
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata_index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// An integer of any width that fits in u32.
    pub fn get_u32(&self, key: &str) -> Option<u32> {
        self.get(key)?.as_u32()
    }

    /// An integer of any width that fits in u64.
    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.get(key)?.as_u64()
    }

    /// An integer of any width that fits in i64.
    pub fn get_i64(&self, key: &str) -> Option<i64> {
        self.get(key)?.as_i64()
    }

    /// A float (f32 or f64) or integer value as f32.
    pub fn get_f32(&self, key: &str) -> Option<f32> {
        self.get(key)?.as_f64().map(|v| v as f32)
    }

    pub fn get_bool(&self, key: &str) -> Option<bool> {
        self.get(key)?.as_bool()
    }

    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key)?.as_str()
    }

    pub fn get_arr(&self, key: &str) -> Option<&Array> {
        self.get(key)?.as_array()
    }

    /// An array of integers of any width, as i64.
    pub fn get_arr_i64(&self, key: &str) -> Option<Vec<i64>> {
        self.get_arr(key)?.to_i64s()
    }

    /// An array of f32 or f64, as f32.
    pub fn get_arr_f32(&self, key: &str) -> Option<Vec<f32>> {
        self.get_arr(key)?.to_f32s()
    }

    pub fn get_arr_str(&self, key: &str) -> Option<&[String]> {
        self.get_arr(key)?.as_strs()
    }

    pub fn get_arr_bool(&self, key: &str) -> Option<&[bool]> {
        self.get_arr(key)?.as_bools()
    }

    /// `general.architecture` ("qwen3next", "qwen35moe"…).
    pub fn arch(&self) -> Option<&str> {
        self.get_str("general.architecture")
    }

    /// Every tensor of every shard, in shard then file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The tensor's bytes, straight from the mapping.
    pub fn tensor_data(&self, t: &TensorInfo) -> Result<&[u8]> {
        let shard = self.shards.get(t.shard).ok_or_else(|| {
            QkError::gguf(
                display(&self.path),
                format!(
                    "tensor '{}' names shard {} of {}",
                    t.name,
                    t.shard,
                    self.shards.len()
                ),
            )
        })?;
        let file = || display(&shard.path);
        if self.header_only {
            return Err(QkError::gguf(
                file(),
                format!(
                    "opened header-only: the data of tensor '{}' is not available",
                    t.name
                ),
            ));
        }
        // Extents were checked at open for tensors of this file; a TensorInfo from elsewhere is
        // checked again rather than trusted.
        let range = usize::try_from(t.offset)
            .ok()
            .zip(usize::try_from(t.nbytes).ok())
            .and_then(|(start, len)| Some(start..start.checked_add(len)?))
            .filter(|r| r.end <= shard.map.len())
            .ok_or_else(|| QkError::gguf(file(), format!("tensor '{}' lies outside its file", t.name)))?;
        Ok(&shard.map[range])
    }

    /// The tensor dequantised to f32, in ggml element order (ne[0] fastest).
    pub fn dequantize_tensor(&self, t: &TensorInfo) -> Result<Vec<f32>> {
        let ty = t.ggml_type()?;
        let n = usize::try_from(t.n_elements)
            .map_err(|_| QkError::gguf(display(&self.path), format!("tensor '{}' is too large", t.name)))?;
        dequant::dequantize(ty, self.tensor_data(t)?, n)
    }

    /// SHA-256 of the headers and tensor tables of all shards.
    pub fn fingerprint(&self) -> [u8; 32] {
        self.fingerprint
    }

    pub fn fingerprint_hex(&self) -> String {
        self.fingerprint.iter().map(|b| format!("{b:02x}")).collect()
    }
}
