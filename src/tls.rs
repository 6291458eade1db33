//! TLS, where users need it: to a managed Redis (`rediss://`, the feed),
//! and on the scoring port for deployments that cross untrusted networks
//! (`[tls]`, served by `src/shard/tls_stream.rs`; spoken by the client and the
//! load generator).
//!
//! This module holds what both ends share and no runtime: the settings,
//! the rustls configurations built from PEM files, and a blocking stream
//! for `std::net` clients. Every configuration uses rustls on ring with its
//! safe defaults (TLS 1.2 and 1.3, no renegotiation, no compression).
//! Configurations are built once at start-up or connect, so a certificate
//! problem is a clear error there, never a failure of the first request.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use serde::{Deserialize, Serialize};

/// How a client speaks TLS to a server (Redis, or a Quiver scoring port).
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ClientTls {
    /// PEM file of the CA certificates to trust instead of the system's.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate chain and its key, for servers that verify
    /// clients (Redis `tls-auth-clients yes`, Quiver `tls.client_ca_file`).
    #[serde(default)]
    pub cert_file: Option<PathBuf>,
    #[serde(default)]
    pub key_file: Option<PathBuf>,
    /// The name the server's certificate must carry; default: the host.
    #[serde(default)]
    pub server_name: Option<String>,
}

/// `[tls]`: the scoring port speaks TLS only (plain TCP stays the default,
/// without the section).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ServerTls {
    /// PEM certificate chain, the server's own certificate first.
    pub cert_file: PathBuf,
    /// PEM private key of that certificate (PKCS#8, PKCS#1 or SEC1).
    pub key_file: PathBuf,
    /// With it, clients must present a certificate this CA signed (mutual
    /// TLS); without it, any client may connect.
    #[serde(default)]
    pub client_ca_file: Option<PathBuf>,
    /// A connection that has not finished its handshake within this is
    /// closed: a client that stalls mid-handshake holds a connection slot
    /// for no longer.
    #[serde(default = "default_handshake_timeout_ms")]
    pub handshake_timeout_ms: u64,
    /// New TLS handshakes a shard starts per second, after a burst of
    /// `handshake_burst`: each costs its reactor about 360 µs of CPU
    /// (docs/BENCHMARKS.md), so a reconnect storm or a flood of handshakes
    /// would otherwise take the shard from the requests it serves. Over
    /// the rate, a new connection is closed before its handshake (clients
    /// retry); connections already open are never affected.
    #[serde(default = "default_handshakes_per_s_max")]
    pub handshakes_per_s_max: u32,
    #[serde(default = "default_handshake_burst")]
    pub handshake_burst: u32,
}

/// The default `handshakes_per_s_max`: at most about a tenth of a core.
pub const HANDSHAKES_PER_S_MAX_DEFAULT: u32 = 250;
/// The default `handshake_burst`: a fleet's connections at start-up.
pub const HANDSHAKE_BURST_DEFAULT: u32 = 100;

fn default_handshakes_per_s_max() -> u32 {
    HANDSHAKES_PER_S_MAX_DEFAULT
}

fn default_handshake_burst() -> u32 {
    HANDSHAKE_BURST_DEFAULT
}

/// The default `handshake_timeout_ms`.
pub const HANDSHAKE_TIMEOUT_MS_DEFAULT: u64 = 2_000;

fn default_handshake_timeout_ms() -> u64 {
    HANDSHAKE_TIMEOUT_MS_DEFAULT
}

/// Longest `handshake_timeout_ms` accepted.
pub const HANDSHAKE_TIMEOUT_MS_MAX: u64 = 60_000;

