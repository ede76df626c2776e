//! `StreamBatches` read straight off its HTTP/2 response body. tonic's `Streaming` copies every
//! DATA frame into its message buffer (and again, part of it, when that buffer is still shared
//! with the batch before): for an inline batch that was a second pass over every sample byte on
//! the client. Here a message that lies within one frame is decoded from that frame's bytes, so
//! an inline batch's `data` is the very buffer h2 read from the socket. Frames as large as a
//! batch ([`crate::MAX_FRAME_SIZE`]) make that the common case; a message across frames is joined
//! with one copy, as tonic does for all of them, into a buffer the stream reuses.
//!
//! The call's status follows gRPC over HTTP/2 as tonic reads it: a `grpc-status` in the response
//! headers (a trailers-only answer) or else in the trailers; errors of the connection keep their
//! source, so [`crate::is_transport_failure`] still tells them from the daemon's.

use std::collections::VecDeque;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use prost::Message;
use shardstream_proto::{StreamMessage, StreamRequest};
use tonic::Status;
use tonic::body::Body;
use tonic::codegen::http;
use tower::ServiceExt;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The gRPC message prefix: a compression flag and a big-endian length.
const PREFIX: usize = 5;

/// The messages of one `StreamBatches` response, whose body is a `B`.
pub struct Messages<B> {
    body: B,
    /// DATA frames received and not yet consumed, in order; `buffered` bytes in all.
    chunks: VecDeque<Bytes>,
    buffered: usize,
    max_message: usize,
    /// Set once the call's status has been read (the stream is over).
    ended: bool,
    /// Buffers of joined messages the consumer has let go of.
    spare: Spare,
}

/// Sends `req` as a `StreamBatches` call over `service` (the client's channel with its
/// credentials) and returns its messages once the response headers are in.
pub async fn stream_batches<S, B>(service: S, req: &StreamRequest, max_message: usize) -> Result<Messages<B>, Status>
where
    S: tower::Service<http::Request<Body>, Response = http::Response<B>>,
    S::Error: Into<BoxError>,
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    let len = req.encoded_len();
    let mut buf = BytesMut::with_capacity(PREFIX + len);
    buf.put_u8(0);
    buf.put_u32(u32::try_from(len).map_err(|_| Status::invalid_argument("stream request too large"))?);
    req.encode(&mut buf).map_err(|e| Status::internal(format!("encoding the stream request: {e}")))?;
    let request = http::Request::builder()
        .method(http::Method::POST)
        // The generated service's own name: the path cannot drift from the proto's package.
        .uri(format!("/{}/StreamBatches", shardstream_proto::shardstream_server::SERVICE_NAME))
        .header(http::header::CONTENT_TYPE, "application/grpc")
        .header(http::header::TE, "trailers")
        .body(Body::new(http_body_util::Full::new(buf.freeze())))
        .map_err(|e| Status::internal(format!("building the stream request: {e}")))?;
    let response = service.oneshot(request).await.map_err(|e| Status::from_error(e.into()))?;
    // A trailers-only answer (the daemon refused the request) carries its status in the headers.
    if let Some(status) = Status::from_header_map(response.headers()) {
        if status.code() != tonic::Code::Ok {
            return Err(status);
        }
    } else if response.status() != http::StatusCode::OK {
        return Err(Status::unknown(format!("the daemon answered HTTP {}", response.status())));
    }
    Ok(Messages {
        body: response.into_body(),
        chunks: VecDeque::new(),
        buffered: 0,
        max_message,
        ended: false,
        spare: Spare::default(),
    })
}

