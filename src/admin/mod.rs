//! The admin HTTP endpoint, on its own thread: `/metrics` (Prometheus text),
//! `/healthz`, `/readyz`, `/stats.json` (for `quiver stats`), and
//! `POST /drain` / `POST /undrain` to take the server out of rotation,
//! model loads and rollbacks, and `POST /replica/{group}/accept` to accept a
//! held resync.
//!
//! It reads only what shards publish (`metrics::Board`) and the readiness
//! flag; it never touches a shard. HTTP is served by `tiny_http` and the
//! exposition format written by `prometheus-client`. The same state can be
//! served twice: with its controls (`admin_listen`, behind a token where
//! configured, see [`auth`]) and read-only (`metrics_listen`). Here: the
//! listeners, routes and controls; `exposition` writes `/metrics`, `stats`
//! builds `/stats.json`.

pub mod auth;
mod exposition;
mod stats;

pub use exposition::BUCKETS_S;
pub use stats::{render as render_stats, FeedGroupStats, StageStats, Stats};

use std::net::SocketAddr;
use std::sync::Arc;
use std::thread::JoinHandle;

use prometheus_client::registry::Registry as Registry_;

use std::sync::atomic::Ordering::Relaxed;

use crate::deadline::{Clock, MonotonicClock};
use crate::ladder::Faults;
use crate::metrics::{Board, Readiness};
use crate::registry::{Registry, RegistryError};

/// What both listeners serve from.
#[derive(Debug)]
pub struct AdminState {
    pub board: Board,
    pub readiness: Arc<Readiness>,
    pub registry: Arc<Registry>,
    /// The backend's name, for `quiver_model_info`.
    pub backend: String,
    /// The fault hooks, when `faults_endpoint` is set.
    pub faults: Option<Arc<Faults>>,
    /// Required on every control request when set.
    pub token: Option<auth::AdminToken>,
    pub refusals: auth::Refusals,
}

/// Which routes a listener serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Surface {
    /// Reads and controls (`admin_listen`).
    Control,
    /// Reads only (`metrics_listen`): metrics, health, readiness, stats, models.
    ReadOnly,
}

/// A running admin endpoint.
pub struct Admin {
    server: Arc<tiny_http::Server>,
    thread: Option<JoinHandle<()>>,
    pub addr: SocketAddr,
}

impl Admin {
    /// Binds `addr` and serves `surface` on a new thread. A control surface
    /// on an address that is not loopback needs a token.
    pub fn start(addr: &str, surface: Surface, state: Arc<AdminState>) -> Result<Admin, crate::Error> {
        let what = match surface {
            Surface::Control => "admin",
            Surface::ReadOnly => "metrics",
        };
        let server = tiny_http::Server::http(addr).map_err(|e| crate::Error::Setup(format!("{what} {addr}: {e}")))?;
        let bound = server
            .server_addr()
            .to_ip()
            .ok_or_else(|| crate::Error::Setup(format!("{what} {addr}: not an IP address")))?;
        if surface == Surface::Control {
            auth::check_exposure(addr, bound, state.token.is_some()).map_err(crate::Error::Setup)?;
        }
        let server = Arc::new(server);
        let mut prometheus = Registry_::default();
        prometheus.register_collector(Box::new(exposition::QuiverCollector { state: state.clone() }));
        let thread = std::thread::Builder::new()
            .name(format!("quiver-{what}"))
            .spawn({
                let server = server.clone();
                move || serve(&server, &prometheus, &state, surface)
            })
            .map_err(|e| crate::Error::Setup(format!("{what} thread: {e}")))?;
        Ok(Admin { server, thread: Some(thread), addr: bound })
    }

