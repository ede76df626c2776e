//! TLS toward S3 stores: what the client trusts (the system's roots and `AWS_CA_BUNDLE`), whether
//! the endpoint the SDK resolves is HTTPS (a store answering over TLS has each answer's bytes
//! checked in transit, which decides how Parquet copies are made: `service::projected`), and
//! telling a refused handshake, which no retry mends, from a network failure.

use std::path::Path;

use aws_smithy_http_client::tls::{TlsContext, TrustStore};
use base64::Engine;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::CertificateDer;
use tokio_rustls::rustls::pki_types::pem::PemObject;

use crate::{Error, Result};

/// The client's TLS settings: the system's roots, and the certificates of `AWS_CA_BUNDLE`
/// besides them (boto3 and the AWS CLI trust that file instead of the defaults; the daemon adds
/// it, so a bundle of the site's CA alone still reaches AWS itself).
pub(super) async fn context() -> Result<TlsContext> {
    let mut trust = TrustStore::default();
    if let Some(pem) = ca_bundle().await? {
        trust = trust.with_pem_certificate(pem);
    }
    TlsContext::builder()
        .with_trust_store(trust)
        .build()
        .map_err(|e| Error::invalid(format!("TLS settings for S3: {}", shardstream_client::error_chain(&e))))
}

/// The S3 endpoint the SDK will use, or None for AWS's own: the client configuration's
/// ([`S3Options::endpoint`](super::s3::S3Options::endpoint)), else the S3-specific one
/// (`AWS_ENDPOINT_URL_S3`, a profile's `services` section), else the general one
/// (`AWS_ENDPOINT_URL`, a profile's `endpoint_url`): the precedence of
/// `aws_sdk_s3::config::Builder::from`.
pub(super) fn endpoint(sdk: &aws_config::SdkConfig) -> Option<String> {
    if sdk.get_origin("endpoint_url").is_client_config() {
        return sdk.endpoint_url().map(str::to_owned);
    }
    let key = aws_types::service_config::ServiceConfigKey::builder()
        .service_id("S3")
        .env("AWS_ENDPOINT_URL")
        .profile("endpoint_url")
        .build()
        .ok()?;
    sdk.service_config().and_then(|c| c.load_config(key)).or_else(|| sdk.endpoint_url().map(str::to_owned))
}

/// Whether `endpoint` is an HTTPS URL (AWS's own endpoints, used when none is set, always are).
pub(super) fn is_https(endpoint: &str) -> bool {
    endpoint.trim_start().get(..8).is_some_and(|scheme| scheme.eq_ignore_ascii_case("https://"))
}

/// The certificates of `AWS_CA_BUNDLE` that can be trusted, as PEM, or None when it is not set.
/// Checked here: the SDK panics on a certificate it cannot parse, at the first connection.
async fn ca_bundle() -> Result<Option<Vec<u8>>> {
    let Some(path) = std::env::var_os("AWS_CA_BUNDLE").filter(|p| !p.is_empty()) else {
        return Ok(None);
    };
    let shown = Path::new(&path).display().to_string();
    let bad = |why: String| Error::invalid(format!("AWS_CA_BUNDLE={shown}: {why}"));
    // Read on the runtime's blocking pool: `S3Store::connect` is async.
    let pem = tokio::fs::read(&path).await.map_err(|e| bad(format!("cannot be read: {e}")))?;
    let (kept, skipped) = trusted_certificates(&pem).map_err(bad)?;
    if skipped > 0 {
        // A system bundle with the site's CA appended may hold a few roots rustls refuses: the
        // others still count, as the system's own roots do.
        tracing::warn!(bundle = %shown, skipped, "AWS_CA_BUNDLE: certificates that cannot be trusted as roots are left out");
    }
    Ok(Some(kept))
}

/// The certificates of PEM `pem` that rustls accepts as roots (re-encoded as PEM) and how many
/// it refused; an error when the file is no PEM or none is accepted.
fn trusted_certificates(pem: &[u8]) -> std::result::Result<(Vec<u8>, usize), String> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| format!("not PEM certificates: {e}"))?;
    if certs.is_empty() {
        return Err("holds no PEM certificate (-----BEGIN CERTIFICATE-----)".into());
    }
    let (mut kept, mut skipped, mut first_refusal) = (Vec::new(), 0, None);
    for cert in certs {
        match rustls::RootCertStore::empty().add(cert.clone()) {
            Ok(()) => kept.push(cert),
            Err(e) => {
                skipped += 1;
                first_refusal.get_or_insert(e);
            }
        }
    }
    if kept.is_empty() {
        let why = first_refusal.map(|e| e.to_string()).unwrap_or_default();
        return Err(format!("none of its {skipped} certificates can be trusted as a root: {why}"));
    }
    let mut out = Vec::new();
    for cert in &kept {
        let b64 = base64::engine::general_purpose::STANDARD.encode(cert.as_ref());
        out.extend_from_slice(b"-----BEGIN CERTIFICATE-----\n");
        for line in b64.as_bytes().chunks(64) {
            out.extend_from_slice(line);
            out.push(b'\n');
        }
        out.extend_from_slice(b"-----END CERTIFICATE-----\n");
    }
    Ok((out, skipped))
}

