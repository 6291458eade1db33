//! `quiver features`: entity vectors written to and deleted from Redis, the
//! source of truth the servers' replicas follow, one at a time or from a
//! file; and `get`, one key's row as a running server serves it now (its
//! admin route `GET /features/{group}?key=K`), the first question when a
//! score looks wrong.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use quiver::features::feed;
use quiver::Error;

use super::{bearer, progress_bar};

#[derive(clap::Subcommand)]
pub enum Command {
    /// Set one entity's vector.
    Put {
        #[command(flatten)]
        target: FeedTarget,
        /// The entity: a u64 id, or with --key-bytes a string key.
        #[arg(long)]
        id: String,
        /// The vector, comma-separated.
        #[arg(long, value_delimiter = ',', allow_hyphen_values = true, required = true)]
        values: Vec<f32>,
        /// For a group with a parent (`parent = "campaign"`): the parent's
        /// key this entity names (a u64 id, or with --parent-key-bytes a
        /// string key). Without it the entity names no parent.
        #[arg(long, allow_hyphen_values = true)]
        parent: Option<String>,
        /// The parent group is keyed by strings of up to this many bytes.
        #[arg(long, requires = "parent")]
        parent_key_bytes: Option<u32>,
    },
    /// Delete entities: the ids given, and those listed in a file.
    Delete {
        #[command(flatten)]
        target: FeedTarget,
        /// Ids (or with --key-bytes string keys) to delete, comma-separated.
        #[arg(long, value_delimiter = ',')]
        id: Vec<String>,
        /// A file of ids (or string keys) to delete, one per line (`#`
        /// comments and blank lines skipped); checked whole before the
        /// first delete.
        #[arg(long)]
        ids_from: Option<PathBuf>,
    },
    /// Write every row of a text file (the `replica build` format) to Redis.
    Load {
        #[command(flatten)]
        target: FeedTarget,
        #[arg(long)]
        input: PathBuf,
        /// For a group with a parent: each row line names the parent's key
        /// after its own (`key,parent,f0,...`, `-` for none).
        #[command(flatten)]
        parent: super::replica_cmd::ParentArgs,
    },
    /// Print one key's row as a running server serves it now (its admin
    /// route GET /features/<group>?key=K): the floats after decoding,
    /// whether the key was found or the default row is served, the
    /// group's staleness and last applied change. Exits 0 when found, 2
    /// when the default row is served, 1 when no answer came back.
    Get {
        /// The server's admin address.
        #[arg(long, default_value = "127.0.0.1:7412")]
        admin: String,
        #[arg(long)]
        group: String,
        /// A decimal id for a u64 group, the key's text for a string group.
        #[arg(long, allow_hyphen_values = true)]
        key: String,
        /// Print the server's JSON answer unchanged.
        #[arg(long)]
        json: bool,
        /// The admin bearer token file (the server's `admin_token_file`).
        #[arg(long, visible_alias = "admin-token-file")]
        token_file: Option<PathBuf>,
    },
}

#[derive(clap::Args)]
pub struct FeedTarget {
    /// redis://[user:password@]host:port[/db], or
    /// redis+cluster://[user:password@]host:port[,host:port...] for a Redis Cluster
    #[arg(long, default_value = "redis://127.0.0.1:6379")]
    redis: String,
    /// Write the bucketed layout with this many buckets (hash-tagged keys,
    /// a counter and a stream per bucket: docs/REPLICA.md). The server's
    /// [feed] buckets must say the same. Default: 16 on a cluster, the plain
    /// layout on one node.
    #[arg(long)]
    buckets: Option<u16>,
    /// Feature group, e.g. user or item.
    #[arg(long)]
    group: String,
    /// Approximate bound on the group's change stream (XADD MAXLEN ~).
    #[arg(long, default_value_t = feed::contract::STREAM_MAXLEN_DEFAULT)]
    stream_maxlen: u64,
    /// The group is keyed by strings of up to this many bytes (1 to 64), as
    /// `quiver replica build --key-bytes` keys a file: ids are then string
    /// keys, and a load file's first field is the key as written. Default:
    /// u64 ids. Redis records a group's key kind at its first write and
    /// refuses a writer of the other.
    #[arg(long)]
    key_bytes: Option<u32>,
}

