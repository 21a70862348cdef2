//! Parsing one GGUF file (a whole model or one split shard) from its bytes: header, metadata,
//! tensor table and data-section layout. Every count and length read from the file is checked
//! against the bytes left before anything is allocated for it, and up-front reservations are
//! capped (RESERVE_CAP), so memory grows only with the bytes actually parsed: a hostile or
//! truncated file costs at most a small multiple of its own size.

use std::collections::HashMap;

use super::types::TypeLayout;
use super::value::{Array, Value, type_id, type_name};
use crate::error::{QkError, Result};

/// "GGUF" read as bytes (gguf.h GGUF_MAGIC).
const MAGIC: &[u8; 4] = b"GGUF";
/// gguf.h GGUF_DEFAULT_ALIGNMENT: used when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml.h GGML_MAX_DIMS: a ggml tensor has at most 4 dimensions.
pub const MAX_DIMS: u32 = 4;
/// Nesting cap for arrays of arrays. The spec allows nesting; no writer nests deeper than 2 (gguf.cpp
/// refuses nested arrays outright). The cap bounds recursion so a crafted file cannot exhaust the stack.
pub const MAX_ARRAY_DEPTH: u32 = 8;
/// Smallest encoding of one key-value pair: u64 key length + empty key + u32 type + a 1-byte value.
const MIN_KV_BYTES: u64 = 8 + 4 + 1;
/// Smallest encoding of one tensor info: u64 name length + u32 n_dims (0 dims) + u32 type + u64 offset.
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 4 + 8;
/// Most elements reserved up front for any table or array. Counts are checked against the bytes
/// left, but in a multi-GiB model file a corrupted count can still pass that check; beyond this
/// the vectors grow only as entries are actually parsed, each consuming bytes of the file.
const RESERVE_CAP: u64 = 1 << 16;
/// Bytes of magic + version + tensor count + kv count (versions 2 and 3).
pub const FIXED_HEADER_BYTES: usize = 4 + 4 + 8 + 8;

/// One tensor as listed in a GGUF tensor table, with its place in the file.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// The GGUF type id as stored.
    pub type_id: u32,
    /// The type, when qk dequantises it (`None` for other ggml types, which are listed but not read).
    pub ty: Option<super::GgmlType>,
    /// Name and block geometry of the type (known for every ggml type id).
    pub layout: TypeLayout,
    /// Dimensions in ggml order: `ne[0]` is contiguous. Length = n_dims (0..=4).
    pub ne: Vec<u64>,
    pub n_elements: u64,
    pub nbytes: u64,
    /// Offset as stored: relative to the start of the shard's data section.
    pub data_offset: u64,
    /// Absolute byte offset of the tensor's data in its shard file.
    pub offset: u64,
    /// Index of the shard file holding the data (0 for an unsplit model).
    pub shard: usize,
}

impl TensorInfo {
    /// The ggml type name ("IQ4_XS", "Q4_1"…).
    pub fn type_name(&self) -> &'static str {
        self.layout.name
    }

    /// The type, or `UnsupportedType` for a ggml type qk does not dequantise.
    pub fn ggml_type(&self) -> Result<super::GgmlType> {
        self.ty.ok_or_else(|| QkError::UnsupportedType {
            tensor: self.name.clone(),
            ty: self.layout.name.into(),
        })
    }

    /// Bytes of one row of `ne[0]` weights (the stride between rows).
    pub fn row_bytes(&self) -> u64 {
        let row = self.ne.first().copied().unwrap_or(1);
        // ne[0] was checked to be a whole number of blocks and the tensor's size not to overflow.
        row / self.layout.block_len as u64 * self.layout.block_bytes as u64
    }

    /// Dimensions in numpy (row-major) order: `ne` reversed.
    pub fn shape(&self) -> Vec<u64> {
        self.ne.iter().rev().copied().collect()
    }
}

/// What one GGUF file's header says.
#[derive(Debug)]
pub struct ParsedHeader {
    pub version: u32,
    pub alignment: u64,
    pub metadata: Vec<(String, Value)>,
    pub metadata_index: HashMap<String, usize>,
    /// Tensors with `shard` set to the index passed in.
    pub tensors: Vec<TensorInfo>,
    /// Bytes from the start of the file to the end of the tensor table.
    pub header_len: usize,
    /// Absolute offset of the data section (header_len rounded up to the alignment).
    pub data_start: u64,
}

