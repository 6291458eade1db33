//! The fraud worked example ("fraud"): a card-payment workload over five
//! feature groups, generated deterministically so `quiver demo --workload
//! fraud` and `quiver serve --demo --workload fraud` need no Redis, no
//! Python and no download.
//!
//! Entities: cards and accounts and merchants keyed by u64, devices keyed
//! by 16-hex-char fingerprints and IPs by dotted IPv4 strings (the two
//! string-keyed groups exercise the string key path end to end). Each has
//! [`WIDTH`] floats. A transaction is (card, account, device, ip, merchant,
//! amount, hour), entities drawn Zipf-skewed as real traffic is; its fraud
//! label comes from a hidden rule over the entities' rows, the amount
//! against the card's usual amount, the hour and noise, so a tree model has
//! something real to learn (about 3% positives).
//!
//! The model served is a LightGBM model trained on
//! [`write_training_set`]'s rows by `bench/train_fraud.py` and committed
//! beside this file (`fraud_model.txt`), imported with the built-in
//! LightGBM importer: the demo never runs Python.

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use crate::features::groups::{GroupConfig, KeyType, Scope};
use crate::features::replica::{Replica, ReplicaBuilder, ReplicaError, KEY_BYTES_MAX};
use crate::loadgen::demo::{IdDist, Ids};
use crate::model::gbdt::{import_lightgbm_text, GbdtError, GbdtOptions};
use crate::model::{Model, ModelError};
use crate::seeded::SplitMix64;
use crate::wire::{GroupKeySpec, RequestSpec};

/// The five groups, in model input order.
pub const GROUPS: [&str; 5] = ["card", "account", "device", "ip", "merchant"];
/// Known entities per group, in [`GROUPS`] order: small enough that the
/// demo builds in about a second.
pub const POPULATIONS: [u64; 5] = [50_000, 30_000, 40_000, 40_000, 2_000];
/// Floats per row of every group.
pub const WIDTH: u32 = 4;
/// Context floats per transaction: the amount in dollars and the hour (0..=23).
pub const CONTEXT_LEN: usize = 2;
/// The `--inputs` mapping the committed model is imported with.
pub const INPUTS: &str = "card:4,account:4,device:4,ip:4,merchant:4,context:2";
pub const MODEL_NAME: &str = "fraud";
pub const MODEL_VERSION: u32 = 1;
/// Device fingerprints: exactly 16 hex characters.
pub const DEVICE_KEY_BYTES: u32 = 16;
/// Dotted IPv4: at most 15 characters.
pub const IP_KEY_BYTES_MAX: u32 = 15;
/// The Zipf exponent entities are drawn with, by default.
pub const ZIPF_DEFAULT: f64 = 1.0;
/// Most rows one training set may hold, so a typo cannot fill the disk.
pub const TRAINING_ROWS_MAX: u64 = 10_000_000;
/// The request-scope group that keeps a canary choice sticky.
pub const CANARY_GROUP: &str = "card";
/// The committed LightGBM model (`bench/train_fraud.py` writes it).
pub const MODEL_TEXT: &str = include_str!("fraud_model.txt");

const SEED: u64 = 0x4652_4155_4400_0001;
const DEVICE_SALT: u64 = 0x6465_7669_6365;
const IP_SALT: u32 = 0x6970_7634;

/// Column names of the joined feature row, in model input order.
pub const FEATURES: [&str; 22] = [
    "card_age_years",
    "card_avg_amount_log",
    "card_chargebacks_90d",
    "card_txn_per_day",
    "account_age_days_log",
    "account_cards_linked",
    "account_verified",
    "account_disputes_1y",
    "device_emulator",
    "device_accounts_seen",
    "device_age_days_log",
    "device_os_risk",
    "ip_proxy",
    "ip_country_risk",
    "ip_accounts_seen_log",
    "ip_datacenter",
    "merchant_category_risk",
    "merchant_fraud_rate_30d",
    "merchant_avg_ticket_log",
    "merchant_online",
    "amount_usd",
    "hour",
];

