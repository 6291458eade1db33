//! Unit tests of the replica: files, the seqlock read path, the writer, growth,
//! checkpoints and recovery, on temporary files.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::format::{Storage, CHECKPOINT_OFFSETS};
use super::*;

fn tmpdir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("quiver-replica-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn sample(rows: u64, dim: u32) -> ReplicaBuilder {
    let mut b = ReplicaBuilder::new("item", dim);
    b.set_default(&vec![-1.0; dim as usize]).unwrap();
    for k in 0..rows {
        let key = k * 7919 + 3;
        let v: Vec<f32> = (0..dim).map(|j| key as f32 + j as f32 * 0.5).collect();
        b.push(key, &v).unwrap();
    }
    b
}

#[test]
fn build_open_lookup() {
    let dir = tmpdir("lookup");
    let path = dir.join("item.qrep");
    sample(1000, 5).write(&path).unwrap();
    let r = Replica::open(&path, "item").unwrap();
    assert_eq!(r.header().row_count, 1000);
    let mut out = [0.0; 5];
    for k in 0..1000u64 {
        let key = k * 7919 + 3;
        assert!(r.read_into(key, &mut out));
        assert_eq!(out, [key as f32, key as f32 + 0.5, key as f32 + 1.0, key as f32 + 1.5, key as f32 + 2.0]);
    }
    assert!(!r.read_into(4, &mut out));
    assert_eq!(out, [-1.0; 5]);
    assert!(!r.read_into(u64::MAX, &mut out));
    assert!(matches!(Replica::open(&path, "user"), Err(ReplicaError::Group { .. })));
}

#[test]
fn batched_lookup_matches_single_lookups() {
    let dir = tmpdir("batch");
    let path = dir.join("item.qrep");
    sample(500, 3).write(&path).unwrap();
    let r = Replica::open(&path, "item").unwrap();
    let keys: Vec<u64> = (0..64u64).map(|i| if i % 5 == 0 { i + 1 } else { i * 7919 + 3 }).collect();
    let mut rows = vec![0u32; 64];
    let mut got = vec![0.0; 64 * 3];
    let missing = r.read_many_into(&keys, &mut rows, &mut got, &mut []);
    let mut want = vec![0.0; 64 * 3];
    let mut want_missing = 0;
    for (k, dst) in keys.iter().zip(want.chunks_exact_mut(3)) {
        want_missing += usize::from(!r.read_into(*k, dst));
    }
    assert_eq!(got, want);
    assert_eq!(missing, want_missing);
    assert!(missing > 0);
}

#[test]
fn empty_and_single_row_files_work() {
    let dir = tmpdir("tiny");
    let path = dir.join("user.qrep");
    let mut b = ReplicaBuilder::new("user", 2);
    b.push(0, &[1.0, 2.0]).unwrap();
    b.write(&path).unwrap();
    let r = Replica::open(&path, "user").unwrap();
    let mut out = [0.0; 2];
    assert!(r.read_into(0, &mut out));
    assert!(!r.read_into(1, &mut out));
    ReplicaBuilder::new("user", 2).write(&path).unwrap();
    let r = Replica::open(&path, "user").unwrap();
    assert!(!r.read_into(0, &mut out));
}

#[test]
fn duplicate_keys_are_refused() {
    let dir = tmpdir("dup");
    let mut b = ReplicaBuilder::new("user", 1);
    b.push(5, &[1.0]).unwrap();
    b.push(5, &[2.0]).unwrap();
    assert!(matches!(b.write(&dir.join("user.qrep")), Err(ReplicaError::DuplicateKey { key: 5 })));
    assert!(matches!(b.push(6, &[1.0, 2.0]), Err(ReplicaError::Dim { found: 2, dim: 1 })));
}

/// Reads every key of `sample(rows, dim)` plus some unknown ones.
fn snapshot(r: &Replica, rows: u64, dim: usize) -> Vec<f32> {
    let mut all = Vec::new();
    let mut out = vec![0.0; dim];
    for k in 0..rows + 10 {
        r.read_into(k * 7919 + 3, &mut out);
        all.extend_from_slice(&out);
    }
    all
}

#[test]
fn corruption_is_refused_or_harmless() {
    let dir = tmpdir("corrupt");
    let path = dir.join("item.qrep");
    sample(100, 4).write(&path).unwrap();
    let good = std::fs::read(&path).unwrap();
    let want = snapshot(&Replica::open(&path, "item").unwrap(), 100, 4);

    std::fs::write(&path, &good[..good.len() - 4]).unwrap();
    assert!(matches!(Replica::open(&path, "item"), Err(ReplicaError::Length { .. })));
    std::fs::write(&path, &good[..10]).unwrap();
    assert!(matches!(Replica::open(&path, "item"), Err(ReplicaError::Length { .. })));

    let mut bad = good.clone();
    bad[13] ^= 1;
    std::fs::write(&path, &bad).unwrap();
    assert!(matches!(Replica::open(&path, "item"), Err(ReplicaError::HeaderChecksum { .. })));
    let mut bad = good.clone();
    bad[0] = b'X';
    std::fs::write(&path, &bad).unwrap();
    assert!(matches!(Replica::open(&path, "item"), Err(ReplicaError::BadMagic { .. })));
    let mut bad = good.clone();
    bad[CHECKPOINT_OFFSETS[0] + 3] ^= 1;
    bad[CHECKPOINT_OFFSETS[1] + 3] ^= 1;
    std::fs::write(&path, &bad).unwrap();
    assert!(matches!(Replica::open(&path, "item"), Err(ReplicaError::Checkpoint { .. })));

    // Flip bytes all over the file: each flip is refused, or it landed in
    // bytes nothing reads (padding, an empty slot's key) and every lookup
    // still answers exactly as before. Nothing else is acceptable.
    let mut refused = 0;
    for at in (0..good.len()).step_by(7) {
        let mut bad = good.clone();
        bad[at] ^= 0x40;
        std::fs::write(&path, &bad).unwrap();
        match Replica::open(&path, "item") {
            Err(e) => {
                assert!(e.is_damage(), "byte {at}: {e}");
                refused += 1;
            }
            Ok(r) => assert_eq!(snapshot(&r, 100, 4), want, "byte {at} flipped, accepted, and changed answers"),
        }
    }
    assert!(refused > good.len() / 7 / 2, "most flips land in checked bytes");
    std::fs::write(&path, &good).unwrap();
    Replica::open(&path, "item").unwrap();
}

#[test]
fn text_input_format() {
    let text = "# users\ndefault, 0.5, 0.5\n1,1.0,2.0\n2 3.0 4.0\n\n";
    let b = ReplicaBuilder::from_text("user", text, "in.csv").unwrap();
    let dir = tmpdir("text");
    let path = dir.join("user.qrep");
    b.write(&path).unwrap();
    let r = Replica::open(&path, "user").unwrap();
    let mut out = [0.0; 2];
    assert!(r.read_into(2, &mut out));
    assert_eq!(out, [3.0, 4.0]);
    assert!(!r.read_into(3, &mut out));
    assert_eq!(out, [0.5, 0.5]);

    let err = ReplicaBuilder::from_text("user", "1,1.0\n2,1.0,2.0\n", "in.csv").err().unwrap();
    assert_eq!(err.to_string(), "in.csv:2: 2 values, earlier lines have 1");
    let err = ReplicaBuilder::from_text("user", "x,1.0\n", "in.csv").err().unwrap();
    assert!(err.to_string().contains("not an unsigned 64-bit id"));
    let err = ReplicaBuilder::from_text("user", "1,abc\n", "in.csv").err().unwrap();
    assert!(err.to_string().contains("'abc' is not a number"));
}

#[test]
fn writer_inserts_updates_deletes_grows_and_reopens() {
    let dir = tmpdir("writer");
    let path = dir.join("user.qrep");
    let mut w = ReplicaWriter::create(&path, "user", 3, Storage::F32, 4, &[9.0; 3]).unwrap();
    let handle = w.handle();
    for k in 0..5000u64 {
        w.upsert(k, &[k as f32, 1.0, 2.0]).unwrap();
    }
    assert!(handle.load().header().row_capacity >= 5000, "grew past the initial 4 rows");
    w.upsert(7, &[70.0, 71.0, 72.0]).unwrap();
    assert!(w.delete(8));
    assert!(!w.delete(8));
    assert!(!w.delete(123_456));
    let mut out = [0.0; 3];
    let r = handle.load();
    assert!(r.read_into(7, &mut out));
    assert_eq!(out, [70.0, 71.0, 72.0]);
    assert!(!r.read_into(8, &mut out));
    assert_eq!(out, [9.0; 3]);
    assert_eq!(r.live_rows(), 4999);
    // Deleted, then inserted again.
    w.upsert(8, &[8.5, 0.0, 0.0]).unwrap();
    assert!(handle.load().read_into(8, &mut out));
    assert_eq!(out[0], 8.5);
    let cursor = Cursor { epoch: 11, seq: 42, change_unix_ms: 5 };
    w.checkpoint(cursor).unwrap();
    assert!(matches!(ReplicaWriter::open(&path, "user"), Err(ReplicaError::Locked { .. })));
    drop(w);
    drop(r);

    let r = Replica::open(&path, "user").unwrap();
    assert_eq!(r.cursor_at_open(), cursor);
    assert_eq!(r.live_rows(), 5000);
    assert!(r.read_into(4999, &mut out));
    assert_eq!(out, [4999.0, 1.0, 2.0]);
    let (w, report) = ReplicaWriter::open(&path, "user").unwrap();
    assert_eq!(report, OpenReport { torn_rows: 0, live_rows: 5000, cursor });
    assert_eq!(w.cursor(), cursor);
}

