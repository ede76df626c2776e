//! The one place where client and daemon errors become Python exceptions:
//! `FileNotFoundError` for a missing dataset or shard, `ValueError` for a bad argument,
//! `shardstream.ShardError` (with `.shard` and `.offset`) for a corrupt shard,
//! `PermissionError` when storage or the daemon's `allow` list refuses access, `ConnectionError` when the daemon cannot be
//! reached or the connection breaks mid-stream, `shardstream.ShardstreamError` otherwise.

use pyo3::exceptions::{PyConnectionError, PyException, PyFileNotFoundError, PyPermissionError, PyValueError};
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
    m.add("ShardstreamError", m.py().get_type::<ShardstreamError>())?;
    m.add("ShardError", m.py().get_type::<ShardError>())?;
    Ok(())
}

pub fn to_pyerr(e: ClientError) -> PyErr {
    match e {
        ClientError::BadAddress(_) => PyValueError::new_err(e.to_string()),
        ClientError::Connect { .. } => PyConnectionError::new_err(e.to_string()),
        ClientError::Protocol(_) | ClientError::Shm(_) => ShardstreamError::new_err(e.to_string()),
        ClientError::Status(s) => status_to_pyerr(&s),
    }
}

fn status_to_pyerr(s: &tonic::Status) -> PyErr {
    let msg = s.message().to_owned();
    let meta = |k: &str| s.metadata().get(k).and_then(|v| v.to_str().ok()).map(str::to_owned);
    match s.code() {
        Code::NotFound => PyFileNotFoundError::new_err(msg),
        Code::PermissionDenied => PyPermissionError::new_err(msg),
        Code::InvalidArgument | Code::OutOfRange | Code::FailedPrecondition => PyValueError::new_err(msg),
        Code::DataLoss => Python::attach(|py| {
            let err = ShardError::new_err(msg);
            let value = err.value(py);
            let shard = meta(error_metadata::SHARD);
            let offset = meta(error_metadata::OFFSET).and_then(|o| o.parse::<u64>().ok());
            // Attribute setting on a fresh exception object cannot fail in practice; if it does,
            // the message still names shard and offset.
            let _ = value.setattr("shard", shard);
            let _ = value.setattr("offset", offset);
            err
        }),
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
