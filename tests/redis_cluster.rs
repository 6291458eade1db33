//! Redis Cluster routing (`quiver::features::feed::redis_cluster`, not the client-side `quiver::client::cluster`) against a real cluster started here:
//! slots computed as the cluster computes them, keys routed to the master that owns them,
//! `ASK` followed while a slot migrates and `MOVED` after, and a killed master's slots found
//! on its promoted replica.

mod common;

use std::time::{Duration, Instant};

use common::redis_cluster::RedisCluster;
use quiver::features::feed::contract::{self, encode_vector, Layout};
use quiver::features::feed::redis_cluster::{key_slot, ClusterConn, SLOTS};
use quiver::features::feed::{ContractError, PublishError, Publisher, RedisError, Reply};

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

    let until = Instant::now() + common::WAIT;
    let mut errors = Vec::new();
    let value = loop {
        // Until the replica is promoted: the dead node's connection fails,
        // or the others answer CLUSTERDOWN.
        match c.command(key, &[b"GET", key]) {
            Ok(Reply::Bulk(v)) => break v,
            Ok(other) => panic!("GET answered {other:?}"),
            Err(e) => errors.push(e.to_string()),
        }
        assert!(Instant::now() < until, "no master for the slot after {:?}: {errors:?}", common::WAIT);
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(value, b"kept");
    let new = c.topology().master_of(key_slot(key)).unwrap().to_string();
    assert_ne!(new, old, "the promoted replica serves the slot");
    assert!(!errors.is_empty(), "the kill was seen before the promotion");
    assert!(c.refreshes() >= 2, "the topology was read again");
}

/// Per bucket: its counter, its stream's length and its bucket-count key.
type BucketState = (u64, u64, Reply);

/// What a group's keys hold on the cluster: every entity's value by id, and each bucket's state.
fn read_back(
    c: &mut ClusterConn,
    layout: Layout,
    group: &str,
    ids: impl Iterator<Item = u64>,
) -> (Vec<(u64, Reply)>, Vec<BucketState>) {
    let values = ids.map(|id| (id, get(c, layout.entity_key(group, id).as_bytes()))).collect();
    let buckets = (0..layout.bucket_count())
        .map(|b| {
            let k = layout.keys(group, b);
            let seq = match get(c, k.seq.as_bytes()) {
                Reply::Bulk(s) => String::from_utf8(s).unwrap().parse().unwrap(),
                other => panic!("bucket {b} counter: {other:?}"),
            };
            let len = c.command(k.stream.as_bytes(), &[b"XLEN", k.stream.as_bytes()]).unwrap().as_int().unwrap();
            (seq, len as u64, get(c, k.buckets.unwrap().as_bytes()))
        })
        .collect();
    (values, buckets)
}

#[test]
fn the_publisher_writes_the_bucketed_contract_on_a_cluster() {
    let cluster = RedisCluster::start(3, 0);
    let conn = || ClusterConn::connect(&cluster.config(), &cluster.seeds()).unwrap();
    let mut p = Publisher::cluster(conn(), 16).unwrap();
    assert_eq!(p.layout(), Layout::bucketed(16).unwrap());
    let rows: Vec<(u64, Vec<f32>)> = (0..100_000u64).map(|id| (id, vec![id as f32, -(id as f32), 0.5])).collect();
    let mut batches = 0;
    let last = p
        .put_many("item", &rows, |done, total| {
            batches += 1;
            assert!(done <= total && total == rows.len());
        })
        .unwrap();
    assert_eq!(batches, 100, "the progress callback sees every batch");
    let deleted: Vec<u64> = (0..100_000u64).step_by(10).collect();
    p.delete_many("item", &deleted, |_, _| {}).unwrap();

    let layout = p.layout();
    let mut c = conn();
    let (values, buckets) = read_back(&mut c, layout, "item", 0..100_000);
    for (id, value) in values {
        let want = if id % 10 == 0 { Reply::Nil } else { Reply::Bulk(encode_vector(&[id as f32, -(id as f32), 0.5])) };
        assert_eq!(value, want, "entity {id}");
    }
    // Each bucket counts its own changes densely, and its stream holds one entry per change.
    let per_bucket: Vec<u64> = (0..16)
        .map(|b| {
            (0..100_000u64).filter(|&id| layout.bucket_of(id) == b).count() as u64
                + deleted.iter().filter(|&&id| layout.bucket_of(id) == b).count() as u64
        })
        .collect();
    for (b, (seq, len, count)) in buckets.into_iter().enumerate() {
        assert_eq!((seq, len), (per_bucket[b], per_bucket[b]), "bucket {b}");
        assert_eq!(count, Reply::Bulk(b"16".to_vec()), "bucket {b} remembers its bucket count");
    }
    let puts_max = (0..16).map(|b| (0..100_000u64).filter(|&id| layout.bucket_of(id) == b).count()).max();
    assert_eq!(Some(last as usize), puts_max, "put_many answers the highest sequence number it wrote");
    // The buckets are spread over every master.
    let masters: std::collections::HashSet<String> = (0..16)
        .map(|b| c.topology().master_of(key_slot(layout.keys("item", b).seq.as_bytes())).unwrap().to_string())
        .collect();
    assert_eq!(masters.len(), 3, "{masters:?}");

    // A writer with another bucket count is refused before it writes anything.
    let mut other = Publisher::cluster(conn(), 8).unwrap();
    let err = other.put("item", 1, &[1.0, 2.0, 3.0]).unwrap_err().to_string();
    assert!(err.contains("says the group has 16 buckets; this writer uses 8"), "{err}");
    assert_eq!(get(&mut c, layout.entity_key("item", 1).as_bytes()), Reply::Bulk(encode_vector(&[1.0, -1.0, 0.5])));
    // The plain layout cannot live on a cluster.
    let plain = Publisher::cluster(conn(), 16).unwrap().with_layout(Layout::Plain);
    assert!(matches!(plain, Err(PublishError::Contract(ContractError::PlainOnCluster))));
}

