//! The admin HTTP endpoint, on its own thread: `/metrics` (Prometheus text),
//! `/healthz`, `/readyz`, `/stats.json` (for `quiver stats`), and
//! `POST /drain` / `POST /undrain` to take the server out of rotation,
//! model loads and rollbacks, `POST /replica/{group}/accept` to accept a
//! held resync, and `GET /features/{group}?key=K` to read one key's row as
//! the shards serve it.
//!
//! It reads only what shards publish (`metrics::Board`) and the readiness
//! flag; it never touches a shard. HTTP is served by hyper within fixed
//! limits (see [`http`]) and the exposition format written by
//! `prometheus-client`. The same state can be
//! served twice: with its controls (`admin_listen`, behind a token where
//! configured, see [`auth`]) and read-only (`metrics_listen`). Here: the
//! listeners, routes and controls; `exposition` writes `/metrics`, `stats`
//! builds `/stats.json`, `feature_row` answers `/features/{group}`.

pub mod auth;
mod exposition;
pub mod feature_row;
pub mod http;
mod stats;

pub use exposition::BUCKETS_S;
pub use stats::{render as render_stats, FeedGroupStats, StageStats, Stats};

use std::net::SocketAddr;
use std::sync::Arc;

use prometheus_client::registry::Registry as Registry_;

use std::sync::atomic::Ordering::Relaxed;

use crate::deadline::{Clock, MonotonicClock};
use crate::infer::Faults;
use crate::metrics::{Board, Readiness};
use crate::registry::{Registry, RegistryError};
use crate::request::SharedGroup;
use http::{Answer, Head};

/// What both listeners serve from.
#[derive(Debug)]
pub struct AdminState {
    pub board: Board,
    pub readiness: Arc<Readiness>,
    pub registry: Arc<Registry>,
    /// The backend's name, for `quiver_model_info`.
    pub backend: String,
    /// The INT8 kernel CPU INT8 backends run, for `quiver_kernel_info`.
    pub kernel: &'static str,
    /// The fault hooks, when `faults_endpoint` is set.
    pub faults: Option<Arc<Faults>>,
    /// Required on every control request when set.
    pub token: Option<auth::AdminToken>,
    pub refusals: auth::Refusals,
    /// Both listeners' connection counters.
    pub http: Arc<http::Counters>,
    /// The feature groups the shards serve, the same handles, for
    /// `GET /features/{group}`.
    pub groups: Vec<SharedGroup>,
    /// The decision-log writer's counters, when `[log]` logs anything.
    pub decision_log: Option<Arc<crate::decision_log::LogStatus>>,
    /// `[feast]`'s views: the first sync, the follower's counters (none
    /// without `[feast]`).
    pub feast: Option<Arc<crate::features::feast::FeastStatus>>,
    /// The v2 front end's request counters (none without `[oip]`).
    pub oip: Option<Arc<crate::metrics::OipCounters>>,
}

/// Which routes a listener serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Surface {
    /// Reads and controls (`admin_listen`).
    Control,
    /// Reads only (`metrics_listen`): metrics, health, readiness, stats, models.
    ReadOnly,
}

