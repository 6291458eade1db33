//! `quiver replica`: feature replica files built from text, copied whole
//! from Redis, checked and described, and a running server's held resync
//! accepted over its admin port.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use quiver::features::feed;
use quiver::features::replica::{KeyKind, Replica, ReplicaBuilder, Storage};
use quiver::Error;

use super::bearer;

#[derive(clap::Subcommand)]
pub enum Command {
    /// Build a replica file from a text input file (see docs/REPLICA.md).
    Build {
        /// Feature group name (`user`, `item`, or a named group: 1 to 16
        /// ASCII letters, digits, '_' or '-').
        #[arg(long)]
        group: String,
        #[arg(long)]
        input: PathBuf,
        #[arg(long)]
        out: PathBuf,
        /// How vectors are stored: f32 (exact), f16 or int8 (see docs/REPLICA.md).
        #[arg(long, default_value = "f32", value_parser = parse_storage)]
        storage: Storage,
        /// Key the group by strings of up to this many bytes (1 to 64): each
        /// line's first field is then the key as written. Default: u64 ids.
        #[arg(long)]
        key_bytes: Option<u32>,
        /// For a group with a parent: each row line names the parent's key
        /// after its own (`key,parent,f0,...`, `-` for none).
        #[command(flatten)]
        parent: ParentArgs,
    },
    /// Full sync of one group from Redis into a replica file, with progress
    /// on stderr (the server does the same when it has no usable file).
    Sync {
        #[arg(long, default_value = "redis://127.0.0.1:6379")]
        redis: String,
        #[arg(long)]
        group: String,
        /// Vector dimension of the group.
        #[arg(long)]
        dim: u32,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value = "f32", value_parser = parse_storage)]
        storage: Storage,
        /// Connections to copy over (1 to 16): one SCANs, the others MGET in parallel.
        #[arg(long, default_value_t = 4)]
        connections: usize,
        /// The group is stored in this many buckets (as `quiver features
        /// --buckets` wrote it; [feed] buckets must say the same): one file
        /// per bucket beside --out, named as the server names them. Default:
        /// 16 on a cluster, the plain layout (one file) on one node.
        #[arg(long)]
        buckets: Option<u16>,
        /// The group is keyed by strings of up to this many bytes (1 to 64),
        /// as `quiver features --key-bytes` wrote it. Default: u64 ids.
        #[arg(long)]
        key_bytes: Option<u32>,
        #[command(flatten)]
        parent: ParentArgs,
    },
    /// Verify a replica file and print its header.
    Inspect {
        #[arg(long)]
        group: String,
        #[arg(long)]
        file: PathBuf,
    },
    /// Accept a held resync on a running server: the copy of what Redis has
    /// now replaces the replica's last-known-good rows (see docs/REPLICA.md).
    Accept {
        /// The server's admin address.
        #[arg(long, default_value = "127.0.0.1:7412")]
        admin: String,
        #[arg(long)]
        group: String,
        /// The admin bearer token file (the server's `admin_token_file`).
        #[arg(long)]
        token_file: Option<PathBuf>,
    },
}

/// Whether a group's rows link to a parent (`parent = ...` in its
/// `[[groups]]` entry), and the parent's key kind.
#[derive(clap::Args)]
pub struct ParentArgs {
    /// The group has a parent keyed by u64 ids: each value names one after
    /// its vector (`quiver features put --parent`), kept in the file's rows.
    #[arg(long)]
    parent_ids: bool,
    /// The group has a parent keyed by strings of up to this many bytes.
    #[arg(long, conflicts_with = "parent_ids")]
    parent_key_bytes: Option<u32>,
}

impl ParentArgs {
    /// The parent's key kind; none without a parent.
    pub fn link(&self) -> Result<Option<KeyKind>, Error> {
        match (self.parent_ids, self.parent_key_bytes) {
            (false, None) => Ok(None),
            (_, bytes) => key_kind(bytes).map(Some),
        }
    }
}

/// A group name a replica file can carry and Redis keys can hold.
fn check_group(group: &str) -> Result<(), Error> {
    let max = quiver::features::replica::GROUP_NAME_BYTES_MAX;
    if feed::contract::check_group(group).is_err() || group.len() > max {
        return Err(Error::Setup(format!(
            "group '{group}': use 1 to {max} ASCII letters, digits, '_' or '-' (user, item, or a named group)"
        )));
    }
    Ok(())
}

/// The key kind `--key-bytes` names: absent, u64 ids.
pub fn key_kind(key_bytes: Option<u32>) -> Result<KeyKind, Error> {
    match key_bytes {
        None => Ok(KeyKind::U64),
        Some(bytes_max @ 1..=quiver::features::replica::KEY_BYTES_MAX) => Ok(KeyKind::Str { bytes_max }),
        Some(bytes_max) => Err(quiver::features::replica::ReplicaError::KeyBytesMax { bytes_max }.into()),
    }
}

fn parse_storage(s: &str) -> Result<Storage, String> {
    Storage::parse(s).ok_or_else(|| format!("unknown storage '{s}': use f32, f16 or int8"))
}