#[test]
fn rows_left_mid_write_are_dropped_by_the_writer_and_refused_by_readers() {
    let dir = tmpdir("torn");
    let path = dir.join("item.qrep");
    sample(50, 4).write(&path).unwrap();
    let r = Replica::open(&path, "item").unwrap();
    let key = 10 * 7919 + 3;
    let row = r.find(key).unwrap();
    let seq_at = r.layout().rows_offset + row as usize * r.layout().row_stride;
    drop(r);
    // What a writer killed between its two counter stores leaves behind.
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[seq_at] |= 1;
    bytes[seq_at + 16] ^= 0xff;
    std::fs::write(&path, &bytes).unwrap();
    assert!(matches!(Replica::open(&path, "item"), Err(ReplicaError::Torn { rows: 1, .. })));
    let (mut w, report) = ReplicaWriter::open(&path, "item").unwrap();
    assert_eq!(report.torn_rows, 1);
    assert_eq!(report.live_rows, 49);
    let mut out = [0.0; 4];
    let handle = w.handle();
    assert!(!handle.load().read_into(key, &mut out), "a torn row is never served");
    assert_eq!(out, [-1.0; 4]);
    w.upsert(key, &[1.0, 2.0, 3.0, 4.0]).unwrap();
    assert!(handle.load().read_into(key, &mut out));
    assert_eq!(out, [1.0, 2.0, 3.0, 4.0]);
    w.checkpoint(Cursor::default()).unwrap();
    drop(w);
    drop(handle);
    assert_eq!(Replica::open(&path, "item").unwrap().live_rows(), 50);
}

#[test]
fn storage_types_round_trip_within_their_documented_error() {
    let dir = tmpdir("storage");
    let dim = 37;
    let v: Vec<f32> = (0..dim).map(|i| ((i as f32) * 0.37).sin() * 3.0).collect();
    let max = v.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    for storage in [Storage::F32, Storage::F16, Storage::Int8] {
        let path = dir.join(format!("{storage:?}.qrep"));
        let mut b = ReplicaBuilder::new("item", dim as u32).storage(storage);
        b.push(1, &v).unwrap();
        b.push(2, &vec![0.0; dim]).unwrap();
        let mut missing = vec![1.0; dim];
        (missing[0], missing[1], missing[2]) = (f32::NAN, 2.0, f32::NAN);
        b.push(3, &missing).unwrap();
        b.write(&path).unwrap();
        let r = Replica::open(&path, "item").unwrap();
        assert_eq!(r.storage(), storage);
        let mut out = vec![0.0; dim];
        assert!(r.read_into(1, &mut out));
        for (x, y) in v.iter().zip(&out) {
            let err = (x - y).abs();
            match storage {
                Storage::F32 => assert_eq!(err, 0.0),
                Storage::F16 => assert!(err <= x.abs() * 2f32.powi(-11) + 1e-7, "{x} {y}"),
                Storage::Int8 => assert!(err <= max / 127.0 / 2.0 + 1e-6, "{x} {y}"),
            }
        }
        assert!(r.read_into(2, &mut out));
        assert!(out.iter().all(|&x| x == 0.0));
        // A missing feature (NaN) stays missing in every storage.
        assert!(r.read_into(3, &mut out));
        assert!(out[0].is_nan() && out[2].is_nan(), "{storage:?}");
        assert!((out[1] - 2.0).abs() <= 2.0 / 127.0, "{storage:?}: {}", out[1]);
    }
    let bytes = |s: Storage| Layout::new(64, s, KeyKind::U64, None, false, 2, 1).unwrap().row_stride;
    assert_eq!((bytes(Storage::F32), bytes(Storage::F16), bytes(Storage::Int8)), (272, 144, 96));
}

use super::format::Layout;

/// The stress test the concurrency argument rests on: a writer rewrites,
/// inserts, deletes and grows while readers check every vector they get.
/// Each vector carries its key and a checksum of its other elements, so a
/// torn copy or another key's row cannot pass.
#[test]
fn readers_never_see_torn_or_foreign_rows_while_the_writer_works() {
    const DIM: usize = 16;
    fn vector(key: u64, generation: u64) -> [f32; DIM] {
        let mut v = [0.0f32; DIM];
        v[0] = key as f32;
        for (i, x) in v.iter_mut().enumerate().take(DIM - 1).skip(1) {
            *x = ((generation * 31 + i as u64 * 7 + key) % 1000) as f32;
        }
        v[DIM - 1] = v[..DIM - 1].iter().sum();
        v
    }
    let dir = tmpdir("stress");
    let path = dir.join("item.qrep");
    let mut w = ReplicaWriter::create(&path, "item", DIM as u32, Storage::F32, 64, &[-1.0; DIM]).unwrap();
    for key in 0..2000 {
        w.upsert(key, &vector(key, 0)).unwrap();
    }
    let handle = w.handle();
    let stop = Arc::new(AtomicBool::new(false));
    let checked = Arc::new(AtomicU64::new(0));
    let readers: Vec<_> = (0..2)
        .map(|seed| {
            let (handle, stop, checked) = (handle.clone(), stop.clone(), checked.clone());
            std::thread::spawn(move || {
                let mut keys = [0u64; 33];
                let mut rows = [0u32; 33];
                let mut out = vec![0.0f32; 33 * DIM];
                let mut x: u64 = seed + 1;
                while !stop.load(Ordering::Relaxed) {
                    for k in keys.iter_mut() {
                        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                        *k = (x >> 33) % 4000;
                    }
                    handle.load().read_many_into(&keys, &mut rows, &mut out, &mut []);
                    for (k, v) in keys.iter().zip(out.chunks_exact(DIM)) {
                        if v == [-1.0; DIM] {
                            continue;
                        }
                        assert_eq!(v[0], *k as f32, "a row of another key was served");
                        assert_eq!(v[DIM - 1], v[..DIM - 1].iter().sum::<f32>(), "torn row served");
                    }
                    checked.fetch_add(33, Ordering::Relaxed);
                }
            })
        })
        .collect();
    // At least 1.5 s of writing, and then until the readers have checked
    // enough rows beside it: a busy machine may give them little time.
    let started = Instant::now();
    let mut generation = 1;
    while started.elapsed() < Duration::from_millis(1500)
        || generation <= 3
        || checked.load(Ordering::Relaxed) <= 10_000
    {
        assert!(started.elapsed() < Duration::from_secs(60), "the readers checked {checked:?} rows in 60 s");
        for key in 0..4000u64 {
            if (key + generation) % 7 == 0 {
                w.delete(key);
            } else {
                w.upsert(key, &vector(key, generation)).unwrap();
            }
        }
        generation += 1;
    }
    stop.store(true, Ordering::Relaxed);
    for r in readers {
        r.join().expect("reader saw no torn or foreign row");
    }
    assert!(generation > 3 && checked.load(Ordering::Relaxed) > 10_000);
    assert!(handle.load().header().row_capacity > 64, "the table grew while readers read");
}

#[test]
fn a_replaced_table_is_released_by_the_writer_not_by_its_last_reader() {
    let dir = tmpdir("retired");
    let path = dir.join("user.qrep");
    let mut w = ReplicaWriter::create(&path, "user", 2, Storage::F32, 4, &[0.0; 2]).unwrap();
    let handle = w.handle();
    w.upsert(1, &[1.0, 2.0]).unwrap();
    // A reader holds the first table across a growth that replaces it.
    let held = Arc::clone(&*handle.load());
    for k in 2..100u64 {
        w.upsert(k, &[k as f32, 0.0]).unwrap();
    }
    assert!(!Arc::ptr_eq(&held, &*handle.load()), "the table was replaced");
    assert!(w.retired_held() >= 1, "the writer keeps the replaced table while a reader holds it");
    // The reader lets go: its drop is not the last one.
    let weak = Arc::downgrade(&held);
    drop(held);
    assert!(weak.upgrade().is_some(), "still mapped: the writer holds it");
    w.reap_retired();
    assert_eq!(w.retired_held(), 0);
    let until = Instant::now() + Duration::from_secs(10);
    while weak.upgrade().is_some() {
        assert!(Instant::now() < until, "released on the writer's side, by its unmap thread");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn a_deferred_open_serves_only_what_verifies_and_its_scan_finds_the_damage() {
    // Flip bytes all over files of each storage type. Opened deferred, a
    // file is refused at open, or every lookup answers as before or with the
    // default vector (never anything else) until the scan, which then
    // refuses it or leaves every answer as before.
    for storage in [Storage::F32, Storage::F16, Storage::Int8] {
        let dir = tmpdir(&format!("deferred-{storage:?}"));
        let path = dir.join("item.qrep");
        sample(60, 4).storage(storage).write(&path).unwrap();
        let good = std::fs::read(&path).unwrap();
        let want = snapshot(&Replica::open(&path, "item").unwrap(), 60, 4);
        let (mut refused_at_open, mut caught_by_reads, mut caught_by_scan) = (0, 0, 0);
        for at in (0..good.len()).step_by(5) {
            let mut bad = good.clone();
            bad[at] ^= 0x40;
            std::fs::write(&path, &bad).unwrap();
            let mut w = match ReplicaWriter::open_deferred(&path, "item") {
                Err(e) => {
                    assert!(e.is_damage(), "byte {at}: {e}");
                    refused_at_open += 1;
                    continue;
                }
                Ok(w) => w,
            };
            assert!(!w.table().verified());
            let served = snapshot(w.table(), 60, 4);
            for (row, (s, g)) in served.chunks(4).zip(want.chunks(4)).enumerate() {
                assert!(s == g || s == [-1.0; 4], "{storage:?} byte {at}: row {row} served {s:?}, wrote {g:?}");
            }
            if served != want {
                caught_by_reads += 1;
            }
            match w.finish_open() {
                Err(e) => {
                    assert!(e.is_damage(), "byte {at}: {e}");
                    assert!(!w.table().verified());
                    caught_by_scan += 1;
                }
                Ok(_) => {
                    assert!(w.table().verified());
                    assert_eq!(snapshot(w.table(), 60, 4), want, "{storage:?} byte {at} passed the scan");
                }
            }
        }
        assert!(refused_at_open > 0 && caught_by_reads > 0 && caught_by_scan > 0, "{storage:?}");
        assert!(caught_by_scan >= caught_by_reads, "whatever reads catch, the scan catches too");
    }
}

#[test]
fn a_deferred_writer_counts_corrupt_reads_and_writes_only_after_its_scan() {
    let dir = tmpdir("deferred-writes");
    let path = dir.join("item.qrep");
    sample(50, 4).write(&path).unwrap();
    let key = 20 * 7919 + 3;
    let mut w = ReplicaWriter::open_deferred(&path, "item").unwrap();
    assert!(w.scan_pending());
    assert_eq!(w.live_rows(), 0, "unknown until the scan");
    let writes = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| w.upsert(1, &[0.0; 4])));
    assert!(writes.is_err(), "an unscanned writer refuses to write");
    let report = w.finish_open().unwrap();
    assert_eq!((report.live_rows, report.torn_rows), (50, 0));
    w.upsert(1, &[1.0; 4]).unwrap();
    w.checkpoint(Cursor::default()).unwrap();
    drop(w);

    // The insert grew the file: find the row in the file as it is now.
    let r = Replica::open(&path, "item").unwrap();
    let payload_at = r.layout().rows_offset + r.find(key).unwrap() as usize * r.layout().row_stride + 16;
    drop(r);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[payload_at] ^= 0x01;
    std::fs::write(&path, &bytes).unwrap();
    let mut w = ReplicaWriter::open_deferred(&path, "item").unwrap();
    let handle = w.handle();
    let mut out = [0.0; 4];
    assert!(!handle.load().read_into(key, &mut out), "a row failing its CRC is not served");
    assert_eq!(out, [-1.0; 4]);
    assert!(handle.load().read_into(key + 7919, &mut out), "its neighbours are");
    assert_eq!(handle.load().corrupt_reads(), 1);
    assert!(matches!(w.finish_open(), Err(ReplicaError::PayloadChecksum { key: k, .. }) if k == key));
    assert!(w.scan_pending(), "a damaged file stays unwritable");
}

