//! Feast's Redis online store as the first sync and the follower reach it:
//! one node (`redis_type: redis`) or a Redis Cluster (`redis_type:
//! redis_cluster`), so the copy and the follower are written once for both.
//!
//! A cluster spreads Feast's keys over its masters by hash slot, so what
//! walks every key (SCAN) and what watches them (keyspace notifications,
//! which a node sends only for its own keys) goes to each master in turn
//! ([`Store::masters`], [`Store::node`]), and what names keys (the pipelines
//! of HGETALL, HMGET and HEXISTS) is routed key by key through
//! [`ClusterConn::pipeline`], which follows `MOVED` and `ASK` and reads the
//! topology again after a failover, as the Quiver contract's cluster feed
//! does. [`Store::topology_reads`] tells the follower the topology was read
//! again, so that it subscribes to the masters there are now.

use super::FeastError;
use crate::features::feed::redis_cluster::{ClusterConn, RedisSource};
use crate::features::feed::{RedisConn, Reply};

/// A connection to the online store.
pub enum Store {
    Node(RedisConn),
    Cluster(ClusterConn),
}

impl Store {
    /// Connects to `source`: the node, or the cluster through its seeds
    /// (reading its topology).
    pub fn connect(source: &RedisSource) -> Result<Store, FeastError> {
        Ok(match source {
            RedisSource::Node(config) => Store::Node(RedisConn::connect(config)?),
            RedisSource::Cluster { config, seeds } => Store::Cluster(ClusterConn::connect(config, seeds)?),
        })
    }

    /// The nodes holding keys, by address: the node, or every master.
    pub fn masters(&self) -> Vec<String> {
        match self {
            Store::Node(conn) => vec![conn.addr().to_string()],
            Store::Cluster(cluster) => cluster.topology().masters().into_iter().map(String::from).collect(),
        }
    }

    /// The connection to master `addr` (one of [`Store::masters`]; on one
    /// node, the node whatever `addr` is).
    pub fn node(&mut self, addr: &str) -> Result<&mut RedisConn, FeastError> {
        match self {
            Store::Node(conn) => Ok(conn),
            Store::Cluster(cluster) => Ok(cluster.node(addr)?),
        }
    }

    /// Runs `cmds`, each on the node owning the key beside it, pipelined
    /// per node; the replies in the order of `cmds`, error replies among
    /// them.
    pub fn pipeline(&mut self, cmds: &[(Vec<u8>, Vec<Vec<u8>>)]) -> Result<Vec<Reply>, FeastError> {
        match self {
            Store::Node(conn) => {
                let plain: Vec<Vec<Vec<u8>>> = cmds.iter().map(|(_, c)| c.clone()).collect();
                Ok(conn.pipeline(&plain)?)
            }
            Store::Cluster(cluster) => Ok(cluster.pipeline(cmds)?),
        }
    }

    /// How often the topology has been read (0 on one node): when it moves,
    /// the masters may have changed.
    pub fn topology_reads(&self) -> u64 {
        match self {
            Store::Node(_) => 0,
            Store::Cluster(cluster) => cluster.refreshes(),
        }
    }

    /// The keys the store holds: DBSIZE of the node, or summed over the masters.
    pub fn keys(&mut self) -> Result<u64, FeastError> {
        let mut keys = 0u64;
        for m in self.masters() {
            let n = self.node(&m)?.command(&[b"DBSIZE"])?.as_int().unwrap_or(0);
            keys += u64::try_from(n).unwrap_or(0);
        }
        Ok(keys)
    }

    /// The address to name in logs: the node, or the first master.
    pub fn addr(&self) -> String {
        self.masters().into_iter().next().unwrap_or_default()
    }
}
