//! The one place where crate errors become gRPC statuses. Shard errors carry the shard and the
//! byte offset as metadata too, so clients can raise a structured error without parsing text.

use shardstream_proto::error_metadata;
use tonic::{Code, Status};

use crate::Error;

pub fn to_status(e: Error) -> Status {
    let msg = e.to_string();
    match e {
        Error::NotFound { path, .. } => {
            let mut s = Status::new(Code::NotFound, msg);
            insert(&mut s, error_metadata::PATH, &path);
            s
        }
        Error::InvalidArgument(_) => Status::new(Code::InvalidArgument, msg),
        Error::Shard { shard, offset, .. } => {
            let mut s = Status::new(Code::DataLoss, msg);
            insert(&mut s, error_metadata::SHARD, &shard);
            if let Some(o) = offset {
                insert(&mut s, error_metadata::OFFSET, &o.to_string());
            }
            s
        }
        Error::PermissionDenied { path, .. } => {
            let mut s = Status::new(Code::PermissionDenied, msg);
            insert(&mut s, error_metadata::PATH, &path);
            s
        }
        Error::CacheFull(_) => Status::new(Code::ResourceExhausted, msg),
        // A local file that cannot be read is a verdict on that file, not a daemon that went
        // away: Unavailable would send a trainer's reconnect logic into a loop. The errno and
        // the path travel as metadata so clients raise the matching OS error.
        Error::Io { path, source, .. } => {
            let code = match source.kind() {
                std::io::ErrorKind::PermissionDenied => Code::PermissionDenied,
                _ => Code::FailedPrecondition,
            };
            let mut s = Status::new(code, msg);
            insert(&mut s, error_metadata::PATH, &path.display().to_string());
            if let Some(errno) = source.raw_os_error() {
                insert(&mut s, error_metadata::ERRNO, &errno.to_string());
            }
            s
        }
        Error::Unavailable(_) => Status::new(Code::Unavailable, msg),
        Error::Internal(_) => Status::new(Code::Internal, msg),
    }
}

fn insert(s: &mut Status, key: &'static str, value: &str) {
    // Metadata values must be visible ASCII; paths that are not go without the metadata entry
    // (the message still names them).
    if let Ok(v) = value.parse() {
        s.metadata_mut().insert(key, v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_io_errors_name_the_file_and_errno_and_are_not_unavailable() {
        let eisdir = std::io::Error::from_raw_os_error(libc::EISDIR);
        let s = to_status(Error::io("cannot read shard", "/d/train-000007.tar", eisdir));
        assert_eq!(s.code(), Code::FailedPrecondition);
        assert!(s.message().contains("/d/train-000007.tar"), "{}", s.message());
        assert_eq!(s.metadata().get(error_metadata::ERRNO).unwrap(), &libc::EISDIR.to_string());
        assert_eq!(s.metadata().get(error_metadata::PATH).unwrap(), "/d/train-000007.tar");
        let eacces = std::io::Error::from_raw_os_error(libc::EACCES);
        let s = to_status(Error::io("cannot open shard", "/d/x.tar", eacces));
        assert_eq!(s.code(), Code::PermissionDenied);
        assert_eq!(s.metadata().get(error_metadata::ERRNO).unwrap(), &libc::EACCES.to_string());
    }
}
