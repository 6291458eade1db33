//! The user replicas `bench/scale_serve.sh` serves (issue 19: the server's
//! end-to-end latency against the user population): a file of N users x 32
//! dims, keys 0..N, written by the server's one writer as `bench/scale.rs`
//! builds them, and the size it will have, so the script can check it fits
//! in memory before writing a byte.
//!
//!     cargo bench --bench scale_serve -- plan --entities N --storage f32
//!     cargo bench --bench scale_serve -- build --entities N --storage f32 --out FILE
//!
//! `plan` prints the file's bytes; `build` writes the file and prints one
//! JSON line (entities, storage, bytes, seconds). Seeded: the same
//! arguments write the same rows.

use std::path::PathBuf;
use std::time::Instant;

use quiver::features::replica::{Cursor, ReplicaWriter, Storage, ROW_CAPACITY_MAX};
use quiver::seeded::SplitMix64;

const DIM: u32 = 32;
const SEED: u64 = 0x5343_414c_4519;

struct Args {
    command: String,
    entities: u64,
    storage: Storage,
    out: Option<PathBuf>,
}

fn parse_args() -> Args {
    let mut it = std::env::args().skip(1).filter(|a| a != "--bench");
    let command = it.next().unwrap_or_else(|| panic!("usage: plan|build --entities N --storage S [--out FILE]"));
    let mut a = Args { command, entities: 0, storage: Storage::F32, out: None };
    while let Some(flag) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--entities" => a.entities = value().parse().expect("entity count"),
            "--storage" => a.storage = Storage::parse(&value()).expect("f32, f16 or int8"),
            "--out" => a.out = Some(value().into()),
            other => panic!("unknown flag {other}"),
        }
    }
    assert!((1..=ROW_CAPACITY_MAX).contains(&a.entities), "--entities must be 1..={ROW_CAPACITY_MAX}");
    a
}

/// The file's bytes for `n` rows, from the format (docs/REPLICA.md): the
/// header and default vector, 2n index slots rounded up to a power of two,
/// then the rows. `build` checks it against the file it wrote.
fn planned_bytes(n: u64, storage: Storage) -> u64 {
    let align = |x: u64, to: u64| x.div_ceil(to) * to;
    let index_offset = align(192 + u64::from(DIM) * 4, 64);
    let slots = (n * 2).max(2).next_power_of_two();
    let rows_offset = align(index_offset + slots * 16, 64);
    let stride = align(16 + storage.payload_words(DIM as usize) as u64 * 4, 16);
    rows_offset + n * stride
}

fn build(n: u64, storage: Storage, out: &std::path::Path) -> serde_json::Value {
    let t = Instant::now();
    let mut w = ReplicaWriter::create(out, "user", DIM, storage, n, &[0.0; DIM as usize]).expect("create");
    let mut rng = SplitMix64::new(SEED);
    let mut v = [0f32; DIM as usize];
    for id in 0..n {
        for x in v.iter_mut() {
            *x = rng.unit() as f32 - 0.5;
        }
        w.upsert(id, &v).expect("upsert");
    }
    w.checkpoint(Cursor { epoch: 1, seq: n, change_unix_ms: 0 }).expect("checkpoint");
    let file_bytes = w.table().file_bytes();
    drop(w);
    assert_eq!(file_bytes, planned_bytes(n, storage), "the planned size is the format's");
    serde_json::json!({
        "entities": n, "dim": DIM, "storage": format!("{storage:?}").to_lowercase(),
        "file_bytes": file_bytes, "build_s": t.elapsed().as_secs_f64(),
    })
}

fn main() {
    let a = parse_args();
    match a.command.as_str() {
        "plan" => println!("{}", planned_bytes(a.entities, a.storage)),
        "build" => println!("{}", build(a.entities, a.storage, &a.out.expect("build needs --out FILE"))),
        other => panic!("unknown command {other}: plan or build"),
    }
}