#[test]
fn a_background_growth_loses_nothing_written_while_it_copies() {
    const DIM: usize = 4;
    let vector = |key: u64, generation: u64| [key as f32, generation as f32, (key ^ generation) as f32, 1.0];
    let dir = tmpdir("grow-ahead");
    let path = dir.join("item.qrep");
    let mut w = ReplicaWriter::create(&path, "item", DIM as u32, Storage::F32, 200_000, &[0.0; DIM]).unwrap();
    let mut want: HashMap<u64, [f32; DIM]> = HashMap::new();
    for key in 0..149_000u64 {
        w.upsert(key, &vector(key, 0)).unwrap();
        want.insert(key, vector(key, 0));
    }
    w.set_grow_ahead(true);
    let handle = w.handle();
    assert!(!w.poll_growth().unwrap() && !w.growing(), "below three quarters: no growth");

    // Updates, deletes and inserts while the copy runs; every change goes
    // to the file readers see now, and must reach the grown one.
    let mut rng = crate::seeded::SplitMix64::new(7);
    let (mut generation, mut during) = (1u64, 0u64);
    let mut next_key = 149_000u64;
    loop {
        let swapped = w.poll_growth().unwrap();
        let growing = w.growing();
        assert!(!(swapped && growing));
        if !growing && w.table().header().row_capacity > 200_000 {
            break;
        }
        during += u64::from(growing);
        generation += 1;
        for _ in 0..50 {
            let key = rng.below(next_key);
            match rng.below(10) {
                0 => {
                    w.delete(key);
                    want.remove(&key);
                }
                1..=3 => {
                    w.upsert(next_key, &vector(next_key, generation)).unwrap();
                    want.insert(next_key, vector(next_key, generation));
                    next_key += 1;
                }
                _ => {
                    w.upsert(key, &vector(key, generation)).unwrap();
                    want.insert(key, vector(key, generation));
                }
            }
        }
        let mut out = [0.0; DIM];
        let key = rng.below(next_key);
        assert_eq!(handle.load().read_into(key, &mut out), want.contains_key(&key), "key {key}");
    }
    assert!(during > 0, "changes were applied while the growth ran");
    assert!(next_key > 150_000, "the writer inserted past three quarters without waiting");
    assert_eq!(w.live_rows(), want.len() as u64);
    let check = |r: &Replica| {
        let mut out = [0.0; DIM];
        for key in 0..next_key {
            match want.get(&key) {
                Some(v) => assert!(r.read_into(key, &mut out) && out == *v, "key {key}: {out:?}, want {v:?}"),
                None => assert!(!r.read_into(key, &mut out), "key {key} was deleted"),
            }
        }
    };
    check(&handle.load());
    w.checkpoint(Cursor::default()).unwrap();
    drop(w);
    check(&Replica::open(&path, "item").unwrap());

    // A full file: the growth starts at the next poll, and an insert that
    // finds no room waits for it instead of rehashing a second time.
    let path = dir.join("full.qrep");
    let mut w = ReplicaWriter::create(&path, "item", DIM as u32, Storage::F32, 1024, &[0.0; DIM]).unwrap();
    for key in 0..1024u64 {
        w.upsert(key, &vector(key, 0)).unwrap();
    }
    w.set_grow_ahead(true);
    w.poll_growth().unwrap();
    assert!(w.growing());
    // Noted while the copy may still run, then replayed inside the insert
    // that waits for the growth.
    w.upsert(5, &vector(5, 7)).unwrap();
    w.upsert(1024, &vector(1024, 0)).unwrap();
    assert!(!w.growing());
    w.upsert(3, &vector(3, 9)).unwrap();
    assert!(w.table().header().row_capacity > 1024);
    let mut out = [0.0; DIM];
    for key in 0..=1024u64 {
        let generation = match key {
            3 => 9,
            5 => 7,
            _ => 0,
        };
        assert!(w.table().read_into(key, &mut out) && out == vector(key, generation), "key {key}");
    }
}

