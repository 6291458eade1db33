//! Redis Cluster routing: which hash slot a key is in, which master owns
//! each slot, and a set of per-node connections that sends each command to
//! the node owning its key and follows the cluster's redirections.
//!
//! The cluster splits its keyspace into 16,384 slots (CRC16 of the key, or
//! of the part between the first `{` and the next `}`: a hash tag, which is
//! how keys that one script changes together are kept on one node). The
//! topology comes from `CLUSTER SLOTS`, asked of any known node. A node that
//! no longer owns a slot answers `MOVED slot host:port` (the slot moved for
//! good: the topology is read again) or, while the slot is being migrated,
//! `ASK slot host:port` (this one command goes to the other node, preceded
//! by `ASKING`). Redirections are bounded, so a cluster that keeps moving
//! surfaces as a typed error instead of a loop. A redirection is followed
//! only to a node the topology names (read again first if it does not yet):
//! the address comes in an error message, and a connection to it would be
//! sent the credentials.
//!
//! Built on [`RedisConn`]: one blocking connection per node, opened on
//! first use with the configured credentials and timeouts. Cluster nodes
//! have only database 0.

use std::collections::{HashMap, HashSet};

use super::resp::{redact_url, RedisConfig, RedisConn, RedisError, Reply, UrlError};

/// Hash slots of a Redis Cluster.
pub const SLOTS: u16 = 16_384;

/// Redirections one command may follow. A resharding moves a slot once;
/// more than a few in a row means the topology is changing under us faster
/// than it can be read.
const REDIRECTS_MAX: usize = 5;

/// How often one command is sent again after `TRYAGAIN` (a multi-key
/// command while its slot migrates) or `CLUSTERDOWN` (a failover under
/// way), and how long it waits between: about 2 s in all, a migration
/// batch's time and more.
const RETRIES_MAX: u32 = 40;
const RETRY_PAUSE_MS: u64 = 50;

/// Nodes a topology may name; a bound on the connections a [`ClusterConn`]
/// opens.
pub const NODES_MAX: usize = 1_000;

/// Why a cluster call failed beyond what one node's [`RedisError`] says.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error(transparent)]
    Redis(#[from] RedisError),
    #[error("redis cluster: no seed node answered CLUSTER SLOTS ({tried})")]
    NoSeed { tried: String },
    #[error("redis cluster {addr}: CLUSTER SLOTS reply: {what}")]
    Topology { addr: String, what: String },
    #[error("redis cluster: slot {slot} has no master in the topology")]
    Unowned { slot: u16 },
    #[error("redis cluster: gave up on slot {slot} after {REDIRECTS_MAX} redirections (last to {to})")]
    Redirects { slot: u16, to: String },
    #[error("redis cluster: database {db} selected, but cluster nodes have only database 0")]
    Database { db: u32 },
    #[error(
        "redis cluster: slot {slot} was redirected to {to}, which CLUSTER SLOTS does not name; not \
         connecting to it with the credentials"
    )]
    Stranger { slot: u16, to: String },
}

/// Where the features live: one Redis node, or a cluster reached through
/// seed nodes.
#[derive(Clone, Debug)]
pub enum RedisSource {
    Node(RedisConfig),
    /// `config.addr` is the first seed; every node gets `config`'s
    /// credentials, timeouts and TLS.
    Cluster {
        config: RedisConfig,
        seeds: Vec<String>,
    },
}

