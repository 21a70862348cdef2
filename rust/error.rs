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
