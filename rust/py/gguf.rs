//! Python bindings of the core's `gguf` module (filled in by its owner).

use pyo3::prelude::*;

pub fn register(_m: &Bound<'_, PyModule>) -> PyResult<()> {
    Ok(())
}
