//! Generates the gRPC code from `proto/shardstream.proto` with `protox` (a pure-Rust protobuf
//! compiler), so building needs no system `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    const PROTO: &str = "proto/shardstream.proto";
    println!("cargo:rerun-if-changed={PROTO}");
    let fds = protox::compile([PROTO], ["proto"])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        // Batch payloads decode into `Bytes` that share the receive buffer instead of a fresh Vec
        // (and an rdma client hands an Arrow batch's ring slot on as `Bytes` too).
        .bytes(".shardstream.v1.InlineBatch.data")
        .bytes(".shardstream.v1.ArrowBatch.data")
        .bytes(".shardstream.v1.PackedBatch.key_bytes")
        .compile_fds(fds)?;
    Ok(())
}
