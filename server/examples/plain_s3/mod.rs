//! The "plain client" of the S3 benchmarks (`s3_fetch`, `s3_put`): aws-sdk-s3 as a user would set
//! it up, from the standard environment (`AWS_ENDPOINT_URL`, credentials), path-style addressing,
//! and none of shardstream's own storage code, so what it measures is what the server delivers.

/// A client from the environment, with the same TLS stack as the daemon (rustls with ring).
pub async fn client() -> aws_sdk_s3::Client {
    let http = aws_smithy_http_client::Builder::new()
        .tls_provider(aws_smithy_http_client::tls::Provider::Rustls(
            aws_smithy_http_client::tls::rustls_provider::CryptoMode::Ring,
        ))
        .build_https();
    let sdk = aws_config::defaults(aws_config::BehaviorVersion::latest()).http_client(http).load().await;
    let conf = aws_sdk_s3::config::Builder::from(&sdk).force_path_style(true).build();
    aws_sdk_s3::Client::from_conf(conf)
}
