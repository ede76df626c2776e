//! The one place where client and daemon errors become Python exceptions:
//! `FileNotFoundError` for a missing dataset or shard, `ValueError` for a bad argument,
//! `shardstream.ShardError` (with `.shard` and `.offset`) for a corrupt shard,
//! `PermissionError` when storage, the daemon's `allow` list or its token check refuses access, `OSError` (with `.errno` and `.filename`) when a
//! local shard cannot be read, `ConnectionError` when the daemon cannot be reached or the
//! connection to it breaks (however it breaks: reset, EOF, HTTP/2 error), and
//! `shardstream.ShardstreamError` otherwise. A Rust panic never reaches Python as
//! `PanicException`: [`no_panic`] turns it into a `ShardstreamError`.

use pyo3::exceptions::{
    PyConnectionError, PyException, PyFileNotFoundError, PyOSError, PyPermissionError, PyValueError,
};
use pyo3::prelude::*;
use shardstream_client::ClientError;
use shardstream_proto::error_metadata;
use tonic::Code;

pyo3::create_exception!(_native, ShardstreamError, PyException, "Base class of shardstream errors.");
pyo3::create_exception!(
    _native,
    ShardError,
    ShardstreamError,
    "A shard is corrupt, truncated or does not match its manifest; `.shard` and `.offset` say where."
);

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    for (name, ty) in
        [("ShardstreamError", m.py().get_type::<ShardstreamError>()), ("ShardError", m.py().get_type::<ShardError>())]
    {
        // The module pickle imports to find the class: torch pickles a DataLoader worker's
        // exception to the trainer, and '_native' (the macro's) cannot be imported, so the
        // worker's error was dropped and its epoch ended early without one.
        ty.setattr("__module__", "shardstream._native")?;
        m.add(name, ty)?;
    }
    Ok(())
}

pub fn to_pyerr(e: ClientError) -> PyErr {
    match e {
        ClientError::BadAddress(_) | ClientError::Credentials(_) => PyValueError::new_err(e.to_string()),
        ClientError::Connect { .. } | ClientError::Disconnected(_) | ClientError::NoAnswer { .. } => {
            PyConnectionError::new_err(e.to_string())
        }
        ClientError::Refused { .. } => PyPermissionError::new_err(e.to_string()),
        ClientError::Protocol(_) | ClientError::Shm(_) | ClientError::Rdma(_) => {
            ShardstreamError::new_err(e.to_string())
        }
        ClientError::Status(s) => status_to_pyerr(&s),
        ClientError::Shard { ref shard, offset, .. } => shard_error(e.to_string(), shard, offset),
    }
}

/// A `ShardError` with its `.shard` and `.offset` attributes.
pub fn shard_error(msg: String, shard: &str, offset: Option<u64>) -> PyErr {
    Python::attach(|py| {
        let err = ShardError::new_err(msg);
        let value = err.value(py);
        // Attribute setting on a fresh exception object cannot fail in practice; if it does,
        // the message still names shard and offset.
        let _ = value.setattr("shard", (!shard.is_empty()).then_some(shard));
        let _ = value.setattr("offset", offset);
        err
    })
}

fn status_to_pyerr(s: &tonic::Status) -> PyErr {
    let msg = s.message().to_owned();
    let meta = |k: &str| s.metadata().get(k).and_then(|v| v.to_str().ok()).map(str::to_owned);
    // A local file the daemon could not read: OSError(errno, message, path), which Python turns
    // into the matching subclass (PermissionError, IsADirectoryError, ...).
    if let Some(errno) = meta(error_metadata::ERRNO).and_then(|e| e.parse::<i32>().ok()) {
        return PyOSError::new_err((errno, msg, meta(error_metadata::PATH)));
    }
    match s.code() {
        Code::NotFound => PyFileNotFoundError::new_err(msg),
        // Unauthenticated: a TCP daemon refused the bearer token (missing or wrong).
        Code::PermissionDenied | Code::Unauthenticated => PyPermissionError::new_err(msg),
        Code::InvalidArgument | Code::OutOfRange | Code::FailedPrecondition => PyValueError::new_err(msg),
        Code::DataLoss => {
            let shard = meta(error_metadata::SHARD);
            let offset = meta(error_metadata::OFFSET).and_then(|o| o.parse::<u64>().ok());
            shard_error(msg, shard.as_deref().unwrap_or_default(), offset)
        }
        // From the daemon (no source): something it depends on is unavailable (S3, its
        // shutdown), and its message says what. Made here from a transport failure: the daemon.
        Code::Unavailable | Code::Cancelled if std::error::Error::source(s).is_none() => {
            PyConnectionError::new_err(msg)
        }
        Code::Unavailable | Code::Cancelled => {
            PyConnectionError::new_err(format!("shardstream daemon unavailable: {msg}"))
        }
        // A status the daemon sent never carries a source; one made here from a transport
        // failure does (the connection broke mid-stream: a daemon that exited after its drain
        // timeout, or was killed). That is a lost daemon, not a daemon error.
        Code::Unknown if std::error::Error::source(s).is_some() => {
            PyConnectionError::new_err(format!("connection to the shardstream daemon lost: {msg}"))
        }
        _ => ShardstreamError::new_err(format!("{:?}: {msg}", s.code())),
    }
}

/// Errors of the embedded daemon's start-up.
pub fn daemon_error(e: shardstream::Error) -> PyErr {
    status_to_pyerr(&shardstream::service::to_status(e))
}

/// Runs the body of a Python entry point, turning a Rust panic into a `ShardstreamError`.
/// PyO3 would raise `PanicException`, a `BaseException` that `except Exception` misses and that
/// ends most training scripts; a bug in this module must be an ordinary, reportable error.
pub fn no_panic<T>(what: &str, f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            let msg = shardstream::panics::message(payload.as_ref()).unwrap_or("unknown panic");
            Err(ShardstreamError::new_err(format!(
                "internal error in shardstream ({what}): {msg}; this is a bug, please report it"
            )))
        }
    }
}