#[test]
fn a_growth_abandoned_by_a_full_resync_leaves_no_copy_behind() {
    const DIM: usize = 4;
    let dir = tmpdir("grow-abandon");
    let path = dir.join("item.qrep");
    let files = || {
        let mut names: Vec<String> =
            std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        names.sort();
        names
    };
    let resynced = |keys: std::ops::Range<u64>| {
        let tmp = temp_path(&path, "sync");
        let mut fresh = ReplicaWriter::create(&tmp, "item", DIM as u32, Storage::F32, 1024, &[0.0; DIM]).unwrap();
        for key in keys {
            fresh.upsert(key, &[key as f32, 9.0, 9.0, 9.0]).unwrap();
        }
        fresh.checkpoint(Cursor::default()).unwrap();
        fresh
    };
    let mut w = ReplicaWriter::create(&path, "item", DIM as u32, Storage::F32, 100_000, &[0.0; DIM]).unwrap();
    for key in 0..76_000u64 {
        w.upsert(key, &[key as f32, 0.0, 0.0, 0.0]).unwrap();
    }
    w.set_grow_ahead(true);
    let handle = w.handle();

    // Replaced while the copy runs (or before the next poll collects it).
    w.poll_growth().unwrap();
    assert_eq!(w.growth_phase(), Some(GrowthPhase::Copying));
    assert!(temp_path(&path, "grow").exists(), "the copy's file exists from the start");
    w.replace(resynced(0..10)).unwrap();
    assert!(!w.growing());
    assert_eq!(files(), ["item.qrep"], "the copy's file is removed with the growth");
    let mut out = [0.0; DIM];
    assert!(handle.load().read_into(3, &mut out) && out == [3.0, 9.0, 9.0, 9.0]);
    assert!(!handle.load().read_into(50, &mut out), "the resynced table serves");

    // Replaced while the noted keys are replayed.
    w.set_grow_ahead(false);
    for key in 10..76_000u64 {
        w.upsert(key, &[key as f32, 0.0, 0.0, 0.0]).unwrap();
    }
    let fill = w.table().header().row_capacity / 4 * 3;
    for key in 76_000..fill {
        w.upsert(key, &[key as f32, 0.0, 0.0, 0.0]).unwrap();
    }
    assert!(!w.growing());
    w.set_grow_ahead(true);
    w.poll_growth().unwrap();
    assert_eq!(w.growth_phase(), Some(GrowthPhase::Copying));
    // More keys noted during the copy than one poll replays.
    for key in 0..40_000u64 {
        w.upsert(key, &[key as f32, 1.0, 0.0, 0.0]).unwrap();
    }
    // Polls that replay only the first keys once the copy is collected: a
    // fast machine replays all 40,000 within one poll's usual budget, and
    // the growth would be over before the resync below could abandon it.
    let until = Instant::now() + Duration::from_secs(60);
    while w.growth_phase() == Some(GrowthPhase::Copying) {
        assert!(Instant::now() < until, "the copy finishes");
        assert!(!w.poll_growth_within(Duration::ZERO).unwrap());
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(matches!(w.growth_phase(), Some(GrowthPhase::Replaying { keys_left }) if keys_left > 0));
    w.replace(resynced(0..20)).unwrap();
    assert!(!w.growing());
    assert_eq!(files(), ["item.qrep"]);
    assert!(handle.load().read_into(15, &mut out) && out == [15.0, 9.0, 9.0, 9.0]);
    drop(w);
    let (w, _) = ReplicaWriter::open(&path, "item").unwrap();
    assert_eq!(w.live_rows(), 20);
}

#[test]
fn a_read_only_server_serves_at_once_and_never_serves_a_row_that_fails_its_crc() {
    let dir = tmpdir("open-serving");
    let path = dir.join("item.qrep");
    sample(500, 4).write(&path).unwrap();
    let handle = ReplicaHandle::open_serving(&path, "item").unwrap();
    let until = Instant::now() + Duration::from_secs(10);
    while !handle.load().verified() {
        assert!(Instant::now() < until, "the background scan of a good file passes");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(snapshot(&handle.load(), 500, 4), snapshot(&Replica::open(&path, "item").unwrap(), 500, 4));
    drop(handle);

    let key = 123 * 7919 + 3;
    let r = Replica::open(&path, "item").unwrap();
    let payload_at = r.layout().rows_offset + r.find(key).unwrap() as usize * r.layout().row_stride + 16;
    drop(r);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[payload_at + 2] ^= 0x10;
    std::fs::write(&path, &bytes).unwrap();
    let handle = ReplicaHandle::open_serving(&path, "item").unwrap();
    let mut out = [0.0; 4];
    for _ in 0..3 {
        assert!(!handle.load().read_into(key, &mut out), "before, during and after the scan");
        assert_eq!(out, [-1.0; 4]);
        assert!(handle.load().read_into(key + 7919, &mut out));
        std::thread::sleep(Duration::from_millis(300));
    }
    assert!(!handle.load().verified(), "a damaged file is never marked verified");
    assert_eq!(handle.load().corrupt_reads(), 3);
}

#[test]
fn a_view_follows_the_writers_swaps_only_when_refreshed_and_then_lets_the_old_table_go() {
    let dir = tmpdir("view");
    let path = dir.join("user.qrep");
    let mut w = ReplicaWriter::create(&path, "user", 2, Storage::F32, 4, &[-1.0; 2]).unwrap();
    let handle = w.handle();
    w.upsert(1, &[1.0, 2.0]).unwrap();
    let mut view = ReplicaView::new(handle.clone());
    assert!(!view.refresh(), "nothing was swapped yet");
    let mut out = [0.0f32; 2];
    assert!(view.read_into(1, &mut out) && out == [1.0, 2.0]);
    // Growth swaps the table behind the handle; the view keeps the old one.
    for k in 2..100u64 {
        w.upsert(k, &[k as f32, 0.0]).unwrap();
    }
    assert!(!view.read_into(99, &mut out), "the old table has no row 99");
    assert_eq!(out, [-1.0, -1.0], "a missing key reads the default row");
    assert!(w.retired_held() >= 1, "the view holds the replaced table");
    assert!(view.refresh(), "the swap is seen");
    assert!(!view.refresh(), "and only once");
    assert!(view.read_into(99, &mut out) && out == [99.0, 0.0]);
    w.reap_retired();
    assert_eq!(w.retired_held(), 0, "after its refresh the view holds no replaced table");
}

#[test]
fn a_view_of_a_bucketed_group_reads_what_each_buckets_table_holds() {
    const BUCKETS: usize = 5;
    const DIM: usize = 3;
    let dir = tmpdir("view-buckets");
    let mut writers: Vec<ReplicaWriter> = (0..BUCKETS)
        .map(|b| {
            let path = bucket_path(&dir.join("item.qrep"), b);
            ReplicaWriter::create(&path, "item", DIM as u32, Storage::F32, 8, &[-1.0; DIM]).unwrap()
        })
        .collect();
    let handle = ReplicaHandle::bucketed(&mut writers);
    let mut view = ReplicaView::new(handle.clone());
    let row = |key: u64| [key as f32, key as f32 * 0.5, 1.0];
    // Enough keys per bucket that every bucket's table grows (a swap each).
    let present: Vec<u64> = (0..200u64).map(|i| i * 7919 + 11).collect();
    for &key in &present {
        writers[bucket_of(key, BUCKETS)].upsert(key, &row(key)).unwrap();
    }
    assert!(view.refresh(), "the buckets' growth swapped tables");
    let keys: Vec<u64> = present.iter().copied().chain((0..50u64).map(|i| i * 31 + 5)).collect();
    let mut rows = vec![0u32; keys.len()];
    let mut out = vec![0.0f32; keys.len() * DIM];
    let missing = view.read_many_into(&keys, &mut rows, &mut out, &mut []);
    let mut expected_missing = 0;
    for (key, got) in keys.iter().zip(out.chunks_exact(DIM)) {
        let mut one = [0.0f32; DIM];
        let found = handle.read_into(*key, &mut one);
        expected_missing += usize::from(!found);
        assert_eq!(got, one, "key {key}: the view reads what the handle reads");
        if present.contains(key) {
            assert!(found && got == row(*key), "key {key} is served from its bucket");
        } else {
            assert_eq!(got, [-1.0; DIM], "an unknown key reads the default row");
        }
    }
    assert_eq!(missing, expected_missing);
    assert_eq!(missing, 50 - (0..50u64).map(|i| i * 31 + 5).filter(|k| present.contains(k)).count());
}

/// A string key for entity `id`: 6 to 15 bytes, some keys prefixes of others.
fn str_key(id: u64) -> Vec<u8> {
    format!("user-{id}").into_bytes()
}

fn str_sample(rows: u64, dim: u32, bytes_max: u32) -> ReplicaBuilder {
    let mut b = ReplicaBuilder::new("user", dim).str_keys(bytes_max).unwrap();
    b.set_default(&vec![-1.0; dim as usize]).unwrap();
    for id in 0..rows {
        let v: Vec<f32> = (0..dim).map(|j| id as f32 + j as f32 * 0.5).collect();
        b.push_str(&str_key(id), &v).unwrap();
    }
    b
}

#[test]
fn the_string_key_hash_is_xxh3_64_as_published() {
    // Reference values of XXH3_64bits (seed 0) from the reference C
    // implementation, through its Python binding.
    assert_eq!(key_hash(b""), 0x2d06_8005_38d3_94c2);
    assert_eq!(key_hash(b"user:42"), 0x9fc1_e605_fa71_74aa);
    assert_eq!(key_hash(&[b'a'; 64]), 0x2ddd_cef0_7d26_ee8c);
}

#[test]
fn string_keys_build_open_and_look_up() {
    let dir = tmpdir("str-lookup");
    let path = dir.join("user.qrep");
    let mut b = str_sample(1000, 3, 16);
    b.push_str(b"", &[7.0, 7.0, 7.0]).unwrap();
    b.push_str(&[b'z'; 16], &[16.0, 16.0, 16.0]).unwrap();
    b.write(&path).unwrap();
    let r = Replica::open(&path, "user").unwrap();
    assert_eq!(r.key_kind(), KeyKind::Str { bytes_max: 16 });
    assert_eq!(r.header().row_count, 1002);
    let mut out = [0.0; 3];
    for id in 0..1000u64 {
        assert!(r.read_str_into(&str_key(id), &mut out), "{id}");
        assert_eq!(out, [id as f32, id as f32 + 0.5, id as f32 + 1.0]);
    }
    assert!(r.read_str_into(b"", &mut out) && out == [7.0; 3]);
    assert!(r.read_str_into(&[b'z'; 16], &mut out) && out == [16.0; 3]);
    for unknown in [&b"user-1000"[..], b"user-", b"user-12 ", &[b'z'; 17]] {
        assert!(!r.read_str_into(unknown, &mut out), "{unknown:?}");
        assert_eq!(out, [-1.0; 3]);
    }
    assert_eq!((r.key_collisions(), r.torn_reads(), r.corrupt_reads()), (0, 0, 0));

    let handle = Arc::new(ReplicaHandle::open(&path, "user").unwrap());
    assert_eq!(handle.key_kind(), KeyKind::Str { bytes_max: 16 });
    assert!(handle.read_str_into(b"user-5", &mut out) && out == [5.0, 5.5, 6.0]);
    let view = ReplicaView::new(handle);
    assert!(view.read_str_into(b"user-6", &mut out) && out == [6.0, 6.5, 7.0]);
    assert!(!view.read_str_into(b"user-x", &mut out) && out == [-1.0; 3]);

    // Keys of the other kind are refused, typed, wherever a caller gets a Result.
    let mut b = ReplicaBuilder::new("user", 1).str_keys(8).unwrap();
    assert!(matches!(b.push(1, &[1.0]), Err(ReplicaError::KeyKind { .. })));
    let mut b = ReplicaBuilder::new("user", 1);
    assert!(matches!(b.push_str(b"a", &[1.0]), Err(ReplicaError::KeyKind { .. })));
    let mut w = ReplicaWriter::create_keyed(
        &dir.join("w.qrep"),
        "user",
        1,
        Storage::F32,
        KeyKind::Str { bytes_max: 8 },
        4,
        &[0.0],
    )
    .unwrap();
    let err = w.upsert(1, &[1.0]).unwrap_err();
    assert!(err.to_string().contains("holds string keys of up to 8 bytes, used with u64 keys"), "{err}");
    let mut w = ReplicaWriter::create(&dir.join("u.qrep"), "user", 1, Storage::F32, 4, &[0.0]).unwrap();
    assert!(matches!(w.upsert_str(b"a", &[1.0]), Err(ReplicaError::KeyKind { .. })));

    // The payload follows the key words in every storage (int8's scale first).
    for storage in [Storage::F16, Storage::Int8] {
        let path = dir.join(format!("{storage:?}.qrep"));
        let mut b = ReplicaBuilder::new("user", 3).storage(storage).str_keys(5).unwrap();
        b.push_str(b"ab", &[127.0, -127.0, 0.0]).unwrap();
        b.push_str(b"abcde", &[-127.0, 0.0, 127.0]).unwrap();
        b.write(&path).unwrap();
        let r = Replica::open(&path, "user").unwrap();
        assert!(r.read_str_into(b"ab", &mut out) && out == [127.0, -127.0, 0.0], "{storage:?}");
        assert!(r.read_str_into(b"abcde", &mut out) && out == [-127.0, 0.0, 127.0], "{storage:?}");
        assert!(!r.read_str_into(b"abc", &mut out) && out == [0.0; 3], "{storage:?}");
    }

    let mut b = str_sample(3, 1, 8);
    b.push_str(b"user-1", &[9.0]).unwrap();
    assert!(matches!(b.write(&path), Err(ReplicaError::DuplicateStrKey { key }) if key == "user-1"));
}

#[test]
#[should_panic(expected = "a u64 lookup in a string-keyed file")]
fn a_u64_lookup_in_a_string_keyed_file_is_a_bug_caught() {
    let dir = tmpdir("str-misuse");
    let path = dir.join("user.qrep");
    str_sample(3, 1, 8).write(&path).unwrap();
    Replica::open(&path, "user").unwrap().read_into(1, &mut [0.0]);
}

#[test]
#[should_panic(expected = "a string lookup in a u64-keyed file")]
fn a_string_lookup_in_a_u64_keyed_file_is_a_bug_caught() {
    let dir = tmpdir("u64-misuse");
    let path = dir.join("item.qrep");
    sample(3, 1).write(&path).unwrap();
    Replica::open(&path, "item").unwrap().read_str_into(b"1", &mut [0.0]);
}

#[test]
fn an_over_long_string_key_is_refused() {
    let dir = tmpdir("str-long");
    assert!(matches!(
        ReplicaBuilder::new("user", 1).str_keys(KEY_BYTES_MAX + 1),
        Err(ReplicaError::KeyBytesMax { bytes_max: 65 })
    ));
    assert!(matches!(ReplicaBuilder::new("user", 1).str_keys(0), Err(ReplicaError::KeyBytesMax { .. })));
    let mut b = ReplicaBuilder::new("user", 1).str_keys(KEY_BYTES_MAX).unwrap();
    b.push_str(&[b'k'; 64], &[1.0]).unwrap();
    assert!(matches!(b.push_str(&[b'k'; 65], &[1.0]), Err(ReplicaError::KeyTooLong { bytes: 65, bytes_max: 64 })));
    let created = ReplicaWriter::create_keyed(
        &dir.join("x.qrep"),
        "user",
        1,
        Storage::F32,
        KeyKind::Str { bytes_max: 65 },
        4,
        &[0.0],
    );
    assert!(matches!(created, Err(ReplicaError::KeyBytesMax { bytes_max: 65 })));
    let path = dir.join("user.qrep");
    let mut w =
        ReplicaWriter::create_keyed(&path, "user", 1, Storage::F32, KeyKind::Str { bytes_max: 8 }, 4, &[0.0]).unwrap();
    w.upsert_str(b"12345678", &[8.0]).unwrap();
    let err = w.upsert_str(b"123456789", &[9.0]).unwrap_err();
    assert_eq!(err.to_string(), "a string key of 9 bytes, the group's keys are at most 8 bytes");
    assert!(!w.delete_str(b"123456789"));
    let mut out = [0.0];
    assert!(!w.table().read_str_into(b"123456789", &mut out));
    assert!(w.table().read_str_into(b"12345678", &mut out) && out == [8.0]);
    assert_eq!(w.live_rows(), 1);
}

#[test]
fn a_key_filed_under_another_keys_hash_is_a_counted_miss_never_its_features() {
    let dir = tmpdir("str-collision");
    let path = dir.join("user.qrep");
    let mut w =
        ReplicaWriter::create_keyed(&path, "user", 2, Storage::F32, KeyKind::Str { bytes_max: 16 }, 64, &[-1.0; 2])
            .unwrap();
    let handle = w.handle();
    let mut out = [0.0; 2];
    // A (alice) is written under B's (bob's) hash, as a real collision would file it.
    w.upsert_hashed(key_hash(b"bob"), b"alice", &[1.0, 1.0]).unwrap();
    assert_eq!(w.key_displacements(), 0, "nothing was displaced");
    assert!(!handle.read_str_into(b"bob", &mut out), "bob's hash holds alice's row");
    assert_eq!(out, [-1.0; 2], "never alice's features");
    assert_eq!(handle.load().key_collisions(), 1);
    assert!(!handle.read_str_into(b"alice", &mut out), "alice is filed under bob's hash only");
    assert_eq!(handle.load().key_collisions(), 1, "a plain miss is not a collision");
    assert!(!w.contains_str(b"bob") && !w.delete_str(b"bob"), "bob's delete leaves alice's row alone");
    assert!(w.table().find(key_hash(b"bob")).is_some());

    // Bob is written: the last written keeps the row, and the displacement is counted.
    w.upsert_str(b"bob", &[2.0, 2.0]).unwrap();
    assert_eq!(w.key_displacements(), 1);
    assert!(handle.read_str_into(b"bob", &mut out) && out == [2.0, 2.0]);
    assert_eq!(w.live_rows(), 1);
    // And alice, under bob's hash once more.
    w.upsert_hashed(key_hash(b"bob"), b"alice", &[3.0, 3.0]).unwrap();
    assert_eq!(w.key_displacements(), 2);
    assert!(!handle.read_str_into(b"bob", &mut out) && out == [-1.0; 2]);
    assert_eq!(handle.load().key_collisions(), 2);
    // The scan checks that a row's key hashes to the hash it is filed under:
    // a real collision always does, this forged one does not.
    w.checkpoint(Cursor::default()).unwrap();
    drop((w, handle));
    let err = Replica::open(&path, "user").unwrap_err();
    assert!(matches!(err, ReplicaError::Index { .. }) && err.is_damage(), "{err}");
}

#[test]
fn a_replacement_carries_the_collision_and_displacement_counts_on() {
    let dir = tmpdir("str-carry");
    let kind = KeyKind::Str { bytes_max: 16 };
    let mut w =
        ReplicaWriter::create_keyed(&dir.join("user.qrep"), "user", 2, Storage::F32, kind, 64, &[0.0; 2]).unwrap();
    let handle = w.handle();
    w.upsert_str(b"bob", &[2.0, 2.0]).unwrap();
    w.upsert_hashed(key_hash(b"bob"), b"alice", &[1.0, 1.0]).unwrap();
    let mut out = [0.0; 2];
    assert!(!handle.read_str_into(b"bob", &mut out));
    assert_eq!((w.key_displacements(), w.table().key_collisions()), (1, 1));
    let fresh = ReplicaWriter::create_keyed(&dir.join("user.fresh.qrep"), "user", 2, Storage::F32, kind, 64, &[0.0; 2])
        .unwrap();
    w.replace(fresh).unwrap();
    assert_eq!((w.key_displacements(), w.table().key_collisions()), (1, 1), "carried into the resync's file");
    assert_eq!(handle.load().key_collisions(), 1, "readers see the carried count");
}

#[test]
fn string_keys_survive_updates_deletes_growth_and_reopening() {
    let dir = tmpdir("str-writer");
    let path = dir.join("user.qrep");
    let mut w =
        ReplicaWriter::create_keyed(&path, "user", 3, Storage::F32, KeyKind::Str { bytes_max: 12 }, 4, &[9.0; 3])
            .unwrap();
    let handle = w.handle();
    // Grown on the writer's thread first, then in the background.
    for id in 0..3000u64 {
        w.upsert_str(&str_key(id), &[id as f32, 1.0, 2.0]).unwrap();
    }
    assert!(handle.load().header().row_capacity >= 3000, "grew past the initial 4 rows");
    w.set_grow_ahead(true);
    let until = Instant::now() + Duration::from_secs(60);
    let mut id = 3000;
    let mut grew_in_background = false;
    while id < 20_000 || w.growing() {
        assert!(Instant::now() < until, "the background growth ends");
        grew_in_background |= w.growing();
        if id < 20_000 {
            w.upsert_str(&str_key(id), &[id as f32, 1.0, 2.0]).unwrap();
            // Rewrites of keys the copy may already hold: the replay must carry them.
            w.upsert_str(&str_key(id / 2), &[(id / 2) as f32, 5.0, 2.0]).unwrap();
            id += 1;
        }
        w.poll_growth().unwrap();
    }
    assert!(grew_in_background && handle.load().header().row_capacity >= 20_000);
    assert!(w.delete_str(b"user-8"));
    assert!(!w.delete_str(b"user-8"));
    assert!(!w.delete_str(b"user-999999"));
    let cursor = Cursor { epoch: 3, seq: 4, change_unix_ms: 5 };
    w.checkpoint(cursor).unwrap();
    let check = |r: &Replica| {
        let mut out = [0.0; 3];
        for id in 0..20_000u64 {
            let found = r.read_str_into(&str_key(id), &mut out);
            if id == 8 {
                assert!(!found && out == [9.0; 3]);
            } else {
                let second = if (1500..10_000).contains(&id) { 5.0 } else { 1.0 };
                assert!(found && out == [id as f32, second, 2.0], "{id}: {out:?}");
            }
        }
        assert_eq!(r.live_rows(), 19_999);
    };
    check(&handle.load());
    assert_eq!(w.key_displacements(), 0);
    drop((w, handle));
    let r = Replica::open(&path, "user").unwrap();
    assert_eq!(r.key_kind(), KeyKind::Str { bytes_max: 12 });
    check(&r);
    drop(r);
    let (mut w, report) = ReplicaWriter::open(&path, "user").unwrap();
    assert_eq!(report, OpenReport { torn_rows: 0, live_rows: 19_999, cursor });
    w.upsert_str(b"user-8", &[8.0, 1.0, 2.0]).unwrap();
    assert!(w.contains_str(b"user-8"));
}

#[test]
fn string_rows_left_mid_write_are_dropped_and_a_flipped_key_byte_fails_the_crc() {
    let dir = tmpdir("str-torn");
    let path = dir.join("user.qrep");
    str_sample(50, 4, 16).write(&path).unwrap();
    let good = std::fs::read(&path).unwrap();
    let r = Replica::open(&path, "user").unwrap();
    let key = str_key(10);
    let row_at = r.layout().rows_offset + r.find(key_hash(&key)).unwrap() as usize * r.layout().row_stride;
    drop(r);
    // What a writer killed between its two counter stores leaves behind,
    // its key half written.
    let mut bytes = good.clone();
    bytes[row_at] |= 1;
    bytes[row_at + 16 + 4] ^= 0xff;
    std::fs::write(&path, &bytes).unwrap();
    assert!(matches!(Replica::open(&path, "user"), Err(ReplicaError::Torn { rows: 1, .. })));
    let (mut w, report) = ReplicaWriter::open(&path, "user").unwrap();
    assert_eq!((report.torn_rows, report.live_rows), (1, 49));
    let mut out = [0.0; 4];
    let handle = w.handle();
    assert!(!handle.read_str_into(&key, &mut out), "a torn row is never served");
    assert_eq!(out, [-1.0; 4]);
    w.upsert_str(&key, &[1.0, 2.0, 3.0, 4.0]).unwrap();
    assert!(handle.read_str_into(&key, &mut out) && out == [1.0, 2.0, 3.0, 4.0]);
    w.checkpoint(Cursor::default()).unwrap();
    drop((w, handle));
    assert_eq!(Replica::open(&path, "user").unwrap().live_rows(), 50);

    // A flipped key byte, seqlock intact: the full open refuses the file;
    // opened deferred, the row fails its CRC when read and is never served.
    for at in [row_at + 16, row_at + 16 + 4 + 2] {
        let mut bytes = good.clone();
        bytes[at] ^= 0x01;
        std::fs::write(&path, &bytes).unwrap();
        let err = Replica::open(&path, "user").unwrap_err();
        assert!(matches!(err, ReplicaError::PayloadChecksum { .. }), "byte {at}: {err}");
        let w = ReplicaWriter::open_deferred(&path, "user").unwrap();
        assert!(!w.table().read_str_into(&key, &mut out) && out == [-1.0; 4]);
        assert_eq!((w.table().corrupt_reads(), w.table().key_collisions()), (1, 0));
        assert!(w.table().read_str_into(&str_key(11), &mut out), "other rows serve");
    }
}

/// The stress test of the seqlock with string keys: each vector carries its
/// entity and a checksum, and the lookup key is rebuilt by the reader from
/// the entity, so a torn row, a torn key or another entity's row cannot pass.
#[test]
fn readers_never_see_torn_or_foreign_rows_under_string_keys() {
    const DIM: usize = 8;
    fn vector(id: u64, generation: u64) -> [f32; DIM] {
        let mut v = [0.0f32; DIM];
        v[0] = id as f32;
        for (i, x) in v.iter_mut().enumerate().take(DIM - 1).skip(1) {
            *x = ((generation * 31 + i as u64 * 7 + id) % 1000) as f32;
        }
        v[DIM - 1] = v[..DIM - 1].iter().sum();
        v
    }
    /// 15 bytes: a shared prefix, so keys differ only in their last words.
    fn key(id: u64) -> [u8; 15] {
        let mut k = *b"entity-\0\0\0\0\0\0\0\0";
        k[7..].copy_from_slice(&id.to_le_bytes());
        k
    }
    let dir = tmpdir("str-stress");
    let path = dir.join("user.qrep");
    let mut w = ReplicaWriter::create_keyed(
        &path,
        "user",
        DIM as u32,
        Storage::F32,
        KeyKind::Str { bytes_max: 15 },
        64,
        &[-1.0; DIM],
    )
    .unwrap();
    for id in 0..2000 {
        w.upsert_str(&key(id), &vector(id, 0)).unwrap();
    }
    let handle = w.handle();
    let stop = Arc::new(AtomicBool::new(false));
    let checked = Arc::new(AtomicU64::new(0));
    let readers: Vec<_> = (0..2)
        .map(|seed| {
            let (handle, stop, checked) = (handle.clone(), stop.clone(), checked.clone());
            std::thread::spawn(move || {
                let mut view = ReplicaView::new(handle);
                let mut out = [0.0f32; DIM];
                let mut x: u64 = seed + 1;
                while !stop.load(Ordering::Relaxed) {
                    view.refresh();
                    for _ in 0..32 {
                        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                        let id = (x >> 33) % 4000;
                        if !view.read_str_into(&key(id), &mut out) {
                            assert_eq!(out, [-1.0; DIM]);
                            continue;
                        }
                        assert_eq!(out[0], id as f32, "a row of another key was served");
                        assert_eq!(out[DIM - 1], out[..DIM - 1].iter().sum::<f32>(), "torn row served");
                    }
                    checked.fetch_add(32, Ordering::Relaxed);
                }
            })
        })
        .collect();
    let started = Instant::now();
    let mut generation = 1;
    while started.elapsed() < Duration::from_millis(1000)
        || generation <= 3
        || checked.load(Ordering::Relaxed) <= 10_000
    {
        assert!(started.elapsed() < Duration::from_secs(60), "the readers checked {checked:?} rows in 60 s");
        for id in 0..4000u64 {
            if (id + generation) % 7 == 0 {
                w.delete_str(&key(id));
            } else {
                w.upsert_str(&key(id), &vector(id, generation)).unwrap();
            }
        }
        generation += 1;
    }
    stop.store(true, Ordering::Relaxed);
    for r in readers {
        r.join().expect("reader saw no torn or foreign row");
    }
    assert!(handle.load().header().row_capacity > 64, "the table grew while readers read");
    assert_eq!(handle.load().key_collisions(), 0);
}

/// A file laid out byte by byte as the format was before string keys
/// (superblock bytes 20..24 unused, zero), without this module's encoders:
/// it still opens, serves and takes writes as a u64-keyed file.
#[test]
fn a_file_written_before_string_keys_opens_and_serves_as_before() {
    let dir = tmpdir("old-format");
    let path = dir.join("user.qrep");
    let crc = |b: &[u8]| crc32fast::hash(b);
    let (key, v, default) = (42u64, [1.5f32, -2.0], [0.25f32, 0.5]);
    // dim 2, f32, 1 row, 2 slots: index at 256, rows at 320, stride 32.
    let mut file = vec![0u8; 352];
    file[0..8].copy_from_slice(b"QVREPL02");
    file[8..12].copy_from_slice(&2u32.to_le_bytes());
    file[12..16].copy_from_slice(&2u32.to_le_bytes());
    file[24..32].copy_from_slice(&2u64.to_le_bytes());
    file[32..40].copy_from_slice(&1u64.to_le_bytes());
    file[40..44].copy_from_slice(b"user");
    let default_bytes: Vec<u8> = default.iter().flat_map(|x| x.to_le_bytes()).collect();
    file[56..60].copy_from_slice(&crc(&default_bytes).to_le_bytes());
    let sb = crc(&file[0..60]);
    file[60..64].copy_from_slice(&sb.to_le_bytes());
    file[128..136].copy_from_slice(&1u64.to_le_bytes());
    let cp = crc(&file[128..188]);
    file[188..192].copy_from_slice(&cp.to_le_bytes());
    file[192..200].copy_from_slice(&default_bytes);
    let slot = (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 63) as usize;
    let at = 256 + slot * 16;
    file[at..at + 8].copy_from_slice(&key.to_le_bytes());
    file[at + 12..at + 16].copy_from_slice(&1u32.to_le_bytes());
    let payload: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    let row_crc = crc(&[&key.to_le_bytes()[..], &payload[..]].concat());
    file[320..324].copy_from_slice(&2u32.to_le_bytes());
    file[324..328].copy_from_slice(&row_crc.to_le_bytes());
    file[328..336].copy_from_slice(&key.to_le_bytes());
    file[336..344].copy_from_slice(&payload);
    std::fs::write(&path, &file).unwrap();

    let r = Replica::open(&path, "user").unwrap();
    assert_eq!(r.key_kind(), KeyKind::U64);
    assert_eq!(r.live_rows(), 1);
    let mut out = [0.0; 2];
    assert!(r.read_into(key, &mut out) && out == v);
    assert!(!r.read_into(7, &mut out) && out == default);
    drop(r);
    let (mut w, report) = ReplicaWriter::open(&path, "user").unwrap();
    assert_eq!(report.live_rows, 1);
    w.upsert(7, &[7.0, 7.0]).unwrap();
    assert!(w.table().read_into(7, &mut out) && out == [7.0, 7.0]);
    assert!(w.table().read_into(key, &mut out) && out == v);
}

#[test]
fn text_input_with_string_keys() {
    let text = "# users by name\ndefault, 0.5, 0.5\nalice,1.0,2.0\nbob 3.0 4.0\n42,5.0,6.0\n";
    let b = ReplicaBuilder::from_text_keyed("user", KeyKind::Str { bytes_max: 8 }, text, "in.csv").unwrap();
    assert_eq!(b.key_kind(), KeyKind::Str { bytes_max: 8 });
    let dir = tmpdir("str-text");
    let path = dir.join("user.qrep");
    b.write(&path).unwrap();
    let r = Replica::open(&path, "user").unwrap();
    let mut out = [0.0; 2];
    assert!(r.read_str_into(b"bob", &mut out) && out == [3.0, 4.0]);
    assert!(r.read_str_into(b"42", &mut out) && out == [5.0, 6.0], "digits are a string key too");
    assert!(!r.read_str_into(b"carol", &mut out) && out == [0.5, 0.5]);

    let keyed =
        |text: &str, bytes_max| ReplicaBuilder::from_text_keyed("user", KeyKind::Str { bytes_max }, text, "in.csv");
    let err = keyed("alice,1.0\nalexander,2.0\n", 8).err().unwrap();
    assert_eq!(err.to_string(), "in.csv:2: a string key of 9 bytes, the group's keys are at most 8 bytes");
    assert!(matches!(keyed("a,1.0\n", 65), Err(ReplicaError::KeyBytesMax { bytes_max: 65 })));
    let dup = keyed("a,1.0\na,2.0\n", 8).unwrap();
    assert!(matches!(dup.write(&path), Err(ReplicaError::DuplicateStrKey { .. })));
    // The u64 format is unchanged: a name is not an id there.
    let err = ReplicaBuilder::from_text("user", "alice,1.0\n", "in.csv").err().unwrap();
    assert!(err.to_string().contains("not an unsigned 64-bit id"));
}

#[test]
fn a_full_resync_replaces_a_string_keyed_file_with_one_of_its_kind_only() {
    let dir = tmpdir("str-resync");
    let path = dir.join("user.qrep");
    let keys = KeyKind::Str { bytes_max: 16 };
    let mut w = ReplicaWriter::create_keyed(&path, "user", 2, Storage::F32, keys, 64, &[-1.0; 2]).unwrap();
    for id in 0..100u64 {
        w.upsert_str(&str_key(id), &[id as f32, 0.0]).unwrap();
    }
    let handle = w.handle();
    let mut view = ReplicaView::new(handle.clone());
    let tmp = temp_path(&path, "sync");
    let mut fresh = ReplicaWriter::create_keyed(&tmp, "user", 2, Storage::F32, keys, 64, &[-1.0; 2]).unwrap();
    for id in 50..150u64 {
        fresh.upsert_str(&str_key(id), &[id as f32, 1.0]).unwrap();
    }
    fresh.checkpoint(Cursor { epoch: 2, seq: 9, change_unix_ms: 1 }).unwrap();
    w.replace(fresh).unwrap();
    let mut out = [0.0; 2];
    assert!(view.read_str_into(b"user-10", &mut out) && out == [10.0, 0.0], "the view reads its table until refreshed");
    assert!(view.refresh());
    assert!(!view.read_str_into(b"user-10", &mut out) && out == [-1.0; 2]);
    assert!(view.read_str_into(b"user-149", &mut out) && out == [149.0, 1.0]);
    assert!(handle.read_str_into(b"user-50", &mut out) && out == [50.0, 1.0]);
    w.upsert_str(b"user-7", &[7.0, 2.0]).unwrap();
    assert!(handle.read_str_into(b"user-7", &mut out) && out == [7.0, 2.0]);

    // A u64-keyed copy is never installed over a string-keyed file.
    let wrong = ReplicaWriter::create(&temp_path(&path, "sync"), "user", 2, Storage::F32, 64, &[-1.0; 2]).unwrap();
    let replaced = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| w.replace(wrong)));
    assert!(replaced.is_err(), "a replacement of another key kind is a bug caught");
    assert!(handle.read_str_into(b"user-7", &mut out) && out == [7.0, 2.0], "the served table is kept");
    w.checkpoint(Cursor { epoch: 2, seq: 10, change_unix_ms: 1 }).unwrap();
    drop((w, view, handle));
    let r = Replica::open(&path, "user").unwrap();
    assert_eq!((r.key_kind(), r.live_rows()), (keys, 101));
    assert!(r.read_str_into(b"user-120", &mut out) && out == [120.0, 1.0]);
}

