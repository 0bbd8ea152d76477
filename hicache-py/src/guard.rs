//! Entry points never let a Rust panic or a hicache error reach Python as anything but an ordinary exception.
//!
//! pyo3 turns a panic into `PanicException`, which derives from `BaseException`: SGLang's storage threads catch
//! `Exception`, so a panic would end the thread (or the server). [`run`] catches the panic first and raises
//! `RuntimeError` instead; [`to_py`] maps hicache's errors to the Python exception a caller expects.

use std::panic::{AssertUnwindSafe, catch_unwind};

use hicache_core::{Error, ErrorKind};
use pyo3::PyErr;
use pyo3::exceptions::{PyOSError, PyRuntimeError, PyTimeoutError, PyTypeError, PyValueError};

use crate::config::ConfigError;

/// Runs `body`, turning a panic into `RuntimeError`.
pub(crate) fn run<T>(body: impl FnOnce() -> Result<T, PyErr>) -> Result<T, PyErr> {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or_else(|payload| {
        let message = payload
            .downcast_ref::<&str>()
            .map(|text| (*text).to_owned())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "no message".into());
        Err(PyRuntimeError::new_err(format!("hicache: internal error (a Rust panic, caught): {message}")))
    })
}

/// The Python exception for a hicache error: bad arguments and configs are `ValueError`, storage failures `OSError`
/// (with `errno` set when an OS error caused them), timeouts `TimeoutError`, the rest `RuntimeError`.
pub(crate) fn to_py(error: Error) -> PyErr {
    let text = format!("hicache: {error}");
    match error.kind() {
        ErrorKind::InvalidInput => PyValueError::new_err(text),
        // with the OS error's number where one caused it, so Python's `OSError.errno` tells ENOSPC from EIO
        ErrorKind::Storage => match error.io_error().and_then(std::io::Error::raw_os_error) {
            Some(errno) => PyOSError::new_err((errno, text)),
            None => PyOSError::new_err(text),
        },
        ErrorKind::Unsupported => PyOSError::new_err(text),
        ErrorKind::TimedOut => PyTimeoutError::new_err(text),
        _ => PyRuntimeError::new_err(text),
    }
}

/// A bad extra config as Python sees it: `TypeError` for a value of the wrong type, else `ValueError`.
pub(crate) fn config_to_py(error: ConfigError) -> PyErr {
    if error.wrong_type { PyTypeError::new_err(error.to_string()) } else { PyValueError::new_err(error.to_string()) }
}