/// The row an unknown key reads, per group in [`GROUPS`] order: a new
/// entity, seen nowhere before (new devices and IPs are riskier than the
/// zero row would say).
const DEFAULTS: [[f32; WIDTH as usize]; 5] =
    [[0.0, 3.5, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.5], [0.0, 0.5, 0.0, 0.0], [0.5, 0.0, 3.8, 1.0]];

/// The device fingerprint of device `i`: 16 hex characters, distinct for
/// every `i` (SplitMix64's output step is a bijection of its state).
pub fn device_key(i: u64) -> String {
    format!("{:016x}", SplitMix64::new(i ^ DEVICE_SALT).next_u64())
}

/// The dotted IPv4 address of IP `i` (below 2^32): distinct for every `i`
/// (an odd multiplier and an xor-shift are bijections of u32), scattered
/// over the address space rather than counting up from 0.0.0.0.
pub fn ip_key(i: u32) -> String {
    let mut s = String::with_capacity(IP_KEY_BYTES_MAX as usize);
    write_ip(i, &mut s);
    s
}

fn write_ip(i: u32, out: &mut String) {
    let mut x = (i ^ IP_SALT).wrapping_mul(0x9E37_79B1);
    x ^= x >> 16;
    let [a, b, c, d] = x.to_be_bytes();
    let _ = write!(out, "{a}.{b}.{c}.{d}");
}

fn write_device(i: u64, out: &mut String) {
    let _ = write!(out, "{:016x}", SplitMix64::new(i ^ DEVICE_SALT).next_u64());
}

fn bernoulli(rng: &mut SplitMix64, p: f64) -> f32 {
    f32::from(u8::from(rng.unit() < p))
}

/// Exponential with this mean.
fn exponential(rng: &mut SplitMix64, mean: f64) -> f64 {
    -(1.0 - rng.unit()).ln() * mean
}

fn card_row(rng: &mut SplitMix64) -> [f32; 4] {
    [
        exponential(rng, 3.0) as f32,
        3.5 + 0.8 * rng.normal(),
        exponential(rng, 0.3).floor() as f32,
        (0.5 * rng.normal()).exp() * 1.5,
    ]
}

fn account_row(rng: &mut SplitMix64) -> [f32; 4] {
    [
        (1.0 + exponential(rng, 600.0)).ln() as f32,
        1.0 + exponential(rng, 0.7).floor() as f32,
        bernoulli(rng, 0.8),
        exponential(rng, 0.2).floor() as f32,
    ]
}

fn device_row(rng: &mut SplitMix64) -> [f32; 4] {
    [
        bernoulli(rng, 0.03),
        1.0 + exponential(rng, 0.5).floor() as f32,
        (1.0 + exponential(rng, 300.0)).ln() as f32,
        rng.unit() as f32,
    ]
}

fn ip_row(rng: &mut SplitMix64) -> [f32; 4] {
    [bernoulli(rng, 0.05), rng.unit().powi(3) as f32, (1.0 + exponential(rng, 2.0)).ln() as f32, bernoulli(rng, 0.04)]
}

fn merchant_row(rng: &mut SplitMix64) -> [f32; 4] {
    [rng.unit().powi(2) as f32, (rng.unit().powi(4) * 0.1) as f32, 3.8 + rng.normal(), bernoulli(rng, 0.6)]
}

/// Every entity's row, generated from the fixed seed: what the replica
/// files hold and what training rows are joined from.
#[derive(Clone, Debug, PartialEq)]
pub struct Tables {
    /// Per group in [`GROUPS`] order, entity `i`'s row at `i`.
    pub rows: [Vec<[f32; 4]>; 5],
}