impl RedisSource {
    /// `redis://…` or `rediss://…` (see [`RedisConfig::from_url`]) for one
    /// node; `redis+cluster://[user:password@]host:port[,host:port…]` (or
    /// `rediss+cluster://…` with the same TLS options) for a cluster, any of
    /// whose nodes may be named.
    pub fn from_url(url: &str) -> Result<RedisSource, UrlError> {
        let Some((scheme, rest)) = url.split_once("://") else {
            return Ok(RedisSource::Node(RedisConfig::from_url(url)?));
        };
        let Some(base) = scheme.to_ascii_lowercase().strip_suffix("+cluster").map(String::from) else {
            return Ok(RedisSource::Node(RedisConfig::from_url(url)?));
        };
        let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(authority_end);
        let (userinfo, hosts) = match authority.rsplit_once('@') {
            Some((u, h)) => (format!("{u}@"), h),
            None => (String::new(), authority),
        };
        let mut seeds = Vec::new();
        let mut config = None;
        for host in hosts.split(',') {
            let bad = |what: String| UrlError { url: redact_url(url), what };
            let one = RedisConfig::from_url(&format!("{base}://{userinfo}{host}{tail}")).map_err(|e| bad(e.what))?;
            if one.db != 0 {
                return Err(bad("cluster nodes have only database 0".into()));
            }
            seeds.push(one.addr.clone());
            config.get_or_insert(one);
        }
        let config = config.expect("split yields at least one host");
        Ok(RedisSource::Cluster { config, seeds })
    }

    /// The address to name in logs: the node, or the first seed.
    pub fn addr(&self) -> &str {
        match self {
            RedisSource::Node(config) | RedisSource::Cluster { config, .. } => &config.addr,
        }
    }

    pub fn config(&self) -> &RedisConfig {
        match self {
            RedisSource::Node(config) | RedisSource::Cluster { config, .. } => config,
        }
    }
}

/// The hash slot of `key`, as the cluster computes it (CRC16/XMODEM of the
/// key or of its hash tag, modulo 16,384).
pub fn key_slot(key: &[u8]) -> u16 {
    let hashed = match key.iter().position(|&b| b == b'{') {
        Some(open) => match key[open + 1..].iter().position(|&b| b == b'}') {
            // An empty tag (`{}`) does not count: the whole key is hashed.
            Some(len) if len > 0 => &key[open + 1..open + 1 + len],
            _ => key,
        },
        None => key,
    };
    crc16(hashed) % SLOTS
}

/// CRC16/XMODEM (polynomial 0x1021, initial value 0, no reflection): the
/// checksum Redis Cluster hashes keys with.
fn crc16(bytes: &[u8]) -> u16 {
    let mut crc = 0u16;
    for &b in bytes {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 { (crc << 1) ^ 0x1021 } else { crc << 1 };
        }
    }
    crc
}

/// A contiguous range of slots and the nodes serving it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotRange {
    pub start: u16,
    /// Inclusive, as the cluster reports it.
    pub end: u16,
    /// `host:port` of the master.
    pub master: String,
    pub replicas: Vec<String>,
}

/// Which master owns each slot, as some node reported it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Topology {
    /// Sorted by `start`, not overlapping.
    ranges: Vec<SlotRange>,
}