    /// Stops serving and joins the thread.
    pub fn stop(mut self) {
        self.server.unblock();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// How long `POST /replica/{group}/accept` waits for the refresher to act.
const ACCEPT_WAIT: std::time::Duration = std::time::Duration::from_secs(3);

/// What an accept of a held resync answers: 200 when the refresher acted
/// (the copy swapped in, or the next copy to be taken whatever its size),
/// 202 when it has not yet (it may be copying or reconnecting), 404 for an
/// unknown group, 409 when nothing is held.
fn accept_resync(readiness: &Readiness, name: &str) -> (u16, String) {
    let json = |code: u16, v: serde_json::Value| (code, format!("{v}\n"));
    let err = |code: u16, why: String| json(code, serde_json::json!({ "error": why }));
    let Some(feed) = readiness.feed() else {
        return err(409, "no [feed]: the replicas do not follow redis".into());
    };
    let Some(g) = feed.group(name) else {
        return err(404, format!("no feature group '{name}'"));
    };
    if !g.resync_held.load(Relaxed) {
        return err(409, format!("nothing held for '{name}': its replica follows redis"));
    }
    let before = g.accepts_total.load(Relaxed);
    g.accept_requested.store(true, std::sync::atomic::Ordering::Release);
    tracing::warn!(group = name, "held resync accept requested on the admin endpoint");
    let until = std::time::Instant::now() + ACCEPT_WAIT;
    while g.accepts_total.load(Relaxed) == before {
        if std::time::Instant::now() >= until {
            return json(202, serde_json::json!({ "group": name, "accepted": false, "requested": true, "held": true }));
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let held = g.resync_held.load(Relaxed);
    json(200, serde_json::json!({ "group": name, "accepted": true, "held": held, "rows": g.live_rows.load(Relaxed) }))
}

/// The HTTP status and text for a failed load or rollback.
fn registry_error(e: RegistryError) -> (u16, String) {
    let code = match e {
        RegistryError::UnknownModel(_) | RegistryError::UnknownVersion { .. } => 404,
        RegistryError::NoPrevious(_) | RegistryError::NoDirectory | RegistryError::Concurrent(_) => 409,
        RegistryError::BadName(_) | RegistryError::BadFraction(_) | RegistryError::NoCanaryVersion => 400,
        _ => 422,
    };
    (code, e.to_string())
}

/// Whether `request` may use a control route: always on a loopback surface
/// without a token, else only with the token. Refusals are counted.
fn authorized(state: &AdminState, request: &tiny_http::Request, path: &str) -> bool {
    let Some(token) = &state.token else {
        return true;
    };
    let authorization = request.headers().iter().find(|h| h.field.equiv("Authorization")).map(|h| h.value.as_str());
    if token.admits(authorization) {
        return true;
    }
    let now_s = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    state.refusals.record(now_s, request.remote_addr().copied(), request.method().as_str(), path);
    false
}

/// What an admin request asks for, read from its method and URL alone:
/// the one place the admin endpoint parses what a client sent.
#[derive(Debug, PartialEq)]
pub enum Route {
    Metrics,
    Healthz,
    Readyz,
    Stats,
    Models,
    Drain,
    Undrain,
    /// `None`: the query did not say `stage_delay_us=N`.
    Faults {
        stage_delay_us: Option<u64>,
    },
    Model {
        name: String,
        action: ModelAction,
    },
    ReplicaAccept {
        group: String,
    },
    /// Answered with this status and text.
    Bad {
        code: u16,
        why: String,
    },
}

#[derive(Debug, PartialEq)]
pub enum ModelAction {
    Load { version: Option<u32> },
    Rollback,
    Canary { version: Option<u32>, fraction: f64 },
    Shadow { version: Option<u32>, fraction: f64 },
}

impl Route {
    /// Whether it changes what the server does (and so needs the token).
    pub fn is_control(&self) -> bool {
        !matches!(
            self,
            Route::Metrics | Route::Healthz | Route::Readyz | Route::Stats | Route::Models | Route::Bad { .. }
        )
    }
}

/// Parses a request line's method and URL into a [`Route`].
pub fn route(method: &str, url: &str) -> Route {
    let (path, query) = url.split_once('?').unwrap_or((url, ""));
    let param = |key: &str| query.split('&').find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='));
    let not_found = || Route::Bad { code: 404, why: "not found".into() };
    match (method, path) {
        ("GET" | "HEAD", "/metrics") => Route::Metrics,
        ("GET" | "HEAD", "/healthz") => Route::Healthz,
        ("GET" | "HEAD", "/readyz") => Route::Readyz,
        ("GET" | "HEAD", "/stats.json") => Route::Stats,
        ("GET" | "HEAD", "/models") => Route::Models,
        ("POST", "/drain") => Route::Drain,
        ("POST", "/undrain") => Route::Undrain,
        ("POST", "/faults") => Route::Faults { stage_delay_us: param("stage_delay_us").and_then(|v| v.parse().ok()) },
        ("POST", p) if p.starts_with("/replica/") => match p["/replica/".len()..].strip_suffix("/accept") {
            Some(group) if !group.is_empty() && !group.contains('/') => Route::ReplicaAccept { group: group.into() },
            _ => Route::Bad { code: 404, why: "use POST /replica/<group>/accept".into() },
        },
        ("POST", p) if p.starts_with("/models/") => {
            let usage = "use /models/<name>/load[?version=N] or /models/<name>/rollback";
            let Some((name, verb)) = p["/models/".len()..].rsplit_once('/') else {
                return Route::Bad { code: 404, why: usage.into() };
            };
            let version = match param("version").map(|v| v.parse::<u32>().map_err(|_| format!("bad version '{v}'"))) {
                Some(Err(why)) => return Route::Bad { code: 400, why },
                Some(Ok(v)) => Some(v),
                None => None,
            };
            let fraction = param("fraction").and_then(|f| f.parse::<f64>().ok());
            let action = match (verb, version, fraction) {
                ("load", version, _) => ModelAction::Load { version },
                ("rollback", None, _) => ModelAction::Rollback,
                ("canary", version, Some(fraction)) => ModelAction::Canary { version, fraction },
                ("shadow", version, Some(fraction)) => ModelAction::Shadow { version, fraction },
                (kind @ ("canary" | "shadow"), _, None) => {
                    return Route::Bad { code: 400, why: format!("use /models/<name>/{kind}?version=N&fraction=F") }
                }
                _ => return Route::Bad { code: 404, why: usage.into() },
            };
            Route::Model { name: name.into(), action }
        }
        _ => not_found(),
    }
}

fn serve(server: &tiny_http::Server, prometheus: &Registry_, state: &AdminState, surface: Surface) {
    use tiny_http::{Header, Response};
    let AdminState { board, readiness, registry, faults, .. } = state;
    let faults = faults.as_deref();
    let header = |v: &str| Header::from_bytes("Content-Type", v).expect("static header is valid");
    for request in server.incoming_requests() {
        let path = request.url().split('?').next().unwrap_or("").to_string();
        let route = route(request.method().as_str(), request.url());
        let control = route.is_control();
        if control && surface == Surface::ReadOnly {
            let body = "not found: this listener serves metrics, health, readiness and stats only\n";
            let _ = request.respond(Response::from_string(body).with_status_code(404));
            continue;
        }
        if control && !authorized(state, &request, &path) {
            let body = "unauthorized: control requests need Authorization: Bearer <the admin_token_file token>\n";
            let www = Header::from_bytes("WWW-Authenticate", "Bearer").expect("static header is valid");
            let _ = request.respond(Response::from_string(body).with_status_code(401).with_header(www));
            continue;
        }
        let json = |body: String| Response::from_string(body).with_header(header("application/json"));
        let response = match route {
            Route::Metrics => {
                let mut body = String::new();
                match prometheus_client::encoding::prometheus_text::encode(&mut body, prometheus) {
                    Ok(()) => {
                        Response::from_string(body).with_header(header("text/plain; version=0.0.4; charset=utf-8"))
                    }
                    Err(_) => Response::from_string("encoding failed\n").with_status_code(500),
                }
            }
            Route::Healthz => Response::from_string("ok\n"),
            Route::Readyz => match readiness.probe(MonotonicClock::new().now_ns()) {
                Ok(()) => Response::from_string("ready\n"),
                Err(why) => Response::from_string(format!("{why}\n")).with_status_code(503),
            },
            Route::Stats => json(
                serde_json::to_string(&stats::snapshot(board, readiness, registry.drift())).expect("stats serialise"),
            ),
            Route::Models => json(serde_json::to_string(&registry.status()).expect("status serialises")),
            Route::Drain => {
                readiness.set(false);
                tracing::info!("drained: not ready until POST /undrain");
                Response::from_string("drained\n")
            }
            Route::Undrain => {
                readiness.set(true);
                tracing::info!("undrained: ready");
                Response::from_string("ready\n")
            }
            Route::Faults { stage_delay_us } => match (faults, stage_delay_us) {
                (None, _) => Response::from_string("not found\n").with_status_code(404),
                (Some(f), Some(us)) => {
                    f.set_stage_delay_us(us);
                    tracing::warn!(stage_delay_us = us, "fault injected");
                    Response::from_string(format!("stage_delay_us={us}\n"))
                }
                (Some(_), None) => Response::from_string("use /faults?stage_delay_us=N\n").with_status_code(400),
            },
            Route::ReplicaAccept { group } => {
                let (code, body) = accept_resync(readiness, &group);
                json(body).with_status_code(code)
            }
            Route::Model { name, action } => {
                let outcome = match action {
                    ModelAction::Load { version } => registry.load(&name, version),
                    ModelAction::Rollback => registry.rollback(&name),
                    ModelAction::Canary { version, fraction } => {
                        registry.canary(&name, version, fraction).map(|v| v.unwrap_or(0))
                    }
                    ModelAction::Shadow { version, fraction } => {
                        registry.shadow(&name, version, fraction).map(|v| v.unwrap_or(0))
                    }
                };
                match outcome.map_err(registry_error) {
                    Ok(version) => json(format!("{{\"version\":{version}}}")),
                    Err((code, why)) => Response::from_string(format!("{why}\n")).with_status_code(code),
                }
            }
            Route::Bad { code, why } => Response::from_string(format!("{why}\n")).with_status_code(code),
        };
        let _ = request.respond(response);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_parse_what_the_controls_need() {
        assert_eq!(route("GET", "/metrics?x=1"), Route::Metrics);
        assert_eq!(route("POST", "/faults?stage_delay_us=7"), Route::Faults { stage_delay_us: Some(7) });
        assert_eq!(route("POST", "/faults?stage_delay_us=x"), Route::Faults { stage_delay_us: None });
        let canary = route("POST", "/models/m/canary?version=2&fraction=0.25");
        assert_eq!(
            canary,
            Route::Model { name: "m".into(), action: ModelAction::Canary { version: Some(2), fraction: 0.25 } }
        );
        assert!(canary.is_control() && !route("GET", "/stats.json").is_control());
        assert!(matches!(route("POST", "/models/m/load?version=-1"), Route::Bad { code: 400, .. }));
        assert!(matches!(route("POST", "/models/m/shadow"), Route::Bad { code: 400, .. }));
        assert!(matches!(route("POST", "/models/m/rollback?version=2"), Route::Bad { code: 404, .. }));
        assert_eq!(route("POST", "/replica/item/accept"), Route::ReplicaAccept { group: "item".into() });
        assert!(matches!(route("POST", "/replica//accept"), Route::Bad { code: 404, .. }));
        assert!(matches!(route("GET", "/drain"), Route::Bad { code: 404, .. }));
    }
}