#[test]
fn batched_string_lookups_match_single_ones_in_one_table_and_across_buckets() {
    let dir = tmpdir("str-batch");
    let keys = KeyKind::Str { bytes_max: 12 };
    let lookups: Vec<Vec<u8>> = (0..64u64)
        .map(|i| match i % 8 {
            0 => format!("nobody-{i}").into_bytes(),
            1 => vec![b'x'; 13],
            _ => str_key(i * 3),
        })
        .collect();
    let mut writers: Vec<ReplicaWriter> = (0..3)
        .map(|b| {
            let path = dir.join(format!("user.b{b}.qrep"));
            ReplicaWriter::create_keyed(&path, "user", 2, Storage::F32, keys, 64, &[-1.0; 2]).unwrap()
        })
        .collect();
    let mut single =
        ReplicaWriter::create_keyed(&dir.join("user.qrep"), "user", 2, Storage::F32, keys, 64, &[-1.0; 2]).unwrap();
    for id in 0..500u64 {
        let key = str_key(id);
        let v = [id as f32, 0.5];
        single.upsert_str(&key, &v).unwrap();
        writers[bucket_of(key_hash(&key), 3)].upsert_str(&key, &v).unwrap();
    }
    let bucketed = ReplicaHandle::bucketed(&mut writers);
    let (mut hashes, mut rows, mut got) = (vec![0u64; 64], vec![0u32; 64], vec![0.0; 64 * 2]);
    for handle in [single.handle(), bucketed.clone()] {
        let missing =
            handle.read_many_str_into(lookups.iter().map(|k| &k[..]), &mut hashes, &mut rows, &mut got, &mut []);
        let mut want = vec![0.0; 64 * 2];
        for (k, dst) in lookups.iter().zip(want.chunks_exact_mut(2)) {
            handle.read_str_into(k, dst);
        }
        assert_eq!((got.as_slice(), missing), (want.as_slice(), 16), "through the handle");
    }
    let views = [ReplicaView::new(single.handle()), ReplicaView::new(bucketed)];
    for view in &views {
        let (mut hashes, mut rows, mut got) = (vec![0u64; 64], vec![0u32; 64], vec![0.0; 64 * 2]);
        let missing =
            view.read_many_str_into(lookups.iter().map(|k| &k[..]), &mut hashes, &mut rows, &mut got, &mut []);
        let mut want = vec![0.0; 64 * 2];
        let mut want_missing = 0;
        for (k, dst) in lookups.iter().zip(want.chunks_exact_mut(2)) {
            want_missing += usize::from(!view.read_str_into(k, dst));
        }
        assert_eq!(got, want);
        assert_eq!((missing, want_missing), (16, 16), "the unknown and the over-long keys");
        assert_eq!(&got[4..6], &[6.0, 0.5], "lookup 2 is user-6");
    }
}