/// Reads a GGUF header from `buf` (the file's bytes). With `check_data`, every tensor must lie
/// inside `buf`; without it (header-only files, truncated after the tensor table) only the layout
/// is checked.
pub fn parse_header(buf: &[u8], file: &str, shard: usize, check_data: bool) -> Result<ParsedHeader> {
    let mut c = Cursor { buf, pos: 0, file };
    if buf.len() < FIXED_HEADER_BYTES {
        return Err(c.err(format!(
            "truncated: file is {} bytes, a GGUF header needs at least {FIXED_HEADER_BYTES}",
            buf.len()
        )));
    }
    let magic = c.bytes(4)?;
    if magic != MAGIC {
        let shown = magic.escape_ascii().to_string();
        return Err(c.err(format!("not a GGUF file: magic \"{shown}\", expected \"GGUF\"")));
    }
    let version = c.u32()?;
    match version {
        2 | 3 => {}
        1 => return Err(c.err("GGUF version 1 (32-bit counts) is not supported; re-convert the model")),
        v if matches!(v.swap_bytes(), 2 | 3) => {
            return Err(c.err("big-endian GGUF is not supported"));
        }
        v => {
            return Err(c.err(format!(
                "unsupported GGUF version {v} (qk reads versions 2 and 3)"
            )));
        }
    }
    let n_tensors = c.u64()?;
    let n_kv = c.u64()?;
    // Both tables must fit in what is left before anything is reserved for them.
    let needed = u128::from(n_kv) * u128::from(MIN_KV_BYTES)
        + u128::from(n_tensors) * u128::from(MIN_TENSOR_INFO_BYTES);
    if needed > c.left() as u128 {
        return Err(c.err(format!(
            "absurd counts: {n_kv} metadata entries and {n_tensors} tensors need at least {needed} bytes, \
             the file has {} left",
            c.left()
        )));
    }

    let mut metadata = Vec::with_capacity(reserve(n_kv));
    let mut metadata_index = HashMap::with_capacity(reserve(n_kv));
    for i in 0..n_kv {
        let key = c
            .string_utf8()
            .map_err(|e| context(e, &format!("metadata entry #{i} key")))?;
        let ty = c
            .u32()
            .map_err(|e| context(e, &format!("metadata key '{key}'")))?;
        let value = read_value(&mut c, ty, 0).map_err(|e| context(e, &format!("metadata key '{key}'")))?;
        if metadata_index.insert(key.clone(), metadata.len()).is_some() {
            return Err(c.err(format!("duplicate metadata key '{key}'")));
        }
        metadata.push((key, value));
    }

    let alignment = match metadata_index.get("general.alignment").map(|&i| &metadata[i].1) {
        None => DEFAULT_ALIGNMENT,
        // gguf.cpp: the key must be a u32 power of two.
        Some(Value::U32(a)) if *a != 0 && a.is_power_of_two() => u64::from(*a),
        Some(Value::U32(a)) => return Err(c.err(format!("general.alignment {a} is not a power of two"))),
        Some(v) => {
            return Err(c.err(format!(
                "general.alignment has type {}, expected u32",
                type_name(v.type_id())
            )));
        }
    };

    let mut tensors: Vec<TensorInfo> = Vec::with_capacity(reserve(n_tensors));
    let mut names = HashMap::with_capacity(reserve(n_tensors));
    for i in 0..n_tensors {
        let name = c
            .string_utf8()
            .map_err(|e| context(e, &format!("tensor #{i} name")))?;
        let info = read_tensor_info(&mut c, name.clone(), alignment, shard)
            .map_err(|e| context(e, &format!("tensor '{name}'")))?;
        if names.insert(name.clone(), tensors.len()).is_some() {
            return Err(c.err(format!("duplicate tensor '{name}'")));
        }
        tensors.push(info);
    }

    let header_len = c.pos;
    let data_start =
        align_up(header_len as u64, alignment).ok_or_else(|| c.err("data section offset overflows"))?;
    for t in &mut tensors {
        t.offset = data_start
            .checked_add(t.data_offset)
            .ok_or_else(|| c.err(format!("tensor '{}': offset {} overflows", t.name, t.data_offset)))?;
        let end = t.offset.checked_add(t.nbytes).ok_or_else(|| {
            c.err(format!(
                "tensor '{}': offset {} + {} bytes overflows",
                t.name, t.offset, t.nbytes
            ))
        })?;
        if check_data && end > buf.len() as u64 {
            return Err(c.err(format!(
                "tensor '{}' (bytes {}..{end}) runs past the end of the file ({} bytes): truncated?",
                t.name,
                t.offset,
                buf.len()
            )));
        }
    }
    check_no_overlap(&tensors).map_err(|m| c.err(m))?;

    Ok(ParsedHeader {
        version,
        alignment,
        metadata,
        metadata_index,
        tensors,
        header_len,
        data_start,
    })
}

