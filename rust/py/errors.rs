//! The Python exception tree and the exhaustive mapping from `QkError`; `detach`, the GIL-free call
//! into the core that also turns a Rust panic into `qk.InternalError`.

use pyo3::create_exception;
use pyo3::exceptions::{PyFileNotFoundError, PyOSError};
use pyo3::prelude::*;

use crate::error::QkError;

mod base {
    pyo3::create_exception!(
        qk,
        QkError,
        pyo3::exceptions::PyException,
        "Base class of every error raised by qk."
    );
}
pub use base::QkError as QkBaseError;
create_exception!(
    qk,
    GgufError,
    QkBaseError,
    "A GGUF file that is malformed, truncated or incomplete."
);
create_exception!(
    qk,
    UnsupportedTypeError,
    GgufError,
    "A tensor type qk does not handle."
);
create_exception!(
    qk,
    DeviceError,
    QkBaseError,
    "No usable GPU adapter, or the device failed."
);
create_exception!(qk, DeviceLostError, DeviceError, "The GPU device was lost.");
create_exception!(
    qk,
    OutOfMemoryError,
    DeviceError,
    "The GPU could not provide an allocation."
);
create_exception!(
    qk,
    ShaderError,
    QkBaseError,
    "A shader that does not validate or build."
);
create_exception!(
    qk,
    EngineError,
    QkBaseError,
    "An engine call invalid for its state or arguments."
);
create_exception!(
    qk,
    TransportError,
    QkBaseError,
    "A stage-transport failure: bad frame, refused hello, dead peer."
);
create_exception!(
    qk,
    InternalError,
    QkBaseError,
    "A bug in qk: a Rust panic, caught at the Python boundary."
);

/// Run `f` with the GIL released, a panic in it answered as `qk.InternalError` (no Rust panic crosses
/// into Python: pyo3 would raise it as PanicException, a BaseException that `except Exception`
/// does not catch).
pub fn detach<T: Send>(py: Python<'_>, f: impl FnOnce() -> crate::Result<T> + Send) -> PyResult<T> {
    Ok(py.detach(|| crate::error::catch_panic(f))?)
}

/// `f` (which holds the GIL), a panic in it answered as `qk.InternalError`.
pub fn guard<T>(f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
        .unwrap_or_else(|payload| Err(QkError::Panic(crate::error::panic_message(payload.as_ref())).into()))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("QkError", py.get_type::<QkBaseError>())?;
    m.add("GgufError", py.get_type::<GgufError>())?;
    m.add("UnsupportedTypeError", py.get_type::<UnsupportedTypeError>())?;
    m.add("DeviceError", py.get_type::<DeviceError>())?;
    m.add("DeviceLostError", py.get_type::<DeviceLostError>())?;
    m.add("OutOfMemoryError", py.get_type::<OutOfMemoryError>())?;
    m.add("ShaderError", py.get_type::<ShaderError>())?;
    m.add("EngineError", py.get_type::<EngineError>())?;
    m.add("TransportError", py.get_type::<TransportError>())?;
    m.add("InternalError", py.get_type::<InternalError>())?;
    Ok(())
}

impl From<QkError> for PyErr {
    fn from(e: QkError) -> PyErr {
        let msg = e.to_string();
        match e {
            QkError::Io { ref source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
                PyFileNotFoundError::new_err(msg)
            }
            QkError::Io { .. } => PyOSError::new_err(msg),
            QkError::Gguf { .. } => GgufError::new_err(msg),
            QkError::UnsupportedType { .. } => UnsupportedTypeError::new_err(msg),
            QkError::Device(_) => DeviceError::new_err(msg),
            QkError::DeviceLost(_) => DeviceLostError::new_err(msg),
            QkError::OutOfMemory(_) => OutOfMemoryError::new_err(msg),
            QkError::Shader { .. } => ShaderError::new_err(msg),
            QkError::Engine(_) => EngineError::new_err(msg),
            QkError::Transport(_) => TransportError::new_err(msg),
            QkError::Panic(_) => InternalError::new_err(msg),
        }
    }
}
