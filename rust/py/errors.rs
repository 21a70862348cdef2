//! The Python exception tree and the exhaustive mapping from `QkError`.

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
        }
    }
}