impl ServerTls {
    pub fn validate(&self) -> Result<(), String> {
        if !(1..=HANDSHAKE_TIMEOUT_MS_MAX).contains(&self.handshake_timeout_ms) {
            return Err(format!(
                "tls.handshake_timeout_ms = {} is outside 1..={HANDSHAKE_TIMEOUT_MS_MAX}",
                self.handshake_timeout_ms
            ));
        }
        if !(1..=1_000_000).contains(&self.handshakes_per_s_max) {
            return Err(format!("tls.handshakes_per_s_max = {} is outside 1..=1000000", self.handshakes_per_s_max));
        }
        if !(1..=1_000_000).contains(&self.handshake_burst) {
            return Err(format!("tls.handshake_burst = {} is outside 1..=1000000", self.handshake_burst));
        }
        Ok(())
    }
}

/// A blocking connection's bytes: plain, or through TLS.
pub enum Stream {
    Plain(TcpStream),
    Tls(Box<rustls::StreamOwned<rustls::ClientConnection, TcpStream>>),
}

impl Stream {
    /// The socket underneath, for timeouts.
    pub fn tcp(&self) -> &TcpStream {
        match self {
            Stream::Plain(s) => s,
            Stream::Tls(s) => &s.sock,
        }
    }

    /// The socket underneath, for tests that write to it behind TLS's back.
    pub fn tcp_mut(&mut self) -> &mut TcpStream {
        match self {
            Stream::Plain(s) => s,
            Stream::Tls(s) => &mut s.sock,
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => s.read(buf),
            Stream::Tls(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => s.write(buf),
            Stream::Tls(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Stream::Plain(s) => s.flush(),
            Stream::Tls(s) => s.flush(),
        }
    }
}

fn read_pem(path: &Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))
}

/// Every certificate in the PEM file at `path`; none is an error.
fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let chain = CertificateDer::pem_slice_iter(&read_pem(path)?)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{}: {e}", path.display()))?;
    if chain.is_empty() {
        return Err(format!("{}: no PEM certificates", path.display()));
    }
    Ok(chain)
}

fn private_key(path: &Path) -> Result<PrivateKeyDer<'static>, String> {
    PrivateKeyDer::from_pem_slice(&read_pem(path)?).map_err(|e| format!("{}: {e}", path.display()))
}

/// The certificates of `ca_file` as a trust store.
fn roots_from(ca_file: &Path) -> Result<rustls::RootCertStore, String> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in certificates(ca_file)? {
        roots.add(cert).map_err(|e| format!("{}: {e}", ca_file.display()))?;
    }
    Ok(roots)
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The rustls client configuration `tls` asks for.
pub fn client_config(tls: &ClientTls) -> Result<Arc<rustls::ClientConfig>, String> {
    let roots = match &tls.ca_file {
        Some(path) => roots_from(path)?,
        None => {
            let mut roots = rustls::RootCertStore::empty();
            for cert in rustls_native_certs::load_native_certs().certs {
                let _ = roots.add(cert);
            }
            if roots.is_empty() {
                return Err("no system CA certificates found: name a CA file".into());
            }
            roots
        }
    };
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots);
    let config = match (&tls.cert_file, &tls.key_file) {
        (Some(cert), Some(key)) => builder
            .with_client_auth_cert(certificates(cert)?, private_key(key)?)
            .map_err(|e| format!("client certificate: {e}"))?,
        (None, None) => builder.with_no_client_auth(),
        _ => return Err("a client certificate needs both a certificate and a key file".into()),
    };
    Ok(Arc::new(config))
}

/// The rustls server configuration of the scoring port.
pub fn server_config(tls: &ServerTls) -> Result<Arc<rustls::ServerConfig>, String> {
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?;
    let builder = match &tls.client_ca_file {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let verifier =
                rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots_from(ca)?), provider())
                    .build()
                    .map_err(|e| format!("{}: {e}", ca.display()))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let config = builder
        .with_single_cert(certificates(&tls.cert_file)?, private_key(&tls.key_file)?)
        .map_err(|e| format!("{} and {}: {e}", tls.cert_file.display(), tls.key_file.display()))?;
    Ok(Arc::new(config))
}

