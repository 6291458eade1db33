//! The subcommands of the `quiver` binary, one module each: its clap flags
//! and its `run`. They sit in the binary, not the library, because they are
//! the edge where the library's typed errors become one line on stderr and an
//! exit code; the library never prints for them.
//!
//! Module names end in `_cmd` so that none shares a file name with the
//! library module it drives (`demo_cmd` beside `demo`, `plot_cmd` beside
//! `plot`): a file name in `src/` names one job.
//!
//! What more than one subcommand needs lives here: the client TLS flags
//! (`score`, `bench`), the admin bearer token (`stats`, `replica accept`) and
//! the progress bar (`import`, `features load`).

use std::path::{Path, PathBuf};

use quiver::Error;

pub mod bench_cmd;
pub mod demo_cmd;
pub mod export_onnx_cmd;
pub mod feast_cmd;
pub mod features_cmd;
#[cfg(feature = "cuda")]
pub mod gpu_check_cmd;
pub mod import_cmd;
pub mod log_cmd;
pub mod plot_cmd;
pub mod replica_cmd;
pub mod score_cmd;
pub mod serve_cmd;
pub mod stats_cmd;
pub mod time_model_cmd;

/// How `score` and `bench` reach a scoring port that speaks TLS.
#[derive(clap::Args)]
pub struct ClientTlsArgs {
    /// Speak TLS, trusting the system's CA certificates (or --tls-ca's).
    #[arg(long)]
    tls: bool,
    /// PEM file of the CA (or the self-signed certificate) to trust; implies --tls.
    #[arg(long)]
    tls_ca: Option<PathBuf>,
    /// Client certificate chain and key (PEM), for a server with `tls.client_ca_file`.
    #[arg(long, requires = "tls_client_key")]
    tls_client_cert: Option<PathBuf>,
    #[arg(long, requires = "tls_client_cert")]
    tls_client_key: Option<PathBuf>,
    /// The name the server's certificate must carry; default: the host of --addr.
    #[arg(long)]
    tls_server_name: Option<String>,
}

impl ClientTlsArgs {
    pub fn settings(&self) -> Option<quiver::tls::ClientTls> {
        let wanted =
            self.tls || self.tls_ca.is_some() || self.tls_client_cert.is_some() || self.tls_server_name.is_some();
        wanted.then(|| quiver::tls::ClientTls {
            ca_file: self.tls_ca.clone(),
            cert_file: self.tls_client_cert.clone(),
            key_file: self.tls_client_key.clone(),
            server_name: self.tls_server_name.clone(),
        })
    }
}

/// onnxruntime's own `ORT_DYLIB_PATH`: its library's path where neither the
/// config nor the command line names one. The binary reads the environment;
/// the library never does. `None` in a binary without onnxruntime, which
/// has nothing to load.
pub fn ort_dylib_path() -> Option<PathBuf> {
    if cfg!(feature = "onnxruntime") {
        std::env::var_os("ORT_DYLIB_PATH").filter(|p| !p.is_empty()).map(PathBuf::from)
    } else {
        None
    }
}

/// The `Authorization` header value for a token file, if one is given.
pub fn bearer(token_file: Option<&Path>) -> Result<Option<String>, Error> {
    let Some(path) = token_file else {
        return Ok(None);
    };
    let text = std::fs::read_to_string(path).map_err(|e| Error::Setup(format!("{}: {e}", path.display())))?;
    Ok(Some(format!("Bearer {}", text.trim())))
}

/// A progress bar on stderr for a long command (import, load); indicatif
/// draws it only when stderr is a terminal.
pub fn progress_bar(len: u64, what: &str) -> indicatif::ProgressBar {
    let style = indicatif::ProgressStyle::with_template(
        "{msg} [{bar:40}] {human_pos}/{human_len} ({percent}%, {per_sec}, eta {eta})",
    )
    .expect("a valid template")
    .progress_chars("=> ");
    indicatif::ProgressBar::new(len).with_style(style).with_message(what.to_string())
}
