//! Who may drive the admin endpoint's controls.
//!
//! Drains, model loads, rollbacks, canaries, shadows, fault hooks and
//! resync accepts change what the server answers; on a routable address
//! they need a bearer token read from `admin_token_file`. Reads (metrics,
//! health, readiness, stats) need none, and `metrics_listen` serves them
//! alone on a listener with no controls at all. A token is compared in
//! constant time and never echoed or logged; refusals are counted and
//! logged at most once a second. A token on a routable address crosses
//! the network in plain HTTP, so that needs the operator's explicit word.
//! On loopback without a token, a control request that a web page in a
//! browser on the host could have sent (an `Origin`, a cross-site
//! `Sec-Fetch-Site`, a `Host` that is not a loopback name) is refused.

use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use super::http::Head;

/// Shorter tokens are refused at start-up: they can be guessed.
pub const TOKEN_BYTES_MIN: usize = 16;
/// A token file is a line, not a document.
const TOKEN_FILE_BYTES_MAX: u64 = 4096;

/// The admin bearer token. Its `Debug` never shows it.
pub struct AdminToken(Vec<u8>);

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminToken(redacted)")
    }
}

impl AdminToken {
    /// Reads the token from `path`: its contents with surrounding white
    /// space trimmed, at least [`TOKEN_BYTES_MIN`] bytes, printable ASCII.
    pub fn load(path: &Path) -> Result<AdminToken, String> {
        let shown = path.display();
        let meta = std::fs::metadata(path).map_err(|e| format!("admin_token_file {shown}: {e}"))?;
        if meta.len() > TOKEN_FILE_BYTES_MAX {
            return Err(format!("admin_token_file {shown}: {} bytes; a token file holds one line", meta.len()));
        }
        let text = std::fs::read(path).map_err(|e| format!("admin_token_file {shown}: {e}"))?;
        let token = text.trim_ascii();
        if token.len() < TOKEN_BYTES_MIN {
            return Err(format!(
                "admin_token_file {shown}: the token has {} bytes, at least {TOKEN_BYTES_MIN} are needed \
                 (e.g. head -c 32 /dev/urandom | base64 > {shown})",
                token.len()
            ));
        }
        if !token.iter().all(|b| b.is_ascii_graphic()) {
            return Err(format!("admin_token_file {shown}: the token must be printable ASCII without spaces"));
        }
        if std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o077 != 0 {
            tracing::warn!(path = %shown, "admin_token_file is readable by other users: chmod 600 it");
        }
        Ok(AdminToken(token.to_vec()))
    }

    pub fn from_bytes(token: &[u8]) -> AdminToken {
        AdminToken(token.to_vec())
    }

    /// Whether an `Authorization` header value carries this token, compared
    /// in time that depends on the lengths only.
    pub fn admits(&self, authorization: Option<&str>) -> bool {
        let Some(given) = authorization.and_then(|v| v.strip_prefix("Bearer ")).map(str::trim) else {
            return false;
        };
        let given = given.as_bytes();
        let mut differ = u8::from(given.len() != self.0.len());
        for (i, &want) in self.0.iter().enumerate() {
            differ |= want ^ given.get(i).copied().unwrap_or(!want);
        }
        std::hint::black_box(differ) == 0
    }
}

/// Refusals of the control surface: counted, and logged at most once a
/// second with how many there were since the last line.
#[derive(Debug, Default)]
pub struct Refusals {
    total: AtomicU64,
    logged: AtomicU64,
    last_log_s: AtomicU64,
}

impl Refusals {
    pub fn total(&self) -> u64 {
        self.total.load(Ordering::Relaxed)
    }

    pub fn record(&self, now_s: u64, from: Option<SocketAddr>, method: &str, path: &str) {
        let total = self.total.fetch_add(1, Ordering::Relaxed) + 1;
        let last = self.last_log_s.load(Ordering::Relaxed);
        if (last == 0 || now_s > last)
            && self.last_log_s.compare_exchange(last, now_s.max(1), Ordering::Relaxed, Ordering::Relaxed).is_ok()
        {
            let since = total - self.logged.swap(total, Ordering::Relaxed);
            let from = from.map_or_else(|| "unknown".to_string(), |a| a.to_string());
            tracing::warn!(
                %from, method, path, refused = since,
                "admin: request without a valid bearer token refused (401)"
            );
        }
    }
}

/// Refuses a control surface that anyone on the network could drive: one
/// bound to an address that is not loopback, with no token, or with a token
/// that would cross the network in plain text when the operator has not
/// said (`plaintext_token_ok`) that the network is trusted with it.
pub fn check_exposure(listen: &str, bound: SocketAddr, token: bool, plaintext_token_ok: bool) -> Result<(), String> {
    if bound.ip().is_loopback() {
        return Ok(());
    }
    if !token {
        return Err(format!(
            "admin_listen = \"{listen}\" is not a loopback address and admin_token_file is not set: anyone who can \
             reach it could drain the server or load models. Set admin_token_file, bind admin_listen to 127.0.0.1, \
             or serve metrics alone with metrics_listen (and admin_listen = \"off\")"
        ));
    }
    if !plaintext_token_ok {
        return Err(format!(
            "admin_listen = \"{listen}\" is not a loopback address: the admin endpoint speaks plain HTTP, so its \
             bearer token would cross the network readable by anyone on the path. Bind admin_listen to 127.0.0.1 \
             (reach it through an SSH tunnel or a TLS proxy), or set admin_token_over_plaintext = true to accept that"
        ));
    }
    Ok(())
}

