//! The native module `qk._qk`: the only pyo3 code. Each submodule registers its classes here.

use pyo3::prelude::*;

mod engine;
mod errors;
mod gguf;
mod gpu;
mod stage;
mod transport;

#[pymodule]
#[pyo3(name = "_qk")]
fn qk_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    errors::register(m)?;
    engine::register(m)?;
    gguf::register(m)?;
    gpu::register(m)?;
    transport::register(m)?;
    stage::register(m)?;
    Ok(())
}