impl Topology {
    /// Reads a `CLUSTER SLOTS` reply from the node at `from` (`host:port`).
    /// A node that announces an empty address means "the address you asked
    /// me on": its host is taken from `from`.
    pub fn parse_slots(reply: Reply, from: &str) -> Result<Topology, ClusterError> {
        let bad = |what: String| ClusterError::Topology { addr: from.into(), what };
        let from_host = from.rsplit_once(':').map_or(from, |(host, _)| host);
        let entries = match reply {
            Reply::Array(entries) => entries,
            Reply::Error(e) => return Err(bad(e)),
            other => return Err(bad(format!("expected an array, got {other:?}"))),
        };
        let mut ranges = Vec::with_capacity(entries.len());
        for entry in entries {
            let parts = entry.into_array().ok_or_else(|| bad("a range is not an array".into()))?;
            if parts.len() < 3 {
                return Err(bad(format!("a range has {} fields, expected at least 3", parts.len())));
            }
            let slot = |r: &Reply| {
                r.as_int()
                    .filter(|&s| (0..i64::from(SLOTS)).contains(&s))
                    .map(|s| s as u16)
                    .ok_or_else(|| bad(format!("slot {r:?} out of range")))
            };
            let (start, end) = (slot(&parts[0])?, slot(&parts[1])?);
            if start > end {
                return Err(bad(format!("range {start}-{end} is reversed")));
            }
            let mut nodes =
                parts[2..].iter().map(|n| node_addr(n, from_host).ok_or_else(|| bad(format!("node {n:?}"))));
            let master = nodes.next().expect("checked: at least one node")?;
            let replicas = nodes.collect::<Result<Vec<_>, _>>()?;
            ranges.push(SlotRange { start, end, master, replicas });
        }
        ranges.sort_by_key(|r| r.start);
        if let Some(w) = ranges.windows(2).find(|w| w[1].start <= w[0].end) {
            return Err(bad(format!("ranges {}-{} and {}-{} overlap", w[0].start, w[0].end, w[1].start, w[1].end)));
        }
        let topology = Topology { ranges };
        if topology.nodes().len() > NODES_MAX {
            return Err(bad(format!("more than {NODES_MAX} nodes")));
        }
        Ok(topology)
    }

    pub fn ranges(&self) -> &[SlotRange] {
        &self.ranges
    }

    /// The master that owns `slot`, if any does.
    pub fn master_of(&self, slot: u16) -> Option<&str> {
        let i = self.ranges.partition_point(|r| r.end < slot);
        self.ranges.get(i).filter(|r| r.start <= slot).map(|r| r.master.as_str())
    }

    /// Every master, once each, in slot order.
    pub fn masters(&self) -> Vec<&str> {
        once_each(self.ranges.iter().map(|r| r.master.as_str()))
    }

    /// Every node, masters first, then replicas, once each.
    pub fn nodes(&self) -> Vec<&str> {
        let replicas = self.ranges.iter().flat_map(|r| r.replicas.iter().map(String::as_str));
        once_each(self.ranges.iter().map(|r| r.master.as_str()).chain(replicas))
    }

    /// Whether every slot has a master (the cluster can serve any key).
    pub fn covers_all_slots(&self) -> bool {
        let mut next = 0u32;
        for r in &self.ranges {
            if u32::from(r.start) != next {
                return false;
            }
            next = u32::from(r.end) + 1;
        }
        next == u32::from(SLOTS)
    }
}

/// `names` in their order, without repeats (a reply may name thousands of
/// ranges: no quadratic scan).
fn once_each<'a>(names: impl Iterator<Item = &'a str>) -> Vec<&'a str> {
    let mut seen = HashSet::new();
    names.filter(|n| seen.insert(*n)).collect()
}

/// `host:port` of one node entry of `CLUSTER SLOTS` (`[ip, port, id, ...]`).
fn node_addr(node: &Reply, from_host: &str) -> Option<String> {
    let Reply::Array(fields) = node else { return None };
    let host = std::str::from_utf8(fields.first()?.as_bytes()?).ok()?;
    let port = fields.get(1)?.as_int().filter(|p| (1..=65_535).contains(p))?;
    let host = if host.is_empty() || host == "?" { from_host } else { host };
    Some(if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    })
}

/// Where a cluster node sent a command instead of running it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Redirect {
    /// The slot is served by `to` from now on.
    Moved { slot: u16, to: String },
    /// The slot is being migrated to `to`: ask it, once, for this command.
    Ask { slot: u16, to: String },
}

impl Redirect {
    /// The redirection an error reply names, if it names one.
    pub fn parse(reply: &Reply) -> Option<Redirect> {
        let Reply::Error(message) = reply else { return None };
        let mut words = message.split(' ');
        let kind = words.next()?;
        let slot = words.next()?.parse().ok().filter(|&s| s < SLOTS)?;
        // Redis writes an IPv6 endpoint unbracketed ("::1:7000"); the
        // topology brackets it, and the two are compared.
        let to = words.next()?;
        let to = match to.rsplit_once(':') {
            Some((host, port)) if host.contains(':') && !host.starts_with('[') => format!("[{host}]:{port}"),
            _ => to.to_string(),
        };
        match kind {
            "MOVED" => Some(Redirect::Moved { slot, to }),
            "ASK" => Some(Redirect::Ask { slot, to }),
            _ => None,
        }
    }
}

