//! Redis Cluster routing (`quiver::feed::cluster`, not the client-side `quiver::cluster`) against a real cluster started here:
//! slots computed as the cluster computes them, keys routed to the master that owns them,
//! `ASK` followed while a slot migrates and `MOVED` after, and a killed master's slots found
//! on its promoted replica.

mod common;

use std::time::{Duration, Instant};

use common::redis_cluster::RedisCluster;
use quiver::feed::cluster::{key_slot, ClusterConn, SLOTS};
use quiver::feed::{RedisError, Reply};

fn get(c: &mut ClusterConn, key: &[u8]) -> Reply {
    c.command(key, &[b"GET", key]).unwrap_or_else(|e| panic!("GET {}: {e}", String::from_utf8_lossy(key)))
}

#[test]
fn slots_topology_and_routing_match_a_real_cluster() {
    let cluster = RedisCluster::start(3, 1);
    let mut direct = cluster.conn(&cluster.seeds()[0]);
    for i in 0..2000u64 {
        let key = match i % 4 {
            0 => format!("item:{i}"),
            1 => format!("{{item:{}}}:{i}", i % 16),
            2 => format!("quiver:seq:{{user:{}}}", i % 7),
            _ => format!("{{}}{i}{{x}}"),
        };
        let want = direct.command(&[b"CLUSTER", b"KEYSLOT", key.as_bytes()]).unwrap().as_int().unwrap();
        assert_eq!(i64::from(key_slot(key.as_bytes())), want, "{key}");
    }

    let mut c = ClusterConn::connect(&cluster.config(), &cluster.seeds()).unwrap();
    let t = c.topology().clone();
    assert!(t.covers_all_slots(), "{t:?}");
    assert_eq!(t.masters().len(), 3);
    assert_eq!(t.nodes().len(), 6);
    assert!(t.ranges().iter().all(|r| r.replicas.len() == 1), "{t:?}");

    // Every key lands on the master that owns its slot, and only there.
    for i in 0..1000u64 {
        let key = format!("item:{i}");
        assert_eq!(
            c.command(key.as_bytes(), &[b"SET", key.as_bytes(), &i.to_le_bytes()]).unwrap(),
            Reply::Simple(b"OK".to_vec())
        );
    }
    let mut per_master = vec![0usize; 3];
    for i in 0..1000u64 {
        let key = format!("item:{i}");
        let owner = t.master_of(key_slot(key.as_bytes())).unwrap();
        let owner_at = t.masters().iter().position(|m| *m == owner).unwrap();
        per_master[owner_at] += 1;
        assert_eq!(
            cluster.conn(owner).command(&[b"GET", key.as_bytes()]).unwrap(),
            Reply::Bulk(i.to_le_bytes().to_vec())
        );
        let other = t.masters().into_iter().find(|m| *m != owner).unwrap();
        let moved = cluster.conn(other).command(&[b"GET", key.as_bytes()]);
        assert!(
            matches!(&moved, Err(RedisError::Server { message, .. }) if message.starts_with("MOVED ")),
            "{moved:?}"
        );
    }
    assert!(per_master.iter().all(|&n| n > 200), "keys spread over the masters: {per_master:?}");
    assert_eq!(c.refreshes(), 1, "no redirection while the topology stands still");
    assert!(t.master_of(SLOTS - 1).is_some());
}

#[test]
fn a_migrating_slot_is_followed_through_ask_then_moved() {
    let cluster = RedisCluster::start(3, 0);
    let mut c = ClusterConn::connect(&cluster.config(), &cluster.seeds()).unwrap();
    let (a, b) = ("{mig}:a".as_bytes(), "{mig}:b".as_bytes());
    let slot = key_slot(a);
    let source = c.topology().master_of(slot).unwrap().to_string();
    let target = c.topology().masters().into_iter().find(|m| *m != source).unwrap().to_string();
    c.command(a, &[b"SET", a, b"1"]).unwrap();
    c.command(b, &[b"SET", b, b"2"]).unwrap();

    // The migration protocol, as `redis-cli --cluster reshard` runs it, one step at a time.
    let (source_id, target_id) = (cluster.id(&source), cluster.id(&target));
    let slot_s = slot.to_string();
    let mut src = cluster.conn(&source);
    let mut dst = cluster.conn(&target);
    dst.command(&[b"CLUSTER", b"SETSLOT", slot_s.as_bytes(), b"IMPORTING", &source_id]).unwrap();
    src.command(&[b"CLUSTER", b"SETSLOT", slot_s.as_bytes(), b"MIGRATING", &target_id]).unwrap();
    let (host, port) = target.rsplit_once(':').unwrap();
    let migrated = src.command(&[b"MIGRATE", host.as_bytes(), port.as_bytes(), a, b"0", b"5000"]).unwrap();
    assert_eq!(migrated, Reply::Simple(b"OK".to_vec()));

    // Mid-migration: `a` is on the target (ASK), `b` still on the source.
    assert_eq!(get(&mut c, a), Reply::Bulk(b"1".to_vec()));
    assert_eq!(get(&mut c, b), Reply::Bulk(b"2".to_vec()));
    assert_eq!(c.refreshes(), 1, "ASK does not change the topology");
    assert_eq!(c.topology().master_of(slot), Some(source.as_str()));

    src.command(&[b"MIGRATE", host.as_bytes(), port.as_bytes(), b, b"0", b"5000"]).unwrap();
    for node in cluster.seeds() {
        cluster.conn(&node).command(&[b"CLUSTER", b"SETSLOT", slot_s.as_bytes(), b"NODE", &target_id]).unwrap();
    }
    // Done: the source answers MOVED, and the topology is read again.
    assert_eq!(get(&mut c, b), Reply::Bulk(b"2".to_vec()));
    assert!(c.refreshes() >= 2);
    assert_eq!(c.topology().master_of(slot), Some(target.as_str()));
    assert_eq!(get(&mut c, a), Reply::Bulk(b"1".to_vec()));
}

#[test]
fn a_killed_master_is_replaced_by_its_promoted_replica() {
    let mut cluster = RedisCluster::start(3, 1);
    let mut c = ClusterConn::connect(&cluster.config(), &cluster.seeds()).unwrap();
    let key = b"failover:1".as_slice();
    c.command(key, &[b"SET", key, b"kept"]).unwrap();
    let old = c.topology().master_of(key_slot(key)).unwrap().to_string();
    // WAIT: the write reached the replica before its master dies.
    let acked = cluster.conn(&old).command(&[b"WAIT", b"1", b"1000"]).unwrap();
    assert_eq!(acked, Reply::Int(1));
    cluster.node(&old).kill();

    let until = Instant::now() + Duration::from_secs(20);
    let mut errors = Vec::new();
    let value = loop {
        // Until the replica is promoted: the dead node's connection fails,
        // or the others answer CLUSTERDOWN.
        match c.command(key, &[b"GET", key]) {
            Ok(Reply::Bulk(v)) => break v,
            Ok(other) => panic!("GET answered {other:?}"),
            Err(e) => errors.push(e.to_string()),
        }
        assert!(Instant::now() < until, "no master for the slot after 20 s: {errors:?}");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(value, b"kept");
    let new = c.topology().master_of(key_slot(key)).unwrap().to_string();
    assert_ne!(new, old, "the promoted replica serves the slot");
    assert!(!errors.is_empty(), "the kill was seen before the promotion");
    assert!(c.refreshes() >= 2, "the topology was read again");
}