fn link_of(r: &ReplicaHandle, filed: u64, str_key: &[u8], dim: usize) -> (bool, Vec<f32>, Option<EntityKeyBuf>) {
    let mut out = vec![0.0; dim];
    let mut link = vec![0u32; r.link_words()];
    let found = r.read_linked_into(filed, str_key, &mut out, &mut link);
    let mut buf = [0u8; KEY_BYTES_MAX as usize];
    let parent = decode_link(&link, r.link_kind().unwrap(), &mut buf).map(EntityKey::to_buf);
    (found, out, parent)
}

#[test]
fn rows_carry_links_to_their_parents_through_growth_reopen_and_rebuild() {
    let dir = tmpdir("links");
    let path = dir.join("ad.qrep");
    let campaigns = KeyKind::Str { bytes_max: 12 };
    // Four rows of room: the writes below grow the file twice.
    let mut w =
        ReplicaWriter::create_linked(&path, "ad", 3, Storage::Int8, KeyKind::U64, Some(campaigns), 4, &[-1.0; 3])
            .unwrap();
    for ad in 0..20u64 {
        let parent = format!("camp-{}", ad % 3);
        let parent = (ad % 5 != 0).then_some(EntityKey::Str(parent.as_bytes()));
        w.upsert_linked(EntityKey::Id(ad), &[ad as f32, 1.0, 2.0], parent).unwrap();
    }
    let check = |h: &ReplicaHandle| {
        assert_eq!(h.link_kind(), Some(campaigns));
        assert_eq!(h.link_words(), 1 + campaigns.key_words());
        for ad in 0..20u64 {
            let (found, v, parent) = link_of(h, ad, &[], 3);
            let bound = (ad as f32).max(2.0) / 254.0 + 1e-6;
            assert!(found && (v[0] - ad as f32).abs() <= bound, "ad {ad}: {v:?}");
            let want = (ad % 5 != 0).then(|| EntityKeyBuf::Str(format!("camp-{}", ad % 3).into_bytes()));
            assert_eq!(parent, want, "ad {ad}");
        }
        let (found, v, parent) = link_of(h, 999, &[], 3);
        assert!(!found && v == [-1.0; 3] && parent.is_none(), "a missing row links nowhere");
    };
    check(&w.handle());
    // A row rewritten without a parent no longer names one.
    w.upsert(7, &[7.0, 1.0, 2.0]).unwrap();
    assert_eq!(link_of(&w.handle(), 7, &[], 3).2, None);
    w.upsert_linked(EntityKey::Id(7), &[7.0, 1.0, 2.0], Some(EntityKey::Str(b"camp-1"))).unwrap();
    w.checkpoint(Cursor::default()).unwrap();
    drop(w);
    let reopened = ReplicaHandle::open(&path, "ad").unwrap();
    check(&reopened);

    // Refused: a parent of another kind, one too long, a parent for a file without links.
    let (mut w, _) = ReplicaWriter::open(&path, "ad").unwrap();
    let e = w.upsert_linked(EntityKey::Id(1), &[0.0; 3], Some(EntityKey::Id(4))).unwrap_err();
    assert!(e.to_string().contains("is not one of the parent's string keys"), "{e}");
    let e = w.upsert_linked(EntityKey::Id(1), &[0.0; 3], Some(EntityKey::Str(b"a-key-of-13-b"))).unwrap_err();
    assert!(matches!(e, ReplicaError::Link { .. }), "{e}");
    let plain = dir.join("plain.qrep");
    let mut p = ReplicaWriter::create(&plain, "plain", 1, Storage::F32, 4, &[0.0]).unwrap();
    let e = p.upsert_linked(EntityKey::Id(1), &[0.0], Some(EntityKey::Id(2))).unwrap_err();
    assert!(e.to_string().contains("has no parent"), "{e}");

    // The builder writes the same rows.
    let built = dir.join("built.qrep");
    let mut b = ReplicaBuilder::new("ad", 3).storage(Storage::Int8).links_to(campaigns).unwrap();
    b.set_default(&[-1.0; 3]).unwrap();
    for ad in 0..20u64 {
        let parent = format!("camp-{}", ad % 3);
        let parent = (ad % 5 != 0).then_some(EntityKey::Str(parent.as_bytes()));
        b.push_linked(EntityKey::Id(ad), &[ad as f32, 1.0, 2.0], parent).unwrap();
    }
    assert!(b.push_linked(EntityKey::Id(99), &[0.0; 3], Some(EntityKey::Id(1))).is_err());
    b.write(&built).unwrap();
    check(&ReplicaHandle::open(&built, "ad").unwrap());
}

