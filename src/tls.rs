//! TLS, where users need it: to a managed Redis (`rediss://`, the feed),
//! and on the scoring port for deployments that cross untrusted networks
//! (`[tls]`, served by `src/shard/tls_stream.rs`; spoken by the client and the
//! load generator).
//!
//! The client side (settings, configuration, the blocking handshake) lives
//! in the client crate (`quiver_client::tls`) and is re-exported here; this
//! module adds the server's: `[tls]` and the rustls server configuration,
//! built from PEM files with the same helpers. Every configuration uses
//! rustls on ring with its safe defaults (TLS 1.2 and 1.3, no renegotiation,
//! no compression). Configurations are built once at start-up or connect,
//! so a certificate problem is a clear error there, never a failure of the
//! first request.

use std::path::PathBuf;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

pub use quiver_client::stream::Stream;
use quiver_client::tls::{certificates, private_key, provider, roots_from};
pub use quiver_client::tls::{client_config, connect, connect_with, server_name, ClientTls};

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

#[cfg(test)]
mod tests {
    use super::*;

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
