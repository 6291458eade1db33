//! The auction worked example ("auction"): ads scored for a user, where
//! each ad's campaign and advertiser rows are reached through the links the
//! replicas store (`parent = "campaign"`), never sent by the request.
//! Generated deterministically, so `quiver demo --workload auction` and
//! `quiver serve --demo --workload auction` need no Redis, no GPU and no
//! download.
//!
//! Why: a real auction scores each candidate ad with what is known about
//! its campaign and its advertiser, and a bidder sends ad ids only. The
//! join `ad → campaign → advertiser` happens on the shard, from the
//! replicas alone: this example is that shape end to end, for the tests,
//! the demo and the benches (`quiver bench --workload auction`).
//!
//! Six groups: `user` (u64), `device` (16-hex-char fingerprints) and
//! `publisher` (u64) keyed once per request; `ad` (u64) keyed once per
//! candidate, linking to `campaign` (u64), linking to `advertiser` (u64).
//! Every row is seeded Gaussian noise, every ad links to a campaign and
//! every campaign to an advertiser. The model is an MLP over the six
//! groups' rows with seeded He-initialised weights, built as the
//! auction-32 demo builds its own (`demo::he_layers`): it scores, it does
//! not predict anything.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use crate::features::groups::{GroupConfig, KeyType, Scope};
use crate::features::replica::{EntityKey, KeyKind, Replica, ReplicaBuilder, ReplicaError, KEY_BYTES_MAX};
use crate::loadgen::demo::{self, Ids};
use crate::model::{GroupName, InputSegment, Model, ModelError, Source};
use crate::seeded::SplitMix64;
use crate::wire::{GroupKeySpec, RequestSpec};

/// The six groups, in model input order.
pub const GROUPS: [&str; 6] = ["user", "device", "publisher", "ad", "campaign", "advertiser"];
/// Each group's scope, in [`GROUPS`] order.
pub const SCOPES: [Scope; 6] =
    [Scope::Request, Scope::Request, Scope::Request, Scope::Candidate, Scope::Candidate, Scope::Candidate];
/// Floats per row, in [`GROUPS`] order.
pub const WIDTHS: [u32; 6] = [16, 8, 8, 16, 12, 8];
/// Known entities per group, in [`GROUPS`] order: small enough that the
/// example builds in well under a second.
pub const POPULATIONS: [u64; 6] = [100_000, 50_000, 2_000, 20_000, 2_000, 300];
/// The groups a request carries keys for, a prefix of [`GROUPS`]: campaign
/// and advertiser are keyed through the links in the rows before them.
pub const KEYED: [&str; 4] = ["user", "device", "publisher", "ad"];
/// Each group's parent, in [`GROUPS`] order.
pub const PARENTS: [Option<&str>; 6] = [None, None, None, Some("campaign"), Some("advertiser"), None];
/// Candidate ads per request.
pub const CANDIDATES: usize = 32;
/// The MLP's hidden layers: (sum of [`WIDTHS`]) → 128 → ReLU → 64 → ReLU → 1.
pub const HIDDEN: [usize; 2] = [128, 64];
pub const MODEL_NAME: &str = "auction";
pub const MODEL_VERSION: u32 = 1;
/// Device fingerprints: exactly 16 hex characters.
pub const DEVICE_KEY_BYTES: u32 = 16;
/// The Zipf exponent keys are drawn with, by default.
pub const ZIPF_DEFAULT: f64 = 1.0;
/// The request-scope group that keeps a canary choice sticky.
pub const CANARY_GROUP: &str = "user";

const USER: usize = 0;
const DEVICE: usize = 1;
const PUBLISHER: usize = 2;
const AD: usize = 3;
const CAMPAIGN: usize = 4;
const ADVERTISER: usize = 5;

const SEED: u64 = 0x4155_4354_494f_4e06;
const DEVICE_SALT: u64 = 0x0061_6465_7669_6365;

/// The floats of one model input row: every group's width.
pub const ROW_DIM: usize = {
    let mut sum = 0;
    let mut g = 0;
    while g < WIDTHS.len() {
        sum += WIDTHS[g] as usize;
        g += 1;
    }
    sum
};

/// Where group `g`'s floats start in a model input row.
pub fn offset(g: usize) -> usize {
    WIDTHS[..g].iter().map(|&w| w as usize).sum()
}