fn read_tensor_info(c: &mut Cursor<'_>, name: String, alignment: u64, shard: usize) -> Result<TensorInfo> {
    let n_dims = c.u32()?;
    if n_dims > MAX_DIMS {
        return Err(c.err(format!(
            "{n_dims} dimensions, ggml tensors have at most {MAX_DIMS}"
        )));
    }
    let mut ne = Vec::with_capacity(n_dims as usize);
    let mut n_elements: u64 = 1;
    for _ in 0..n_dims {
        let d = c.u64()?;
        // ggml stores ne as int64_t: the element count must stay below INT64_MAX (gguf.cpp check).
        n_elements = n_elements
            .checked_mul(d)
            .filter(|&n| n <= i64::MAX as u64)
            .ok_or_else(|| c.err(format!("element count overflows (dimensions {ne:?} then {d})")))?;
        ne.push(d);
    }
    let type_id = c.u32()?;
    let layout =
        TypeLayout::of_id(type_id).ok_or_else(|| c.err(format!("unknown ggml type id {type_id}")))?;
    let row = ne.first().copied().unwrap_or(1);
    if !row.is_multiple_of(layout.block_len as u64) {
        return Err(c.err(format!(
            "row length ne[0] = {row} is not a multiple of the {} block size {}",
            layout.name, layout.block_len
        )));
    }
    let nbytes = layout.bytes_for(n_elements).ok_or_else(|| {
        c.err(format!(
            "byte size of {n_elements} {} weights overflows",
            layout.name
        ))
    })?;
    let data_offset = c.u64()?;
    if !data_offset.is_multiple_of(alignment) {
        return Err(c.err(format!(
            "data offset {data_offset} is not a multiple of the alignment {alignment}"
        )));
    }
    Ok(TensorInfo {
        name,
        type_id,
        ty: layout.supported(),
        layout,
        ne,
        n_elements,
        nbytes,
        data_offset,
        offset: 0,
        shard,
    })
}

/// Tensors must not share bytes (empty tensors share nothing, wherever they sit).
fn check_no_overlap(tensors: &[TensorInfo]) -> std::result::Result<(), String> {
    let mut order: Vec<&TensorInfo> = tensors.iter().filter(|t| t.nbytes > 0).collect();
    order.sort_by_key(|t| t.offset);
    for pair in order.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        // Offsets and sizes were checked not to overflow when the table was read.
        if a.offset + a.nbytes > b.offset {
            return Err(format!(
                "tensors '{}' (bytes {}..{}) and '{}' (from byte {}) overlap",
                a.name,
                a.offset,
                a.offset + a.nbytes,
                b.name,
                b.offset
            ));
        }
    }
    Ok(())
}

/// How many elements to reserve for a table or array of `count` entries.
fn reserve(count: u64) -> usize {
    count.min(RESERVE_CAP) as usize
}

fn align_up(x: u64, alignment: u64) -> Option<u64> {
    Some(x.checked_add(alignment - 1)? / alignment * alignment)
}

/// Prefixes a GGUF error's message with where it happened; other errors pass through.
fn context(e: QkError, what: &str) -> QkError {
    match e {
        QkError::Gguf { file, msg } => QkError::Gguf {
            file,
            msg: format!("{what}: {msg}"),
        },
        other => other,
    }
}

/// Smallest encoding of one array element of value type `ty` (a string is at least its u64 length,
/// an array at least its u32 type and u64 count); `None` for an unknown type.
fn min_elem_bytes(ty: u32) -> Option<u64> {
    Some(match ty {
        type_id::U8 | type_id::I8 | type_id::BOOL => 1,
        type_id::U16 | type_id::I16 => 2,
        type_id::U32 | type_id::I32 | type_id::F32 => 4,
        type_id::U64 | type_id::I64 | type_id::F64 | type_id::STRING => 8,
        type_id::ARRAY => 4 + 8,
        _ => return None,
    })
}

fn read_value(c: &mut Cursor<'_>, ty: u32, depth: u32) -> Result<Value> {
    Ok(match ty {
        type_id::U8 => Value::U8(c.u8()?),
        type_id::I8 => Value::I8(c.u8()? as i8),
        type_id::U16 => Value::U16(u16::from_le_bytes(c.array()?)),
        type_id::I16 => Value::I16(i16::from_le_bytes(c.array()?)),
        type_id::U32 => Value::U32(c.u32()?),
        type_id::I32 => Value::I32(i32::from_le_bytes(c.array()?)),
        type_id::F32 => Value::F32(f32::from_le_bytes(c.array()?)),
        // Any non-zero byte reads as true, as in gguf-py (numpy bool view) and gguf.cpp (int8 != 0).
        type_id::BOOL => Value::Bool(c.u8()? != 0),
        type_id::STRING => Value::Str(c.string_lossy()?),
        type_id::ARRAY => Value::Array(read_array(c, depth + 1)?),
        type_id::U64 => Value::U64(c.u64()?),
        type_id::I64 => Value::I64(i64::from_le_bytes(c.array()?)),
        type_id::F64 => Value::F64(f64::from_le_bytes(c.array()?)),
        other => return Err(c.err(format!("unknown value type {other}"))),
    })
}

