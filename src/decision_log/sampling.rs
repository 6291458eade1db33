//! Which decisions a shard logs, and how that changes while serving: the
//! [`Sampler`] (keyed by a group's key, sticky, or by request id; the
//! client's, model's or default rate; the always rules), the
//! [`Sampling`] every shard loads per decision and `POST /log` replaces,
//! and the parsing and checking of such a change ([`parse_change`]).
//!
//! Apart from the log's config and rings (`mod.rs`) because it is the part
//! that changes at run time: the admin side builds a new sampler under a
//! lock only it takes, and a shard only loads the one in force.

use std::collections::BTreeMap;
use std::sync::Arc;

use arc_swap::ArcSwap;
use serde::Serialize;

use super::{check_rate, parse_client, record, Always, LogConfig};
use crate::features::groups::Scope;
use crate::features::replica::key_hash;

/// The sampling hash is reduced modulo this: rates are kept to a millionth.
pub const SAMPLE_BUCKETS: u64 = 1_000_000;

fn buckets(rate: f64) -> u64 {
    (rate * SAMPLE_BUCKETS as f64).round() as u64
}

/// Which decisions a shard logs: a pure function of the key (or request
/// id) and the rate that applies (the client's, else the model's, else
/// `sample_rate`), so every shard and every restart samples the same keys.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampler {
    /// Buckets of [`SAMPLE_BUCKETS`] below which a hash is sampled.
    below: u64,
    /// Models' and clients' own buckets (at most [`super::RATES_MAX`] each).
    models: Vec<(Box<str>, u64)>,
    clients: Vec<(u32, u64)>,
    pub key_group: Option<Box<str>>,
    always_errors: bool,
    always_non_primary: bool,
    /// `always_log_shadow_diff`.
    pub shadow_diff: Option<f32>,
}

/// The key a sample is decided by.
#[derive(Clone, Copy, Debug)]
pub enum SampleKey<'a> {
    Id(u64),
    Str(&'a str),
}

impl Sampler {
    /// The sampler of a validated config (a client id that does not parse
    /// is left out: `validate` refuses it first).
    pub fn new(config: &LogConfig) -> Sampler {
        Sampler {
            below: buckets(config.sample_rate),
            models: config.model_sample_rates.iter().map(|(m, &r)| (m.as_str().into(), buckets(r))).collect(),
            clients: (config.client_sample_rates.iter())
                .filter_map(|(c, &r)| Some((parse_client(c).ok()?, buckets(r))))
                .collect(),
            key_group: config.key_group.as_deref().map(Into::into),
            always_errors: config.always.contains(&Always::Errors),
            always_non_primary: config.always.contains(&Always::NonPrimary),
            shadow_diff: config.always_log_shadow_diff.map(|d| d as f32),
        }
    }

    /// The buckets that apply to a decision of `model` for `client`.
    fn below_for(&self, model: &str, client: u32) -> u64 {
        if let Some(&(_, b)) = self.clients.iter().find(|(c, _)| *c == client) {
            return b;
        }
        self.models.iter().find(|(m, _)| &**m == model).map_or(self.below, |&(_, b)| b)
    }

    /// Whether a decision of `model` for `client`, keyed by `key`, is in
    /// the sample.
    pub fn sampled(&self, model: &str, client: u32, key: SampleKey<'_>) -> bool {
        let below = self.below_for(model, client);
        // The replicas' key hash (xxh3-64, seed 0): stable across
        // processes and releases, so a key stays in or out of the sample.
        below > 0 && Self::hash(key) % SAMPLE_BUCKETS < below
    }

    fn hash(key: SampleKey<'_>) -> u64 {
        match key {
            SampleKey::Id(id) => key_hash(&id.to_le_bytes()),
            SampleKey::Str(s) => key_hash(s.as_bytes()),
        }
    }

    /// Whether a decision is logged whatever the sample: an error
    /// (`ok` false) or an answer from below the primary (`primary` false).
    pub fn always(&self, ok: bool, primary: bool) -> bool {
        self.always_rule(ok, primary) != 0
    }