/// The device fingerprint of device `i`: 16 hex characters, distinct for
/// every `i` (SplitMix64's output step is a bijection of its state).
pub fn device_key(i: u64) -> String {
    let mut s = String::with_capacity(DEVICE_KEY_BYTES as usize);
    write_device(i, &mut s);
    s
}

fn write_device(i: u64, out: &mut String) {
    let _ = write!(out, "{:016x}", SplitMix64::new(i ^ DEVICE_SALT).next_u64());
}

/// Every entity's row and every link, generated from the fixed seed: what
/// the replica files hold and what a reference score is computed from.
#[derive(Clone, Debug, PartialEq)]
pub struct Tables {
    /// Per group in [`GROUPS`] order, entity `i`'s row at
    /// `i * WIDTHS[g]..(i + 1) * WIDTHS[g]`.
    pub rows: [Vec<f32>; 6],
    /// Ad `i`'s campaign.
    pub ad_campaign: Vec<u64>,
    /// Campaign `i`'s advertiser.
    pub campaign_advertiser: Vec<u64>,
}

impl Tables {
    pub fn generate() -> Tables {
        let rows = std::array::from_fn(|g| {
            let mut rng = SplitMix64::new(SEED ^ (g as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            (0..POPULATIONS[g] * u64::from(WIDTHS[g])).map(|_| rng.normal() * 0.5).collect()
        });
        let mut rng = SplitMix64::new(SEED ^ 0x4c49_4e4b);
        let ad_campaign = (0..POPULATIONS[AD]).map(|_| rng.below(POPULATIONS[CAMPAIGN])).collect();
        let campaign_advertiser = (0..POPULATIONS[CAMPAIGN]).map(|_| rng.below(POPULATIONS[ADVERTISER])).collect();
        Tables { rows, ad_campaign, campaign_advertiser }
    }

    /// Entity `i`'s row of group `g`, if it is a known one.
    pub fn row(&self, g: usize, i: u64) -> Option<&[f32]> {
        let w = WIDTHS[g] as usize;
        let i = usize::try_from(i).ok()?;
        self.rows[g].get(i.checked_mul(w)?..(i + 1).checked_mul(w)?)
    }

    /// The model input rows of `a`, one per ad, as the server joins them:
    /// an unknown entity reads its group's default row (zeros), and an
    /// unknown ad's campaign and advertiser are unknown too. Returns the
    /// rows and how many were missing (what `features_missing` counts).
    pub fn features(&self, a: &Auction) -> (Vec<f32>, u32) {
        let mut missing = 0;
        let mut put = |row: &mut [f32], g: usize, i: Option<u64>| {
            let dst = &mut row[offset(g)..offset(g) + WIDTHS[g] as usize];
            match i.and_then(|i| self.row(g, i)) {
                Some(r) => dst.copy_from_slice(r),
                None => {
                    dst.fill(0.0);
                    missing += 1;
                }
            }
        };
        let mut request = vec![0.0f32; ROW_DIM];
        put(&mut request, USER, Some(a.user));
        put(&mut request, DEVICE, Some(a.device));
        put(&mut request, PUBLISHER, Some(a.publisher));
        let mut x = Vec::with_capacity(a.ads.len() * ROW_DIM);
        for &ad in &a.ads {
            let mut row = request.clone();
            let campaign = self.ad_campaign.get(usize::try_from(ad).unwrap_or(usize::MAX)).copied();
            let advertiser = campaign.and_then(|c| self.campaign_advertiser.get(c as usize).copied());
            put(&mut row, AD, Some(ad));
            put(&mut row, CAMPAIGN, campaign);
            put(&mut row, ADVERTISER, advertiser);
            x.extend_from_slice(&row);
        }
        (x, missing)
    }
}

/// One auction: a user on a device at a publisher, and the candidate ads
/// (indices; the device keyed through [`device_key`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Auction {
    pub user: u64,
    pub device: u64,
    pub publisher: u64,
    pub ads: Vec<u64>,
}

impl Auction {
    /// The request that scores this auction: one key for each request-scope
    /// group, one ad id per candidate, no context.
    pub fn request(&self, request_id: u64) -> RequestSpec {
        let mut spec = RequestSpec { request_id, ..RequestSpec::default() };
        fill_request(self.user, self.device, self.publisher, |ads| ads.extend_from_slice(&self.ads), &mut spec);
        spec
    }
}

/// Writes an auction into `spec`, reusing its vectors; `ads` fills the
/// (cleared) ad ids.
fn fill_request(user: u64, device: u64, publisher: u64, ads: impl FnOnce(&mut Vec<u64>), spec: &mut RequestSpec) {
    spec.user_id = 0;
    spec.item_ids.clear();
    spec.context_ids.clear();
    spec.context.clear();
    let shaped = spec.groups.len() == KEYED.len() && spec.groups.iter().zip(KEYED).all(|((n, _), g)| n == g);
    if !shaped {
        spec.groups.clear();
        for (g, name) in KEYED.iter().enumerate() {
            let keys = if g == DEVICE { GroupKeySpec::Strs(vec![String::new()]) } else { GroupKeySpec::Ids(vec![]) };
            spec.groups.push(((*name).into(), keys));
        }
    }
    let mut ads = Some(ads);
    for (g, (_, keys)) in spec.groups.iter_mut().enumerate() {
        match keys {
            GroupKeySpec::Ids(v) => {
                v.clear();
                match g {
                    USER => v.push(user),
                    PUBLISHER => v.push(publisher),
                    _ => (ads.take().expect("one ad group"))(v),
                }
            }
            GroupKeySpec::Strs(v) => {
                v.truncate(1);
                if v.is_empty() {
                    v.push(String::new());
                }
                v[0].clear();
                write_device(device, &mut v[0]);
            }
        }
    }
}

/// Why the auction example's files could not be written.
#[derive(Debug, thiserror::Error)]
pub enum AuctionError {
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
    #[error(transparent)]
    Replica(#[from] ReplicaError),
    #[error(transparent)]
    Model(#[from] ModelError),
}

/// The `[[groups]]` the example serves: three request-scope groups and the
/// ad's chain, each required (a request without `device`, `publisher` or
/// `ad` is `BadRequest`; `user` falls back to `user_id`), widths fixed.
pub fn groups() -> Vec<GroupConfig> {
    GROUPS
        .iter()
        .enumerate()
        .map(|(g, name)| GroupConfig {
            name: (*name).into(),
            scope: SCOPES[g],
            key: if g == DEVICE { KeyType::String } else { KeyType::U64 },
            key_bytes_max: if g == DEVICE { DEVICE_KEY_BYTES } else { KEY_BYTES_MAX },
            width: Some(WIDTHS[g]),
            storage: None,
            default: Vec::new(),
            path: None,
            absent: None,
            parent: PARENTS[g].map(Into::into),
        })
        .collect()
}

/// The config file `quiver demo --workload auction` writes beside its
/// data: `quiver serve --config <dir>/quiver.toml` serves the example.
pub fn config_toml(data_dir: &Path) -> String {
    let dir = toml::Value::String(data_dir.display().to_string());
    let mut s = String::new();
    s.push_str("# The auction worked example (`quiver demo --workload auction` wrote this file):\n");
    s.push_str("# user, device and publisher keyed per request, ads per candidate; each ad's row\n");
    s.push_str("# links to its campaign's, each campaign's to its advertiser's.\n");
    let _ = writeln!(s, "data_dir = {dir}");
    let _ = writeln!(s, "canary_group = \"{CANARY_GROUP}\"");
    for g in groups() {
        let _ = write!(
            s,
            "\n[[groups]]\nname = \"{}\"\nscope = \"{}\"\nkey = \"{}\"\n",
            g.name,
            g.scope.name(),
            g.key.name()
        );
        if g.key == KeyType::String {
            let _ = writeln!(s, "key_bytes_max = {}", g.key_bytes_max);
        }
        let _ = writeln!(s, "width = {}", g.width.unwrap_or(0));
        if let Some(p) = &g.parent {
            let _ = writeln!(s, "parent = \"{p}\"");
        }
    }
    s
}

/// The example's model: an MLP over the six groups' rows in [`GROUPS`]
/// order, He-initialised from a fixed seed as the auction-32 demo's is.
pub fn model() -> Model {
    let mut rng = SplitMix64::new(SEED ^ 0x4d4f_4445_4c00);
    let layers = demo::he_layers(&mut rng, &[ROW_DIM, HIDDEN[0], HIDDEN[1], 1], 0.05);
    let inputs = GROUPS
        .iter()
        .enumerate()
        .map(|(g, name)| InputSegment {
            source: match g {
                USER => Source::User,
                _ => Source::Group { name: GroupName::new(name).expect("a valid group name"), scope: SCOPES[g] },
            },
            dim: WIDTHS[g] as usize,
        })
        .collect();
    Model {
        name: MODEL_NAME.into(),
        version: MODEL_VERSION,
        inputs,
        layers,
        calibration: None,
        graph: None,
        onnx: None,
        feature_names: Vec::new(),
    }
}

/// Paths of the example's files inside a data directory.
#[derive(Clone, Debug)]
pub struct AuctionFiles {
    /// Per group in [`GROUPS`] order: `<dir>/<group>.qrep`, the path a
    /// `[[groups]]` entry without `path` reads.
    pub replicas: [PathBuf; 6],
    pub model: PathBuf,
    pub config: PathBuf,
}

impl AuctionFiles {
    pub fn in_dir(dir: &Path) -> AuctionFiles {
        AuctionFiles {
            replicas: std::array::from_fn(|g| dir.join(format!("{}.qrep", GROUPS[g]))),
            model: dir.join("model.qm"),
            config: dir.join("quiver.toml"),
        }
    }
}

/// The kind of key group `g`'s rows link to, for a group with a parent.
fn link_kind(g: usize) -> Option<KeyKind> {
    PARENTS[g].map(|_| KeyKind::U64)
}

fn replica(tables: &Tables, g: usize) -> Result<ReplicaBuilder, ReplicaError> {
    let width = WIDTHS[g];
    let mut b = ReplicaBuilder::new(GROUPS[g], width);
    if g == DEVICE {
        b = b.str_keys(DEVICE_KEY_BYTES)?;
    }
    if let Some(kind) = link_kind(g) {
        b = b.links_to(kind)?;
    }
    let links = match g {
        AD => Some(&tables.ad_campaign),
        CAMPAIGN => Some(&tables.campaign_advertiser),
        _ => None,
    };
    let mut key = String::with_capacity(DEVICE_KEY_BYTES as usize);
    for (i, row) in tables.rows[g].chunks_exact(width as usize).enumerate() {
        let parent = links.map(|l| EntityKey::Id(l[i]));
        if g == DEVICE {
            key.clear();
            write_device(i as u64, &mut key);
            b.push_linked(EntityKey::Str(key.as_bytes()), row, parent)?;
        } else {
            b.push_linked(EntityKey::Id(i as u64), row, parent)?;
        }
    }
    Ok(b)
}

fn files_ok(files: &AuctionFiles, model: &Model) -> bool {
    let replicas_ok = files.replicas.iter().enumerate().all(|(g, p)| {
        Replica::open(p, GROUPS[g]).is_ok_and(|r| {
            r.header().row_count == POPULATIONS[g] && r.dim() == WIDTHS[g] as usize && r.link_kind() == link_kind(g)
        })
    });
    replicas_ok && files.config.exists() && Model::load(&files.model).is_ok_and(|m| &m == model)
}

/// Creates the example's files in `dir` (the six replicas, `model.qm` and
/// `quiver.toml`) unless valid ones are already there.
pub fn ensure(dir: &Path) -> Result<AuctionFiles, AuctionError> {
    std::fs::create_dir_all(dir).map_err(|source| AuctionError::Io { path: dir.to_path_buf(), source })?;
    let files = AuctionFiles::in_dir(dir);
    let model = model();
    crate::loadgen::drop_demo_fallback(dir)
        .map_err(|source| AuctionError::Io { path: dir.join("fallback.qm"), source })?;
    if files_ok(&files, &model) {
        tracing::info!(dir = %dir.display(), "auction example data present");
        return Ok(files);
    }
    tracing::info!(dir = %dir.display(), "generating the auction example's data");
    let tables = Tables::generate();
    for (g, path) in files.replicas.iter().enumerate() {
        replica(&tables, g)?.write(path)?;
    }
    model.save(&files.model)?;
    std::fs::write(&files.config, config_toml(dir))
        .map_err(|source| AuctionError::Io { path: files.config.clone(), source })?;
    Ok(files)
}

/// What `quiver bench --workload auction` draws: per request-keyed group
/// ([`KEYED`]), a population and a Zipf exponent.
pub type Mix = crate::loadgen::GroupMix<4>;

/// The example's own populations and [`ZIPF_DEFAULT`] for every group.
pub const MIX_DEFAULT: Mix = crate::loadgen::GroupMix {
    names: KEYED,
    populations: [POPULATIONS[USER], POPULATIONS[DEVICE], POPULATIONS[PUBLISHER], POPULATIONS[AD]],
    zipf: [ZIPF_DEFAULT; 4],
};

/// Generates auction requests for the load generator: a user, a device and
/// a publisher, and `candidates` ads, each key drawn Zipf over its group's
/// population.
#[derive(Clone, Debug)]
pub struct Auctions {
    ids: [Ids; 4],
    pub candidates: usize,
    /// Fraction of device keys and of ad ids drawn outside the known
    /// populations (read as the group's default row; an unknown ad's
    /// campaign and advertiser too).
    pub unknown_fraction: f64,
    pub budget_us: u32,
    rng: SplitMix64,
}

impl Auctions {
    pub fn new(mix: &Mix, seed: u64) -> Result<Auctions, String> {
        let ids = mix.ids()?;
        Ok(Auctions { ids, candidates: CANDIDATES, unknown_fraction: 0.0, budget_us: 0, rng: SplitMix64::new(seed) })
    }

    /// A key from `ids`, or, with probability `unknown`, one outside its
    /// population.
    fn draw(ids: &Ids, rng: &mut SplitMix64, unknown: f64) -> u64 {
        if unknown > 0.0 && rng.unit() < unknown {
            let n = ids.count();
            n + rng.below(u64::MAX - n)
        } else {
            ids.draw(rng)
        }
    }

    /// Fills `spec` with the next auction, reusing its allocations.
    pub fn fill(&mut self, request_id: u64, spec: &mut RequestSpec) {
        let (rng, ids, unknown) = (&mut self.rng, &self.ids, self.unknown_fraction);
        let user = Self::draw(&ids[USER], rng, 0.0);
        let device = Self::draw(&ids[DEVICE], rng, unknown);
        let publisher = Self::draw(&ids[PUBLISHER], rng, 0.0);
        let candidates = self.candidates;
        spec.request_id = request_id;
        spec.budget_us = self.budget_us;
        fill_request(
            user,
            device,
            publisher,
            |ads| ads.extend((0..candidates).map(|_| Self::draw(&ids[AD], rng, unknown))),
            spec,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_are_deterministic_and_every_link_lands() {
        let t = Tables::generate();
        assert_eq!(t, Tables::generate());
        for g in 0..GROUPS.len() {
            assert_eq!(t.rows[g].len() as u64, POPULATIONS[g] * u64::from(WIDTHS[g]), "{}", GROUPS[g]);
        }
        assert_eq!(t.ad_campaign.len() as u64, POPULATIONS[AD]);
        assert!(t.ad_campaign.iter().all(|&c| c < POPULATIONS[CAMPAIGN]));
        assert!(t.campaign_advertiser.iter().all(|&a| a < POPULATIONS[ADVERTISER]));
        // Ads share campaigns and campaigns share advertisers.
        let mut campaigns = t.ad_campaign.clone();
        campaigns.sort_unstable();
        campaigns.dedup();
        assert!(campaigns.len() > 1_000 && campaigns.len() < t.ad_campaign.len());
        assert_eq!(ROW_DIM, WIDTHS.iter().sum::<u32>() as usize);
        assert_eq!(offset(GROUPS.len()), ROW_DIM);
        // The README's `quiver score` line names device 7.
        assert_eq!(device_key(7), "1a5122783edfaa43");
        let mut seen = std::collections::HashSet::new();
        for i in 0..POPULATIONS[DEVICE] {
            let k = device_key(i);
            assert!(k.len() == DEVICE_KEY_BYTES as usize && k.bytes().all(|b| b.is_ascii_hexdigit()));
            assert!(seen.insert(k));
        }
    }

    #[test]
    fn the_model_reads_the_six_groups_and_the_config_names_the_chain() {
        let m = model();
        m.validate().unwrap();
        assert_eq!(m.to_bytes(), model().to_bytes());
        assert_eq!(m.input_dim(), ROW_DIM);
        let read: Vec<_> = m.inputs.iter().map(|s| s.source.group().unwrap()).collect();
        let want: Vec<_> = GROUPS.iter().copied().zip(SCOPES).collect();
        assert_eq!(read, want);
        #[derive(serde::Deserialize)]
        struct File {
            data_dir: PathBuf,
            canary_group: String,
            groups: Vec<GroupConfig>,
        }
        let dir = std::env::temp_dir().join("quiver-auction-config");
        let file: File = toml::from_str(&config_toml(&dir)).unwrap();
        assert_eq!((file.data_dir, file.canary_group.as_str(), &file.groups), (dir.clone(), CANARY_GROUP, &groups()));
        let legacy = |name: &str| (dir.join(format!("{name}.qrep")), None, crate::features::replica::Storage::F32);
        let legacy = crate::features::groups::legacy(legacy("user"), legacy("item"));
        let resolved = crate::features::groups::resolve_all(&file.groups, &dir, legacy).unwrap();
        assert_eq!(resolved[3].parent.as_ref().map(|p| p.0.as_str()), Some("campaign"));
        assert_eq!(resolved[4].parent.as_ref().map(|p| p.0.as_str()), Some("advertiser"));
        assert_eq!(resolved[5].child.as_deref(), Some("campaign"));
    }

    #[test]
    fn requests_carry_the_keyed_groups_and_reuse_their_vectors() {
        let mut w = Auctions::new(&MIX_DEFAULT, 5).unwrap();
        let mut spec = RequestSpec::default();
        for i in 0..100 {
            w.fill(i, &mut spec);
            let names: Vec<&str> = spec.groups.iter().map(|(n, _)| n.as_str()).collect();
            assert_eq!(names, KEYED);
            assert!(spec.item_ids.is_empty() && spec.context.is_empty());
            match (&spec.groups[0].1, &spec.groups[1].1, &spec.groups[2].1, &spec.groups[3].1) {
                (GroupKeySpec::Ids(u), GroupKeySpec::Strs(d), GroupKeySpec::Ids(p), GroupKeySpec::Ids(ads)) => {
                    assert!(u.len() == 1 && u[0] < POPULATIONS[USER]);
                    assert_eq!((d.len(), d[0].len()), (1, DEVICE_KEY_BYTES as usize));
                    assert!(p.len() == 1 && p[0] < POPULATIONS[PUBLISHER]);
                    assert_eq!(ads.len(), CANDIDATES);
                    assert!(ads.iter().all(|&a| a < POPULATIONS[AD]));
                }
                other => panic!("key kinds {other:?}"),
            }
        }
        let a = Auction { user: 1, device: 2, publisher: 3, ads: vec![4, 5] };
        let r = a.request(9);
        assert_eq!(r.groups[1].1, GroupKeySpec::Strs(vec![device_key(2)]));
        assert_eq!(r.groups[3].1, GroupKeySpec::Ids(vec![4, 5]));
        let (x, missing) = Tables::generate().features(&a);
        assert_eq!((x.len(), missing), (2 * ROW_DIM, 0));
        w.unknown_fraction = 1.0;
        w.fill(1, &mut spec);
        let GroupKeySpec::Ids(ads) = &spec.groups[3].1 else { panic!() };
        assert!(ads.iter().all(|&a| a >= POPULATIONS[AD]));
        let GroupKeySpec::Strs(d) = &spec.groups[1].1 else { panic!() };
        assert!((0..POPULATIONS[DEVICE]).all(|i| device_key(i) != d[0]));
        let empty_device = Mix { populations: [1, 0, 1, 1], ..MIX_DEFAULT };
        assert!(Auctions::new(&empty_device, 1).unwrap_err().contains("device"));
        assert_eq!(MIX_DEFAULT.parse("ad=7, user=9", MIX_DEFAULT.populations).unwrap(), [9, 50_000, 2_000, 7]);
        assert!(MIX_DEFAULT.parse("campaign=3", MIX_DEFAULT.populations).unwrap_err().contains("user, device"));
    }

    #[test]
    fn ensure_writes_the_files_fast_and_keeps_valid_ones() {
        let dir = std::env::temp_dir().join(format!("quiver-auction-ensure-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let started = std::time::Instant::now();
        let files = ensure(&dir).unwrap();
        let took = started.elapsed();
        assert!(took < std::time::Duration::from_secs(5), "took {took:?}");
        let ad = Replica::open(&files.replicas[AD], "ad").unwrap();
        assert_eq!((ad.dim(), ad.link_kind()), (WIDTHS[AD] as usize, Some(KeyKind::U64)));
        // A rewrite is a new file renamed into place: another inode.
        let inode = || std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&files.replicas[AD]).unwrap());
        let before = inode();
        ensure(&dir).unwrap();
        assert_eq!(inode(), before);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
