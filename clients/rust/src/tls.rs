//! TLS to a Quiver scoring port with `[tls]` (feature `tls`): the client's
//! settings, the rustls client configuration built from PEM files, and the
//! handshake over a blocking `std::net` socket. rustls on ring with its safe
//! defaults (TLS 1.2 and 1.3, no renegotiation, no compression). The PEM
//! helpers are public because the server builds its own configuration from
//! the same files.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

use crate::stream::Stream;

/// How a client speaks TLS to a server (Redis, or a Quiver scoring port).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Deserialize), serde(deny_unknown_fields))]
pub struct ClientTls {
    /// PEM file of the CA certificates to trust instead of the system's.
    #[cfg_attr(feature = "serde", serde(default))]
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate chain and its key, for servers that verify
    /// clients (Redis `tls-auth-clients yes`, Quiver `tls.client_ca_file`).
    #[cfg_attr(feature = "serde", serde(default))]
    pub cert_file: Option<PathBuf>,
    #[cfg_attr(feature = "serde", serde(default))]
    pub key_file: Option<PathBuf>,
    /// The name the server's certificate must carry; default: the host.
    #[cfg_attr(feature = "serde", serde(default))]
    pub server_name: Option<String>,
}

pub fn read_pem(path: &Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))
}

/// Every certificate in the PEM file at `path`; none is an error.
pub fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let chain = CertificateDer::pem_slice_iter(&read_pem(path)?)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{}: {e}", path.display()))?;
    if chain.is_empty() {
        return Err(format!("{}: no PEM certificates", path.display()));
    }
    Ok(chain)
}

pub fn private_key(path: &Path) -> Result<PrivateKeyDer<'static>, String> {
    PrivateKeyDer::from_pem_slice(&read_pem(path)?).map_err(|e| format!("{}: {e}", path.display()))
}

/// The certificates of `ca_file` as a trust store.
pub fn roots_from(ca_file: &Path) -> Result<rustls::RootCertStore, String> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in certificates(ca_file)? {
        roots.add(cert).map_err(|e| format!("{}: {e}", ca_file.display()))?;
    }
    Ok(roots)
}

pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
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
}