/// The name to check the server's certificate against: `tls.server_name`,
/// else the host part of `addr` (brackets of an IPv6 literal removed).
pub fn server_name(addr: &str, tls: &ClientTls) -> Result<ServerName<'static>, String> {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    let name = tls.server_name.as_deref().unwrap_or(host);
    let name = name.trim_start_matches('[').trim_end_matches(']');
    ServerName::try_from(name.to_string()).map_err(|e| format!("server name '{name}': {e}"))
}

/// Wraps `tcp` in TLS to the server at `addr` and completes the handshake
/// within the socket's own timeouts.
pub fn connect(tcp: TcpStream, addr: &str, tls: &ClientTls) -> Result<Stream, String> {
    let config = client_config(tls)?;
    connect_with(tcp, config, server_name(addr, tls)?).map(|s| Stream::Tls(Box::new(s)))
}

/// [`connect`] with a configuration built once for many connections.
pub fn connect_with(
    tcp: TcpStream,
    config: Arc<rustls::ClientConfig>,
    name: ServerName<'static>,
) -> Result<rustls::StreamOwned<rustls::ClientConnection, TcpStream>, String> {
    let conn = rustls::ClientConnection::new(config, name).map_err(|e| e.to_string())?;
    let mut stream = rustls::StreamOwned::new(conn, tcp);
    while stream.conn.is_handshaking() {
        stream.conn.complete_io(&mut stream.sock).map_err(|e| format!("handshake: {e}"))?;
    }
    Ok(stream)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_names_come_from_the_address_unless_named() {
        let none = ClientTls::default();
        assert_eq!(server_name("db.example:6380", &none).unwrap(), ServerName::try_from("db.example").unwrap());
        assert_eq!(server_name("[::1]:7411", &none).unwrap(), ServerName::try_from("::1").unwrap());
        let named = ClientTls { server_name: Some("quiver.internal".into()), ..ClientTls::default() };
        assert_eq!(server_name("10.0.0.1:7411", &named).unwrap(), ServerName::try_from("quiver.internal").unwrap());
        assert!(server_name("bad name!:1", &none).is_err());
    }

    #[test]
    fn missing_and_empty_pem_files_are_named() {
        let dir = std::env::temp_dir().join(format!("quiver-tls-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let empty = dir.join("empty.pem");
        std::fs::write(&empty, "not a certificate\n").unwrap();
        let tls = ServerTls {
            cert_file: empty.clone(),
            key_file: dir.join("absent.key"),
            client_ca_file: None,
            handshake_timeout_ms: 2_000,
            handshakes_per_s_max: HANDSHAKES_PER_S_MAX_DEFAULT,
            handshake_burst: HANDSHAKE_BURST_DEFAULT,
        };
        let err = server_config(&tls).unwrap_err();
        assert!(err.contains("empty.pem: no PEM certificates"), "{err}");
        let err =
            client_config(&ClientTls { ca_file: Some(dir.join("absent.pem")), ..ClientTls::default() }).unwrap_err();
        assert!(err.contains("absent.pem"), "{err}");
        let err = client_config(&ClientTls { cert_file: Some(empty), ..ClientTls::default() }).unwrap_err();
        assert!(err.contains("needs both"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_handshake_timeout_is_bounded() {
        let mut tls = ServerTls {
            cert_file: "c".into(),
            key_file: "k".into(),
            client_ca_file: None,
            handshake_timeout_ms: 0,
            handshakes_per_s_max: HANDSHAKES_PER_S_MAX_DEFAULT,
            handshake_burst: HANDSHAKE_BURST_DEFAULT,
        };
        assert!(tls.validate().unwrap_err().contains("handshake_timeout_ms = 0"));
        tls.handshake_timeout_ms = 2_000;
        tls.validate().unwrap();
        tls.handshakes_per_s_max = 0;
        assert!(tls.validate().unwrap_err().contains("handshakes_per_s_max = 0"));
    }
}