#[test]
fn batched_lookups_return_each_rows_link_and_none_for_a_missing_row() {
    let dir = tmpdir("links-batched");
    let path = dir.join("campaign.qrep");
    let keys = KeyKind::Str { bytes_max: 8 };
    let mut w =
        ReplicaWriter::create_linked(&path, "campaign", 2, Storage::F32, keys, Some(KeyKind::U64), 64, &[0.5; 2])
            .unwrap();
    for c in 0..10u64 {
        let key = format!("c{c}");
        w.upsert_linked(EntityKey::Str(key.as_bytes()), &[c as f32; 2], Some(EntityKey::Id(1000 + c))).unwrap();
    }
    let handle = w.handle();
    let view = ReplicaView::new(handle.clone());
    let lw = view.link_words();
    assert_eq!(lw, 3);
    let lookups: Vec<Vec<u8>> = ["c3", "nope", "c9", "c0"].iter().map(|k| k.as_bytes().to_vec()).collect();
    let (mut hashes, mut rows, mut out, mut links) = (vec![0; 4], vec![0; 4], vec![0.0; 8], vec![7u32; 4 * lw]);
    for through_handle in [false, true] {
        let keys = lookups.iter().map(|k| &k[..]);
        let missing = if through_handle {
            handle.read_many_str_into(keys, &mut hashes, &mut rows, &mut out, &mut links)
        } else {
            view.read_many_str_into(keys, &mut hashes, &mut rows, &mut out, &mut links)
        };
        assert_eq!(missing, 1);
        assert_eq!(out, [3.0, 3.0, 0.5, 0.5, 9.0, 9.0, 0.0, 0.0]);
        let mut buf = [0u8; KEY_BYTES_MAX as usize];
        let parents: Vec<Option<EntityKeyBuf>> =
            links.chunks_exact(lw).map(|l| decode_link(l, KeyKind::U64, &mut buf).map(EntityKey::to_buf)).collect();
        assert_eq!(
            parents,
            [Some(EntityKeyBuf::Id(1003)), None, Some(EntityKeyBuf::Id(1009)), Some(EntityKeyBuf::Id(1000))]
        );
        links.fill(7);
    }
}