/// Connections to the nodes of one cluster, and the topology they route by.
pub struct ClusterConn {
    /// Credentials, timeouts and TLS for every node; `addr` is set per node.
    config: RedisConfig,
    /// Where to ask for the topology when no known node answers.
    seeds: Vec<String>,
    topology: Topology,
    nodes: HashMap<String, RedisConn>,
    /// Topology reads so far (the first included): for tests and metrics.
    refreshes: u64,
}

impl ClusterConn {
    /// Reads the topology from the first of `seeds` (`host:port`) that
    /// answers, with `config`'s credentials, timeouts and TLS.
    pub fn connect(config: &RedisConfig, seeds: &[String]) -> Result<ClusterConn, ClusterError> {
        if config.db != 0 {
            return Err(ClusterError::Database { db: config.db });
        }
        let mut conn = ClusterConn {
            config: config.clone(),
            seeds: seeds.to_vec(),
            topology: Topology::default(),
            nodes: HashMap::new(),
            refreshes: 0,
        };
        conn.refresh()?;
        Ok(conn)
    }

    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    pub fn refreshes(&self) -> u64 {
        self.refreshes
    }

    /// Reads the topology again: from the known masters first, then the
    /// seeds. Connections to nodes no longer in it are closed.
    pub fn refresh(&mut self) -> Result<(), ClusterError> {
        let mut candidates: Vec<String> = self.topology.masters().into_iter().map(String::from).collect();
        for seed in &self.seeds {
            if !candidates.contains(seed) {
                candidates.push(seed.clone());
            }
        }
        let mut tried = Vec::new();
        for addr in candidates {
            let reply = self.node(&addr).and_then(|c| c.command(&[b"CLUSTER", b"SLOTS"]));
            match reply {
                Ok(reply) => {
                    let topology = Topology::parse_slots(reply, &addr)?;
                    let known = topology.nodes().into_iter().map(String::from).collect::<Vec<_>>();
                    self.nodes.retain(|a, _| known.contains(a));
                    self.topology = topology;
                    self.refreshes += 1;
                    return Ok(());
                }
                Err(e) => {
                    self.nodes.remove(&addr);
                    tried.push(format!("{addr}: {e}"));
                }
            }
        }
        Err(ClusterError::NoSeed { tried: tried.join("; ") })
    }

    /// The connection to `addr`, opened if need be.
    pub fn node(&mut self, addr: &str) -> Result<&mut RedisConn, RedisError> {
        if !self.nodes.contains_key(addr) {
            let config = RedisConfig { addr: addr.into(), ..self.config.clone() };
            let conn = RedisConn::connect(&config)?;
            self.nodes.insert(addr.into(), conn);
        }
        Ok(self.nodes.get_mut(addr).expect("inserted above"))
    }