/// Why a control request without a token looks like it came from a web page
/// (a browser on this host sends `Origin` or `Sec-Fetch-Site` with it, or
/// names another host in `Host` after DNS rebinding), or `None` when it came
/// from a program such as curl or `quiver`. Only a loopback listener serves
/// controls without a token, so this is its one guard against pages.
pub fn browser_origin(head: &Head) -> Option<String> {
    if let Some(origin) = &head.origin {
        return Some(format!("a request from a web page (Origin: {origin}) may not drive the admin controls"));
    }
    if let Some(site) = head.sec_fetch_site.as_deref().filter(|s| !s.eq_ignore_ascii_case("none")) {
        return Some(format!("a request from a web page (Sec-Fetch-Site: {site}) may not drive the admin controls"));
    }
    let host = head.host.as_deref()?;
    let name = match host.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(""),
        None => host.rsplit_once(':').map_or(host, |(name, _port)| name),
    };
    let loopback = name.eq_ignore_ascii_case("localhost") || name.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback());
    (!loopback).then(|| format!("Host: {host} is not a loopback name; controls without a token are for this host only"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_exact_bearer_token_is_admitted() {
        let t = AdminToken::from_bytes(b"0123456789abcdef");
        assert!(t.admits(Some("Bearer 0123456789abcdef")));
        assert!(t.admits(Some("Bearer 0123456789abcdef ")));
        for bad in ["Bearer 0123456789abcdeF", "Bearer 0123456789abcde", "Bearer 0123456789abcdef0", "0123456789abcdef"]
        {
            assert!(!t.admits(Some(bad)), "{bad}");
        }
        assert!(!t.admits(Some("Bearer ")) && !t.admits(None));
        assert_eq!(format!("{t:?}"), "AdminToken(redacted)");
    }

    #[test]
    fn token_files_are_checked() {
        let dir = std::env::temp_dir().join(format!("quiver-token-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("t");
        std::fs::write(&f, "short\n").unwrap();
        assert!(AdminToken::load(&f).unwrap_err().contains("at least 16"));
        std::fs::write(&f, "has a space in it, long enough\n").unwrap();
        assert!(AdminToken::load(&f).unwrap_err().contains("printable ASCII"));
        std::fs::write(&f, "  0123456789abcdef\n").unwrap();
        assert!(AdminToken::load(&f).unwrap().admits(Some("Bearer 0123456789abcdef")));
        assert!(AdminToken::load(&dir.join("absent")).unwrap_err().contains("absent"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_exposed_control_surface_needs_a_token_and_consent_to_plaintext() {
        let at = |s: &str| s.parse::<SocketAddr>().unwrap();
        assert!(check_exposure("127.0.0.1:0", at("127.0.0.1:7412"), false, false).is_ok());
        assert!(check_exposure("[::1]:0", at("[::1]:7412"), false, false).is_ok());
        let err = check_exposure("0.0.0.0:7412", at("0.0.0.0:7412"), false, true).unwrap_err();
        assert!(err.contains("admin_listen") && err.contains("admin_token_file"), "{err}");
        let err = check_exposure("0.0.0.0:7412", at("0.0.0.0:7412"), true, false).unwrap_err();
        assert!(err.contains("plain HTTP") && err.contains("admin_token_over_plaintext"), "{err}");
        assert!(check_exposure("0.0.0.0:7412", at("0.0.0.0:7412"), true, true).is_ok());
    }

    #[test]
    fn pages_in_a_browser_are_told_apart_from_programs() {
        let head = |host: Option<&str>, origin: Option<&str>, site: Option<&str>| Head {
            method: "POST".into(),
            url: "/drain".into(),
            remote: "127.0.0.1:5000".parse().unwrap(),
            authorization: None,
            host: host.map(Into::into),
            origin: origin.map(Into::into),
            sec_fetch_site: site.map(Into::into),
        };
        for host in [None, Some("127.0.0.1:7412"), Some("localhost:7412"), Some("[::1]:7412"), Some("127.0.0.2")] {
            assert_eq!(browser_origin(&head(host, None, None)), None, "{host:?}");
        }
        assert_eq!(browser_origin(&head(Some("localhost"), None, Some("none"))), None);
        let refused = [
            head(Some("127.0.0.1:7412"), Some("http://evil.example"), None),
            head(Some("127.0.0.1:7412"), Some("null"), None),
            head(Some("127.0.0.1:7412"), None, Some("cross-site")),
            head(Some("evil.example:7412"), None, None),
            head(Some("10.0.0.1:7412"), None, None),
        ];
        for h in refused {
            assert!(browser_origin(&h).is_some(), "{h:?}");
        }
    }

    #[test]
    fn refusals_are_counted_every_time() {
        let r = Refusals::default();
        for s in [5, 5, 5, 6] {
            r.record(s, None, "POST", "/drain");
        }
        assert_eq!(r.total(), 4);
    }
}
