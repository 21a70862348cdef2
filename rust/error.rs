//! The one error enum of the core. Variants are named after the failure; the Python layer maps each
//! to a typed exception (rust/py/errors.rs).

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum QkError {
    /// An OS-level read/open failure, with the file it concerns.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A GGUF file that is malformed, truncated, absurd or incomplete.
    #[error("{file}: {msg}")]
    Gguf { file: String, msg: String },
    /// A tensor whose ggml type qk does not handle (at load or in a kernel).
    #[error("tensor {tensor}: unsupported type {ty}")]
    UnsupportedType { tensor: String, ty: String },
    /// No usable adapter, or the device could not be created with what the kernels need.
    #[error("GPU device: {0}")]
    Device(String),
    /// The device was lost (driver reset, removed GPU).
    #[error("GPU device lost: {0}")]
    DeviceLost(String),
    /// A buffer or allocation the device could not provide.
    #[error("GPU out of memory: {0}")]
    OutOfMemory(String),
    /// A shader that does not parse, validate or build into a pipeline.
    #[error("shader {name}: {msg}")]
    Shader { name: String, msg: String },
    /// A call that is invalid for the engine's state or arguments (bad slot, base, shape…).
    #[error("{0}")]
    Engine(String),
    /// The stage transport: a malformed frame, a refused hello, a dead or stalled peer.
    #[error("{0}")]
    Transport(String),
    /// A bug: a Rust panic, caught where Python calls in (`catch_panic`) so that it reaches Python as a
    /// typed error instead of unwinding into the interpreter.
    #[error("internal error (a bug in qk): {0}")]
    Panic(String),
}

pub type Result<T> = std::result::Result<T, QkError>;

impl QkError {
    pub fn gguf(file: impl Into<String>, msg: impl Into<String>) -> Self {
        QkError::Gguf {
            file: file.into(),
            msg: msg.into(),
        }
    }
}

/// Run `f`, turning a panic inside it into `QkError::Panic` with the panic's message. The last line of
/// defence at the Python boundary: bad input gets a typed error long before this (bounded parsing,
/// checked arithmetic), but a panic that got through must not cross into Python as a BaseException.
pub fn catch_panic<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
        .unwrap_or_else(|payload| Err(QkError::Panic(panic_message(payload.as_ref()))))
}

/// The message a panic was raised with (`panic!("...")` gives a `&str` or a `String`).
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_string())
}

/// Return early with an error: `bail!(QkError::Engine(format!(...)))`.
#[macro_export]
macro_rules! bail {
    ($e:expr) => {
        return Err($e.into())
    };
}

/// Return early with `$e` unless `$cond` holds.
#[macro_export]
macro_rules! ensure {
    ($cond:expr, $e:expr) => {
        if !($cond) {
            return Err($e.into());
        }
    };
}