fn read_array(c: &mut Cursor<'_>, depth: u32) -> Result<Array> {
    if depth > MAX_ARRAY_DEPTH {
        return Err(c.err(format!("arrays nested deeper than {MAX_ARRAY_DEPTH}")));
    }
    let elem = c.u32()?;
    let count = c.u64()?;
    let min = min_elem_bytes(elem).ok_or_else(|| c.err(format!("unknown array element type {elem}")))?;
    // Every element takes at least `min` bytes: a count the rest of the file cannot hold is refused
    // before the element vector is reserved.
    if u128::from(count) * u128::from(min) > c.left() as u128 {
        return Err(c.err(format!(
            "absurd array length {count} of {}: needs at least {} bytes, {} left",
            type_name(elem),
            u128::from(count) * u128::from(min),
            c.left()
        )));
    }
    let n = count as usize;
    fn fixed<const N: usize, T>(c: &mut Cursor<'_>, n: usize, f: impl Fn([u8; N]) -> T) -> Result<Vec<T>> {
        let raw = c.bytes(n * N)?;
        Ok(raw.chunks_exact(N).map(|b| f(le_array(b))).collect())
    }
    Ok(match elem {
        type_id::U8 => Array::U8(c.bytes(n)?.to_vec()),
        type_id::I8 => Array::I8(fixed(c, n, |b: [u8; 1]| b[0] as i8)?),
        type_id::U16 => Array::U16(fixed(c, n, u16::from_le_bytes)?),
        type_id::I16 => Array::I16(fixed(c, n, i16::from_le_bytes)?),
        type_id::U32 => Array::U32(fixed(c, n, u32::from_le_bytes)?),
        type_id::I32 => Array::I32(fixed(c, n, i32::from_le_bytes)?),
        type_id::F32 => Array::F32(fixed(c, n, f32::from_le_bytes)?),
        type_id::BOOL => Array::Bool(fixed(c, n, |b: [u8; 1]| b[0] != 0)?),
        type_id::U64 => Array::U64(fixed(c, n, u64::from_le_bytes)?),
        type_id::I64 => Array::I64(fixed(c, n, i64::from_le_bytes)?),
        type_id::F64 => Array::F64(fixed(c, n, f64::from_le_bytes)?),
        type_id::STRING => {
            let mut v = Vec::with_capacity(reserve(count));
            for _ in 0..n {
                v.push(c.string_lossy()?);
            }
            Array::Str(v)
        }
        type_id::ARRAY => {
            // Nested arrays: no reservation up front. Each inner array was only checked against
            // the bytes left, not against what its siblings still need, so reserving here could
            // multiply the allocation by the nesting depth.
            let mut v = Vec::new();
            for _ in 0..n {
                v.push(read_array(c, depth + 1)?);
            }
            Array::Array(v)
        }
        other => return Err(c.err(format!("unknown array element type {other}"))),
    })
}

/// A fixed-size copy of `b`, whose length the caller guarantees (chunks_exact).
fn le_array<const N: usize>(b: &[u8]) -> [u8; N] {
    let mut a = [0u8; N];
    a.copy_from_slice(b);
    a
}

/// A bounds-checked little-endian reader over the file's bytes.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    file: &'a str,
}

impl<'a> Cursor<'a> {
    fn left(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn err(&self, msg: impl Into<String>) -> QkError {
        QkError::gguf(self.file, msg)
    }

    fn bytes(&mut self, n: usize) -> Result<&'a [u8]> {
        if n > self.left() {
            return Err(self.err(format!(
                "truncated: needs {n} bytes at offset {}, the file has {} left",
                self.pos,
                self.left()
            )));
        }
        let out = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        Ok(le_array(self.bytes(N)?))
    }

    fn u8(&mut self) -> Result<u8> {
        Ok(self.bytes(1)?[0])
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A length-prefixed string's bytes; the length is checked against the bytes left.
    fn string_bytes(&mut self) -> Result<&'a [u8]> {
        let len = self.u64()?;
        if len > self.left() as u64 {
            return Err(self.err(format!(
                "absurd string length {len} at offset {}, the file has {} bytes left",
                self.pos - 8,
                self.left()
            )));
        }
        self.bytes(len as usize)
    }

    /// Keys and tensor names must be UTF-8 (the spec requires it and they are looked up by name).
    fn string_utf8(&mut self) -> Result<String> {
        let at = self.pos;
        let b = self.string_bytes()?;
        String::from_utf8(b.to_vec()).map_err(|_| self.err(format!("string at offset {at} is not UTF-8")))
    }

    /// String values: invalid UTF-8 (seen in some converted vocabularies) becomes U+FFFD instead of
    /// refusing the whole file.
    fn string_lossy(&mut self) -> Result<String> {
        Ok(String::from_utf8_lossy(self.string_bytes()?).into_owned())
    }
}
