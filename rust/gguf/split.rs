//! Split models as llama.cpp's gguf-split writes them: `NAME-00001-of-0000N.gguf` … with the
//! metadata in the first shard and `split.no` (u16, 0-based), `split.count` (u16) and
//! `split.tensors.count` (i32) in every shard (tools/gguf-split/gguf-split.cpp; src/llama.cpp
//! `llama_split_path` format "%s-%05d-of-%05d.gguf").

use std::path::{Path, PathBuf};

pub const KEY_SPLIT_NO: &str = "split.no";
pub const KEY_SPLIT_COUNT: &str = "split.count";
pub const KEY_SPLIT_TENSORS_COUNT: &str = "split.tensors.count";

/// The file name of shard `index` (0-based) of `count` with prefix `prefix`.
pub fn shard_file_name(prefix: &str, index: u64, count: u64) -> String {
    format!("{prefix}-{:05}-of-{count:05}.gguf", index + 1)
}

/// The paths of all `count` shards, given the path of the first; `None` if its file name does not
/// end in `-00001-of-{count:05}.gguf`.
pub fn shard_paths(first: &Path, count: u64) -> Option<Vec<PathBuf>> {
    let name = first.file_name()?.to_str()?;
    let suffix = shard_file_name("", 0, count);
    let prefix = name.strip_suffix(&suffix)?;
    if prefix.is_empty() {
        return None;
    }
    Some(
        (0..count)
            .map(|i| first.with_file_name(shard_file_name(prefix, i, count)))
            .collect(),
    )
}