    /// Which always rule takes a decision: [`record::why`]'s `ERRORS` or
    /// `NON_PRIMARY`, or 0 for none.
    pub fn always_rule(&self, ok: bool, primary: bool) -> u8 {
        if !ok && self.always_errors {
            record::why::ERRORS
        } else if ok && !primary && self.always_non_primary {
            record::why::NON_PRIMARY
        } else {
            0
        }
    }

    /// Whether no decision is ever sampled (only `always` ones are logged).
    pub fn samples_none(&self) -> bool {
        self.below == 0 && self.models.iter().all(|(_, b)| *b == 0) && self.clients.iter().all(|(_, b)| *b == 0)
    }

    /// Whether some decision may be logged whatever the sample.
    pub fn has_always(&self) -> bool {
        self.always_errors || self.always_non_primary || self.shadow_diff.is_some()
    }
}

/// A change of one rate: for every decision, a model or a client; `None`
/// removes a model's or a client's own rate.
#[derive(Clone, Debug, PartialEq)]
pub enum RateChange {
    Default(f64),
    Model(String, Option<f64>),
    Client(u32, Option<f64>),
}

/// What one `POST /log` changes: any of a rate, the always rules, the key
/// group and the shadow threshold, applied together or not at all. `None`
/// leaves a setting as it is; `Some(None)` unsets an optional one.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LogChange {
    pub rate: Option<RateChange>,
    pub always: Option<Vec<Always>>,
    pub key_group: Option<Option<String>>,
    pub always_log_shadow_diff: Option<Option<f64>>,
}

/// How `POST /log` is used.
pub const CHANGE_USAGE: &str = "use POST /log with one or more of sample_rate=R (with model=NAME or client=ID: that \
                                one's own rate, R=none removes it; R in 0..=1), always=non_primary,errors|none, \
                                key_group=NAME|none, always_log_shadow_diff=D|none (D >= 0)";

/// The most parameters one `POST /log` takes (each at most once).
const CHANGE_PARAMS_MAX: usize = 6;

/// Reads `POST /log`'s query into a change; the error says what is wrong
/// and how the route is used.
pub fn parse_change(query: &str) -> Result<LogChange, String> {
    const KEYS: [&str; CHANGE_PARAMS_MAX] =
        ["sample_rate", "model", "client", "always", "key_group", "always_log_shadow_diff"];
    let mut given: [Option<String>; CHANGE_PARAMS_MAX] = Default::default();
    for kv in query.split('&').filter(|kv| !kv.is_empty()) {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        let Some(at) = KEYS.iter().position(|key| *key == k) else {
            return Err(format!("unknown parameter '{k}': {CHANGE_USAGE}"));
        };
        let v = percent_encoding::percent_decode_str(v)
            .decode_utf8()
            .map_err(|_| format!("'{k}' is not UTF-8 once percent-decoded: {CHANGE_USAGE}"))?;
        if given[at].replace(v.into_owned()).is_some() {
            return Err(format!("'{k}' given twice: {CHANGE_USAGE}"));
        }
    }
    let [rate, model, client, always, key_group, shadow_diff] = given;
    let rate = match rate.as_deref() {
        None if model.is_some() || client.is_some() => {
            return Err(format!("model= or client= without sample_rate=: {CHANGE_USAGE}"));
        }
        None => None,
        Some(rate) => Some(parse_rate_change(rate, model.as_deref(), client.as_deref())?),
    };
    let always = match always.as_deref() {
        None => None,
        Some("none" | "") => Some(Vec::new()),
        Some(list) => {
            let mut rules = Vec::new();
            for name in list.split(',') {
                let rule = match name {
                    "non_primary" => Always::NonPrimary,
                    "errors" => Always::Errors,
                    _ => return Err(format!("always rule '{name}' is not non_primary or errors: {CHANGE_USAGE}")),
                };
                if !rules.contains(&rule) {
                    rules.push(rule);
                }
            }
            Some(rules)
        }
    };
    let key_group = match key_group.as_deref() {
        None => None,
        Some("") => return Err(format!("an empty key_group: {CHANGE_USAGE}")),
        Some("none") => Some(None),
        Some(g) => Some(Some(g.to_string())),
    };
    let always_log_shadow_diff = match shadow_diff.as_deref() {
        None => None,
        Some("none") => Some(None),
        Some(d) => Some(Some(
            d.parse::<f64>().map_err(|_| format!("always_log_shadow_diff '{d}' is not a number: {CHANGE_USAGE}"))?,
        )),
    };
    let change = LogChange { rate, always, key_group, always_log_shadow_diff };
    if change == LogChange::default() {
        return Err(format!("nothing to change: {CHANGE_USAGE}"));
    }
    Ok(change)
}

