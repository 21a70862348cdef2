//! GGUF reader tests on bytes built inline: well-formed files of every value type, splits, and
//! malformed files that must be refused with a `QkError::Gguf` naming the problem (never a panic,
//! hang or huge allocation).

use std::path::{Path, PathBuf};

use qk::QkError;
use qk::gguf::dequant::dequantize;
use qk::gguf::{Array, GgmlType, GgufFile, TypeLayout, Value};

// ---------------------------------------------------------------- byte builder

/// A GGUF file under construction: header fields, raw key-value bytes and tensor infos.
struct Builder {
    magic: [u8; 4],
    version: u32,
    n_kv: u64,
    kv: Vec<u8>,
    /// (name, ne, type id, data offset)
    tensors: Vec<(String, Vec<u64>, u32, u64)>,
    alignment: u64,
    /// Count written in the header instead of the real one, when set.
    n_tensors_override: Option<u64>,
    n_kv_override: Option<u64>,
}

fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend((s.len() as u64).to_le_bytes()); // u64 length, then the bytes, no terminator
    b.extend(s.as_bytes());
}

impl Builder {
    fn new() -> Builder {
        Builder {
            magic: *b"GGUF",
            version: 3,
            n_kv: 0,
            kv: Vec::new(),
            tensors: Vec::new(),
            alignment: 32,
            n_tensors_override: None,
            n_kv_override: None,
        }
    }

    /// A key with value type `ty` and already-encoded value bytes.
    fn kv_raw(&mut self, key: &str, ty: u32, value: &[u8]) -> &mut Self {
        put_str(&mut self.kv, key);
        self.kv.extend(ty.to_le_bytes());
        self.kv.extend(value);
        self.n_kv += 1;
        self
    }

    fn kv_u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.kv_raw(key, 4, &v.to_le_bytes())
    }

    fn kv_u16(&mut self, key: &str, v: u16) -> &mut Self {
        self.kv_raw(key, 2, &v.to_le_bytes())
    }

    fn kv_str(&mut self, key: &str, s: &str) -> &mut Self {
        let mut v = Vec::new();
        put_str(&mut v, s);
        self.kv_raw(key, 8, &v)
    }

    fn alignment(&mut self, a: u32) -> &mut Self {
        self.alignment = u64::from(a);
        self.kv_u32("general.alignment", a)
    }

    fn tensor(&mut self, name: &str, ne: &[u64], ty: u32, offset: u64) -> &mut Self {
        self.tensors.push((name.into(), ne.to_vec(), ty, offset));
        self
    }

    /// Header + metadata + tensor table, without padding or data.
    fn header(&self) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend(self.magic);
        b.extend(self.version.to_le_bytes());
        b.extend(
            self.n_tensors_override
                .unwrap_or(self.tensors.len() as u64)
                .to_le_bytes(),
        );
        b.extend(self.n_kv_override.unwrap_or(self.n_kv).to_le_bytes());
        b.extend(&self.kv);
        for (name, ne, ty, offset) in &self.tensors {
            put_str(&mut b, name);
            b.extend((ne.len() as u32).to_le_bytes()); // n_dims
            for d in ne {
                b.extend(d.to_le_bytes());
            }
            b.extend(ty.to_le_bytes());
            b.extend(offset.to_le_bytes());
        }
        b
    }

    /// The whole file: header, padding to the alignment, then `data` (the data section).
    fn build(&self, data: &[u8]) -> Vec<u8> {
        let mut b = self.header();
        while !(b.len() as u64).is_multiple_of(self.alignment) {
            b.push(0);
        }
        b.extend(data);
        b
    }
}

/// A file in the temp directory, removed on drop.
struct TempFile(PathBuf);

