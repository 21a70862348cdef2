//! Python bindings of the core's `gguf` module: `_qk.GgufFile`, wrapped by `qk.gguf.Gguf`.

use std::path::PathBuf;

use numpy::PyArray1;
use pyo3::exceptions::PyKeyError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use crate::gguf::{Array, GgufFile, TensorInfo, Value};

/// An open GGUF model (one file or every shard of a split model), memory-mapped.
#[pyclass(name = "GgufFile", module = "qk._qk", frozen)]
pub struct PyGgufFile {
    inner: GgufFile,
}

impl PyGgufFile {
    fn tensor_info(&self, name: &str) -> PyResult<&TensorInfo> {
        self.inner
            .tensor(name)
            .ok_or_else(|| PyKeyError::new_err(format!("no tensor named {name:?}")))
    }
}

fn value_to_py<'py>(py: Python<'py>, v: &Value) -> PyResult<Bound<'py, PyAny>> {
    Ok(match v {
        Value::U8(x) => x.into_pyobject(py)?.into_any(),
        Value::I8(x) => x.into_pyobject(py)?.into_any(),
        Value::U16(x) => x.into_pyobject(py)?.into_any(),
        Value::I16(x) => x.into_pyobject(py)?.into_any(),
        Value::U32(x) => x.into_pyobject(py)?.into_any(),
        Value::I32(x) => x.into_pyobject(py)?.into_any(),
        Value::U64(x) => x.into_pyobject(py)?.into_any(),
        Value::I64(x) => x.into_pyobject(py)?.into_any(),
        Value::F32(x) => f64::from(*x).into_pyobject(py)?.into_any(),
        Value::F64(x) => x.into_pyobject(py)?.into_any(),
        Value::Bool(x) => x.into_pyobject(py)?.to_owned().into_any(),
        Value::Str(s) => s.into_pyobject(py)?.into_any(),
        Value::Array(a) => array_to_py(py, a)?.into_any(),
    })
}

fn array_to_py<'py>(py: Python<'py>, a: &Array) -> PyResult<Bound<'py, PyList>> {
    match a {
        Array::U8(v) => PyList::new(py, v),
        Array::I8(v) => PyList::new(py, v),
        Array::U16(v) => PyList::new(py, v),
        Array::I16(v) => PyList::new(py, v),
        Array::U32(v) => PyList::new(py, v),
        Array::I32(v) => PyList::new(py, v),
        Array::U64(v) => PyList::new(py, v),
        Array::I64(v) => PyList::new(py, v),
        Array::F32(v) => PyList::new(py, v.iter().map(|&x| f64::from(x))),
        Array::F64(v) => PyList::new(py, v),
        Array::Bool(v) => PyList::new(py, v),
        Array::Str(v) => PyList::new(py, v),
        Array::Array(v) => PyList::new(
            py,
            v.iter()
                .map(|inner| array_to_py(py, inner))
                .collect::<PyResult<Vec<_>>>()?,
        ),
    }
}

#[pymethods]
impl PyGgufFile {
    /// Opens `path` (a single file or the first shard of a split model). With `header_only`, only
    /// metadata and tensor tables are read and the data may be absent.
    #[new]
    #[pyo3(signature = (path, header_only = false))]
    fn new(py: Python<'_>, path: PathBuf, header_only: bool) -> PyResult<Self> {
        let inner = py.detach(|| {
            if header_only {
                GgufFile::open_header_only(&path)
            } else {
                GgufFile::open(&path)
            }
        })?;
        Ok(PyGgufFile { inner })
    }

    #[getter]
    fn path(&self) -> PathBuf {
        self.inner.path().to_path_buf()
    }

    #[getter]
    fn shard_paths(&self) -> Vec<PathBuf> {
        self.inner
            .shard_paths()
            .into_iter()
            .map(|p| p.to_path_buf())
            .collect()
    }

    #[getter]
    fn version(&self) -> u32 {
        self.inner.version()
    }

    #[getter]
    fn alignment(&self) -> u64 {
        self.inner.alignment()
    }

    #[getter]
    fn header_only(&self) -> bool {
        self.inner.is_header_only()
    }

    #[getter]
    fn arch(&self) -> Option<&str> {
        self.inner.arch()
    }

    /// SHA-256 (hex) of every shard's header and tensor table.
    #[getter]
    fn fingerprint(&self) -> String {
        self.inner.fingerprint_hex()
    }

    /// Metadata as a dict in file order: integers → int, floats → float, arrays → (nested) lists.
    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (k, v) in self.inner.metadata() {
            d.set_item(k, value_to_py(py, v)?)?;
        }
        Ok(d)
    }

    /// The tensor table: (name, type name, type id, ne, offset in its file, nbytes, shard,
    /// offset in the data section) per tensor.
    fn tensors<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let rows = self
            .inner
            .tensors()
            .iter()
            .map(|t| {
                (
                    t.name.as_str(),
                    t.type_name(),
                    t.type_id,
                    PyTuple::new(py, &t.ne)?,
                    t.offset,
                    t.nbytes,
                    t.shard,
                    t.data_offset,
                )
                    .into_pyobject(py)
            })
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, rows)
    }

    /// A copy of the tensor's bytes as a 1-D uint8 array.
    fn raw<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyArray1<u8>>> {
        let t = self.tensor_info(name)?;
        Ok(PyArray1::from_slice(py, self.inner.tensor_data(t)?))
    }

    /// The tensor dequantised to f32, 1-D in ggml element order (the wrapper reshapes).
    fn dequantize<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyArray1<f32>>> {
        let t = self.tensor_info(name)?;
        let values = py.detach(|| self.inner.dequantize_tensor(t))?;
        Ok(PyArray1::from_vec(py, values))
    }
}

/// The ggml type names qk loads and dequantises (`GgmlType::ALL`), for `python -m qk.info`.
#[pyfunction]
fn supported_types() -> Vec<&'static str> {
    crate::gguf::GgmlType::ALL.iter().map(|t| t.name()).collect()
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyGgufFile>()?;
    m.add_function(wrap_pyfunction!(supported_types, m)?)?;
    Ok(())
}
