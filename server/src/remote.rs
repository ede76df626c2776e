//! Security of TCP listeners: TLS, bearer tokens, and the rule that plaintext is for loopback only.
//!
//! A Unix socket is guarded by its file mode and SO_PEERCRED; a TCP port by nothing of the kind,
//! so a TCP listener must have TLS (`--tls-cert`/`--tls-key`) and a way to tell who connects:
//! bearer tokens (`--tokens`, each with a name that the `allow` list can match) and/or client
//! certificates signed by `--tls-client-ca` (mutual TLS). Plaintext TCP is refused unless the
//! operator says `--insecure` AND the address is loopback; tokens are still checked then when a
//! token file is given. Everything is read and checked when the daemon starts, with the file named
//! in the error, never at the first request.
//!
//! Tokens never appear in logs or errors: the token file's errors name the line, not its text; a
//! refused request is told "missing or wrong bearer token" and nothing else. A presented token is
//! compared with every known token as SHA-256 digests in constant time, so neither the time taken
//! nor an early exit says how much of it matched.

use std::net::{IpAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use subtle::ConstantTimeEq;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};
use tokio_rustls::rustls::{self, RootCertStore, ServerConfig, crypto::CryptoProvider};

use crate::{Error, Result};

/// The metadata key a client sends its token in, as `Bearer <token>`.
pub const AUTHORIZATION: &str = "authorization";

/// Shortest token accepted in a token file: shorter ones are guessable.
pub const MIN_TOKEN_LEN: usize = 16;

/// The operator's settings (flags or config keys), before they are checked.
#[derive(Debug, Clone)]
pub struct RemoteOptions {
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub tls_client_ca: Option<PathBuf>,
    pub token_file: Option<PathBuf>,
    pub insecure: bool,
    /// How long a TCP client may stay silent before it is pinged, and the ping's answer waited
    /// for (`--tcp-timeout`).
    pub tcp_timeout: std::time::Duration,
}

/// Checked settings of a TCP listener.
#[derive(Clone, Default)]
pub struct RemoteSecurity {
    /// TLS for the listener (the daemon does the handshake itself, [`crate::accept`]); `None`
    /// only with `--insecure` on loopback.
    pub tls: Option<Arc<ServerConfig>>,
    /// Known tokens; `None`: no token is asked for (mutual TLS, or `--insecure` without a file).
    pub tokens: Option<Arc<Tokens>>,
    /// Client certificates are required (and verified against the client CA).
    pub mutual_tls: bool,
}

impl std::fmt::Debug for RemoteSecurity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteSecurity")
            .field("tls", &self.tls.is_some())
            .field("tokens", &self.tokens.as_ref().map(|t| t.len()))
            .field("mutual_tls", &self.mutual_tls)
            .finish()
    }
}

impl Default for RemoteOptions {
    fn default() -> Self {
        Self {
            tls_cert: None,
            tls_key: None,
            tls_client_ca: None,
            token_file: None,
            insecure: false,
            tcp_timeout: shardstream_client::TCP_TIMEOUT,
        }
    }
}

impl RemoteOptions {
    /// True when any TCP-only option is set (for a warning on a Unix listener).
    pub fn any(&self) -> bool {
        self.tls_cert.is_some()
            || self.tls_key.is_some()
            || self.tls_client_ca.is_some()
            || self.token_file.is_some()
            || self.insecure
    }