impl Tables {
    pub fn generate() -> Tables {
        let makers: [fn(&mut SplitMix64) -> [f32; 4]; 5] = [card_row, account_row, device_row, ip_row, merchant_row];
        let rows = std::array::from_fn(|g| {
            let mut rng = SplitMix64::new(SEED ^ (g as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            (0..POPULATIONS[g]).map(|_| makers[g](&mut rng)).collect()
        });
        Tables { rows }
    }

    /// The joined model input row of `t` (its entities' rows, then the
    /// context), or `None` when an entity is outside the populations.
    pub fn features(&self, t: &Transaction) -> Option<[f32; 22]> {
        let mut x = [0.0f32; 22];
        for (g, &e) in t.entities.iter().enumerate() {
            let row = self.rows[g].get(usize::try_from(e).ok()?)?;
            x[g * 4..g * 4 + 4].copy_from_slice(row);
        }
        x[20] = t.amount_usd;
        x[21] = t.hour;
        Some(x)
    }
}

/// One card payment: entity indices in [`GROUPS`] order (devices and IPs
/// keyed through [`device_key`] and [`ip_key`]), the amount and the hour.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Transaction {
    pub entities: [u64; 5],
    pub amount_usd: f32,
    pub hour: f32,
}

impl Transaction {
    /// The request that scores this transaction: one key per group, the
    /// context, no items (one candidate, one score).
    pub fn request(&self, request_id: u64) -> RequestSpec {
        let mut spec = RequestSpec { request_id, ..RequestSpec::default() };
        fill_request(&self.entities, self.amount_usd, self.hour, &mut spec);
        spec
    }
}

/// Writes `entities`, amount and hour into `spec`, reusing its vectors.
fn fill_request(entities: &[u64; 5], amount_usd: f32, hour: f32, spec: &mut RequestSpec) {
    spec.user_id = 0;
    spec.item_ids.clear();
    spec.context_ids.clear();
    spec.context.clear();
    spec.context.extend_from_slice(&[amount_usd, hour]);
    let shaped = spec.groups.len() == GROUPS.len() && spec.groups.iter().zip(GROUPS).all(|((n, _), g)| n == g);
    if !shaped {
        spec.groups.clear();
        for (g, name) in GROUPS.iter().enumerate() {
            let keys =
                if g == 2 || g == 3 { GroupKeySpec::Strs(vec![String::new()]) } else { GroupKeySpec::Ids(vec![0]) };
            spec.groups.push(((*name).into(), keys));
        }
    }
    for (g, (_, keys)) in spec.groups.iter_mut().enumerate() {
        match keys {
            GroupKeySpec::Ids(v) => {
                v.clear();
                v.push(entities[g]);
            }
            GroupKeySpec::Strs(v) => {
                v.truncate(1);
                if v.is_empty() {
                    v.push(String::new());
                }
                v[0].clear();
                if g == 2 {
                    write_device(entities[g], &mut v[0]);
                } else {
                    write_ip(entities[g] as u32, &mut v[0]);
                }
            }
        }
    }
}

/// The amount of a payment on a card whose usual log-amount is
/// `avg_amount_log`: log-normal around it, in cents.
fn draw_amount(rng: &mut SplitMix64, avg_amount_log: f32) -> f32 {
    let dollars = (f64::from(avg_amount_log) + 0.8 * f64::from(rng.normal())).exp().min(50_000.0);
    ((dollars * 100.0).round() / 100.0).max(0.01) as f32
}

/// The hidden rule: the log-odds that a transaction is fraud, before noise.
/// Nothing outside this module reads it; the model has to learn it.
fn fraud_logit(x: &[f32; 22]) -> f64 {
    let f = |i: usize| f64::from(x[i]);
    let amount_surprise = (f(20).max(0.01).ln() - f(1)).max(0.0);
    let night = f64::from(u8::from(f(21) < 6.0));
    let new_device = f64::from(u8::from(f(10) < 2.0));
    -6.4 + 0.9 * f(2).min(3.0) + 1.1 * amount_surprise - 0.9 * f(6)
        + 0.5 * f(7).min(3.0)
        + 0.6 * f64::from(u8::from(f(5) > 2.0))
        + 2.2 * f(8)
        + 0.7 * (f(9) - 1.0).min(3.0)
        + 0.9 * new_device
        + 0.8 * f(11)
        + 1.4 * f(12)
        + 1.6 * f(13)
        + f(15)
        + 1.3 * f(16)
        + 12.0 * f(17)
        + 0.7 * f(19)
        + 0.9 * night
}

/// Draws transactions over the known populations with Zipf-skewed
/// entities, each with its label.
pub struct TrainingRows {
    tables: Tables,
    ids: [Ids; 5],
    rng: SplitMix64,
}

impl TrainingRows {
    pub fn new(tables: Tables, seed: u64) -> TrainingRows {
        let ids = std::array::from_fn(|g| {
            Ids::new(IdDist::Zipf(ZIPF_DEFAULT), POPULATIONS[g]).expect("the demo's populations are valid")
        });
        TrainingRows { tables, ids, rng: SplitMix64::new(seed) }
    }