pub fn run(cmd: Command) -> Result<ExitCode, Error> {
    match cmd {
        Command::Build { group, input, out, storage, key_bytes, parent } => {
            check_group(&group)?;
            let text =
                std::fs::read_to_string(&input).map_err(|e| Error::Setup(format!("{}: {e}", input.display())))?;
            let keys = key_kind(key_bytes)?;
            let name = input.display().to_string();
            let builder =
                ReplicaBuilder::from_text_linked(&group, keys, parent.link()?, &text, &name)?.storage(storage);
            builder.write(&out)?;
            let r = Replica::open(&out, &group)?;
            println!(
                "wrote {}: group {} dim {} rows {} ({})",
                out.display(),
                group,
                r.dim(),
                r.header().row_count,
                r.key_kind()
            );
        }
        Command::Sync { redis, group, dim, out, storage, connections, buckets, key_bytes, parent } => {
            check_group(&group)?;
            let key_kind = key_kind(key_bytes)?;
            let link = parent.link()?;
            if dim == 0 || dim > quiver::features::replica::DIM_MAX {
                return Err(Error::Setup(format!("--dim must be 1 to {}", quiver::features::replica::DIM_MAX)));
            }
            if !(1..=feed::sync::SYNC_CONNECTIONS_MAX).contains(&connections) {
                return Err(Error::Setup(format!("--connections must be 1 to {}", feed::sync::SYNC_CONNECTIONS_MAX)));
            }
            let source = feed::redis_cluster::RedisSource::from_url(&redis).map_err(feed::FeedError::from)?;
            let layout = match (buckets, &source) {
                (None, feed::redis_cluster::RedisSource::Node(_)) => feed::contract::Layout::Plain,
                (None, feed::redis_cluster::RedisSource::Cluster { .. }) => {
                    feed::contract::Layout::bucketed(feed::contract::CLUSTER_BUCKETS_DEFAULT)
                        .map_err(feed::FeedError::from)?
                }
                (Some(b), _) => feed::contract::Layout::bucketed(b).map_err(feed::FeedError::from)?,
            };
            let started = Instant::now();
            let spinner = indicatif::ProgressBar::new_spinner().with_style(
                indicatif::ProgressStyle::with_template("{spinner} {human_pos} entities copied ({per_sec}, {elapsed})")
                    .expect("a valid template"),
            );
            spinner.enable_steady_tick(Duration::from_millis(100));
            let mut progress = |rows: u64| spinner.set_position(rows);
            let default = vec![0.0; dim as usize];
            let target = feed::sync::GroupTarget {
                link,
                group: &group,
                layout,
                key_kind,
                path: &out,
                dim: dim as usize,
                storage,
                default: &default,
                batch_keys_max: 1000,
                connections,
            };
            let copies = feed::sync::sync_group(&source, &target, &mut progress)?;
            spinner.finish_and_clear();
            let secs = started.elapsed().as_secs_f64();
            let rows: u64 = copies.iter().map(|(_, w)| w.live_rows()).sum();
            for (path, fresh) in &copies {
                println!("{}: {} entities, stream seq {}", path.display(), fresh.live_rows(), fresh.cursor().seq);
            }
            println!(
                "synced {rows} entities of group {group} into {} file{} in {secs:.2} s ({:.0}/s)",
                copies.len(),
                if copies.len() == 1 { "" } else { "s" },
                rows as f64 / secs.max(1e-9),
            );
        }
        Command::Accept { admin, group, token_file } => {
            let url = format!("http://{admin}/replica/{group}/accept");
            let agent: ureq::Agent = ureq::Agent::config_builder()
                .timeout_global(Some(Duration::from_secs(10)))
                .http_status_as_error(false)
                .build()
                .into();
            let mut req = agent.post(&url);
            if let Some(a) = bearer(token_file.as_deref())? {
                req = req.header("Authorization", a);
            }
            let mut resp = req.send_empty().map_err(|e| Error::Setup(format!("{url}: {e}")))?;
            let code = resp.status().as_u16();
            let body = resp.body_mut().read_to_string().map_err(|e| Error::Setup(format!("{url}: {e}")))?;
            let reply: serde_json::Value = serde_json::from_str(&body).unwrap_or(serde_json::Value::String(body));
            return match code {
                200 => {
                    println!("accepted: group {group} now serves {} rows", reply["rows"]);
                    if reply["held"] == true {
                        println!("the next copy from redis is swapped in whatever its size");
                    }
                    Ok(ExitCode::SUCCESS)
                }
                202 => {
                    println!(
                        "requested: the server has not acted on it yet (copying or reconnecting); watch quiver stats"
                    );
                    Ok(ExitCode::SUCCESS)
                }
                _ => Err(Error::Setup(format!(
                    "{url}: {code}: {}",
                    reply["error"].as_str().unwrap_or(&reply.to_string())
                ))),
            };
        }
        Command::Inspect { group, file } => {
            let r = Replica::open(&file, &group)?;
            let h = r.header();
            let c = r.cursor_at_open();
            println!(
                "{}: ok; group {} dim {} storage {:?} {} rows {} capacity {} index slots {}; redis epoch {} seq {}",
                file.display(),
                h.group,
                h.dim,
                h.storage,
                h.keys,
                h.row_count,
                h.row_capacity,
                h.slot_count,
                c.epoch,
                c.seq
            );
            if let Some(kind) = h.link {
                println!("links: each row names its parent's key ({kind})");
            }
            let (entities, bytes) = (r.live_rows(), r.file_bytes());
            let mib = |b: u64| b as f64 / (1 << 20) as f64;
            println!(
                "size: {entities} entities, {:.1} MiB file ({:.0} bytes per entity), {:.1} MiB resident when served \
                 (pages are pre-faulted at open; replica_lock locks them)",
                mib(bytes),
                bytes as f64 / entities.max(1) as f64,
                mib(r.resident_bytes())
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}