    /// Checks the options for a TCP listener on `host_port` and reads the files they name.
    pub fn check(&self, host_port: &str) -> Result<RemoteSecurity> {
        let bad = |msg: String| Error::invalid(format!("TCP listener {host_port}: {msg}"));
        let tokens = self.token_file.as_deref().map(Tokens::load).transpose()?.map(Arc::new);
        match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => {
                let (cert_pem, key_pem) = (read("--tls-cert", cert)?, read("--tls-key", key)?);
                let ca_pem = self.tls_client_ca.as_deref().map(|ca| read("--tls-client-ca", ca)).transpose()?;
                if tokens.is_none() && ca_pem.is_none() {
                    return Err(bad("TLS alone does not say who may connect: give --tokens (bearer \
                                    tokens) or --tls-client-ca (client certificates), or both"
                        .into()));
                }
                // Parsed now, so a bad certificate, key or CA stops the daemon at start.
                let verifier = match (&self.tls_client_ca, &ca_pem) {
                    (Some(ca), Some(pem)) => Some(
                        client_verifier(pem)
                            .map_err(|e| bad(format!("bad client CA certificate ({}): {e}", ca.display())))?,
                    ),
                    _ => None,
                };
                let tls = server_config(&cert_pem, &key_pem, verifier).map_err(|e| {
                    bad(format!("bad TLS certificate or key ({}, {}): {e}", cert.display(), key.display()))
                })?;
                Ok(RemoteSecurity { tls: Some(Arc::new(tls)), tokens, mutual_tls: ca_pem.is_some() })
            }
            (Some(_), None) | (None, Some(_)) => Err(bad("--tls-cert and --tls-key go together".into())),
            (None, None) => {
                if self.tls_client_ca.is_some() {
                    return Err(bad("--tls-client-ca needs TLS: give --tls-cert and --tls-key too".into()));
                }
                if !self.insecure {
                    return Err(bad("refusing plaintext TCP: give --tls-cert and --tls-key (with --tokens \
                                    or --tls-client-ca), or --insecure for a loopback address"
                        .into()));
                }
                if !is_loopback(host_port) {
                    return Err(bad("--insecure (plaintext) is allowed only on a loopback address \
                                    (127.0.0.0/8, ::1, localhost); use TLS for any other address"
                        .into()));
                }
                Ok(RemoteSecurity { tls: None, tokens, mutual_tls: false })
            }
        }
    }
}

/// The crypto provider tonic's own TLS set-up would use: the process default if something installed
/// one, else ring (the only provider built in: tonic's `tls-ring`, and deny.toml bans aws-lc).
fn provider() -> Arc<CryptoProvider> {
    CryptoProvider::get_default().cloned().unwrap_or_else(|| Arc::new(rustls::crypto::ring::default_provider()))
}

/// Client certificates required and verified against the CAs in `ca_pem` (`--tls-client-ca`), as
/// tonic 0.14's `ServerTlsConfig::client_ca_root` without `client_auth_optional` did: a client
/// without a certificate is refused in the handshake. Unparsable certificates in the file are
/// skipped, as tonic did; a file with none is an error.
fn client_verifier(ca_pem: &[u8]) -> std::result::Result<Arc<dyn rustls::server::danger::ClientCertVerifier>, String> {
    let certs = CertificateDer::pem_slice_iter(ca_pem)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())?;
    let mut roots = RootCertStore::empty();
    roots.add_parsable_certificates(certs);
    rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
        .build()
        .map_err(|e| e.to_string())
}

/// The TLS configuration of a TCP listener, the one tonic 0.14 built from a `ServerTlsConfig` with
/// this identity (its `TlsAcceptor::new`): the default protocol versions (TLS 1.2 and 1.3), the
/// certificate chain and key, ALPN `h2`, and client certificates as `client_verifier` says (none
/// asked without a client CA). Built here because the daemon does the TLS accept itself
/// ([`crate::accept`]), with a deadline tonic's accept lacks.
fn server_config(
    cert_pem: &[u8],
    key_pem: &[u8],
    client_verifier: Option<Arc<dyn rustls::server::danger::ClientCertVerifier>>,
) -> std::result::Result<ServerConfig, String> {
    let chain = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| format!("certificate: {e}"))?;
    if chain.is_empty() {
        return Err("no certificate (PEM \"BEGIN CERTIFICATE\") in the certificate file".into());
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| format!("private key: {e}"))?;
    let builder = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?;
    let builder = match client_verifier {
        Some(v) => builder.with_client_cert_verifier(v),
        None => builder.with_no_client_auth(),
    };
    let mut config = builder.with_single_cert(chain, key).map_err(|e| e.to_string())?;
    config.alpn_protocols.push(b"h2".to_vec());
    Ok(config)
}