/// A stride 48 bytes past a whole number of lines (176: 32 floats with a
/// 16-byte string key, or 40 floats with a u64 key) is padded to 192 in a
/// new file, so every row starts a line and spans 3, not 3 or 4; no other
/// stride changes. Files written before (no flag) read as they were, and a
/// build before the padding refuses a padded file (an unknown key kind).
#[test]
fn rows_48_bytes_past_a_line_are_padded_and_unpadded_files_still_read() {
    let dir = tmpdir("line-aligned");
    let str16 = KeyKind::Str { bytes_max: 16 };
    let stride = |dim, keys, aligned| Layout::new(dim, Storage::F32, keys, None, aligned, 2, 1).unwrap().row_stride;
    assert_eq!((stride(32, str16, false), stride(32, str16, true)), (176, 192));
    assert_eq!((stride(40, KeyKind::U64, false), stride(40, KeyKind::U64, true)), (176, 192));
    for (dim, keys) in [(32, KeyKind::U64), (36, KeyKind::U64), (44, KeyKind::U64), (4, str16)] {
        assert_eq!(stride(dim, keys, true), stride(dim, keys, false), "{dim} {keys}");
        assert!(!format::line_padding_helps(dim, Storage::F32, keys, None));
    }
    for (dim, keys) in [(32, str16), (40, KeyKind::U64)] {
        assert!(format::line_padding_helps(dim, Storage::F32, keys, None));
        let key = |id: u64| format!("device-{id:09}").into_bytes();
        let row = |id: u64| (0..dim).map(|j| id as f32 + j as f32 * 0.25).collect::<Vec<f32>>();
        for aligned in [true, false] {
            let path = dir.join(format!("{dim}-{aligned}.qrep"));
            let mut w = ReplicaWriter::create_with(
                &path,
                "device",
                dim,
                Storage::F32,
                keys,
                None,
                aligned,
                300,
                &vec![-1.0; dim as usize],
            )
            .unwrap();
            for id in 0..300u64 {
                match keys {
                    KeyKind::U64 => w.upsert(id, &row(id)).unwrap(),
                    KeyKind::Str { .. } => w.upsert_str(&key(id), &row(id)).unwrap(),
                }
            }
            w.checkpoint(Cursor::default()).unwrap();
            drop(w);
            let r = Replica::open(&path, "device").unwrap();
            assert_eq!(r.header().line_aligned, aligned);
            assert_eq!(r.layout().row_stride, if aligned { 192 } else { 176 });
            assert_eq!(r.layout().rows_offset % 64, 0);
            let mut out = vec![0.0; dim as usize];
            for id in 0..300u64 {
                let found = match keys {
                    KeyKind::U64 => r.read_into(id, &mut out),
                    KeyKind::Str { .. } => r.read_str_into(&key(id), &mut out),
                };
                assert!(found && out == row(id), "{dim} {aligned} {id}");
            }
            let b = std::fs::read(&path).unwrap();
            let word = u32::from_le_bytes(b[20..24].try_into().unwrap());
            // What a build before the padding reads as the key kind.
            assert_eq!(KeyKind::from_code(word & 0xFFFF).is_none(), aligned);
        }
    }
}

#[test]
fn a_link_kind_is_in_the_superblock_where_older_builds_read_an_unknown_key_kind() {
    let header = |link| Header {
        dim: 4,
        storage: Storage::F32,
        slot_count: 2,
        row_capacity: 1,
        group: "ad".into(),
        keys: KeyKind::Str { bytes_max: 16 },
        link,
        line_aligned: false,
        row_count: 0,
    };
    for link in [None, Some(KeyKind::U64), Some(KeyKind::Str { bytes_max: 1 }), Some(KeyKind::Str { bytes_max: 64 })] {
        let b = format::encode_superblock(&header(link), 0);
        let (decoded, _) = format::decode_superblock(&b, "t").unwrap();
        assert_eq!(decoded, header(link));
        // What a build before links reads as the key kind: the whole word.
        let word = u32::from_le_bytes(b[20..24].try_into().unwrap());
        assert_eq!(KeyKind::from_code(word).is_none(), link.is_some());
    }
    // A link word no kind has is refused, not guessed.
    let mut b = format::encode_superblock(&header(None), 0);
    b[22] = 200;
    let crc = crc32fast::hash(&b[0..60]);
    b[60..64].copy_from_slice(&crc.to_le_bytes());
    let e = format::decode_superblock(&b, "t").unwrap_err();
    assert!(e.to_string().contains("unknown link kind"), "{e}");
}

#[test]
fn malformed_link_words_name_no_parent() {
    let mut buf = [0u8; KEY_BYTES_MAX as usize];
    let kind = KeyKind::Str { bytes_max: 8 };
    let mut words = vec![0u32; kind.link_words()];
    encode_link(Some(EntityKey::Str(b"abc")), &mut words);
    assert_eq!(decode_link(&words, kind, &mut buf), Some(EntityKey::Str(b"abc")));
    words[1] = 9;
    assert_eq!(decode_link(&words, kind, &mut buf), None, "a length past the limit");
    words[1] = 0;
    assert_eq!(decode_link(&words, kind, &mut buf), None, "an empty key");
    encode_link(None, &mut words);
    assert_eq!(decode_link(&words, kind, &mut buf), None);
    let mut ids = vec![0u32; KeyKind::U64.link_words()];
    encode_link(Some(EntityKey::Id(u64::MAX - 1)), &mut ids);
    assert_eq!(decode_link(&ids, KeyKind::U64, &mut buf), Some(EntityKey::Id(u64::MAX - 1)));
}

/// `keys_in_slots` walks a file's index a stretch at a time and, over a
/// whole walk, names every key once (a string key read whole from its
/// row), and no deleted one.
#[test]
fn a_walk_of_the_index_in_stretches_names_every_key_once() {
    let d = tmpdir("keys-in-slots");
    let walk = |table: &Replica, stretch: u64| {
        let (mut keys, mut from, mut steps) = (Vec::new(), 0, 0);
        loop {
            from = table.keys_in_slots(from, stretch, &mut keys);
            steps += 1;
            if from == 0 {
                return (keys, steps);
            }
        }
    };
    let path = d.join("item.qrep");
    sample(300, 2).write(&path).unwrap();
    let (mut writer, _) = ReplicaWriter::open(&path, "item").unwrap();
    assert!(writer.delete(3));
    let (keys, steps) = walk(writer.table(), 64);
    assert!(steps > 1);
    let mut ids: Vec<u64> =
        keys.iter().map(|k| if let EntityKeyBuf::Id(id) = k { *id } else { panic!("{k:?}") }).collect();
    ids.sort_unstable();
    assert_eq!(ids, (1..300).map(|k| k * 7919 + 3).collect::<Vec<_>>());
    // Past the end: nothing, and the walk starts over.
    let mut none = Vec::new();
    assert_eq!(writer.table().keys_in_slots(u64::MAX, 10, &mut none), 0);
    assert!(none.is_empty());

    let path = d.join("user.qrep");
    str_sample(100, 1, 16).write(&path).unwrap();
    let table = Replica::open(&path, "user").unwrap();
    let (keys, _) = walk(&table, 7);
    let mut got: Vec<Vec<u8>> =
        keys.into_iter().map(|k| if let EntityKeyBuf::Str(b) = k { b } else { panic!("{k:?}") }).collect();
    got.sort();
    let mut want: Vec<Vec<u8>> = (0..100).map(str_key).collect();
    want.sort();
    assert_eq!(got, want);
}
