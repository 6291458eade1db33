//! Certificates for the TLS tests, made with `openssl`: a CA, a server
//! certificate for localhost and 127.0.0.1, a client certificate, and a
//! second CA that signed neither.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::scratch;

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl").current_dir(dir).args(args).output().unwrap_or_else(|e| {
        panic!("openssl is needed for the TLS tests (apt-get install openssl): {e}");
    });
    assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// `openssl req` with a new P-256 key written to `{prefix}.key`, the rest of
/// the arguments after.
fn req_with_new_key(dir: &Path, prefix: &str, rest: &[&str]) {
    let key = format!("{prefix}.key");
    let mut args = vec!["req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", &key];
    args.extend_from_slice(rest);
    openssl(dir, &args);
}

/// A self-signed CA named `name` in `dir`: `{name}.crt`, `{name}.key`.
pub fn make_ca(dir: &Path, name: &str) {
    let (crt, subject) = (format!("{name}.crt"), format!("/CN={name}"));
    req_with_new_key(
        dir,
        name,
        &[
            "-x509",
            "-out",
            &crt,
            "-days",
            "2",
            "-subj",
            &subject,
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ],
    );
}

/// A certificate for `cn` signed by the CA `ca`, with the extensions in
/// `ext`: `{prefix}.crt`, `{prefix}.key`.
pub fn make_cert(dir: &Path, ca: &str, prefix: &str, cn: &str, ext: &str) {
    let (csr, subject) = (format!("{prefix}.csr"), format!("/CN={cn}"));
    req_with_new_key(dir, prefix, &["-out", &csr, "-subj", &subject]);
    std::fs::write(dir.join(format!("{prefix}.ext")), ext).unwrap();
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            &format!("{ca}.crt"),
            "-CAkey",
            &format!("{ca}.key"),
            "-CAcreateserial",
            "-out",
            &format!("{prefix}.crt"),
            "-days",
            "2",
            "-extfile",
            &format!("{prefix}.ext"),
        ],
    );
}

pub struct Pki {
    pub dir: PathBuf,
}

impl Pki {
    pub fn new(name: &str) -> Pki {
        let dir = scratch(name);
        make_ca(&dir, "ca");
        make_ca(&dir, "other-ca");
        make_cert(
            &dir,
            "ca",
            "server",
            "localhost",
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
        );
        make_cert(&dir, "ca", "client", "quiver", "extendedKeyUsage=clientAuth\n");
        Pki { dir }
    }

    pub fn path(&self, f: &str) -> String {
        self.dir.join(f).display().to_string()
    }
}