/// The file the option `flag` names; an error names both (a bare "not found" left the user to
/// guess which of three files it was).
fn read(flag: &str, path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| Error::invalid(format!("{flag} {}: cannot read it: {e}", path.display())))
}

/// True when every address `host:port` names is a loopback address.
pub fn is_loopback(host_port: &str) -> bool {
    let Some((host, _)) = host_port.rsplit_once(':') else { return false };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if let Ok(ip) = host.parse::<IpAddr>() {
        return ip.is_loopback();
    }
    // A name: every address it resolves to must be loopback (`localhost` normally is).
    match host_port.to_socket_addrs() {
        Ok(addrs) => {
            let addrs: Vec<_> = addrs.collect();
            !addrs.is_empty() && addrs.iter().all(|a| a.ip().is_loopback())
        }
        Err(_) => false,
    }
}

/// The token file: one `NAME:TOKEN` per line; blank lines and `#` comments are skipped. The name
/// is what the `allow` list's `client` key matches.
pub struct Tokens {
    /// (name, SHA-256 of the token).
    entries: Vec<(String, [u8; 32])>,
}

impl Tokens {
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io("cannot read token file", path, e))?;
        Self::parse(&text).map_err(|e| Error::invalid(format!("token file {}: {e}", path.display())))
    }

    /// Parses a token file's text. Errors name the line number, never its content.
    pub fn parse(text: &str) -> std::result::Result<Self, String> {
        let mut entries: Vec<(String, [u8; 32])> = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let n = i + 1;
            let (name, token) = line.split_once(':').ok_or_else(|| format!("line {n}: expected NAME:TOKEN"))?;
            let (name, token) = (name.trim(), token.trim());
            if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.@".contains(c)) {
                return Err(format!("line {n}: the name must be letters, digits, '-', '_', '.' or '@'"));
            }
            if token.len() < MIN_TOKEN_LEN || !token.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(format!(
                    "line {n}: the token must be at least {MIN_TOKEN_LEN} printable ASCII characters without spaces"
                ));
            }
            if entries.iter().any(|(m, _)| m == name) {
                return Err(format!("line {n}: the name {name:?} appears twice"));
            }
            let digest = digest(token.as_bytes());
            if entries.iter().any(|(_, d)| bool::from(d.ct_eq(&digest))) {
                return Err(format!("line {n}: the same token is given to two names"));
            }
            entries.push((name.to_owned(), digest));
        }
        if entries.is_empty() {
            return Err("no tokens (expected NAME:TOKEN lines)".into());
        }
        Ok(Self { entries })
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The name of the token `presented`, if it is one. Looks at every entry whatever matches.
    pub fn identify(&self, presented: &[u8]) -> Option<&str> {
        let d = digest(presented);
        let mut found = None;
        for (name, known) in &self.entries {
            if bool::from(known.ct_eq(&d)) {
                found = Some(name.as_str());
            }
        }
        found
    }
}

fn digest(bytes: &[u8]) -> [u8; 32] {
    let mut out = [0u8; 32];
    out.copy_from_slice(ring::digest::digest(&ring::digest::SHA256, bytes).as_ref());
    out
}

/// Who a request over TCP came from, put into its extensions by [`Authenticator`]: the token's
/// name; without tokens, the subject CN of the client certificate (mutual TLS); `None` when
/// neither says (`--insecure` without a token file, a certificate without a CN).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteClient {
    pub name: Option<String>,
}

/// Checks every request's bearer token (TCP listeners with a token file), before the request is
/// decoded further. On a Unix listener it does nothing.
#[derive(Clone, Default)]
pub struct Authenticator {
    /// `None`: a Unix listener (SO_PEERCRED and the socket's mode apply instead).
    tcp: Option<Option<Arc<Tokens>>>,
    /// The refusals' warning: a peer without a token sends as many requests as it likes.
    refused_warn: Arc<crate::accept::Throttle>,
}

