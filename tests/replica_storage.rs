//! The accuracy cost of storing features as f16 or int8 instead of f32,
//! measured on the demo model (auction-32) over seeded random requests with
//! the f32 reference forward pass. docs/REPLICA.md quotes what this prints:
//!
//!     cargo test --release --test replica_storage -- --nocapture

mod common;

use common::demo_dir;
use quiver::features::replica::{Replica, ReplicaBuilder, Storage};
use quiver::loadgen::demo::{self, SplitMix64};
use quiver::model::{sigmoid, Model};

/// Re-encodes a demo replica with `storage`.
fn reencode(group: &str, rows: u64, storage: Storage, out: &std::path::Path) -> Replica {
    let src = Replica::open(&demo_dir().join(format!("{group}.qrep")), group).unwrap();
    let mut b = ReplicaBuilder::new(group, src.dim() as u32).storage(storage);
    b.set_default(&src.default_vector()).unwrap();
    let mut v = vec![0.0; src.dim()];
    for id in 0..rows {
        if src.read_into(id, &mut v) {
            b.push(id, &v).unwrap();
        }
    }
    b.write(out).unwrap();
    Replica::open(out, group).unwrap()
}

fn scores(model: &Model, user: &Replica, item: &Replica, user_id: u64, items: &[u64], context: &[f32]) -> Vec<f32> {
    let mut u = vec![0.0; user.dim()];
    user.read_into(user_id, &mut u);
    let mut x = Vec::new();
    let mut v = vec![0.0; item.dim()];
    for &id in items {
        item.read_into(id, &mut v);
        x.extend_from_slice(&u);
        x.extend_from_slice(&v);
        x.extend_from_slice(context);
    }
    let mut logits = vec![0.0; items.len()];
    model.forward_f32_reference(&x, items.len(), &mut logits);
    logits.into_iter().map(sigmoid).collect()
}

#[test]
fn f16_and_int8_storage_cost_little_score_accuracy_and_says_how_much() {
    let dir = common::scratch("storage");
    let model = Model::load(&demo_dir().join("model.qm")).unwrap();
    let exact = |g: &str| Replica::open(&demo_dir().join(format!("{g}.qrep")), g).unwrap();
    let (user32, item32) = (exact("user"), exact("item"));
    for (storage, bound) in [(Storage::F16, 1e-3f32), (Storage::Int8, 2e-2)] {
        let user = reencode("user", demo::USERS, storage, &dir.join(format!("user-{storage:?}.qrep")));
        let item = reencode("item", demo::ITEMS, storage, &dir.join(format!("item-{storage:?}.qrep")));
        let mut rng = SplitMix64::new(7);
        let (mut max, mut sum, mut n) = (0.0f32, 0.0f64, 0u64);
        for _ in 0..2000 {
            let user_id = rng.below(demo::USERS);
            let items: Vec<u64> = (0..demo::CANDIDATES).map(|_| rng.below(demo::ITEMS)).collect();
            let context: Vec<f32> = (0..demo::CONTEXT_LEN).map(|_| rng.normal()).collect();
            let want = scores(&model, &user32, &item32, user_id, &items, &context);
            let got = scores(&model, &user, &item, user_id, &items, &context);
            for (a, b) in want.iter().zip(&got) {
                let d = (a - b).abs();
                max = max.max(d);
                sum += f64::from(d);
                n += 1;
            }
        }
        let row_bytes =
            |r: &Replica| std::fs::metadata(r.path()).unwrap().len() as f64 / r.header().row_capacity as f64;
        println!(
            "storage {storage:?}: {n} scores, max |score - f32 score| {max:.2e}, mean {:.2e}; item file {:.0} bytes/row (f32: {:.0})",
            sum / n as f64,
            row_bytes(&item),
            row_bytes(&item32),
        );
        assert!(max <= bound, "{storage:?}: max score error {max} above the documented {bound}");
        assert!(max > 0.0, "{storage:?} is lossy, so some score must move");
    }
}