/// What the TLS handshake with the store refused, said for a user, when that is among `err`'s
/// causes.
pub(super) fn handshake_refused(err: &(dyn std::error::Error + 'static)) -> Option<&'static str> {
    use rustls::Error as Tls;
    causes(err).filter_map(|e| e.downcast_ref::<Tls>()).find_map(|e| match e {
        Tls::InvalidCertificate(_) | Tls::InvalidCertRevocationList(_) => Some(
            "the store's TLS certificate is not trusted (AWS_CA_BUNDLE names a file of CA certificates to \
             trust besides the system's)",
        ),
        Tls::NoCertificatesPresented => Some("the store presented no TLS certificate"),
        Tls::PeerIncompatible(_) | Tls::UnsupportedNameType => {
            Some("the store speaks no TLS version or cipher suite this client offers (TLS 1.2 or 1.3, AEAD suites)")
        }
        _ => None,
    })
}

/// `err` and its causes, including the error an `io::Error` wraps (whose `source` skips it).
pub(super) fn causes<'a>(
    err: &'a (dyn std::error::Error + 'static),
) -> impl Iterator<Item = &'a (dyn std::error::Error + 'static)> {
    let mut next = Some(err);
    std::iter::from_fn(move || {
        let e = next?;
        next = match e.downcast_ref::<std::io::Error>().and_then(std::io::Error::get_ref) {
            Some(inner) => Some(inner as &(dyn std::error::Error + 'static)),
            None => e.source(),
        };
        Some(e)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_cross_tls_only_from_an_https_endpoint() {
        assert!(is_https("https://s3.example.com"));
        assert!(is_https("HTTPS://minio.local:9000/"));
        assert!(!is_https("http://127.0.0.1:9000"));
        assert!(!is_https("https:/typo"));
        assert!(!is_https("s3.example.com"));
    }

    #[test]
    fn a_ca_bundle_without_a_usable_certificate_is_refused_before_any_connection() {
        let no_pem = trusted_certificates(b"just some text\n").unwrap_err();
        assert!(no_pem.contains("no PEM certificate"), "{no_pem}");
        let key_only =
            trusted_certificates(b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n").unwrap_err();
        assert!(key_only.contains("no PEM certificate"), "{key_only}");
        // Base64 that decodes, DER that does not parse: the SDK would have panicked on it.
        let garbage =
            trusted_certificates(b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n").unwrap_err();
        assert!(garbage.contains("none of its 1 certificates"), "{garbage}");
        let broken =
            trusted_certificates(b"-----BEGIN CERTIFICATE-----\n!!!!\n-----END CERTIFICATE-----\n").unwrap_err();
        assert!(broken.contains("not PEM"), "{broken}");
    }

    #[test]
    fn the_s3_endpoint_is_the_one_the_sdk_resolves() {
        use aws_types::origin::Origin;
        use aws_types::service_config::{LoadServiceConfig, ServiceConfigKey};

        #[derive(Debug)]
        struct Env(&'static [(&'static str, &'static str)]);
        impl LoadServiceConfig for Env {
            fn load_config(&self, key: ServiceConfigKey<'_>) -> Option<String> {
                let wanted = format!("{}_{}", key.env(), key.service_id().to_uppercase());
                self.0.iter().find(|(k, _)| *k == wanted).map(|(_, v)| (*v).to_owned())
            }
        }
        let general = || aws_types::SdkConfig::builder().endpoint_url("http://general:9000");
        // The S3-specific setting wins over the general one, as in the SDK.
        let specific = general().service_config(Env(&[("AWS_ENDPOINT_URL_S3", "https://s3only:9000")])).build();
        assert_eq!(endpoint(&specific).as_deref(), Some("https://s3only:9000"));
        // Without one, the general setting.
        assert_eq!(endpoint(&general().service_config(Env(&[])).build()).as_deref(), Some("http://general:9000"));
        // The client's own configuration (`S3Options::endpoint`) wins over both.
        let mut client = general().service_config(Env(&[("AWS_ENDPOINT_URL_S3", "https://s3only:9000")]));
        client.insert_origin("endpoint_url", Origin::shared_config());
        assert_eq!(endpoint(&client.build()).as_deref(), Some("http://general:9000"));
        // None set: AWS's own, always HTTPS.
        assert_eq!(endpoint(&aws_types::SdkConfig::builder().build()), None);
    }
}