    /// Runs `args` on the master owning `key`'s slot, following `MOVED`
    /// (reading the topology again) and `ASK` redirections; any other error
    /// reply is `Err(RedisError::Server)`, as from [`RedisConn::command`]. Every key the
    /// command names must be in that slot, as the cluster requires. A node
    /// that cannot be reached or fails mid-command makes the topology be
    /// read again, and the command goes to the slot's new master if it has
    /// one (a failover); a command is only resent where the node never
    /// answered it, so writes must be idempotent or checked by the caller.
    /// `TRYAGAIN` and `CLUSTERDOWN` are waited out, up to about 2 s.
    pub fn command(&mut self, key: &[u8], args: &[&[u8]]) -> Result<Reply, ClusterError> {
        let slot = key_slot(key);
        let mut to = self.topology.master_of(slot).ok_or(ClusterError::Unowned { slot })?.to_string();
        let mut asking = false;
        let mut retries = 0;
        let mut redirects = 0;
        while redirects <= REDIRECTS_MAX {
            let reply = match self.send(&to, args, asking) {
                Ok(reply) => reply,
                Err(e) => {
                    self.nodes.remove(&to);
                    self.refresh()?;
                    match self.topology.master_of(slot) {
                        Some(next) if next != to => {
                            (to, asking) = (next.to_string(), false);
                            continue;
                        }
                        _ => return Err(e.into()),
                    }
                }
            };
            if is_transient(&reply) && retries < RETRIES_MAX {
                retries += 1;
                std::thread::sleep(std::time::Duration::from_millis(RETRY_PAUSE_MS));
                if matches!(&reply, Reply::Error(m) if m.starts_with("CLUSTERDOWN")) {
                    self.refresh()?;
                    to = self.topology.master_of(slot).ok_or(ClusterError::Unowned { slot })?.to_string();
                    asking = false;
                }
                continue;
            }
            redirects += 1;
            match Redirect::parse(&reply) {
                None => {
                    return match reply {
                        Reply::Error(message) => Err(RedisError::Server { addr: to, message }.into()),
                        reply => Ok(reply),
                    }
                }
                Some(Redirect::Moved { to: next, .. }) => {
                    self.refresh()?;
                    (to, asking) = (self.member(slot, next)?, false);
                }
                Some(Redirect::Ask { to: next, .. }) => (to, asking) = (self.member(slot, next)?, true),
            }
        }
        Err(ClusterError::Redirects { slot, to })
    }

    /// `to` when the topology names it, read again first if it does not:
    /// a node being added gets its first slot by a migration, and is named
    /// once it owns one. A redirection elsewhere is refused.
    fn member(&mut self, slot: u16, to: String) -> Result<String, ClusterError> {
        let known = |c: &ClusterConn| c.topology.nodes().contains(&to.as_str());
        if !known(self) {
            self.refresh()?;
        }
        if known(self) {
            Ok(to)
        } else {
            Err(ClusterError::Stranger { slot, to })
        }
    }

    /// Whether `slot` is served by the master the topology names, and is
    /// neither being migrated away nor imported there (its `CLUSTER NODES`
    /// line): a copy of the slot's keys taken meanwhile may miss some.
    pub fn slot_stable(&mut self, slot: u16) -> Result<bool, ClusterError> {
        let master = self.topology.master_of(slot).ok_or(ClusterError::Unowned { slot })?.to_string();
        let reply = self.node(&master)?.command(&[b"CLUSTER", b"NODES"])?;
        let text = reply.into_bytes().map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default();
        let Some(me) = text.lines().find(|l| l.split(' ').nth(2).is_some_and(|flags| flags.contains("myself"))) else {
            return Ok(false);
        };
        let mut owned = false;
        for field in me.split(' ').skip(8) {
            if let Some(moving) = field.strip_prefix('[') {
                if moving.split(['-', ']']).next().and_then(|s| s.parse::<u16>().ok()) == Some(slot) {
                    return Ok(false);
                }
                continue;
            }
            let (start, end) = field.split_once('-').unwrap_or((field, field));
            if let (Ok(start), Ok(end)) = (start.parse::<u16>(), end.parse::<u16>()) {
                owned |= (start..=end).contains(&slot);
            }
        }
        Ok(owned)
    }

    /// The address of the master the topology says serves `slot`.
    pub fn master_addr(&self, slot: u16) -> Result<String, ClusterError> {
        self.topology.master_of(slot).map(String::from).ok_or(ClusterError::Unowned { slot })
    }