impl TempFile {
    fn new(name: &str, bytes: &[u8]) -> TempFile {
        let dir = std::env::temp_dir().join(format!("qk-gguf-tests-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create temp dir");
        let path = dir.join(name);
        std::fs::write(&path, bytes).expect("write temp file");
        TempFile(path)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn open_bytes(name: &str, bytes: &[u8]) -> qk::Result<GgufFile> {
    let f = TempFile::new(name, bytes);
    GgufFile::open(f.path())
}

/// The message of the `QkError::Gguf` that `r` must be; also checks it names the file.
#[track_caller]
fn gguf_error(r: qk::Result<GgufFile>) -> String {
    match r {
        Ok(_) => panic!("malformed file was accepted"),
        Err(QkError::Gguf { file, msg }) => {
            assert!(file.ends_with(".gguf"), "error names no file: {file}");
            msg
        }
        Err(e) => panic!("expected QkError::Gguf, got {e:?}"),
    }
}

#[track_caller]
fn assert_refused(name: &str, bytes: &[u8], fragment: &str) {
    let msg = gguf_error(open_bytes(name, bytes));
    assert!(msg.contains(fragment), "message {msg:?} lacks {fragment:?}");
}

/// One F32 tensor {4, 2} at offset 0 and one Q8_0 tensor {32} right after it (offset 32).
fn two_tensor_file() -> (Builder, Vec<u8>) {
    let mut b = Builder::new();
    b.kv_str("general.architecture", "qwen35moe");
    b.tensor("a", &[4, 2], 0, 0).tensor("q", &[32], 8, 32);
    let mut data = Vec::new();
    for i in 0..8 {
        data.extend((i as f32).to_le_bytes());
    }
    data.resize(32, 0); // pad to the next aligned offset
    data.extend(half::f16::from_f32(0.5).to_le_bytes()); // Q8_0 d
    data.extend((0..32).map(|i| (i as i8 - 16) as u8)); // Q8_0 qs
    (b, data)
}

// ---------------------------------------------------------------- well-formed files

#[test]
fn every_value_type_round_trips() {
    let mut b = Builder::new();
    b.kv_raw("u8", 0, &[200]);
    b.kv_raw("i8", 1, &[0xfe]);
    b.kv_raw("u16", 2, &60000u16.to_le_bytes());
    b.kv_raw("i16", 3, &(-3i16).to_le_bytes());
    b.kv_u32("u32", 4_000_000_000);
    b.kv_raw("i32", 5, &(-5i32).to_le_bytes());
    b.kv_raw("f32", 6, &1.5f32.to_le_bytes());
    b.kv_raw("bool", 7, &[1]);
    b.kv_str("str", "héllo");
    b.kv_raw("u64", 10, &u64::MAX.to_le_bytes());
    b.kv_raw("i64", 11, &i64::MIN.to_le_bytes());
    b.kv_raw("f64", 12, &(-2.25f64).to_le_bytes());
    // array of i32 [1, -2]
    let mut arr = 5u32.to_le_bytes().to_vec();
    arr.extend(2u64.to_le_bytes());
    arr.extend(1i32.to_le_bytes());
    arr.extend((-2i32).to_le_bytes());
    b.kv_raw("arr_i32", 9, &arr);
    // array of strings ["a", ""]
    let mut arr = 8u32.to_le_bytes().to_vec();
    arr.extend(2u64.to_le_bytes());
    put_str(&mut arr, "a");
    put_str(&mut arr, "");
    b.kv_raw("arr_str", 9, &arr);
    // array of arrays: [[true], []] as bool arrays
    let mut arr = 9u32.to_le_bytes().to_vec();
    arr.extend(2u64.to_le_bytes());
    arr.extend(7u32.to_le_bytes());
    arr.extend(1u64.to_le_bytes());
    arr.push(1);
    arr.extend(7u32.to_le_bytes());
    arr.extend(0u64.to_le_bytes());
    b.kv_raw("arr_arr", 9, &arr);

    let g = open_bytes("values.gguf", &b.build(&[])).expect("valid file");
    assert_eq!(g.get("u8"), Some(&Value::U8(200)));
    assert_eq!(g.get("i8"), Some(&Value::I8(-2)));
    assert_eq!(g.get("u16"), Some(&Value::U16(60000)));
    assert_eq!(g.get("i16"), Some(&Value::I16(-3)));
    assert_eq!(g.get_u32("u32"), Some(4_000_000_000));
    assert_eq!(g.get_i64("i32"), Some(-5));
    assert_eq!(g.get_u32("i32"), None, "a negative value is no u32");
    assert_eq!(g.get_f32("f32"), Some(1.5));
    assert_eq!(g.get_bool("bool"), Some(true));
    assert_eq!(g.get_str("str"), Some("héllo"));
    assert_eq!(g.get_u64("u64"), Some(u64::MAX));
    assert_eq!(g.get_i64("i64"), Some(i64::MIN));
    assert_eq!(g.get("f64"), Some(&Value::F64(-2.25)));
    assert_eq!(g.get_arr_i64("arr_i32"), Some(vec![1, -2]));
    assert_eq!(
        g.get_arr_str("arr_str"),
        Some(&["a".to_string(), String::new()][..])
    );
    assert_eq!(
        g.get_arr("arr_arr"),
        Some(&Array::Array(vec![Array::Bool(vec![true]), Array::Bool(vec![])]))
    );
    let keys: Vec<&str> = g.metadata().iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(keys[..3], ["u8", "i8", "u16"], "metadata keeps file order");
    assert_eq!(g.tensors().len(), 0);
}

#[test]
fn tensors_offsets_and_data() {
    let (b, data) = two_tensor_file();
    let bytes = b.build(&data);
    let f = TempFile::new("two.gguf", &bytes);
    let g = GgufFile::open(f.path()).expect("valid file");
    assert_eq!((g.version(), g.alignment(), g.arch()), (3, 32, Some("qwen35moe")));
    let a = g.tensor("a").expect("tensor a");
    assert_eq!(
        (a.ne.clone(), a.shape(), a.n_elements, a.nbytes),
        (vec![4, 2], vec![2, 4], 8, 32)
    );
    assert_eq!((a.ty, a.type_name()), (Some(GgmlType::F32), "F32"));
    let header_end = b.header().len() as u64;
    let data_start = header_end.div_ceil(32) * 32;
    assert_eq!(a.offset, data_start);
    let q = g.tensor("q").expect("tensor q");
    assert_eq!((q.data_offset, q.offset, q.nbytes), (32, data_start + 32, 34));
    assert_eq!((a.row_bytes(), q.row_bytes()), (16, 34));
    assert!(format!("{g:?}").contains("tensors: 2"));
    let values = g.dequantize_tensor(a).expect("f32");
    assert_eq!(values, (0..8).map(|i| i as f32).collect::<Vec<_>>());
    let qv = g.dequantize_tensor(q).expect("q8_0");
    assert_eq!(qv[0], -8.0);
    assert_eq!(qv[31], 7.5);
    assert_eq!(g.tensor_data(q).expect("bytes"), &data[32..66]);
    assert!(g.tensor("missing").is_none());
}

#[test]
fn version_2_and_custom_alignment() {
    let mut b = Builder::new();
    b.version = 2;
    b.alignment(64).tensor("t", &[16], 0, 0).tensor("u", &[4], 0, 64);
    let g = open_bytes("v2.gguf", &b.build(&[0u8; 80])).expect("valid v2 file");
    assert_eq!((g.version(), g.alignment()), (2, 64));
    assert_eq!(g.tensor("u").expect("u").offset % 64, 0);
}

#[test]
fn unsupported_but_known_type_is_listed_not_dequantised() {
    let mut b = Builder::new();
    b.tensor("q81", &[32], 9, 0); // Q8_1 (an activation format): 36 bytes per 32 weights
    let bytes = b.build(&[7u8; 36]);
    let f = TempFile::new("q81.gguf", &bytes);
    let g = GgufFile::open(f.path()).expect("Q8_1 offsets validate");
    let t = g.tensor("q81").expect("q81");
    assert_eq!((t.type_name(), t.nbytes, t.ty), ("Q8_1", 36, None));
    assert_eq!(g.tensor_data(t).expect("raw bytes").len(), 36);
    match g.dequantize_tensor(t) {
        Err(QkError::UnsupportedType { tensor, ty }) => {
            assert_eq!((tensor.as_str(), ty.as_str()), ("q81", "Q8_1"))
        }
        other => panic!("expected UnsupportedType, got {other:?}"),
    }
}

#[test]
fn header_only_reads_a_truncated_file_but_not_its_data() {
    let (b, data) = two_tensor_file();
    let full = b.build(&data);
    let header = b.header();
    let f = TempFile::new("trunc.gguf", &header);
    assert!(matches!(GgufFile::open(f.path()), Err(QkError::Gguf { .. })));
    let g = GgufFile::open_header_only(f.path()).expect("header-only open");
    assert_eq!(g.tensors().len(), 2);
    let msg = match g.tensor_data(&g.tensors()[0]) {
        Err(QkError::Gguf { msg, .. }) => msg,
        other => panic!("expected a Gguf error, got {other:?}"),
    };
    assert!(msg.contains("header-only"), "{msg}");
    let whole = TempFile::new("whole.gguf", &full);
    let g_full = GgufFile::open(whole.path()).expect("full open");
    assert_eq!(
        g.fingerprint(),
        g_full.fingerprint(),
        "fingerprint covers only header + tensor table"
    );
}

#[test]
fn fingerprint_is_stable_and_sees_metadata() {
    let (b, data) = two_tensor_file();
    let one = open_bytes("fp1.gguf", &b.build(&data))
        .expect("open")
        .fingerprint_hex();
    let two = open_bytes("fp2.gguf", &b.build(&data))
        .expect("open")
        .fingerprint_hex();
    assert_eq!(one, two);
    assert_eq!(one.len(), 64);
    let (mut b2, data2) = two_tensor_file();
    b2.kv_u32("extra", 1);
    let three = open_bytes("fp3.gguf", &b2.build(&data2))
        .expect("open")
        .fingerprint_hex();
    assert_ne!(one, three);
}

/// Shard `no` of `count` holding one F32 tensor `name` of 8 values `fill`.
fn shard_bytes(no: u16, count: u16, name: &str, fill: f32, with_metadata: bool) -> Vec<u8> {
    let mut b = Builder::new();
    if with_metadata {
        b.kv_str("general.architecture", "qwen3next");
    }
    b.kv_u16("split.no", no).kv_u16("split.count", count);
    b.kv_raw("split.tensors.count", 5, &(i32::from(count)).to_le_bytes());
    b.tensor(name, &[8], 0, 0);
    b.build(&fill.to_le_bytes().repeat(8))
}

#[test]
fn split_model_opens_as_one() {
    let s1 = TempFile::new("m-00001-of-00003.gguf", &shard_bytes(0, 3, "t0", 1.0, true));
    let _s2 = TempFile::new("m-00002-of-00003.gguf", &shard_bytes(1, 3, "t1", 2.0, false));
    let s3 = TempFile::new("m-00003-of-00003.gguf", &shard_bytes(2, 3, "t2", 3.0, false));
    let g = GgufFile::open(s1.path()).expect("split model");
    assert_eq!(g.arch(), Some("qwen3next"));
    assert_eq!(g.shard_paths().len(), 3);
    let names: Vec<(&str, usize)> = g.tensors().iter().map(|t| (t.name.as_str(), t.shard)).collect();
    assert_eq!(names, [("t0", 0), ("t1", 1), ("t2", 2)]);
    for (name, fill) in [("t0", 1.0), ("t1", 2.0), ("t2", 3.0)] {
        let t = g.tensor(name).expect("tensor");
        assert_eq!(g.dequantize_tensor(t).expect("data"), vec![fill; 8]);
    }
    // Opening a later shard is refused: the model starts at the first.
    let msg = gguf_error(GgufFile::open(s3.path()));
    assert!(msg.contains("shard 3 of 3"), "{msg}");
}

#[test]
fn split_model_with_a_missing_shard_is_refused() {
    let s1 = TempFile::new("n-00001-of-00002.gguf", &shard_bytes(0, 2, "t0", 1.0, true));
    let msg = gguf_error(GgufFile::open(s1.path()));
    assert!(
        msg.contains("missing shard 2 of 2") && msg.contains("n-00002-of-00002.gguf"),
        "{msg}"
    );
}

#[test]
fn split_shards_must_agree() {
    let s1 = TempFile::new("w-00001-of-00002.gguf", &shard_bytes(0, 2, "t0", 1.0, true));
    // The second file claims to be shard index 0 again.
    let _s2 = TempFile::new("w-00002-of-00002.gguf", &shard_bytes(0, 2, "t1", 1.0, false));
    let msg = gguf_error(GgufFile::open(s1.path()));
    assert!(msg.contains("split.no = 1"), "{msg}");
    // Same tensor name in two shards.
    let d1 = TempFile::new("d-00001-of-00002.gguf", &shard_bytes(0, 2, "t", 1.0, true));
    let _d2 = TempFile::new("d-00002-of-00002.gguf", &shard_bytes(1, 2, "t", 1.0, false));
    let msg = gguf_error(GgufFile::open(d1.path()));
    assert!(msg.contains("more than one shard"), "{msg}");
    // split.count > 1 but a file name without the shard suffix.
    assert_refused(
        "plain.gguf",
        &shard_bytes(0, 2, "t", 1.0, true),
        "does not end in -00001-of-00002.gguf",
    );
}

#[test]
fn missing_file_is_an_io_error() {
    match GgufFile::open("/nonexistent/qk/model.gguf") {
        Err(QkError::Io { source, .. }) => assert_eq!(source.kind(), std::io::ErrorKind::NotFound),
        other => panic!("expected Io NotFound, got {:?}", other.err()),
    }
}

// ---------------------------------------------------------------- malformed files

#[test]
fn every_truncation_is_refused() {
    let (b, data) = two_tensor_file();
    let full = b.build(&data);
    let f = TempFile::new("cut.gguf", &[]);
    for len in 0..full.len() {
        std::fs::write(f.path(), &full[..len]).expect("write");
        match GgufFile::open(f.path()) {
            Err(QkError::Gguf { .. }) => {}
            other => panic!(
                "prefix of {len} bytes: expected a Gguf error, got {:?}",
                other.map(|_| ())
            ),
        }
    }
    std::fs::write(f.path(), &full).expect("write");
    GgufFile::open(f.path()).expect("the whole file opens");
}

#[test]
fn bad_magic_and_versions() {
    let (mut b, data) = two_tensor_file();
    b.magic = *b"GGML";
    assert_refused("magic.gguf", &b.build(&data), "not a GGUF file");
    let (mut b, data) = two_tensor_file();
    b.version = 1;
    assert_refused("v1.gguf", &b.build(&data), "version 1");
    b.version = 4;
    assert_refused("v4.gguf", &b.build(&data), "unsupported GGUF version 4");
    b.version = 3u32.swap_bytes();
    assert_refused("be.gguf", &b.build(&data), "big-endian");
}

#[test]
fn absurd_counts_and_lengths() {
    let (mut b, data) = two_tensor_file();
    b.n_kv_override = Some(u64::MAX);
    assert_refused("nkv.gguf", &b.build(&data), "absurd counts");
    let (mut b, data) = two_tensor_file();
    b.n_tensors_override = Some(1 << 40);
    assert_refused("nt.gguf", &b.build(&data), "absurd counts");

    // A string value claiming 2^62 bytes.
    let mut b = Builder::new();
    b.kv_raw("s", 8, &(1u64 << 62).to_le_bytes());
    assert_refused("strlen.gguf", &b.build(&[]), "absurd string length");

    // A u64 array claiming 2^61 elements (2^64 bytes).
    let mut arr = 10u32.to_le_bytes().to_vec();
    arr.extend((1u64 << 61).to_le_bytes());
    let mut b = Builder::new();
    b.kv_raw("a", 9, &arr);
    assert_refused("arrlen.gguf", &b.build(&[]), "absurd array length");

    // Unknown value type and unknown array element type.
    let mut b = Builder::new();
    b.kv_raw("x", 13, &[0; 8]);
    assert_refused("vtype.gguf", &b.build(&[]), "unknown value type 13");
    let mut arr = 99u32.to_le_bytes().to_vec();
    arr.extend(0u64.to_le_bytes());
    let mut b = Builder::new();
    b.kv_raw("x", 9, &arr);
    assert_refused("etype.gguf", &b.build(&[]), "unknown array element type 99");
}

#[test]
fn deeply_nested_arrays_are_refused() {
    // 200 levels of "array of 1 array", the innermost an empty u8 array.
    let mut arr = Vec::new();
    for _ in 0..200 {
        arr.extend(9u32.to_le_bytes());
        arr.extend(1u64.to_le_bytes());
    }
    arr.extend(0u32.to_le_bytes());
    arr.extend(0u64.to_le_bytes());
    let mut b = Builder::new();
    b.kv_raw("deep", 9, &arr[12..]); // the value starts at the first element type
    assert_refused("deep.gguf", &b.build(&[]), "nested deeper");
}

#[test]
fn bad_tensor_tables() {
    let f32x8 = [0u8; 32];
    let cases: [(&str, Builder, &str); 8] = [
        (
            "eof",
            {
                let mut b = Builder::new();
                b.tensor("t", &[64], 0, 0);
                b
            },
            "runs past the end",
        ),
        (
            "unknown",
            {
                let mut b = Builder::new();
                b.tensor("t", &[8], 4, 0);
                b
            },
            "unknown ggml type id 4",
        ),
        (
            "unknown_big",
            {
                let mut b = Builder::new();
                b.tensor("t", &[8], 1000, 0);
                b
            },
            "unknown ggml type id 1000",
        ),
        (
            "misaligned",
            {
                let mut b = Builder::new();
                b.tensor("t", &[4], 0, 4);
                b
            },
            "not a multiple of the alignment",
        ),
        (
            "overlap",
            {
                let mut b = Builder::new();
                b.tensor("t", &[8], 0, 0).tensor("u", &[8], 0, 0);
                b
            },
            "overlap",
        ),
        (
            "dims",
            {
                let mut b = Builder::new();
                b.tensor("t", &[1, 1, 1, 1, 1], 0, 0);
                b
            },
            "5 dimensions",
        ),
        (
            "overflow",
            {
                let mut b = Builder::new();
                b.tensor("t", &[1 << 32, 1 << 32], 0, 0);
                b
            },
            "element count overflows",
        ),
        (
            "block",
            {
                let mut b = Builder::new();
                b.tensor("t", &[16], 8, 0);
                b
            },
            "not a multiple of the Q8_0 block",
        ),
    ];
    for (name, b, fragment) in cases {
        assert_refused(&format!("{name}.gguf"), &b.build(&f32x8), fragment);
    }
    let mut b = Builder::new();
    b.tensor("t", &[2], 0, 0).tensor("t", &[2], 0, 32);
    assert_refused("duptensor.gguf", &b.build(&[0u8; 40]), "duplicate tensor 't'");
    let mut b = Builder::new();
    b.tensor("t", &[u64::MAX], 0, 0);
    assert_refused("huge.gguf", &b.build(&f32x8), "element count overflows");
    let mut b = Builder::new();
    b.tensor("t", &[(1 << 62) - 32], 0, u64::MAX - 31); // offset + size overflow u64
    assert_refused("offovf.gguf", &b.build(&f32x8), "overflows");
}

#[test]
fn bad_metadata() {
    let mut b = Builder::new();
    b.kv_u32("k", 1).kv_u32("k", 2);
    assert_refused("dupkey.gguf", &b.build(&[]), "duplicate metadata key 'k'");
    let mut b = Builder::new();
    b.alignment(48);
    assert_refused("align48.gguf", &b.build(&[]), "not a power of two");
    let mut b = Builder::new();
    b.kv_str("general.alignment", "32");
    assert_refused("alignstr.gguf", &b.build(&[]), "expected u32");
    let mut b = Builder::new();
    b.kv_raw("bad\u{0}", 4, &0u32.to_le_bytes());
    let mut bytes = b.build(&[]);
    let key_at = 24 + 8; // fixed header, then the key's u64 length
    bytes[key_at] = 0xff; // not UTF-8
    assert_refused("utf8.gguf", &bytes, "not UTF-8");
}

#[test]
fn type_table_is_consistent() {
    for ty in GgmlType::ALL {
        let layout = TypeLayout::of_id(ty.id()).expect("every supported type is in the table");
        assert_eq!(layout, ty.layout(), "{ty}");
        assert_eq!(layout.supported(), Some(ty));
    }
    // Sizes quoted in docs/numerics.md "GGUF block formats".
    assert_eq!(GgmlType::IQ4XS.block_bytes(), 136);
    assert_eq!(
        TypeLayout::of_id(3).map(|l| (l.name, l.block_bytes)),
        Some(("Q4_1", 20))
    );
    assert!(TypeLayout::of_id(4).is_none() && TypeLayout::of_id(31).is_none());
}

// ---------------------------------------------------------------- dequantisation by hand

#[test]
fn dequant_hand_computed_blocks() {
    let h = |x: f32| half::f16::from_f32(x).to_le_bytes();
    // Q4_0: d = 2, byte j = (j low, 15-j high) → weights (j-8)*2 and (7-j)*2.
    let mut b = h(2.0).to_vec();
    b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    let y = dequantize(GgmlType::Q4_0, &b, 32).expect("q4_0");
    assert_eq!((y[0], y[15], y[16], y[31]), (-16.0, 14.0, 14.0, -16.0));

    // IQ4_NL: d = 1: nibble k → KVALUES_IQ4NL[k].
    let mut b = h(1.0).to_vec();
    b.extend((0..16u8).map(|j| j | (j << 4)));
    let y = dequantize(GgmlType::IQ4NL, &b, 32).expect("iq4_nl");
    assert_eq!((y[0], y[8], y[31]), (-127.0, 1.0, 113.0));

    // IQ4_XS: d = 0.5; sub-block 1 gets ls = 0x3 | (0b10 << 4) = 35 → dl = 0.5*3; sub-block 0 gets
    // ls = 0x1 | 0 → dl = 0.5*(1-32). All nibbles 15 → 113.
    let mut b = h(0.5).to_vec();
    b.extend(0b1000u16.to_le_bytes()); // scales_h: bits 2..3 (sub-block 1) = 0b10
    b.extend([0x31, 0, 0, 0]); // scales_l[0]: low nibble sub-block 0 = 1, high nibble sub-block 1 = 3
    b.extend([0xffu8; 128]);
    let y = dequantize(GgmlType::IQ4XS, &b, 256).expect("iq4_xs");
    assert_eq!(
        (y[0], y[32], y[64]),
        (0.5 * -31.0 * 113.0, 0.5 * 3.0 * 113.0, 0.5 * -32.0 * 113.0)
    );

    // Q6_K with every 6-bit value 32 (ql nibbles 0, qh bits 2) and scale 3, d = 1: all zero;
    // with ql = 0x11, qh = 0b01010101: q = 1 | 16 = 17 - 32 = -15 → -45.
    let mut b = vec![0x11u8; 128];
    b.extend([0b0101_0101u8; 64]);
    b.extend([3u8; 16]);
    b.extend(h(1.0));
    let y = dequantize(GgmlType::Q6K, &b, 256).expect("q6_k");
    assert!(y.iter().all(|&v| v == -45.0), "{:?}", &y[..4]);

    // BF16 and F16.
    let y = dequantize(GgmlType::BF16, &0x3fc0u16.to_le_bytes(), 1).expect("bf16");
    assert_eq!(y, [1.5]);
    let y = dequantize(GgmlType::F16, &h(-0.25), 1).expect("f16");
    assert_eq!(y, [-0.25]);
}

#[test]
fn dequant_checks_sizes() {
    assert!(matches!(
        dequantize(GgmlType::Q4K, &[0; 144], 128),
        Err(QkError::Engine(_))
    ));
    assert!(matches!(
        dequantize(GgmlType::Q4K, &[0; 143], 256),
        Err(QkError::Engine(_))
    ));
    assert_eq!(dequantize(GgmlType::Q8_0, &[], 0).expect("empty").len(), 0);
}
