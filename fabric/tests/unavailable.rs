//! Without libfabric everything still builds and runs, and the error says why `rdma` cannot be
//! had. (Its own test binary: the library is loaded once per process.)

#[test]
fn missing_library_is_a_named_error() {
    // SAFETY: set before any thread of this test binary reads the environment.
    unsafe { std::env::set_var(shardstream_fabric::LIBFABRIC_ENV, "/nonexistent/libfabric.so.1") };
    let err = shardstream_fabric::Fabric::open(Some("tcp")).err().expect("no library, no fabric");
    let msg = err.to_string();
    assert!(msg.contains("libfabric is not available"), "{msg}");
    assert!(msg.contains("/nonexistent/libfabric.so.1"), "{msg}");
    assert!(msg.contains("libfabric1"), "{msg}");
}