#[test]
fn the_cli_publishes_to_a_cluster() {
    let cluster = RedisCluster::start(3, 0);
    let url = format!("redis+cluster://{}", cluster.seeds()[..2].join(","));
    let input = common::scratch("cluster-cli").join("items.txt");
    let text: String = (0..3000u64).map(|id| format!("{id} {} 1.5\n", id as f32 / 8.0)).collect();
    std::fs::write(&input, text).unwrap();
    let run = |args: &[&str]| {
        let out = std::process::Command::new(common::BIN).args(args).output().unwrap();
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    run(&["features", "load", "--redis", &url, "--group", "item", "--input", input.to_str().unwrap()]);
    let printed = run(&["features", "put", "--redis", &url, "--group", "item", "--id", "7", "--values", "9,9"]);
    let layout = Layout::bucketed(contract::CLUSTER_BUCKETS_DEFAULT).unwrap();
    assert!(printed.starts_with(&format!("{} seq ", layout.entity_key("item", 7))), "{printed}");
    run(&["features", "delete", "--redis", &url, "--group", "item", "--id", "8"]);
    let mut c = ClusterConn::connect(&cluster.config(), &cluster.seeds()).unwrap();
    let (values, _) = read_back(&mut c, layout, "item", 0..3000);
    for (id, value) in values {
        let want = match id {
            7 => Reply::Bulk(encode_vector(&[9.0, 9.0])),
            8 => Reply::Nil,
            _ => Reply::Bulk(encode_vector(&[id as f32 / 8.0, 1.5])),
        };
        assert_eq!(value, want, "entity {id}");
    }
}

#[test]
fn string_keys_are_published_to_and_copied_from_a_cluster() {
    let cluster = RedisCluster::start(3, 0);
    let conn = || ClusterConn::connect(&cluster.config(), &cluster.seeds()).unwrap();
    let kind = contract::KeyKind::Str { bytes_max: 32 };
    let mut p = Publisher::cluster(conn(), 16).unwrap().with_key_kind(kind).unwrap();
    let key = |n: u32| format!("device:{n}").into_bytes();
    let rows: Vec<(Vec<u8>, Vec<f32>)> = (0..3000u32).map(|n| (key(n), vec![n as f32, 0.5])).collect();
    p.put_many_str("device", &rows, |_, _| {}).unwrap();
    p.delete_many_str("device", &[key(7), key(8)], |_, _| {}).unwrap();
    let err = Publisher::cluster(conn(), 16).unwrap().put("device", 1, &[1.0, 2.0]).unwrap_err();
    assert!(matches!(err, PublishError::Contract(ContractError::KeyKind { .. })), "{err}");

    let layout = p.layout();
    let out = common::scratch("cluster-strkeys").join("device.qrep");
    let target = quiver::features::feed::sync::GroupTarget {
        link: None,
        group: "device",
        layout,
        key_kind: kind,
        path: &out,
        dim: 2,
        storage: quiver::features::replica::Storage::F32,
        default: &[0.0, 0.0],
        batch_keys_max: 500,
        connections: 2,
    };
    let source = quiver::features::feed::redis_cluster::RedisSource::Cluster {
        config: cluster.config(),
        seeds: cluster.seeds(),
    };
    let copies = quiver::features::feed::sync::sync_group(&source, &target, &mut |_| {}).unwrap();
    assert_eq!(copies.len(), 16);
    assert_eq!(copies.iter().map(|(_, w)| w.live_rows()).sum::<u64>(), 2998);
    drop(copies);
    let mut v = [0.0f32; 2];
    for n in 0..3000u32 {
        let b = layout.bucket_of_key(contract::EntityKey::Str(&key(n)));
        let r = quiver::features::replica::Replica::open(&quiver::features::replica::bucket_path(&out, b), "device")
            .unwrap();
        let found = r.read_str_into(&key(n), &mut v);
        assert_eq!(found, n != 7 && n != 8, "key {n} in bucket {b}");
        assert!(!found || v == [n as f32, 0.5], "key {n}: {v:?}");
    }
}