impl Authenticator {
    /// For a Unix listener.
    pub fn unix() -> Self {
        Self { tcp: None, refused_warn: Arc::default() }
    }

    /// For a TCP listener; `tokens`: the token file, if one is required.
    pub fn tcp(tokens: Option<Arc<Tokens>>) -> Self {
        Self { tcp: Some(tokens), refused_warn: Arc::default() }
    }
}

impl tonic::service::Interceptor for Authenticator {
    fn call(&mut self, mut request: tonic::Request<()>) -> std::result::Result<tonic::Request<()>, tonic::Status> {
        let Some(tokens) = &self.tcp else { return Ok(request) };
        let Some(tokens) = tokens else {
            // No tokens: a mutual-TLS client is known by its certificate's subject CN (rustls
            // verified the certificate against --tls-client-ca before any request).
            let name = request
                .peer_certs()
                .and_then(|certs| certs.first().and_then(|c| crate::cert_name::subject_common_name(c)));
            request.extensions_mut().insert(RemoteClient { name });
            return Ok(request);
        };
        let presented = request
            .metadata()
            .get(AUTHORIZATION)
            .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
            .map(|t| t.trim_ascii().to_vec());
        match presented.as_deref().and_then(|t| tokens.identify(t)) {
            Some(name) => {
                let name = name.to_owned();
                request.extensions_mut().insert(RemoteClient { name: Some(name) });
                Ok(request)
            }
            None => {
                let peer = request.remote_addr().map(|a| a.to_string()).unwrap_or_else(|| "?".into());
                crate::accept::throttled_warn!(
                    self.refused_warn,
                    %peer,
                    presented = presented.is_some(),
                    "request refused: missing or wrong bearer token"
                );
                Err(tonic::Status::unauthenticated(
                    "missing or wrong bearer token: this daemon requires one on TCP \
                     (set SHARDSTREAM_TOKEN_FILE to a file holding the token)",
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use tonic::service::Interceptor;

    use super::*;

    const SECRET: &str = "s3cr3t-t0ken-0123456789";

    #[test]
    fn token_file_is_parsed_and_errors_never_show_a_token() {
        let t =
            Tokens::parse(&format!("# trainers\n\ntrainer-a:{SECRET}\n trainer-b : another-token-abcdef \n")).unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(t.identify(SECRET.as_bytes()), Some("trainer-a"));
        assert_eq!(t.identify(b"another-token-abcdef"), Some("trainer-b"));
        assert_eq!(t.identify(b"s3cr3t-t0ken-012345678"), None, "a prefix is not the token");
        assert_eq!(t.identify(b""), None);
        for (text, want) in [
            (format!("{SECRET}\n"), "line 1: expected NAME:TOKEN"),
            ("a:short\n".to_owned(), "line 1: the token must be"),
            (format!("a:{SECRET}\na:{SECRET}x\n"), "line 2: the name \"a\" appears twice"),
            (format!("a:{SECRET}\nb:{SECRET}\n"), "line 2: the same token"),
            (format!("bad name:{SECRET}\n"), "line 1: the name must be"),
            ("# nothing\n".to_owned(), "no tokens"),
        ] {
            let e = Tokens::parse(&text).err().unwrap();
            assert!(e.contains(want), "{text:?}: {e}");
            assert!(!e.contains(SECRET) && !e.contains("short"), "the error shows the token: {e}");
        }
    }

    #[test]
    fn plaintext_only_with_insecure_on_loopback() {
        let insecure = RemoteOptions { insecure: true, ..Default::default() };
        assert!(insecure.check("127.0.0.1:7000").is_ok());
        assert!(insecure.check("[::1]:7000").is_ok());
        assert!(insecure.check("localhost:7000").is_ok());
        for addr in ["0.0.0.0:7000", "10.1.2.3:7000", "[::]:7000"] {
            let e = insecure.check(addr).unwrap_err().to_string();
            assert!(e.contains("only on a loopback address") && e.contains(addr), "{e}");
        }
        let e = RemoteOptions::default().check("127.0.0.1:7000").unwrap_err().to_string();
        assert!(e.contains("refusing plaintext TCP") && e.contains("--insecure"), "{e}");
        let half = RemoteOptions { tls_cert: Some("/c".into()), ..Default::default() };
        assert!(half.check("127.0.0.1:1").unwrap_err().to_string().contains("go together"));
        let ca_only = RemoteOptions { tls_client_ca: Some("/c".into()), insecure: true, ..Default::default() };
        assert!(ca_only.check("127.0.0.1:1").unwrap_err().to_string().contains("needs TLS"));
    }

    #[test]
    fn missing_files_are_named() {
        let o = RemoteOptions {
            tls_cert: Some("/nonexistent/cert.pem".into()),
            tls_key: Some("/nonexistent/key.pem".into()),
            tls_client_ca: Some("/nonexistent/ca.pem".into()),
            ..Default::default()
        };
        let e = o.check("0.0.0.0:1").unwrap_err().to_string();
        assert!(e.contains("--tls-cert /nonexistent/cert.pem: cannot read it"), "{e}");
        let o = RemoteOptions { token_file: Some("/nonexistent/tokens".into()), insecure: true, ..Default::default() };
        assert!(o.check("127.0.0.1:1").unwrap_err().to_string().contains("/nonexistent/tokens"));
    }

    #[test]
    fn files_without_pem_are_refused_at_start_naming_them() {
        let dir = tempfile::tempdir().unwrap();
        let junk = dir.path().join("junk.pem");
        std::fs::write(&junk, "not PEM\n").unwrap();
        let tokens = dir.path().join("tokens");
        std::fs::write(&tokens, format!("trainer-a:{SECRET}\n")).unwrap();
        let tls = RemoteOptions {
            tls_cert: Some(junk.clone()),
            tls_key: Some(junk.clone()),
            token_file: Some(tokens),
            ..Default::default()
        };
        let e = tls.check("0.0.0.0:1").unwrap_err().to_string();
        assert!(e.contains("bad TLS certificate or key") && e.contains("junk.pem"), "{e}");
        let mutual = RemoteOptions { tls_client_ca: Some(junk.clone()), ..tls };
        let e = mutual.check("0.0.0.0:1").unwrap_err().to_string();
        assert!(e.contains("bad client CA certificate (") && e.contains("junk.pem"), "{e}");
    }

    fn request(auth: Option<&str>) -> tonic::Request<()> {
        let mut r = tonic::Request::new(());
        if let Some(a) = auth {
            r.metadata_mut().insert(AUTHORIZATION, a.parse().unwrap());
        }
        r
    }

    #[test]
    fn interceptor_names_the_client_or_refuses_without_echoing() {
        let tokens = Arc::new(Tokens::parse(&format!("trainer-a:{SECRET}\n")).unwrap());
        let mut auth = Authenticator::tcp(Some(tokens));
        let ok = auth.call(request(Some(&format!("Bearer {SECRET}")))).unwrap();
        assert_eq!(ok.extensions().get::<RemoteClient>(), Some(&RemoteClient { name: Some("trainer-a".into()) }));
        for bad in [None, Some("Bearer wrong-token-0123456789"), Some(SECRET), Some("Basic abc")] {
            let s = auth.call(request(bad)).unwrap_err();
            assert_eq!(s.code(), tonic::Code::Unauthenticated);
            assert!(!s.message().contains("wrong-token") && !s.message().contains(SECRET), "{}", s.message());
        }
        // Unix listeners: no token asked, no identity added.
        let r = Authenticator::unix().call(request(None)).unwrap();
        assert!(r.extensions().get::<RemoteClient>().is_none());
        // TCP without tokens (mutual TLS): an anonymous remote client.
        let r = Authenticator::tcp(None).call(request(None)).unwrap();
        assert_eq!(r.extensions().get::<RemoteClient>(), Some(&RemoteClient { name: None }));
    }
}
