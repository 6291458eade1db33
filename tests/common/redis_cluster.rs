//! Test harness: a real Redis Cluster on 127.0.0.1, started from the test itself.
//!
//! Six (or any number of) `redis-server --cluster-enabled yes` processes, each a
//! [`RedisServer`] on free ports with its own directory, joined by `redis-cli --cluster
//! create`. Every process is killed by PID and its directory removed when the cluster drops.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use quiver::features::feed::redis_cluster::Topology;
use quiver::features::feed::{RedisConfig, RedisConn, Reply};

use super::redis::{free_port, RedisServer};

/// How long a new cluster may take until every node reports every slot served.
const FORM_TIMEOUT: Duration = Duration::from_secs(30);

pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// `masters` masters with `replicas` replicas each; node timeout 1 s, so a killed master's
    /// replica is promoted within a few seconds.
    pub fn start(masters: usize, replicas: usize) -> RedisCluster {
        RedisCluster::start_with_password(masters, replicas, None)
    }

    /// `start`, with every node asking for `password` (`requirepass`, and `masterauth` so
    /// that replicas can follow their masters).
    pub fn start_with_password(masters: usize, replicas: usize, password: Option<&str>) -> RedisCluster {
        let nodes: Vec<RedisServer> = (0..masters * (1 + replicas))
            .map(|_| {
                let bus = free_port().to_string();
                let mut opts = vec![
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-port",
                    &bus,
                    "--cluster-node-timeout",
                    "1000",
                ];
                if let Some(password) = password {
                    opts.extend(["--requirepass", password, "--masterauth", password]);
                }
                RedisServer::start_opts(false, &opts)
            })
            .collect();
        let mut args: Vec<String> = match password {
            Some(password) => vec!["-a".into(), password.into(), "--no-auth-warning".into()],
            None => Vec::new(),
        };
        args.extend(["--cluster".into(), "create".into()]);
        args.extend(nodes.iter().map(RedisServer::addr));
        args.extend(["--cluster-replicas".into(), replicas.to_string(), "--cluster-yes".into()]);
        let out = Command::new("redis-cli")
            .args(&args)
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("cannot run redis-cli (it comes with redis-server): {e}"));
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let cluster = RedisCluster { nodes };
        cluster.wait_formed(masters, replicas);
        cluster
    }

    /// `host:port` of every node still running.
    pub fn seeds(&self) -> Vec<String> {
        self.nodes.iter().filter(|n| n.pid().is_some()).map(RedisServer::addr).collect()
    }

    pub fn config(&self) -> RedisConfig {
        self.nodes[0].config()
    }

    /// Waits until every running node says the cluster is ok, with all slots served by
    /// `masters` masters, each with `replicas` replicas.
    pub fn wait_formed(&self, masters: usize, replicas: usize) {
        let until = Instant::now() + FORM_TIMEOUT;
        loop {
            let views: Vec<String> = self
                .nodes
                .iter()
                .filter(|n| n.pid().is_some())
                .map(|n| {
                    let info = match n.conn().command(&[b"CLUSTER", b"INFO"]) {
                        Ok(Reply::Bulk(b)) => String::from_utf8_lossy(&b).into_owned(),
                        other => return format!("{}: {other:?}", n.addr()),
                    };
                    let formed = info.contains("cluster_state:ok")
                        && info.contains("cluster_slots_ok:16384")
                        && info.contains(&format!("cluster_size:{masters}\r"));
                    let slots = n
                        .conn()
                        .command(&[b"CLUSTER", b"SLOTS"])
                        .map_err(|e| e.to_string())
                        .and_then(|r| Topology::parse_slots(r, &n.addr()).map_err(|e| e.to_string()));
                    match slots {
                        Ok(t) if formed && t.ranges().iter().all(|r| r.replicas.len() == replicas) => String::new(),
                        other => format!("{}: formed {formed}, {other:?}", n.addr()),
                    }
                })
                .collect();
            if views.iter().all(String::is_empty) {
                return;
            }
            assert!(Instant::now() < until, "the cluster did not form within {FORM_TIMEOUT:?}: {views:?}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The node whose address is `addr`.
    pub fn node(&mut self, addr: &str) -> &mut RedisServer {
        self.nodes.iter_mut().find(|n| n.addr() == addr).unwrap_or_else(|| panic!("no node {addr}"))
    }

    /// A direct connection to the node at `addr` (no routing).
    pub fn conn(&self, addr: &str) -> RedisConn {
        self.nodes.iter().find(|n| n.addr() == addr).unwrap_or_else(|| panic!("no node {addr}")).conn()
    }

    /// The node id of the node at `addr` (`CLUSTER MYID`).
    pub fn id(&self, addr: &str) -> Vec<u8> {
        self.conn(addr).command(&[b"CLUSTER", b"MYID"]).unwrap().into_bytes().expect("CLUSTER MYID")
    }

    /// Moves `slots` hash slots from the master at `from` to the one at `to` with
    /// `redis-cli --cluster reshard`, the way an operator does, and waits for it to end.
    pub fn reshard(&self, from: &str, to: &str, slots: usize) {
        let (from_id, to_id) = (self.id(from), self.id(to));
        let out = Command::new("redis-cli")
            .args(["--cluster", "reshard", from, "--cluster-from"])
            .arg(String::from_utf8_lossy(&from_id).as_ref())
            .arg("--cluster-to")
            .arg(String::from_utf8_lossy(&to_id).as_ref())
            .args(["--cluster-slots", &slots.to_string(), "--cluster-pipeline", "100", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("cannot run redis-cli: {e}"));
        assert!(
            out.status.success(),
            "redis-cli --cluster reshard failed: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
