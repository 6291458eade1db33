//! TLS to Redis (`rediss://`), for managed offerings that require it.
//!
//! rustls with the system's roots, or the CA file the URL names (`?ca=`),
//! server name indication from the host (or `?sni=`), and an optional
//! client certificate (`?cert=` and `?key=`, PEM). The handshake completes
//! inside `connect`, so a certificate problem is a clear connect error, not
//! a confusing failure of the first command. The stream stays blocking, with
//! the socket's own read and write timeouts.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use serde::Deserialize;

/// How to speak TLS to Redis.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct RedisTls {
    /// PEM file of the CA certificates to trust instead of the system's.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate chain and its key, for servers that verify
    /// clients (`tls-auth-clients yes`).
    #[serde(default)]
    pub cert_file: Option<PathBuf>,
    #[serde(default)]
    pub key_file: Option<PathBuf>,
    /// The name the server's certificate must carry; default: the host.
    #[serde(default)]
    pub server_name: Option<String>,
}

/// A connection's bytes: plain, or through TLS.
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

/// The rustls client configuration `tls` asks for.
pub fn client_config(tls: &RedisTls) -> Result<Arc<rustls::ClientConfig>, String> {
    let mut roots = rustls::RootCertStore::empty();
    match &tls.ca_file {
        Some(path) => {
            let pem = read_pem(path)?;
            let mut added = 0;
            for cert in CertificateDer::pem_slice_iter(&pem) {
                let cert = cert.map_err(|e| format!("{}: {e}", path.display()))?;
                roots.add(cert).map_err(|e| format!("{}: {e}", path.display()))?;
                added += 1;
            }
            if added == 0 {
                return Err(format!("{}: no PEM certificates", path.display()));
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            for cert in found.certs {
                let _ = roots.add(cert);
            }
            if roots.is_empty() {
                return Err("no system CA certificates found: name a CA file with ?ca=FILE".into());
            }
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots);
    let config = match (&tls.cert_file, &tls.key_file) {
        (Some(cert), Some(key)) => {
            let chain = CertificateDer::pem_slice_iter(&read_pem(cert)?)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| format!("{}: {e}", cert.display()))?;
            let key_der =
                PrivateKeyDer::from_pem_slice(&read_pem(key)?).map_err(|e| format!("{}: {e}", key.display()))?;
            builder.with_client_auth_cert(chain, key_der).map_err(|e| format!("client certificate: {e}"))?
        }
        (None, None) => builder.with_no_client_auth(),
        _ => return Err("a client certificate needs both ?cert= and ?key=".into()),
    };
    Ok(Arc::new(config))
}

/// Wraps `tcp` in TLS to `host` and completes the handshake.
pub fn connect(tcp: TcpStream, host: &str, tls: &RedisTls) -> Result<Stream, String> {
    let config = client_config(tls)?;
    let name = tls.server_name.as_deref().unwrap_or(host);
    let name = name.trim_start_matches('[').trim_end_matches(']');
    let server_name = ServerName::try_from(name.to_string()).map_err(|e| format!("server name '{name}': {e}"))?;
    let conn = rustls::ClientConnection::new(config, server_name).map_err(|e| e.to_string())?;
    let mut stream = rustls::StreamOwned::new(conn, tcp);
    while stream.conn.is_handshaking() {
        stream.conn.complete_io(&mut stream.sock).map_err(|e| format!("handshake: {e}"))?;
    }
    Ok(Stream::Tls(Box::new(stream)))
}