/// `sample_rate`, for `model` or `client` or every decision.
fn parse_rate_change(rate: &str, model: Option<&str>, client: Option<&str>) -> Result<RateChange, String> {
    let rate = match rate {
        "none" => None,
        r => {
            let r: f64 = r.parse().map_err(|_| format!("sample_rate '{r}' is not a number: {CHANGE_USAGE}"))?;
            check_rate("sample_rate", r)?;
            Some(r)
        }
    };
    match (model, client, rate) {
        (Some(_), Some(_), _) => Err(format!("both model and client: {CHANGE_USAGE}")),
        (Some(""), None, _) => Err(format!("an empty model name: {CHANGE_USAGE}")),
        (Some(m), None, r) => Ok(RateChange::Model(m.into(), r)),
        (None, Some(c), r) => Ok(RateChange::Client(parse_client(c)?, r)),
        (None, None, Some(r)) => Ok(RateChange::Default(r)),
        (None, None, None) => {
            Err(format!("sample_rate=none only removes a model's or a client's rate: {CHANGE_USAGE}"))
        }
    }
}

/// Checks a key group against the served groups (`name`, `scope`): a
/// request-scope group, or `user` (then `user_id` when no such group is
/// served). `what` names the setting.
pub fn check_key_group<'a>(
    what: &str,
    name: &str,
    mut groups: impl Iterator<Item = (&'a str, Scope)>,
) -> Result<(), String> {
    match groups.find(|(g, _)| *g == name) {
        Some((_, Scope::Candidate)) => {
            Err(format!("{what} = \"{name}\" is a candidate-scope group; a decision is sampled per request"))
        }
        Some(_) => Ok(()),
        None if name == "user" => Ok(()),
        None => Err(format!("{what} = \"{name}\" is not a configured group")),
    }
}

/// The sampling every shard reads, changed at run time by `POST /log`:
/// the admin side stores a new config's sampler, each shard loads the
/// current one per decision (one atomic load, no lock, no allocation).
#[derive(Debug)]
pub struct Sampling {
    config: std::sync::Mutex<LogConfig>,
    current: ArcSwap<Sampler>,
    /// The served groups' names and scopes, which a key group is checked
    /// against (set once at start-up; before, only `user` is known).
    groups: std::sync::OnceLock<Vec<(Box<str>, Scope)>>,
}

impl Sampling {
    pub fn new(config: &LogConfig) -> Sampling {
        Sampling {
            config: std::sync::Mutex::new(config.clone()),
            current: ArcSwap::from_pointee(Sampler::new(config)),
            groups: std::sync::OnceLock::new(),
        }
    }

    /// Names the served groups a run-time key group must be one of.
    pub fn know_groups<'a>(&self, groups: impl Iterator<Item = (&'a str, Scope)>) {
        let _ = self.groups.set(groups.map(|(name, scope)| (name.into(), scope)).collect());
    }

    /// The sampler in force.
    pub fn load(&self) -> arc_swap::Guard<Arc<Sampler>> {
        self.current.load()
    }

    /// Applies `change`, checked like the config file; on an error nothing
    /// changes. Returns the settings now in force.
    pub fn change(&self, change: LogChange) -> Result<Rates, String> {
        let mut config = self.config.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut next = config.clone();
        match change.rate {
            None => {}
            Some(RateChange::Default(r)) => next.sample_rate = r,
            Some(RateChange::Model(m, Some(r))) => {
                next.model_sample_rates.insert(m, r);
            }
            Some(RateChange::Model(m, None)) => {
                next.model_sample_rates.remove(&m);
            }
            Some(RateChange::Client(c, Some(r))) => {
                next.client_sample_rates.insert(c.to_string(), r);
            }
            Some(RateChange::Client(c, None)) => {
                next.client_sample_rates.remove(&c.to_string());
            }
        }
        if let Some(always) = change.always {
            next.always = always;
        }
        if let Some(group) = change.key_group {
            if let Some(name) = &group {
                let groups = self.groups.get().map_or(&[][..], Vec::as_slice);
                check_key_group("log.key_group", name, groups.iter().map(|(g, s)| (&**g, *s)))?;
            }
            next.key_group = group;
        }
        if let Some(diff) = change.always_log_shadow_diff {
            next.always_log_shadow_diff = diff;
        }
        next.validate()?;
        self.current.store(Arc::new(Sampler::new(&next)));
        *config = next;
        Ok(Rates::of(&config))
    }

    /// The rates in force.
    pub fn rates(&self) -> Rates {
        Rates::of(&self.config.lock().unwrap_or_else(std::sync::PoisonError::into_inner))
    }
}