    /// The next transaction, its joined row and its label.
    pub fn next_row(&mut self) -> (Transaction, [f32; 22], bool) {
        let rng = &mut self.rng;
        let entities: [u64; 5] = std::array::from_fn(|g| self.ids[g].draw(rng));
        let card = &self.tables.rows[0][entities[0] as usize];
        let amount_usd = draw_amount(rng, card[1]);
        let hour = rng.below(24) as f32;
        let t = Transaction { entities, amount_usd, hour };
        let x = self.tables.features(&t).expect("drawn within the populations");
        let noisy = fraud_logit(&x) + 0.5 * f64::from(rng.normal());
        let label = rng.unit() < 1.0 / (1.0 + (-noisy).exp());
        (t, x, label)
    }
}

/// The seed training sets are drawn with unless another is given: apart
/// from the bench's, so a benchmark's requests are not the training rows.
pub const TRAINING_SEED: u64 = 7;

/// Why the fraud example's files could not be written.
#[derive(Debug, thiserror::Error)]
pub enum FraudError {
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
    #[error("a training set of {rows} rows: must be 1..={TRAINING_ROWS_MAX}")]
    Rows { rows: u64 },
    #[error(transparent)]
    Replica(#[from] ReplicaError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("the committed fraud model: {0}")]
    Import(#[from] GbdtError),
}

/// Writes `rows` labelled transactions as CSV to `path`: a header of
/// [`FEATURES`] and `label`, then one row each, floats in their shortest
/// exact form so the trainer reads the very f32 values the server serves.
pub fn write_training_set(path: &Path, rows: u64, seed: u64) -> Result<u64, FraudError> {
    if !(1..=TRAINING_ROWS_MAX).contains(&rows) {
        return Err(FraudError::Rows { rows });
    }
    let io = |source| FraudError::Io { path: path.to_path_buf(), source };
    let mut out = std::io::BufWriter::new(std::fs::File::create(path).map_err(io)?);
    let mut gen = TrainingRows::new(Tables::generate(), seed);
    let mut line = String::with_capacity(256);
    line.push_str(&FEATURES.join(","));
    line.push_str(",label\n");
    out.write_all(line.as_bytes()).map_err(io)?;
    let mut positives = 0;
    for _ in 0..rows {
        let (_, x, label) = gen.next_row();
        line.clear();
        for v in x {
            let _ = write!(line, "{v},");
        }
        line.push_str(if label { "1\n" } else { "0\n" });
        positives += u64::from(label);
        out.write_all(line.as_bytes()).map_err(io)?;
    }
    out.flush().map_err(io)?;
    Ok(positives)
}

/// The `[[groups]]` the example serves: five request-scope groups, each
/// required (a request without one is `BadRequest`), widths fixed.
pub fn groups() -> Vec<GroupConfig> {
    GROUPS
        .iter()
        .enumerate()
        .map(|(g, name)| GroupConfig {
            name: (*name).into(),
            scope: Scope::Request,
            key: if g == 2 || g == 3 { KeyType::String } else { KeyType::U64 },
            key_bytes_max: match g {
                2 => DEVICE_KEY_BYTES,
                3 => IP_KEY_BYTES_MAX,
                _ => KEY_BYTES_MAX,
            },
            width: Some(WIDTH),
            storage: None,
            default: Vec::new(),
            path: None,
            absent: None,
            parent: None,
        })
        .collect()
}

/// The config file `quiver demo --workload fraud` writes beside its data:
/// `quiver serve --config <dir>/quiver.toml` serves the example with it.
pub fn config_toml(data_dir: &Path) -> String {
    let dir = toml::Value::String(data_dir.display().to_string());
    let mut s = String::new();
    s.push_str("# The fraud worked example (`quiver demo --workload fraud` wrote this file):\n");
    s.push_str("# five request-scope groups, each required; the model reads them in this order.\n");
    let _ = writeln!(s, "data_dir = {dir}");
    let _ = writeln!(s, "canary_group = \"{CANARY_GROUP}\"");
    for g in groups() {
        let _ = write!(s, "\n[[groups]]\nname = \"{}\"\nkey = \"{}\"\n", g.name, g.key.name());
        if g.key == KeyType::String {
            let _ = writeln!(s, "key_bytes_max = {}", g.key_bytes_max);
        }
        let _ = writeln!(s, "width = {WIDTH}");
    }
    s
}

/// The committed model, imported with the built-in LightGBM importer.
pub fn model() -> Result<Model, FraudError> {
    let inputs =
        INPUTS.parse().map_err(|e: crate::model::onnx::OnnxError| GbdtError::Mapping { what: e.to_string() })?;
    let opts = GbdtOptions { name: MODEL_NAME.into(), version: MODEL_VERSION, inputs, output_kind: None };
    Ok(import_lightgbm_text(MODEL_TEXT, "src/loadgen/fraud_model.txt", &opts)?.model)
}

/// Paths of the example's files inside a data directory.
#[derive(Clone, Debug)]
pub struct FraudFiles {
    /// Per group in [`GROUPS`] order: `<dir>/<group>.qrep`, the path a
    /// `[[groups]]` entry without `path` reads.
    pub replicas: [PathBuf; 5],
    pub model: PathBuf,
    pub config: PathBuf,
}

impl FraudFiles {
    pub fn in_dir(dir: &Path) -> FraudFiles {
        FraudFiles {
            replicas: std::array::from_fn(|g| dir.join(format!("{}.qrep", GROUPS[g]))),
            model: dir.join("model.qm"),
            config: dir.join("quiver.toml"),
        }
    }
}

fn replica(tables: &Tables, g: usize) -> Result<ReplicaBuilder, ReplicaError> {
    let mut b = ReplicaBuilder::new(GROUPS[g], WIDTH);
    b = match g {
        2 => b.str_keys(DEVICE_KEY_BYTES)?,
        3 => b.str_keys(IP_KEY_BYTES_MAX)?,
        _ => b,
    };
    b.set_default(&DEFAULTS[g])?;
    for (i, row) in tables.rows[g].iter().enumerate() {
        match g {
            2 => b.push_str(device_key(i as u64).as_bytes(), row)?,
            3 => b.push_str(ip_key(i as u32).as_bytes(), row)?,
            _ => b.push(i as u64, row)?,
        }
    }
    Ok(b)
}

fn files_ok(files: &FraudFiles, model: &Model) -> bool {
    let replicas_ok = files
        .replicas
        .iter()
        .enumerate()
        .all(|(g, p)| Replica::open(p, GROUPS[g]).is_ok_and(|r| r.header().row_count == POPULATIONS[g]));
    replicas_ok && files.config.exists() && Model::load(&files.model).is_ok_and(|m| &m == model)
}

/// Creates the example's files in `dir` (the five replicas, `model.qm` and
/// `quiver.toml`) unless valid ones are already there.
pub fn ensure(dir: &Path) -> Result<FraudFiles, FraudError> {
    std::fs::create_dir_all(dir).map_err(|source| FraudError::Io { path: dir.to_path_buf(), source })?;
    let files = FraudFiles::in_dir(dir);
    let model = model()?;
    crate::loadgen::drop_demo_fallback(dir)
        .map_err(|source| FraudError::Io { path: dir.join("fallback.qm"), source })?;
    if files_ok(&files, &model) {
        tracing::info!(dir = %dir.display(), "fraud example data present");
        return Ok(files);
    }
    tracing::info!(dir = %dir.display(), "generating the fraud example's data");
    let tables = Tables::generate();
    for (g, path) in files.replicas.iter().enumerate() {
        replica(&tables, g)?.write(path)?;
    }
    model.save(&files.model)?;
    std::fs::write(&files.config, config_toml(dir))
        .map_err(|source| FraudError::Io { path: files.config.clone(), source })?;
    Ok(files)
}

/// What `quiver bench --workload fraud` draws: per group ([`GROUPS`]), a
/// population and a Zipf exponent.
pub type Mix = crate::loadgen::GroupMix<5>;

/// The example's own populations and [`ZIPF_DEFAULT`] for every group.
pub const MIX_DEFAULT: Mix =
    crate::loadgen::GroupMix { names: GROUPS, populations: POPULATIONS, zipf: [ZIPF_DEFAULT; 5] };

/// Generates fraud-scoring requests for the load generator: one
/// transaction each, every group's key drawn from its population.
#[derive(Clone, Debug)]
pub struct Transactions {
    ids: [Ids; 5],
    /// Fraction of device and IP keys drawn outside the known populations
    /// (new devices and addresses, read as their group's default row).
    pub unknown_fraction: f64,
    pub budget_us: u32,
    rng: SplitMix64,
}

impl Transactions {
    pub fn new(mix: &Mix, seed: u64) -> Result<Transactions, String> {
        // IPs are u32 indices; every other group's keys are unbounded.
        let ips = mix.populations[3];
        if ips > u64::from(u32::MAX) {
            return Err(format!("ip: a population of {ips}: at most {}", u32::MAX));
        }
        let ids = mix.ids()?;
        Ok(Transactions { ids, unknown_fraction: 0.0, budget_us: 0, rng: SplitMix64::new(seed) })
    }

    /// Fills `spec` with the next transaction, reusing its allocations.
    pub fn fill(&mut self, request_id: u64, spec: &mut RequestSpec) {
        let rng = &mut self.rng;
        let mut entities: [u64; 5] = std::array::from_fn(|g| self.ids[g].draw(rng));
        for g in [2, 3] {
            if self.unknown_fraction > 0.0 && rng.unit() < self.unknown_fraction {
                let n = self.ids[g].count();
                let end = if g == 3 { u64::from(u32::MAX) } else { u64::MAX };
                entities[g] = n + rng.below(end - n);
            }
        }
        let amount_usd = draw_amount(rng, 3.5);
        let hour = rng.below(24) as f32;
        spec.request_id = request_id;
        spec.budget_us = self.budget_us;
        fill_request(&entities, amount_usd, hour, spec);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_distinct_and_within_their_limits() {
        let mut seen = std::collections::HashSet::new();
        for i in 0..POPULATIONS[2] {
            let k = device_key(i);
            assert_eq!(k.len(), DEVICE_KEY_BYTES as usize);
            assert!(k.bytes().all(|b| b.is_ascii_hexdigit()));
            assert!(seen.insert(k));
        }
        seen.clear();
        for i in 0..POPULATIONS[3] as u32 {
            let k = ip_key(i);
            assert!(k.len() <= IP_KEY_BYTES_MAX as usize && k.split('.').count() == 4, "{k}");
            assert!(seen.insert(k));
        }
        assert_eq!(ip_key(u32::MAX - 1).parse::<std::net::Ipv4Addr>().map(|_| ()), Ok(()));
    }

    #[test]
    fn tables_and_rows_are_deterministic_and_a_few_percent_fraud() {
        let tables = Tables::generate();
        assert_eq!(tables, Tables::generate());
        assert!(tables.rows.iter().zip(POPULATIONS).all(|(r, n)| r.len() as u64 == n));
        let mut a = TrainingRows::new(tables.clone(), 3);
        let mut b = TrainingRows::new(tables, 3);
        let n = 40_000;
        let mut positives = 0;
        for _ in 0..n {
            let (ta, xa, la) = a.next_row();
            let (tb, xb, lb) = b.next_row();
            assert_eq!((ta, xa, la), (tb, xb, lb));
            assert!(xa.iter().all(|v| v.is_finite()) && (0.0..24.0).contains(&xa[21]) && xa[20] > 0.0);
            positives += u32::from(la);
        }
        let rate = f64::from(positives) / f64::from(n);
        assert!((0.02..=0.05).contains(&rate), "fraud rate {rate}");
    }

    #[test]
    fn requests_carry_one_key_per_group_and_reuse_their_vectors() {
        let mut w = Transactions::new(&MIX_DEFAULT, 5).unwrap();
        let mut spec = RequestSpec::default();
        for i in 0..100 {
            w.fill(i, &mut spec);
            assert_eq!(spec.context.len(), CONTEXT_LEN);
            assert!(spec.item_ids.is_empty());
            let names: Vec<&str> = spec.groups.iter().map(|(n, _)| n.as_str()).collect();
            assert_eq!(names, GROUPS);
            match (&spec.groups[0].1, &spec.groups[2].1, &spec.groups[3].1) {
                (GroupKeySpec::Ids(c), GroupKeySpec::Strs(d), GroupKeySpec::Strs(ip)) => {
                    assert!(c.len() == 1 && c[0] < POPULATIONS[0]);
                    assert_eq!((d.len(), d[0].len()), (1, DEVICE_KEY_BYTES as usize));
                    assert_eq!(ip.len(), 1);
                }
                other => panic!("key kinds {other:?}"),
            }
        }
        // A transaction's request and a filled one agree.
        let t = Transaction { entities: [1, 2, 3, 4, 5], amount_usd: 12.5, hour: 3.0 };
        let r = t.request(9);
        assert_eq!(r.groups[2].1, GroupKeySpec::Strs(vec![device_key(3)]));
        assert_eq!(r.groups[3].1, GroupKeySpec::Strs(vec![ip_key(4)]));
        assert_eq!(r.context, [12.5, 3.0]);
        w.unknown_fraction = 1.0;
        w.fill(1, &mut spec);
        let GroupKeySpec::Strs(d) = &spec.groups[2].1 else { panic!() };
        assert!((0..POPULATIONS[2]).all(|i| device_key(i) != d[0]));
    }

    #[test]
    fn populations_parse_over_the_defaults() {
        let p = MIX_DEFAULT.parse("card=7, merchant=9", POPULATIONS).unwrap();
        assert_eq!(p, [7, 30_000, 40_000, 40_000, 9]);
        assert!(MIX_DEFAULT.parse("user=3", POPULATIONS).is_err());
        assert!(MIX_DEFAULT.parse("card", POPULATIONS).is_err());
        assert_eq!(MIX_DEFAULT.parse("device=0.5", [1.0; 5]).unwrap(), [1.0, 1.0, 0.5, 1.0, 1.0]);
        assert!(MIX_DEFAULT.parse("device=x", [1.0; 5]).is_err());
        assert!(Transactions::new(&Mix { populations: [0, 1, 1, 1, 1], ..MIX_DEFAULT }, 1).is_err());
        assert!(Transactions::new(&Mix { populations: [1, 1, 1, 1 << 33, 1], ..MIX_DEFAULT }, 1).is_err());
        let bad_exponent = Mix { zipf: [1.0, 1.0, -1.0, 1.0, 1.0], ..MIX_DEFAULT };
        assert!(Transactions::new(&bad_exponent, 1).unwrap_err().contains("device"));
    }
}