    /// The credentials, timeouts and TLS every node is reached with.
    pub fn config(&self) -> &RedisConfig {
        &self.config
    }

    /// Runs `cmds`, each routed by the key beside it, pipelined per master;
    /// the replies come back in the order of `cmds`. A command its node did
    /// not run (redirected, or `TRYAGAIN` while its slot migrates) is sent
    /// again alone through [`ClusterConn::command`] after the pipelines, in
    /// the order of `cmds`: within one slot it then runs after commands that
    /// came later but were not turned away, so commands that must keep their
    /// order need a common key (a node turns away every command on a key it
    /// does not hold, so those on one key stay in order). Other error replies
    /// are returned as replies. A node that fails mid-pipeline fails the
    /// call, with the topology read again: some of its commands may have run.
    pub fn pipeline(&mut self, cmds: &[(Vec<u8>, Vec<Vec<u8>>)]) -> Result<Vec<Reply>, ClusterError> {
        let mut by_node: Vec<(String, Vec<usize>)> = Vec::new();
        for (i, (key, _)) in cmds.iter().enumerate() {
            let slot = key_slot(key);
            let master = self.topology.master_of(slot).ok_or(ClusterError::Unowned { slot })?;
            match by_node.iter_mut().find(|(node, _)| node == master) {
                Some((_, at)) => at.push(i),
                None => by_node.push((master.to_string(), vec![i])),
            }
        }
        let mut replies = vec![Reply::Nil; cmds.len()];
        for (node, at) in &by_node {
            let batch: Vec<Vec<Vec<u8>>> = at.iter().map(|&i| cmds[i].1.clone()).collect();
            let answered = match self.node(node).and_then(|c| c.pipeline(&batch)) {
                Ok(answered) => answered,
                Err(e) => {
                    self.nodes.remove(node);
                    // The next call routes by what the cluster says now; this one reports the failure.
                    let _ = self.refresh();
                    return Err(e.into());
                }
            };
            for (&i, reply) in at.iter().zip(answered) {
                replies[i] = reply;
            }
        }
        for i in 0..cmds.len() {
            if Redirect::parse(&replies[i]).is_some() || is_transient(&replies[i]) {
                let (key, args) = &cmds[i];
                let refs: Vec<&[u8]> = args.iter().map(Vec::as_slice).collect();
                replies[i] = match self.command(key, &refs) {
                    Ok(reply) => reply,
                    Err(ClusterError::Redis(RedisError::Server { message, .. })) => Reply::Error(message),
                    Err(e) => return Err(e),
                };
            }
        }
        Ok(replies)
    }

    /// Sends `args` to the node at `to`, after `ASKING` when `asking`; an
    /// error reply (a redirection among them) is returned as a reply.
    fn send(&mut self, to: &str, args: &[&[u8]], asking: bool) -> Result<Reply, RedisError> {
        let conn = self.node(to)?;
        let command: Vec<Vec<u8>> = args.iter().map(|a| a.to_vec()).collect();
        let mut replies =
            if asking { conn.pipeline(&[vec![b"ASKING".to_vec()], command])? } else { conn.pipeline(&[command])? };
        Ok(replies.pop().expect("one reply per command"))
    }
}