impl<B> Messages<B>
where
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    /// The next message; `None` once the daemon ended the call with status OK.
    pub async fn message(&mut self) -> Result<Option<StreamMessage>, Status> {
        use http_body_util::BodyExt;
        loop {
            if let Some(bytes) = self.take_message()? {
                return StreamMessage::decode(bytes)
                    .map(Some)
                    .map_err(|e| Status::internal(format!("malformed stream message: {e}")));
            }
            if self.ended {
                return Ok(None);
            }
            match self.body.frame().await {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => {
                        if !data.is_empty() {
                            self.buffered += data.len();
                            self.chunks.push_back(data);
                        }
                    }
                    Err(frame) => {
                        if let Ok(trailers) = frame.into_trailers() {
                            self.ended = true;
                            match Status::from_header_map(&trailers) {
                                Some(s) if s.code() == tonic::Code::Ok => {}
                                Some(s) => return Err(s),
                                None => return Err(no_status()),
                            }
                            if self.buffered != 0 {
                                return Err(Status::internal("the stream ended inside a message"));
                            }
                        }
                    }
                },
                // Keeps the error's source: a broken connection must still read as one.
                Some(Err(e)) => return Err(Status::from_error(e.into())),
                None => {
                    self.ended = true;
                    return Err(no_status());
                }
            }
        }
    }

    /// The next whole message's bytes, when all of them are in: a slice of the frame that holds
    /// it, or (across frames) a copy.
    fn take_message(&mut self) -> Result<Option<Bytes>, Status> {
        if self.buffered < PREFIX {
            return Ok(None);
        }
        let mut prefix = [0u8; PREFIX];
        let mut got = 0;
        for c in &self.chunks {
            let n = (PREFIX - got).min(c.len());
            prefix[got..got + n].copy_from_slice(&c[..n]);
            got += n;
            if got == PREFIX {
                break;
            }
        }
        if prefix[0] != 0 {
            return Err(Status::internal("a compressed message, which this client never asks for"));
        }
        let len = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize;
        if len > self.max_message {
            return Err(Status::out_of_range(format!(
                "a stream message of {len} bytes, over the limit of {}",
                self.max_message
            )));
        }
        if self.buffered < PREFIX + len {
            return Ok(None);
        }
        self.drain(PREFIX, |_| {})?;
        let front = self.chunks.front_mut().ok_or_else(lost)?;
        if front.len() >= len {
            let message = front.split_to(len);
            if front.is_empty() {
                self.chunks.pop_front();
            }
            self.buffered -= len;
            return Ok(Some(message));
        }
        let mut joined = self.spare.take(len);
        self.drain(len, |part| joined.extend_from_slice(part))?;
        Ok(Some(Bytes::from_owner(Pooled { buf: joined, spare: self.spare.clone() })))
    }

    /// Takes `n` buffered bytes off the front, handing each chunk's share of them to `sink`.
    fn drain(&mut self, mut n: usize, mut sink: impl FnMut(&[u8])) -> Result<(), Status> {
        self.buffered = self.buffered.checked_sub(n).ok_or_else(lost)?;
        while n > 0 {
            let front = self.chunks.front_mut().ok_or_else(lost)?;
            let k = n.min(front.len());
            sink(&front[..k]);
            front.advance(k);
            n -= k;
            if front.is_empty() {
                self.chunks.pop_front();
            }
        }
        Ok(())
    }
}

/// Buffers of messages joined across frames, back from batches the consumer dropped, for the
/// stream's next joins: a fresh buffer of a batch's size costs a page fault per 4 KiB page, which
/// profiles put at a fifth of the client's time on 1 MiB samples. Kept while the stream or one
/// of its batches lives; at most [`SPARE_BUFFERS`], none over [`SPARE_MAX_BYTES`].
#[derive(Clone, Default)]
struct Spare(std::sync::Arc<std::sync::Mutex<Vec<Vec<u8>>>>);

const SPARE_BUFFERS: usize = 8;
const SPARE_MAX_BYTES: usize = 64 << 20;

impl Spare {
    /// An empty buffer of at least `len` bytes' capacity: the smallest spare one that fits, else
    /// a new one with an eighth more, so that the stream's next batches, of about the same size,
    /// fit it too.
    fn take(&self, len: usize) -> Vec<u8> {
        let mut spare = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let fit = spare.iter().enumerate().filter(|(_, b)| b.capacity() >= len).min_by_key(|(_, b)| b.capacity());
        match fit.map(|(i, _)| i) {
            Some(i) => spare.swap_remove(i),
            None => Vec::with_capacity(len.saturating_add(len / 8)),
        }
    }

    /// Keeps `buf` for a later batch; a full pool gives up its smallest buffer for a larger one.
    fn give(&self, mut buf: Vec<u8>) {
        if buf.capacity() > SPARE_MAX_BYTES {
            return;
        }
        buf.clear();
        let mut spare = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if spare.len() < SPARE_BUFFERS {
            spare.push(buf);
        } else if let Some((i, _)) =
            spare.iter().enumerate().min_by_key(|(_, b)| b.capacity()).filter(|(_, b)| b.capacity() < buf.capacity())
        {
            spare[i] = buf;
        }
    }
}

