//! The one place where crate errors become gRPC statuses. Shard errors carry the shard and the
//! byte offset as metadata too, so clients can raise a structured error without parsing text.

use shardstream_proto::error_metadata;
use tonic::{Code, Status};

use crate::Error;

/// The most of an error's text a status carries. Messages name URLs and paths, and a URL may be
/// a brace pattern of thousands of names (a 16 KiB request): the status travels in the reply's
/// headers (`grpc-message`, percent-encoded: up to three bytes a character), and headers beyond
/// the client's limit (16 KiB in tonic and grpcio) reset the stream, which the trainer then sees as
/// a daemon that does not answer instead of the error.
const MAX_MESSAGE_BYTES: usize = 2048;

/// The most a metadata value (a path, a shard) may hold; a longer one is left out (the message
/// still names it, shortened).
const MAX_METADATA_BYTES: usize = 1024;

pub fn to_status(e: Error) -> Status {
    let msg = bounded(e.to_string());
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
        Error::Unavailable(_) | Error::ClientGone(_) => Status::new(Code::Unavailable, msg),
        Error::Internal(_) => Status::new(Code::Internal, msg),
    }
}

/// `msg`, or its start and end with how much was left out between them when it is over
/// [`MAX_MESSAGE_BYTES`].
fn bounded(msg: String) -> String {
    if msg.len() <= MAX_MESSAGE_BYTES {
        return msg;
    }
    // (str::floor_char_boundary is newer than the minimum Rust this builds with.)
    let head = (0..=MAX_MESSAGE_BYTES * 3 / 4).rev().find(|&i| msg.is_char_boundary(i)).unwrap_or(0);
    let tail = (msg.len() - MAX_MESSAGE_BYTES / 8..=msg.len()).find(|&i| msg.is_char_boundary(i)).unwrap_or(msg.len());
    format!("{} [... {} bytes left out ...] {}", &msg[..head], tail - head, &msg[tail..])
}

fn insert(s: &mut Status, key: &'static str, value: &str) {
    // Metadata values must be visible ASCII; paths that are not, or that are too long for the
    // reply's headers, go without the metadata entry (the message still names them).
    if value.len() > MAX_METADATA_BYTES {
        return;
    }
    if let Ok(v) = value.parse() {
        s.metadata_mut().insert(key, v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_message_and_path_are_cut_to_fit_the_reply_headers() {
        let url = format!("/data/train-{{{}}}.tar", (0..1300).map(|i| format!("{i:06}")).collect::<Vec<_>>().join(","));
        let s = to_status(Error::PermissionDenied { path: url.clone(), reason: "not in the allow list".into() });
        assert!(s.message().len() <= MAX_MESSAGE_BYTES + 64, "{}", s.message().len());
        assert!(s.message().starts_with("access denied to /data/train-{000000,"), "{}", s.message());
        assert!(s.message().ends_with("not in the allow list"), "{}", s.message());
        assert!(s.message().contains("bytes left out"), "{}", s.message());
        assert!(s.metadata().get(error_metadata::PATH).is_none());
        // Short ones stay whole.
        let s = to_status(Error::PermissionDenied { path: "/d/x".into(), reason: "no".into() });
        assert_eq!(s.metadata().get(error_metadata::PATH).unwrap(), "/d/x");
        assert!(!s.message().contains("left out"));
        // A cut never splits a character.
        assert!(bounded("é".repeat(3000)).is_char_boundary(0));
    }

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