impl FeedTarget {
    fn publisher(&self) -> Result<feed::Publisher, Error> {
        feed::contract::check_group(&self.group).map_err(feed::FeedError::from)?;
        let publisher = match feed::redis_cluster::RedisSource::from_url(&self.redis).map_err(feed::FeedError::from)? {
            feed::redis_cluster::RedisSource::Node(config) => {
                let conn = feed::RedisConn::connect(&config).map_err(feed::FeedError::from)?;
                let plain = feed::Publisher::new(conn).map_err(feed::FeedError::from)?;
                match self.buckets {
                    None => plain,
                    Some(b) => {
                        let layout = feed::contract::Layout::bucketed(b).map_err(feed::FeedError::from)?;
                        plain.with_layout(layout).map_err(feed::FeedError::from)?
                    }
                }
            }
            feed::redis_cluster::RedisSource::Cluster { config, seeds } => {
                let conn = feed::redis_cluster::ClusterConn::connect(&config, &seeds).map_err(feed::FeedError::from)?;
                let buckets = self.buckets.unwrap_or(feed::contract::CLUSTER_BUCKETS_DEFAULT);
                feed::Publisher::cluster(conn, buckets).map_err(feed::FeedError::from)?
            }
        };
        let kind = super::replica_cmd::key_kind(self.key_bytes)?;
        Ok(publisher.with_stream_maxlen(self.stream_maxlen).with_key_kind(kind).map_err(feed::FeedError::from)?)
    }

    /// An entity named on the command line, of the group's key kind.
    fn key(&self, text: &str) -> Result<feed::contract::EntityKeyBuf, Error> {
        parse_key(text, super::replica_cmd::key_kind(self.key_bytes)?, "--key-bytes")
    }
}

/// A key named on the command line, of the kind `kind`; `flag` is what
/// makes a group string-keyed, named when a string is given for a u64 key.
fn parse_key(text: &str, kind: feed::contract::KeyKind, flag: &str) -> Result<feed::contract::EntityKeyBuf, Error> {
    match kind {
        feed::contract::KeyKind::U64 => text
            .trim()
            .parse()
            .map(feed::contract::EntityKeyBuf::Id)
            .map_err(|_| Error::Setup(format!("'{text}' is not a u64 id (give {flag} N for a string-keyed group)"))),
        feed::contract::KeyKind::Str { .. } => Ok(feed::contract::EntityKeyBuf::Str(text.as_bytes().to_vec())),
    }
}

