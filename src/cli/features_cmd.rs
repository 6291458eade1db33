//! `quiver features`: entity vectors written to and deleted from Redis, the
//! source of truth the servers' replicas follow, one at a time or from a
//! file.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use quiver::features::feed;
use quiver::Error;

use super::progress_bar;

#[derive(clap::Subcommand)]
pub enum Command {
    /// Set one entity's vector.
    Put {
        #[command(flatten)]
        target: FeedTarget,
        #[arg(long)]
        id: u64,
        /// The vector, comma-separated.
        #[arg(long, value_delimiter = ',', allow_hyphen_values = true, required = true)]
        values: Vec<f32>,
    },
    /// Delete entities: the ids given, and those listed in a file.
    Delete {
        #[command(flatten)]
        target: FeedTarget,
        /// Ids to delete, comma-separated.
        #[arg(long, value_delimiter = ',')]
        id: Vec<u64>,
        /// A file of ids to delete, one per line (`#` comments and blank
        /// lines skipped); checked whole before the first delete.
        #[arg(long)]
        ids_from: Option<PathBuf>,
    },
    /// Write every row of a text file (the `replica build` format) to Redis.
    Load {
        #[command(flatten)]
        target: FeedTarget,
        #[arg(long)]
        input: PathBuf,
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
        Ok(publisher.with_stream_maxlen(self.stream_maxlen))
    }
}

pub fn run(cmd: Command) -> Result<ExitCode, Error> {
    let publish_err = |e: feed::PublishError| Error::Feed(e.into());
    match cmd {
        Command::Put { target, id, values } => {
            let mut publisher = target.publisher()?;
            let seq = publisher.put(&target.group, id, &values).map_err(publish_err)?;
            println!("{} seq {seq}", publisher.layout().entity_key(&target.group, id));
        }
        Command::Delete { target, mut id, ids_from } => {
            if let Some(path) = &ids_from {
                id.extend(feed::load::read_ids(path)?);
            }
            match id.as_slice() {
                [] => return Err(Error::Setup("nothing to delete: give --id or --ids-from".into())),
                [one] => {
                    let mut publisher = target.publisher()?;
                    let seq = publisher.delete(&target.group, *one).map_err(publish_err)?;
                    println!("{} deleted, seq {seq}", publisher.layout().entity_key(&target.group, *one));
                }
                many => {
                    let started = Instant::now();
                    let bar = indicatif::ProgressBar::new(many.len() as u64);
                    let seq = target
                        .publisher()?
                        .delete_many(&target.group, many, |done, _| bar.set_position(done as u64))
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
        Command::Load { target, input } => {
            let mut publisher = target.publisher()?;
            let summary = feed::load::load_file(&mut publisher, &target.group, &input, load_progress())?;
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