/// Why an admin or metrics listener could not start. `what` is "admin" or
/// "metrics", so the operator knows which of the two addresses to fix.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("{what} {addr}: {source}")]
    Bind { what: &'static str, addr: String, source: std::io::Error },
    /// A control surface reachable from the network without the token
    /// safeguards it needs (`auth::check_exposure`).
    #[error("{what} {addr}: {reason}")]
    Exposed { what: &'static str, addr: String, reason: String },
    #[error("{what} thread: {source}")]
    Thread { what: &'static str, source: std::io::Error },
}

/// A running admin endpoint.
pub struct Admin {
    listener: http::Listener,
    pub addr: SocketAddr,
}

impl Admin {
    /// Binds `addr` and serves `surface` on a new thread. A control surface
    /// on an address that is not loopback needs a token, and the operator's
    /// word (`plaintext_token_ok`) that the token may cross the network in
    /// plain text.
    pub fn start(
        addr: &str,
        surface: Surface,
        state: Arc<AdminState>,
        plaintext_token_ok: bool,
    ) -> Result<Admin, AdminError> {
        let what = match surface {
            Surface::Control => "admin",
            Surface::ReadOnly => "metrics",
        };
        let bind = |source| AdminError::Bind { what, addr: addr.to_string(), source };
        let listener = std::net::TcpListener::bind(addr).map_err(bind)?;
        let bound = listener.local_addr().map_err(bind)?;
        if surface == Surface::Control {
            auth::check_exposure(addr, bound, state.token.is_some(), plaintext_token_ok)
                .map_err(|reason| AdminError::Exposed { what, addr: addr.to_string(), reason })?;
        }
        let mut prometheus = Registry_::default();
        prometheus.register_collector(Box::new(exposition::QuiverCollector { state: state.clone() }));
        let counters = state.http.clone();
        let endpoint = Arc::new(Endpoint { state, prometheus, surface, loopback: bound.ip().is_loopback() });
        let listener = http::Listener::start(format!("quiver-{what}"), listener, endpoint, counters)
            .map_err(|source| AdminError::Thread { what, source })?;
        Ok(Admin { listener, addr: bound })
    }

    /// Stops serving and joins the thread.
    pub fn stop(self) {
        self.listener.stop();
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

/// Whether `head` may use a control route: with the token where one is
/// set, else (on loopback) only from a program on this host, not from a web
/// page in one of its browsers. Refusals are counted.
fn authorized(state: &AdminState, head: &Head, path: &str) -> Result<(), Answer> {
    let refuse = |answer: Answer| {
        let now_s = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        state.refusals.record(now_s, Some(head.remote), &head.method, path);
        Err(answer)
    };
    match &state.token {
        Some(token) if token.admits(head.authorization.as_deref()) => Ok(()),
        Some(_) => refuse(Answer {
            bearer_challenge: true,
            ..Answer::text(
                401,
                "unauthorized: control requests need Authorization: Bearer <the admin_token_file token>\n",
            )
        }),
        None => match auth::browser_origin(head) {
            None => Ok(()),
            Some(why) => refuse(Answer::text(403, format!("forbidden: {why}\n"))),
        },
    }
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
    /// `GET /features/{group}?key=K`. A control, though it changes nothing:
    /// it reads any entity's features, which only those holding the token
    /// may. `Err`: why the request is refused (400), answered only past
    /// the token check.
    FeatureRow(Result<feature_row::RowQuery, String>),
    /// `GET /log` (`None`: the rates in force) or `POST /log?...` (a
    /// change of the decision log's sampling; `Err`: why it is refused).
    Log(Result<Option<crate::decision_log::LogChange>, String>),
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
            Route::Metrics
                | Route::Healthz
                | Route::Readyz
                | Route::Stats
                | Route::Models
                | Route::Log(Ok(None))
                | Route::Bad { .. }
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
        ("GET" | "HEAD", p) if p.starts_with("/features/") => match &p["/features/".len()..] {
            group if group.contains('/') => Route::Bad { code: 404, why: feature_row::USAGE.into() },
            group => Route::FeatureRow(feature_row::parse(group, query)),
        },
        ("GET" | "HEAD", "/log") => Route::Log(Ok(None)),
        ("POST", "/log") => Route::Log(crate::decision_log::parse_change(query).map(Some)),
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

/// One listener's routes over the shared state.
struct Endpoint {
    state: Arc<AdminState>,
    prometheus: Registry_,
    surface: Surface,
    /// Bound to a loopback address.
    loopback: bool,
}

impl http::Handler for Endpoint {
    fn blocks(&self, head: &Head) -> bool {
        // A row lookup is a few memory reads: answered at once, it is not
        // queued behind model loads on the blocking threads.
        let route = route(&head.method, &head.url);
        self.surface == Surface::Control && route.is_control() && !matches!(route, Route::FeatureRow(_))
    }

    fn answer(&self, head: &Head) -> Answer {
        let AdminState { board, readiness, registry, faults, .. } = &*self.state;
        let faults = faults.as_deref();
        let path = head.url.split('?').next().unwrap_or("");
        let route = route(&head.method, &head.url);
        let control = route.is_control();
        if control && self.surface == Surface::ReadOnly {
            return Answer::text(404, "not found: this listener serves metrics, health, readiness and stats only\n");
        }
        if control {
            debug_assert!(self.loopback || self.state.token.is_some(), "check_exposure refused this at start-up");
            if let Err(refused) = authorized(&self.state, head, path) {
                return refused;
            }
        }
        match route {
            Route::Metrics => {
                let mut body = String::new();
                match prometheus_client::encoding::prometheus_text::encode(&mut body, &self.prometheus) {
                    Ok(()) => {
                        Answer { content_type: "text/plain; version=0.0.4; charset=utf-8", ..Answer::text(200, body) }
                    }
                    Err(_) => Answer::text(500, "encoding failed\n"),
                }
            }
            Route::Healthz => Answer::text(200, "ok\n"),
            Route::Readyz => match readiness.probe(MonotonicClock::new().now_ns()) {
                Ok(()) => Answer::text(200, "ready\n"),
                Err(why) => Answer::text(503, format!("{why}\n")),
            },
            Route::Stats => Answer::json(
                200,
                serde_json::to_string(&stats::snapshot(board, readiness, registry.drift(), self.state.kernel))
                    .expect("stats serialise"),
            ),
            Route::Models => Answer::json(200, serde_json::to_string(&registry.status()).expect("status serialises")),
            Route::Drain => {
                readiness.set(false);
                tracing::info!("drained: not ready until POST /undrain");
                Answer::text(200, "drained\n")
            }
            Route::Undrain => {
                readiness.set(true);
                tracing::info!("undrained: ready");
                Answer::text(200, "ready\n")
            }
            Route::Faults { stage_delay_us } => match (faults, stage_delay_us) {
                (None, _) => Answer::text(404, "not found\n"),
                (Some(f), Some(us)) => {
                    f.set_stage_delay_us(us);
                    tracing::warn!(stage_delay_us = us, "fault injected");
                    Answer::text(200, format!("stage_delay_us={us}\n"))
                }
                (Some(_), None) => Answer::text(400, "use /faults?stage_delay_us=N\n"),
            },
            Route::ReplicaAccept { group } => {
                let (code, body) = accept_resync(readiness, &group);
                Answer::json(code, body)
            }
            Route::FeatureRow(Err(why)) => Answer::text(400, format!("{why}\n")),
            Route::FeatureRow(Ok(q)) => match feature_row::lookup(&self.state.groups, readiness, &q) {
                Ok(row) => Answer::json(200, format!("{}\n", serde_json::to_string(&row).expect("a row serialises"))),
                Err(e) => Answer::text(e.status(), format!("{e}\n")),
            },
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
                    Ok(version) => Answer::json(200, format!("{{\"version\":{version}}}")),
                    Err((code, why)) => Answer::text(code, format!("{why}\n")),
                }
            }
            Route::Log(change) => {
                let Some(sampling) = self.state.decision_log.as_ref().and_then(|l| l.sampling.get()) else {
                    return Answer::text(404, "no decision log: [log] sets no dir\n");
                };
                let rates = match change {
                    Ok(None) => Ok(sampling.rates()),
                    Ok(Some(change)) => sampling.change(change.clone()).inspect(|_| {
                        tracing::info!(?change, "decision-log sampling changed on the admin endpoint");
                    }),
                    Err(why) => Err(why),
                };
                match rates {
                    Ok(r) => {
                        // A rate for a model of no such name is kept (one
                        // may be loaded later), and said.
                        let not_served: Vec<&String> =
                            r.model_sample_rates.keys().filter(|m| !registry.serves(m)).collect();
                        let mut body = serde_json::to_value(&r).expect("rates serialise");
                        body["models_not_served"] = serde_json::json!(not_served);
                        Answer::json(200, format!("{body}\n"))
                    }
                    Err(why) => Answer::text(400, format!("{why}\n")),
                }
            }
            Route::Bad { code, why } => Answer::text(code, format!("{why}\n")),
        }
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
        let row = route("GET", "/features/device?key=ab%20c");
        let query = feature_row::RowQuery { group: "device".into(), key: b"ab c".to_vec() };
        assert_eq!(row, Route::FeatureRow(Ok(query)));
        assert!(row.is_control(), "reading an entity's features needs the token");
        let no_key = route("GET", "/features/device");
        assert!(matches!(&no_key, Route::FeatureRow(Err(why)) if why.starts_with("no key")));
        assert!(no_key.is_control(), "a malformed lookup is refused only past the token");
        assert!(matches!(route("GET", "/features/a/b?key=1"), Route::Bad { code: 404, .. }));
        assert!(matches!(route("POST", "/features/user?key=1"), Route::Bad { code: 404, .. }));
        assert!(!route("GET", "/log").is_control());
        let change = route("POST", "/log?model=m&sample_rate=0.5");
        let rate = Some(crate::decision_log::RateChange::Model("m".into(), Some(0.5)));
        assert_eq!(change, Route::Log(Ok(Some(crate::decision_log::LogChange { rate, ..Default::default() }))));
        assert!(change.is_control());
        let bad = route("POST", "/log?sample_rate=7");
        assert!(matches!(&bad, Route::Log(Err(why)) if why.contains("outside 0..=1")) && bad.is_control());
    }
}