/// A joined message's bytes; its buffer goes back to the stream's [`Spare`] when the last
/// `Bytes` of it drops.
struct Pooled {
    buf: Vec<u8>,
    spare: Spare,
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        self.spare.give(std::mem::take(&mut self.buf));
    }
}

/// The body ended, or its trailers came, without the call's status: gRPC requires one.
fn no_status() -> Status {
    Status::unknown("the stream ended without a grpc-status")
}

/// `buffered` counts more bytes than the chunks hold: a bug here, not the daemon's.
fn lost() -> Status {
    Status::internal("the stream reader lost count of its buffered bytes")
}

#[cfg(test)]
mod tests {
    use std::pin::Pin;
    use std::task::{Context, Poll};

    use http_body::Frame;
    use shardstream_proto::{InlineBatch, stream_message};

    use super::*;

    /// A response body that hands out the frames it was given, then ends.
    struct Frames(VecDeque<Result<Frame<Bytes>, Status>>);

    impl http_body::Body for Frames {
        type Data = Bytes;
        type Error = Status;
        fn poll_frame(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
            Poll::Ready(self.0.pop_front())
        }
    }

    fn batch(index: u64, data: &[u8]) -> StreamMessage {
        StreamMessage {
            kind: Some(stream_message::Kind::InlineBatch(InlineBatch {
                batch_index: index,
                data: Bytes::copy_from_slice(data),
                ..Default::default()
            })),
        }
    }

    fn framed(m: &StreamMessage) -> Vec<u8> {
        let body = m.encode_to_vec();
        let mut v = vec![0u8];
        v.extend_from_slice(&(body.len() as u32).to_be_bytes());
        v.extend_from_slice(&body);
        v
    }

    fn trailers(code: tonic::Code, message: &str) -> Frame<Bytes> {
        let mut h = http::HeaderMap::new();
        h.insert("grpc-status", (code as i32).to_string().parse().unwrap());
        h.insert("grpc-message", message.parse().unwrap());
        Frame::trailers(h)
    }

    fn messages(frames: Vec<Result<Frame<Bytes>, Status>>) -> Messages<Frames> {
        Messages {
            body: Frames(frames.into()),
            chunks: VecDeque::new(),
            buffered: 0,
            max_message: 1 << 20,
            ended: false,
            spare: Spare::default(),
        }
    }

    async fn all(mut m: Messages<Frames>) -> Result<Vec<StreamMessage>, Status> {
        let mut out = Vec::new();
        while let Some(x) = m.message().await? {
            out.push(x);
        }
        Ok(out)
    }