/// The sampling in force, as `GET /log` and `POST /log` answer it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Rates {
    pub sample_rate: f64,
    pub model_sample_rates: BTreeMap<String, f64>,
    pub client_sample_rates: BTreeMap<String, f64>,
    pub key_group: Option<String>,
    pub always: Vec<Always>,
    pub always_log_shadow_diff: Option<f64>,
}

impl Rates {
    fn of(c: &LogConfig) -> Rates {
        Rates {
            sample_rate: c.sample_rate,
            model_sample_rates: c.model_sample_rates.clone(),
            client_sample_rates: c.client_sample_rates.clone(),
            key_group: c.key_group.clone(),
            always: c.always.clone(),
            always_log_shadow_diff: c.always_log_shadow_diff,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision_log::tests::config;
    use crate::decision_log::LogRings;

    #[test]
    fn keyed_sampling_is_sticky_and_near_its_rate() {
        let sampler = |rate| Sampler::new(&LogConfig { sample_rate: rate, ..LogConfig::default() });
        for rate in [0.01, 0.1, 0.5] {
            let s = sampler(rate);
            let keys = 200_000u64;
            let ids = (0..keys).filter(|&k| s.sampled("m", 0, SampleKey::Id(k))).count() as f64;
            let strs = (0..keys).filter(|&k| s.sampled("m", 0, SampleKey::Str(&format!("card-{k}")))).count() as f64;
            for got in [ids, strs] {
                let want = rate * keys as f64;
                assert!((got - want).abs() <= 0.1 * want, "rate {rate}: {got} of {keys} sampled");
            }
            // Sticky: the same key decides the same way every time, on any
            // sampler built from the same config (another shard, a restart).
            let again = sampler(rate);
            for k in 0..10_000u64 {
                assert_eq!(s.sampled("m", 0, SampleKey::Id(k)), again.sampled("m", 0, SampleKey::Id(k)));
            }
        }
        assert!((0..100_000u64).all(|k| sampler(1.0).sampled("m", 0, SampleKey::Id(k))));
        assert!((0..100_000u64).all(|k| !sampler(0.0).sampled("m", 0, SampleKey::Id(k))));
    }

    #[test]
    fn a_client_rate_comes_before_a_model_rate_before_the_default() {
        let c = config(
            "dir = \"d\"\nsample_rate = 0.1\n[model_sample_rates]\nranker = 0.5\nquiet = 0.0\n\
             [client_sample_rates]\n\"7\" = 1.0\n\"8\" = 0.0\n",
        )
        .unwrap();
        let s = Sampler::new(&c);
        let share = |model: &str, client: u32| {
            (0..100_000u64).filter(|&k| s.sampled(model, client, SampleKey::Id(k))).count() as f64 / 100_000.0
        };
        for (model, client, want) in
            [("other", 0, 0.1), ("ranker", 0, 0.5), ("quiet", 0, 0.0), ("ranker", 7, 1.0), ("ranker", 8, 0.0)]
        {
            let got = share(model, client);
            assert!((got - want).abs() <= 0.1 * want, "{model} client {client}: {got}, want {want}");
        }
        // A key sampled at a lower rate is sampled at every higher one: a
        // raised rate adds keys, it does not trade them.
        assert!((0..10_000u64).filter(|&k| s.sampled("other", 0, SampleKey::Id(k))).all(|k| s.sampled(
            "ranker",
            0,
            SampleKey::Id(k)
        )));
        assert!(!s.samples_none());
        for (text, want) in [
            ("[client_sample_rates]\ncard = 1.0\n", "log.client_sample_rates: client 'card' is not a client id"),
            ("[model_sample_rates]\nm = 2.0\n", "log.model_sample_rates.m = 2 is outside 0..=1"),
            ("[client_sample_rates]\n\"3\" = -1.0\n", "log.client_sample_rates.3 = -1 is outside 0..=1"),
        ] {
            let got = config(&format!("dir = \"d\"\n{text}")).unwrap_err();
            assert!(got.starts_with(want), "{got}");
        }
    }

    #[test]
    fn run_time_changes_are_checked_and_seen_by_every_shard() {
        let c = LogConfig { dir: Some("d".into()), ..LogConfig::default() };
        let rings = LogRings::new(&c, 2);
        let (a, b) = (rings.shard(0).unwrap(), rings.shard(1).unwrap());
        assert!(a.sampling.load().samples_none());
        let rate = |r| LogChange { rate: Some(r), ..LogChange::default() };
        let rates = rings.sampling.change(rate(RateChange::Model("ranker".into(), Some(1.0)))).unwrap();
        assert_eq!(rates.model_sample_rates.get("ranker"), Some(&1.0));
        for log in [&a, &b] {
            assert!(log.sampling.load().sampled("ranker", 0, SampleKey::Id(1)));
            assert!(!log.sampling.load().sampled("other", 0, SampleKey::Id(1)));
        }
        // A bad change is refused whole, naming the key as the file would.
        let bad = rings.sampling.change(rate(RateChange::Default(1.5))).unwrap_err();
        assert_eq!(bad, "log.sample_rate = 1.5 is outside 0..=1");
        assert_eq!(rings.sampling.rates().sample_rate, 0.0);
        rings.sampling.change(rate(RateChange::Client(7, Some(0.0)))).unwrap();
        assert!(!a.sampling.load().sampled("ranker", 7, SampleKey::Id(1)));
        rings.sampling.change(rate(RateChange::Client(7, None))).unwrap();
        rings.sampling.change(rate(RateChange::Model("ranker".into(), None))).unwrap();
        assert!(a.sampling.load().samples_none());
        assert_eq!(rings.sampling.rates(), Rates::of(&c));
    }

    #[test]
    fn run_time_changes_of_the_rules_and_the_key_group_are_checked_and_applied_together() {
        let c = LogConfig { dir: Some("d".into()), ..LogConfig::default() };
        let rings = LogRings::new(&c, 1);
        let log = rings.shard(0).unwrap();
        rings.sampling.know_groups([("card", Scope::Request), ("ad", Scope::Candidate)].into_iter());
        let change = LogChange {
            rate: Some(RateChange::Default(0.5)),
            always: Some(vec![Always::Errors]),
            key_group: Some(Some("card".into())),
            always_log_shadow_diff: Some(Some(0.25)),
        };
        let rates = rings.sampling.change(change).unwrap();
        assert_eq!(
            (rates.sample_rate, &rates.always[..], rates.key_group.as_deref(), rates.always_log_shadow_diff),
            (0.5, &[Always::Errors][..], Some("card"), Some(0.25))
        );
        let s = log.sampling.load();
        assert_eq!((s.key_group.as_deref(), s.shadow_diff, s.always(false, true)), (Some("card"), Some(0.25), true));
        drop(s);
        // A change with one bad part changes nothing.
        for (bad, want) in [
            (LogChange { key_group: Some(Some("ad".into())), ..LogChange::default() }, "is a candidate-scope group"),
            (LogChange { key_group: Some(Some("device".into())), ..LogChange::default() }, "is not a configured group"),
            (
                LogChange {
                    always: Some(Vec::new()),
                    always_log_shadow_diff: Some(Some(-1.0)),
                    ..LogChange::default()
                },
                "log.always_log_shadow_diff = -1 is not a finite number >= 0",
            ),
        ] {
            let got = rings.sampling.change(bad).unwrap_err();
            assert!(got.contains(want), "{got}");
        }
        assert_eq!(rings.sampling.rates(), rates);
        // And each unsets.
        let off = LogChange {
            always: Some(Vec::new()),
            key_group: Some(None),
            always_log_shadow_diff: Some(None),
            ..LogChange::default()
        };
        let rates = rings.sampling.change(off).unwrap();
        assert_eq!((rates.always.len(), rates.key_group, rates.always_log_shadow_diff), (0, None, None));
        assert!(!log.sampling.load().has_always());
        // `user` is known with no group of that name (its key is `user_id`).
        rings.sampling.change(LogChange { key_group: Some(Some("user".into())), ..LogChange::default() }).unwrap();
    }

    #[test]
    fn post_log_queries_parse_or_say_why() {
        let rate = |r| Ok(LogChange { rate: Some(r), ..LogChange::default() });
        assert_eq!(parse_change("sample_rate=0.25"), rate(RateChange::Default(0.25)));
        assert_eq!(parse_change("model=ranker&sample_rate=1"), rate(RateChange::Model("ranker".into(), Some(1.0))));
        assert_eq!(parse_change("client=7&sample_rate=none"), rate(RateChange::Client(7, None)));
        assert_eq!(
            parse_change("model=fraud%20v2%26x&sample_rate=0%2E5"),
            rate(RateChange::Model("fraud v2&x".into(), Some(0.5)))
        );
        assert_eq!(
            parse_change("always=errors%2Cnon_primary,errors&key_group=card&always_log_shadow_diff=0.5"),
            Ok(LogChange {
                rate: None,
                always: Some(vec![Always::Errors, Always::NonPrimary]),
                key_group: Some(Some("card".into())),
                always_log_shadow_diff: Some(Some(0.5)),
            })
        );
        assert_eq!(
            parse_change("always=none&key_group=none&always_log_shadow_diff=none&sample_rate=0"),
            Ok(LogChange {
                rate: Some(RateChange::Default(0.0)),
                always: Some(Vec::new()),
                key_group: Some(None),
                always_log_shadow_diff: Some(None),
            })
        );
        assert_eq!(parse_change("always=").map(|c| c.always), Ok(Some(Vec::new())));
        for (query, want) in [
            ("", "nothing to change"),
            ("model=m", "model= or client= without sample_rate="),
            ("sample_rate=2", "sample_rate = 2 is outside 0..=1"),
            ("sample_rate=NaN", "sample_rate = NaN is outside 0..=1"),
            ("sample_rate=half", "sample_rate 'half' is not a number"),
            ("sample_rate=none", "sample_rate=none only removes"),
            ("client=x&sample_rate=1", "client 'x' is not a client id"),
            ("client=1&model=m&sample_rate=1", "both model and client"),
            ("model=&sample_rate=1", "an empty model name"),
            ("model=%FF&sample_rate=1", "'model' is not UTF-8"),
            ("rate=1", "unknown parameter 'rate'"),
            ("sample_rate=1&sample_rate=0", "'sample_rate' given twice"),
            ("always=errors,shadow", "always rule 'shadow' is not non_primary or errors"),
            ("key_group=", "an empty key_group"),
            ("always_log_shadow_diff=wide", "always_log_shadow_diff 'wide' is not a number"),
        ] {
            let got = parse_change(query).unwrap_err();
            assert!(got.starts_with(want), "{query}: {got}");
        }
    }

    #[test]
    fn the_always_rules() {
        let s = Sampler::new(&LogConfig { always: vec![Always::NonPrimary], ..LogConfig::default() });
        assert!(s.always(true, false));
        assert!(!s.always(true, true));
        assert!(!s.always(false, true));
        let s = Sampler::new(&LogConfig { always: vec![Always::Errors], ..LogConfig::default() });
        assert!(s.always(false, true));
        assert!(!s.always(true, false));
        assert_eq!(s.always_rule(false, true), record::why::ERRORS);
        assert_eq!(s.always_rule(true, true), 0);
        let s = Sampler::new(&LogConfig { always_log_shadow_diff: Some(0.25), ..LogConfig::default() });
        assert_eq!((s.shadow_diff, s.has_always(), s.always(true, true)), (Some(0.25), true, false));
    }
}
