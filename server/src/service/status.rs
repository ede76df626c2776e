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
        Error::Io { .. } => Status::new(Code::Unavailable, msg),
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