    fn data_of(m: &StreamMessage) -> &Bytes {
        match &m.kind {
            Some(stream_message::Kind::InlineBatch(b)) => &b.data,
            other => panic!("not an inline batch: {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_message_within_a_frame_shares_the_frames_bytes() {
        let sent = [batch(0, &[7; 5000]), batch(1, &[9; 3000])];
        let frame = Bytes::from([framed(&sent[0]), framed(&sent[1])].concat());
        let range = frame.as_ptr() as usize..frame.as_ptr() as usize + frame.len();
        let got = all(messages(vec![Ok(Frame::data(frame)), Ok(trailers(tonic::Code::Ok, ""))])).await.unwrap();
        assert_eq!(got, sent);
        for m in &got {
            let p = data_of(m).as_ptr() as usize;
            assert!(range.contains(&p), "the batch's data was copied out of its frame");
        }
    }

    #[tokio::test]
    async fn messages_and_prefixes_across_frames_are_joined() {
        let sent: Vec<StreamMessage> = (0..4).map(|i| batch(i, &vec![i as u8; 1000 + i as usize * 777])).collect();
        let wire: Vec<u8> = sent.iter().flat_map(framed).collect();
        // Cut everywhere: inside prefixes (1..5), inside bodies, one byte at a time at the start.
        let mut cuts = vec![1, 2, 3, 4, 5, 6, 700, 1005, 1006];
        cuts.extend((2000..wire.len()).step_by(911));
        cuts.push(wire.len());
        let mut frames = Vec::new();
        let mut at = 0;
        for c in cuts {
            frames.push(Ok(Frame::data(Bytes::copy_from_slice(&wire[at..c]))));
            at = c;
        }
        frames.push(Ok(trailers(tonic::Code::Ok, "")));
        assert_eq!(all(messages(frames)).await.unwrap(), sent);
    }

    #[tokio::test]
    async fn a_joined_buffer_is_reused_once_its_batch_is_dropped() {
        // Message sizes differ a little (the index's varint), as batches of a stream do.
        let sent: Vec<StreamMessage> = [1, 2, 300].iter().map(|&i| batch(i, &[i as u8; 4000])).collect();
        // Every message split in two frames, so that each is joined.
        let mut frames = Vec::new();
        for m in &sent {
            let wire = framed(m);
            frames.push(Ok(Frame::data(Bytes::copy_from_slice(&wire[..100]))));
            frames.push(Ok(Frame::data(Bytes::copy_from_slice(&wire[100..]))));
        }
        frames.push(Ok(trailers(tonic::Code::Ok, "")));
        let mut m = messages(frames);
        let first = m.message().await.unwrap().unwrap();
        let second = m.message().await.unwrap().unwrap();
        let (p1, p2) = (data_of(&first).as_ptr(), data_of(&second).as_ptr());
        assert_ne!(p1, p2, "two live batches share a buffer");
        assert_eq!(first, sent[0]);
        drop(first);
        let third = m.message().await.unwrap().unwrap();
        assert_eq!(third, sent[2]);
        assert_eq!(second, sent[1], "reusing a buffer overwrote a live batch");
        // The third message (one byte longer) landed in the first one's buffer: its data starts
        // one byte further in.
        assert_eq!(data_of(&third).as_ptr(), p1.wrapping_add(1), "the dropped batch's buffer was not reused");
        assert_eq!(m.message().await.unwrap(), None);
    }

    #[tokio::test]
    async fn the_daemons_status_in_the_trailers_is_the_error() {
        let frames = vec![
            Ok(Frame::data(Bytes::from(framed(&batch(0, b"x"))))),
            Ok(trailers(tonic::Code::PermissionDenied, "not allowed")),
        ];
        let mut m = messages(frames);
        assert_eq!(m.message().await.unwrap(), Some(batch(0, b"x")));
        let e = m.message().await.unwrap_err();
        assert_eq!((e.code(), e.message()), (tonic::Code::PermissionDenied, "not allowed"));
    }

    #[tokio::test]
    async fn an_end_without_status_or_inside_a_message_is_an_error() {
        let e = all(messages(vec![Ok(Frame::data(Bytes::from(framed(&batch(0, b"x")))))])).await.unwrap_err();
        assert!(e.message().contains("without a grpc-status"), "{e}");
        let mut cut = framed(&batch(0, b"abcdef"));
        cut.truncate(cut.len() - 2);
        let frames = vec![Ok(Frame::data(Bytes::from(cut))), Ok(trailers(tonic::Code::Ok, ""))];
        let e = all(messages(frames)).await.unwrap_err();
        assert!(e.message().contains("inside a message"), "{e}");
    }

    #[tokio::test]
    async fn oversized_compressed_and_malformed_messages_are_refused() {
        let mut big = vec![0u8];
        big.extend_from_slice(&(2u32 << 20).to_be_bytes());
        let e = all(messages(vec![Ok(Frame::data(Bytes::from(big)))])).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::OutOfRange, "{e}");
        let mut compressed = framed(&batch(0, b"x"));
        compressed[0] = 1;
        let e = all(messages(vec![Ok(Frame::data(Bytes::from(compressed)))])).await.unwrap_err();
        assert!(e.message().contains("compressed"), "{e}");
        let garbage = [0u8, 0, 0, 0, 3, 0xff, 0xff, 0xff];
        let e = all(messages(vec![Ok(Frame::data(Bytes::copy_from_slice(&garbage)))])).await.unwrap_err();
        assert!(e.message().contains("malformed"), "{e}");
    }

    #[tokio::test]
    async fn a_broken_body_keeps_its_error() {
        let frames = vec![Err(Status::unavailable("connection reset"))];
        let e = all(messages(frames)).await.unwrap_err();
        assert_eq!((e.code(), e.message()), (tonic::Code::Unavailable, "connection reset"));
    }
}
