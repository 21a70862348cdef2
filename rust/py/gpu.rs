//! Python bindings of the core's `gpu` module: adapter listing and selection (for diagnostics,
//! `qk devices`-style output and the CI check that lavapipe is what runs).

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use super::errors::detach;
use crate::gpu::{AdapterSummary, GpuOptions};

fn summary_dict<'py>(py: Python<'py>, a: &AdapterSummary) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("index", a.index)?;
    d.set_item("name", &a.name)?;
    d.set_item("backend", &a.backend)?;
    d.set_item("device_type", &a.device_type)?;
    d.set_item("driver", &a.driver)?;
    Ok(d)
}

/// Every Vulkan/Metal adapter visible, as dicts with index, name, backend, device_type, driver.
#[pyfunction]
fn adapters(py: Python<'_>) -> PyResult<Bound<'_, PyList>> {
    let list = detach(py, || Ok(crate::gpu::adapters()))?;
    let items = list
        .iter()
        .map(|a| summary_dict(py, a))
        .collect::<PyResult<Vec<_>>>()?;
    PyList::new(py, items)
}

/// The adapter qk would use (QK_DEVICE or `device`: index or name substring); raises DeviceError
/// when there is none.
#[pyfunction]
#[pyo3(signature = (device=None))]
fn selected_adapter(py: Python<'_>, device: Option<String>) -> PyResult<Bound<'_, PyDict>> {
    let mut opts = GpuOptions::from_env();
    if device.is_some() {
        opts.device = device;
    }
    let chosen = detach(py, || crate::gpu::select_adapter(&opts))?;
    summary_dict(py, &chosen)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(adapters, m)?)?;
    m.add_function(wrap_pyfunction!(selected_adapter, m)?)?;
    Ok(())
}