pub fn run(cmd: Command) -> Result<ExitCode, Error> {
    let publish_err = |e: feed::PublishError| Error::Feed(e.into());
    match cmd {
        Command::Get { admin, group, key, json, token_file } => return get(&admin, &group, &key, json, token_file),
        Command::Put { target, id, values, parent, parent_key_bytes } => {
            let key = target.key(&id)?;
            let parent = match &parent {
                None => None,
                Some(text) => {
                    Some(parse_key(text, super::replica_cmd::key_kind(parent_key_bytes)?, "--parent-key-bytes")?)
                }
            };
            let mut publisher = target.publisher()?;
            let parent_key = parent.as_ref().map(feed::contract::EntityKeyBuf::as_key);
            let seq = publisher.put_linked(&target.group, key.as_key(), &values, parent_key).map_err(publish_err)?;
            let entity = publisher.layout().key_of(&target.group, key.as_key());
            println!("{} seq {seq}", String::from_utf8_lossy(&entity));
        }
        Command::Delete { target, id, ids_from } => {
            let mut keys = id.iter().map(|text| target.key(text)).collect::<Result<Vec<_>, Error>>()?;
            if let Some(path) = &ids_from {
                match target.key_bytes {
                    None => keys.extend(feed::load::read_ids(path)?.into_iter().map(feed::contract::EntityKeyBuf::Id)),
                    Some(bytes_max) => keys.extend(
                        feed::load::read_str_keys(path, bytes_max)?.into_iter().map(feed::contract::EntityKeyBuf::Str),
                    ),
                }
            }
            match keys.as_slice() {
                [] => return Err(Error::Setup("nothing to delete: give --id or --ids-from".into())),
                [one] => {
                    let mut publisher = target.publisher()?;
                    let seq = match one.as_key() {
                        feed::contract::EntityKey::Id(id) => publisher.delete(&target.group, id),
                        feed::contract::EntityKey::Str(key) => publisher.delete_str(&target.group, key),
                    }
                    .map_err(publish_err)?;
                    let entity = publisher.layout().key_of(&target.group, one.as_key());
                    println!("{} deleted, seq {seq}", String::from_utf8_lossy(&entity));
                }
                many => {
                    let started = Instant::now();
                    let bar = indicatif::ProgressBar::new(many.len() as u64);
                    let mut publisher = target.publisher()?;
                    let seq = publisher
                        .delete_many_keyed(&target.group, many, |done, _| bar.set_position(done as u64))
                        .map_err(publish_err)?;
                    bar.finish_and_clear();
                    println!(
                        "deleted {} entities of group {} in {:.2} s, last seq {seq}",
                        many.len(),
                        target.group,
                        started.elapsed().as_secs_f64()
                    );
                }
            }
        }
        Command::Load { target, input, parent } => {
            let mut publisher = target.publisher()?;
            let link = parent.link()?;
            let summary = feed::load::load_file(&mut publisher, &target.group, &input, link, load_progress())?;
            if summary.defaults_skipped > 0 {
                eprintln!(
                    "note: skipped {} 'default' line(s): the default vector belongs to the replica, not Redis",
                    summary.defaults_skipped
                );
            }
            eprintln!(
                "loaded {} entities of dim {} into group {} in {:.2} s ({:.0}/s), last seq {}",
                summary.rows,
                summary.dim,
                target.group,
                summary.elapsed_s,
                summary.rows as f64 / summary.elapsed_s.max(1e-9),
                summary.last_seq
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Progress for `features load` on stderr: a bar on a terminal, an occasional
/// plain line otherwise (so logs show the load is alive without flooding them).
fn load_progress() -> impl FnMut(usize, usize) {
    let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let bar = progress_bar(0, "loading");
    let mut last: Option<Instant> = None;
    move |done, total| {
        if tty {
            bar.set_length(total as u64);
            bar.set_position(done as u64);
            if done == total {
                bar.finish_and_clear();
            }
            return;
        }
        let now = Instant::now();
        let finished = done == total;
        if !finished && last.is_some_and(|t| now.duration_since(t) < Duration::from_secs(5)) {
            return;
        }
        if last.is_none() && finished {
            return;
        }
        last = Some(now);
        eprintln!("{done}/{total} entities ({:.0}%)", 100.0 * done as f64 / total.max(1) as f64);
    }
}

/// How long `features get` waits for the admin endpoint's answer.
const GET_TIMEOUT: Duration = Duration::from_secs(10);

/// `features get`: asks the admin endpoint, prints its answer, and exits 2
/// when the server serves the default row for the key, so a script can
/// tell "not in the replica" from "found" without parsing.
fn get(admin: &str, group: &str, key: &str, json: bool, token_file: Option<PathBuf>) -> Result<ExitCode, Error> {
    // Checked here, not only by the server, since it goes into the URL's path.
    quiver::features::groups::check_name(group).map_err(Error::Setup)?;
    let url = format!("http://{admin}/features/{group}?key={}", percent_encode(key.as_bytes()));
    let agent: ureq::Agent =
        ureq::Agent::config_builder().timeout_global(Some(GET_TIMEOUT)).http_status_as_error(false).build().into();
    let mut req = agent.get(&url);
    if let Some(a) = bearer(token_file.as_deref())? {
        req = req.header("Authorization", a);
    }
    let mut resp = req.call().map_err(|e| Error::Setup(format!("{url}: {e}")))?;
    let code = resp.status().as_u16();
    let body = resp.body_mut().read_to_string().map_err(|e| Error::Setup(format!("{url}: {e}")))?;
    if code != 200 {
        return Err(Error::Setup(format!("{url}: {code}: {}", body.trim())));
    }
    let row: serde_json::Value = serde_json::from_str(&body).map_err(|e| Error::Setup(format!("{url}: {e}")))?;
    let found = row["found"].as_bool().ok_or_else(|| Error::Setup(format!("{url}: no 'found' in {body}")))?;
    if json {
        print!("{body}");
    } else {
        print!("{}", render_row(&row, found));
    }
    Ok(if found { ExitCode::SUCCESS } else { ExitCode::from(2) })
}

/// Every byte but RFC 3986's unreserved ones as `%XX`, so any key reaches
/// the server as it was typed (a `+`, `&`, `%` or space included).
fn percent_encode(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 3);
    for &b in bytes {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The route's answer for a person: what the group is, whether the key was
/// found, the row (index and value), then how current the group is.
fn render_row(row: &serde_json::Value, found: bool) -> String {
    let text = |k: &str| row[k].as_str().unwrap_or("?").to_string();
    let mut out = format!(
        "group {}: {} keys, {} scope, {} storage, width {}, a request without its key: {}\n",
        text("group"),
        text("key_type"),
        text("scope"),
        text("storage"),
        row["width"],
        text("absent"),
    );
    let key = match row["key_hex"].as_str() {
        Some(hex) => format!("{:?} (bytes {hex})", text("key")),
        None => format!("{:?}", text("key")),
    };
    if found {
        out.push_str(&format!("key {key}: found\n"));
    } else {
        out.push_str(&format!("key {key}: NOT in the replica: the group's default row is served\n"));
    }
    out.push_str("index  value\n");
    for (i, v) in row["row"].as_array().map(Vec::as_slice).unwrap_or_default().iter().enumerate() {
        out.push_str(&format!("{i:>5}  {v}\n"));
    }
    if let Some(parent) = row["parent"].as_object() {
        let group = parent.get("group").and_then(|g| g.as_str()).unwrap_or("?");
        match parent.get("key").and_then(|k| k.as_str()) {
            Some(key) => out.push_str(&format!("parent: {group} {key:?} (its row is joined through this link)\n")),
            None => out.push_str(&format!("parent: names no {group} (the {group} default row is served)\n")),
        }
    }
    match row["staleness_ms"].as_u64() {
        Some(ms) => out.push_str(&format!("staleness {ms} ms (the replica follows redis)\n")),
        None => out.push_str("staleness unknown: no [feed], the replica file is served as it is\n"),
    }
    let seq = &row["group_applied_seq"];
    match row["group_change_unix_ms"].as_u64() {
        Some(ms) => {
            let now_ms =
                std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
            let age_s = now_ms.saturating_sub(ms) as f64 / 1e3;
            out.push_str(&format!(
                "group's last applied change: {} UTC ({age_s:.1} s ago), seq {seq}; not this row's: replicas keep \
                 no per-row time\n",
                utc(ms)
            ));
        }
        None => out.push_str(&format!("group's last applied change: none recorded (seq {seq})\n")),
    }
    out
}

/// Unix milliseconds as `YYYY-MM-DD hh:mm:ss.mmm` (proleptic Gregorian,
/// UTC), by the days-to-civil conversion of Howard Hinnant's date library.
fn utc(unix_ms: u64) -> String {
    let (days, ms_of_day) = ((unix_ms / 86_400_000) as i64, unix_ms % 86_400_000);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let (h, m, s, ms) = (ms_of_day / 3_600_000, ms_of_day / 60_000 % 60, ms_of_day / 1000 % 60, ms_of_day % 1000);
    format!("{year:04}-{month:02}-{day:02} {h:02}:{m:02}:{s:02}.{ms:03}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_encoded_and_times_are_utc() {
        assert_eq!(percent_encode(b"a b+c/%&=~"), "a%20b%2Bc%2F%25%26%3D~");
        assert_eq!(utc(0), "1970-01-01 00:00:00.000");
        assert_eq!(utc(951_782_400_123), "2000-02-29 00:00:00.123");
        assert_eq!(utc(1_764_892_842_500), "2025-12-05 00:00:42.500");
    }
}
