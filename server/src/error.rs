//! The crate's error type: a short list of kinds, each carrying what a user needs to act on it
//! (the path, the shard, the byte offset). Modules keep their own detailed error enums
//! (`TarError`, `SidecarError`, `PlanError`, ...) and convert into this one at their boundary; the
//! service converts this into a gRPC status in exactly one place (`service::status`).

use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A dataset, shard or file that does not exist.
    #[error("{what} not found: {path}")]
    NotFound { what: &'static str, path: String },

    /// A request or argument that can never succeed as given.
    #[error("{0}")]
    InvalidArgument(String),

    /// A shard whose bytes are not what they must be (corrupt, truncated, checksum mismatch).
    #[error("shard {shard}: {reason}")]
    Shard { shard: String, offset: Option<u64>, reason: String },

    /// An I/O failure on a named path.
    #[error("{op} {path}: {source}")]
    Io { op: &'static str, path: PathBuf, source: std::io::Error },

    /// Storage refused access (S3 403): credentials or policy, not something a retry fixes.
    #[error("access denied to {path}: {reason}")]
    PermissionDenied { path: String, reason: String },

    /// The node cache (capacity or disk space) or the packed-ring budget cannot hold what a stream
    /// needs, or a client keeps as many ended shared-memory streams as it may.
    #[error("{0}")]
    CacheFull(String),

    /// The daemon is shutting down or a resource is exhausted; the request may succeed later.
    #[error("{0}")]
    Unavailable(String),

    /// A stream's client left: it dropped its loader (a trainer that stops mid-epoch), closed
    /// its stream or its shared-memory channel. No failure of the daemon's: logged at info.
    /// Told to a client still listening as [`Error::Unavailable`] is.
    #[error("{0}")]
    ClientGone(String),

    /// A bug: something the code assumed cannot happen did.
    #[error("internal error: {0}")]
    Internal(String),
}

impl Error {
    pub fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        let path = path.into();
        if source.kind() == std::io::ErrorKind::NotFound {
            return Error::NotFound { what: "path", path: path.display().to_string() };
        }
        Error::Io { op, path, source }
    }

    pub fn invalid(msg: impl Into<String>) -> Self {
        Error::InvalidArgument(msg.into())
    }

    /// The same error again, for another caller that waited on the work that failed (a
    /// dataset's open, a shard's download): the same kind and message, so it maps to the same
    /// status and Python exception (an I/O error keeps its OS code or kind; `std::io::Error`
    /// cannot be cloned).
    pub fn again(&self) -> Self {
        match self {
            Error::NotFound { what, path } => Error::NotFound { what, path: path.clone() },
            Error::InvalidArgument(m) => Error::InvalidArgument(m.clone()),
            Error::Shard { shard, offset, reason } => {
                Error::Shard { shard: shard.clone(), offset: *offset, reason: reason.clone() }
            }
            Error::Io { op, path, source } => {
                let source = match source.raw_os_error() {
                    Some(code) => std::io::Error::from_raw_os_error(code),
                    None => std::io::Error::new(source.kind(), source.to_string()),
                };
                Error::Io { op, path: path.clone(), source }
            }
            Error::PermissionDenied { path, reason } => {
                Error::PermissionDenied { path: path.clone(), reason: reason.clone() }
            }
            Error::CacheFull(m) => Error::CacheFull(m.clone()),
            Error::Unavailable(m) => Error::Unavailable(m.clone()),
            Error::ClientGone(m) => Error::ClientGone(m.clone()),
            Error::Internal(m) => Error::Internal(m.clone()),
        }
    }
}

impl From<crate::plan::PlanError> for Error {
    fn from(e: crate::plan::PlanError) -> Self {
        Error::InvalidArgument(e.to_string())
    }
}