/// A reply asking for the same command again shortly: a multi-key command
/// on a migrating slot whose keys are split between the nodes, or a cluster
/// that has lost a master and not yet promoted its replica.
fn is_transient(reply: &Reply) -> bool {
    matches!(reply, Reply::Error(m) if m.starts_with("TRYAGAIN") || m.starts_with("CLUSTERDOWN"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_follow_the_cluster_specification() {
        // The specification's check value for CRC16/XMODEM.
        assert_eq!(crc16(b"123456789"), 0x31C3);
        assert_eq!(key_slot(b"123456789"), 0x31C3 % SLOTS);
        assert_eq!(key_slot(b"{user1000}.following"), key_slot(b"user1000"));
        assert_eq!(key_slot(b"{user1000}.followers"), key_slot(b"user1000"));
        assert_eq!(key_slot(b"foo{}{bar}"), crc16(b"foo{}{bar}") % SLOTS, "an empty tag hashes the whole key");
        assert_eq!(key_slot(b"foo{{bar}}zap"), key_slot(b"{bar"), "the tag ends at the first }}");
        assert_eq!(key_slot(b"foo{bar}{zap}"), key_slot(b"bar"));
        assert_eq!(key_slot(b"{unclosed"), crc16(b"{unclosed") % SLOTS);
    }

    fn node(host: &str, port: i64) -> Reply {
        Reply::Array(vec![Reply::Bulk(host.into()), Reply::Int(port), Reply::Bulk(b"id".to_vec())])
    }

    fn range(start: i64, end: i64, nodes: Vec<Reply>) -> Reply {
        let mut parts = vec![Reply::Int(start), Reply::Int(end)];
        parts.extend(nodes);
        Reply::Array(parts)
    }

    #[test]
    fn a_topology_is_read_checked_and_looked_up() {
        let reply = Reply::Array(vec![
            range(5461, 10922, vec![node("10.0.0.2", 7001), node("10.0.0.5", 7004)]),
            range(0, 5460, vec![node("", 7000), node("10.0.0.4", 7003)]),
            range(10923, 16383, vec![node("10.0.0.3", 7002)]),
        ]);
        let t = Topology::parse_slots(reply, "seed.example:7000").unwrap();
        assert!(t.covers_all_slots());
        assert_eq!(t.master_of(0), Some("seed.example:7000"), "an empty address is the one asked");
        assert_eq!(t.master_of(5460), Some("seed.example:7000"));
        assert_eq!(t.master_of(5461), Some("10.0.0.2:7001"));
        assert_eq!(t.master_of(16383), Some("10.0.0.3:7002"));
        assert_eq!(t.masters(), ["seed.example:7000", "10.0.0.2:7001", "10.0.0.3:7002"]);
        assert_eq!(t.nodes().len(), 5);

        let gap = Reply::Array(vec![range(0, 100, vec![node("a", 1)]), range(200, 16383, vec![node("b", 2)])]);
        let t = Topology::parse_slots(gap, "a:1").unwrap();
        assert!(!t.covers_all_slots());
        assert_eq!(t.master_of(150), None);
        assert_eq!(t.master_of(100), Some("a:1"));

        for (bad, what) in [
            (Reply::Array(vec![range(0, 20000, vec![node("a", 1)])]), "out of range"),
            (Reply::Array(vec![range(10, 5, vec![node("a", 1)])]), "reversed"),
            (Reply::Array(vec![range(0, 10, vec![node("a", 1)]), range(5, 20, vec![node("b", 2)])]), "overlap"),
            (Reply::Array(vec![range(0, 10, vec![node("a", 0)])]), "node"),
            (Reply::Array(vec![Reply::Array(vec![Reply::Int(0), Reply::Int(1)])]), "at least 3"),
            (Reply::Error("ERR This instance has cluster support disabled".into()), "cluster support disabled"),
            (Reply::Int(3), "expected an array"),
        ] {
            let err = Topology::parse_slots(bad, "a:1").unwrap_err().to_string();
            assert!(err.contains(what), "{err}");
        }
    }

    #[test]
    fn cluster_urls_name_seeds_and_share_credentials() {
        let RedisSource::Cluster { config, seeds } =
            RedisSource::from_url("redis+cluster://app:s3cret@10.0.0.1:7000,10.0.0.2,[::1]:7002").unwrap()
        else {
            panic!("a cluster URL");
        };
        assert_eq!(seeds, ["10.0.0.1:7000", "10.0.0.2:6379", "[::1]:7002"]);
        assert_eq!(config.addr, "10.0.0.1:7000");
        assert_eq!((config.username.as_deref(), config.password.as_deref()), (Some("app"), Some("s3cret")));
        assert!(config.tls.is_none());
        let RedisSource::Cluster { config, .. } =
            RedisSource::from_url("rediss+cluster://h:1?sni=redis.example").unwrap()
        else {
            panic!("a TLS cluster URL");
        };
        assert_eq!(config.tls.unwrap().server_name.as_deref(), Some("redis.example"));
        assert!(matches!(RedisSource::from_url("redis://h:1/2").unwrap(), RedisSource::Node(c) if c.db == 2));
        for (bad, what) in [
            ("redis+cluster://:pw@h:1/3", "database 0"),
            ("redis+cluster://:pw@h:1,,h:2", "no host"),
            ("redis+cluster://a:pw@h:x", "not a port"),
        ] {
            let e = RedisSource::from_url(bad).unwrap_err();
            assert!(e.what.contains(what), "{bad}: {e}");
            assert!(!e.to_string().contains("pw"), "the password is not repeated: {e}");
        }
    }

    #[test]
    fn redirections_are_recognised() {
        let r = |s: &str| Redirect::parse(&Reply::Error(s.into()));
        assert_eq!(r("MOVED 3999 127.0.0.1:6381"), Some(Redirect::Moved { slot: 3999, to: "127.0.0.1:6381".into() }));
        assert_eq!(r("ASK 12 10.0.0.1:7000"), Some(Redirect::Ask { slot: 12, to: "10.0.0.1:7000".into() }));
        assert_eq!(r("MOVED 7 ::1:7000"), Some(Redirect::Moved { slot: 7, to: "[::1]:7000".into() }));
        assert_eq!(r("ASK 7 [::1]:7000"), Some(Redirect::Ask { slot: 7, to: "[::1]:7000".into() }));
        assert_eq!(r("MOVED 99999 a:1"), None);
        assert_eq!(r("ERR unknown command"), None);
        assert_eq!(Redirect::parse(&Reply::Bulk(b"MOVED 1 a:1".to_vec())), None);
    }

    /// A node that answers every key command with a redirection to
    /// another address, one CLUSTER SLOTS never names: that address is
    /// never connected to, so it is never sent the password.
    #[test]
    fn a_redirection_to_a_stranger_is_refused_without_credentials() {
        use crate::features::feed::resp::fake::FakeRedis;
        for kind in ["MOVED", "ASK"] {
            let stranger = FakeRedis::start(|_| b"+OK\r\n".to_vec());
            let stranger_addr = stranger.addr.clone();
            let node = FakeRedis::start_with_port(move |cmd, port| match cmd[0].to_ascii_uppercase().as_slice() {
                b"AUTH" => b"+OK\r\n".to_vec(),
                b"CLUSTER" => {
                    format!("*1\r\n*3\r\n:0\r\n:16383\r\n*3\r\n$9\r\n127.0.0.1\r\n:{port}\r\n$2\r\nid\r\n").into_bytes()
                }
                _ => format!("-{kind} {} {stranger_addr}\r\n", key_slot(b"k")).into_bytes(),
            });
            let config = RedisConfig { password: Some("s3cret".into()), ..RedisConfig::new(node.addr.clone()) };
            let mut cluster = ClusterConn::connect(&config, std::slice::from_ref(&node.addr)).unwrap();
            let e = cluster.command(b"k", &[b"GET", b"k"]).unwrap_err();
            assert!(
                matches!(&e, ClusterError::Stranger { slot, to } if *slot == key_slot(b"k") && *to == stranger.addr),
                "{kind}: {e}"
            );
            assert!(e.to_string().contains("which CLUSTER SLOTS does not name"), "{e}");
            assert_eq!(stranger.connections(), 0, "{kind}: the stranger was connected to");
            assert!(node.commands().iter().any(|c| c[0] == b"AUTH"), "the member was authenticated");
        }
    }
}
