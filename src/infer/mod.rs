//! The inference stage: a dedicated thread that takes scoring jobs from every
//! shard through lock-free rings, batches them with their deadlines in mind,
//! runs the backend, and hands results back the same way.
//!
//! Feature rows never travel through a queue: each shard owns a fixed set of
//! job slots (allocated at start-up, sized for the largest request) and
//! writes a request's rows into a free slot; the ring carries only the slot
//! number and timing. Ownership of a slot passes shard → stage with the job
//! and stage → shard with the completion; the rings' Release/Acquire order
//! the slot's contents. A full ring or no free slot is `Overloaded` at once.
//!
//! Batching: the thread gathers jobs for one model and launches when no
//! more jobs arrived since its last look (a lone job does not wait for
//! company: under load, jobs pile up while the kernel runs and form the next
//! batch by themselves), when the batch is full (`batch_rows_max`), when
//! the oldest job has waited `batch_wait_us_max` while others kept
//! arriving, or when waiting any longer would make the earliest deadline in
//! the batch miss given the expected kernel time for that many rows (a
//! running estimate per batch-size bucket). Jobs already past their
//! deadline (or that cannot finish by it) are dropped before the kernel, and
//! every job's deadline is checked again after it.
//!
//! Idle, the thread spins for `spin_us` and then parks; a shard unparks it
//! only if it is parked, so a busy stage costs no syscall per job. A stage
//! whose core also runs a shard (`shares_core`) never spins: it parks at
//! once and yields instead of polling, since every cycle it spins is taken
//! from the shard whose jobs it waits for.

mod cost;
pub mod ring;

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::deadline::{Clock, MonotonicClock};
use crate::model::Model;
use crate::registry::Registry;
use crate::score::{self, Backend, BackendKind};
use cost::CostTable;
use ring::{Consumer, Producer};

/// Sizes and timings of the stage, from config.
#[derive(Clone, Copy, Debug)]
pub struct StageConfig {
    /// Most rows the thread puts in one kernel launch.
    pub batch_rows_max: usize,
    /// Longest a job waits for company, while more jobs keep arriving,
    /// before its batch launches.
    pub batch_wait_us_max: u64,
    /// How long the idle thread spins before it parks.
    pub spin_us: u64,
    /// Jobs in flight per shard: the number of slots and the ring capacity.
    pub jobs_per_shard_max: usize,
    /// Rows one job may carry (the request candidate limit).
    pub rows_per_job_max: usize,
    /// Widest model input row the slots must hold.
    pub row_dim_max: usize,
    /// The core the stage thread is pinned to, if any.
    pub core: Option<usize>,
    /// That core (or, unpinned, every core) also runs a shard.
    pub shares_core: bool,
}

/// What one slot holds while a job is in flight.
pub struct SlotData {
    /// Which entry of its shard's model table scores it (`ShardEnd::set_model`).
    model: Option<ModelRef>,
    pub rows: usize,
    /// `rows_per_job_max × row_dim_max` input floats.
    pub x: Vec<f32>,
    /// `rows_per_job_max` logits, written by the stage.
    pub logits: Vec<f32>,
}

/// A slot's model, as an entry of its shard's model table: resolving it
/// reads the entry's `Arc` in place, so a hand-off touches no refcount.
/// `generation` is the entry's at the hand-off: an entry is rewritten only
/// while no slot names it, so a mismatch is a broken invariant, never a
/// slot resolved to the model that replaced its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ModelRef {
    index: u32,
    generation: u32,
}

/// One entry of a shard's model table.
struct ModelEntry {
    model: Option<Arc<Model>>,
    /// Bumped each time the entry is given another model.
    generation: u32,
}

struct Slots {
    slots: Box<[UnsafeCell<SlotData>]>,
    /// The models this shard's slots name, one entry per slot at most (so a
    /// free entry exists whenever a slot is free). Written by the shard only,
    /// and only for an entry no slot in flight names; read by the stage for
    /// the slots it holds.
    models: Box<[UnsafeCell<ModelEntry>]>,
}

// SAFETY: a slot is touched by one side at a time: the shard until it pushes
// the job (Release), the stage from popping the job (Acquire) until it pushes
// the completion (Release), the shard again after popping it (Acquire). A
// model entry is written by the shard only while no slot names it, before
// the push of a job that names it (Release); the stage reads it only for a
// job it popped (Acquire) and holds.
unsafe impl Sync for Slots {}
// SAFETY: as above; `SlotData` itself is `Send`.
unsafe impl Send for Slots {}

/// A scoring job on the ring: which slot, by when.
#[derive(Clone, Copy, Debug)]
struct Job {
    slot: u32,
    deadline_ns: u64,
    submitted_ns: u64,
}

/// How a job ended on the stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Logits are in the slot.
    Scored,
    /// Dropped before the kernel: it could not finish by its deadline.
    Expired,
    /// Scored, but the kernel ended after the deadline.
    Late,
    /// The model could not be run (no backend could be built for it).
    Failed,
}

/// A finished job, with the stage's timings for metrics.
#[derive(Clone, Copy, Debug)]
pub struct Done {
    pub slot: u32,
    pub outcome: Outcome,
    /// From submission to the start of its kernel (or its drop).
    pub queue_ns: u64,
    pub kernel_ns: u64,
    pub batch_rows: u32,
}

struct Wake {
    parked: AtomicBool,
    thread: std::sync::OnceLock<std::thread::Thread>,
}

impl Wake {
    fn nudge(&self) {
        // Pairs with the fence in `run`: either the stage sees the job this
        // shard just pushed, or this shard sees `parked` and unparks it.
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.parked.load(Ordering::SeqCst) {
            if let Some(t) = self.thread.get() {
                t.unpark();
            }
        }
    }
}

/// How the stage wakes a shard that sleeps waiting for its completions
/// (one whose core the stage thread shares, and which therefore must not
/// spin): a socket pair the shard's runtime can wait on. The stage writes a
/// byte only when the shard said it waits, so a shard that polls costs the
/// stage no syscall.
struct Bell {
    waiting: AtomicBool,
    tx: std::os::unix::net::UnixStream,
}

impl Bell {
    fn ring(&self) {
        // Pairs with the fence in `ShardEnd::will_wait`: either the shard
        // sees the completion just pushed, or the stage sees `waiting`.
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.waiting.load(Ordering::SeqCst) && self.waiting.swap(false, Ordering::SeqCst) {
            // Non-blocking: a full socket already holds a wake-up.
            let _ = std::io::Write::write(&mut &self.tx, &[1]);
        }
    }
}

/// The shard's ownership of one job slot, as a value: `acquire` and a
/// completion (`poll`) hand one out, `submit` and `release` consume it, and
/// only its holder can reach the slot's memory (`slot_mut`). It is neither
/// `Copy` nor `Clone` nor constructible outside this module, so safe code
/// cannot touch a slot the stage owns; it names its `ShardEnd`, so it cannot
/// open another shard's slot either.
#[must_use = "a slot token must be submitted or released, or the slot is lost"]
#[derive(Debug)]
pub struct SlotToken {
    slot: u32,
    end: u32,
}

impl SlotToken {
    /// The slot's number, for the shard's own per-slot bookkeeping.
    pub fn index(&self) -> u32 {
        self.slot
    }
}

/// A shard's end of the stage. Owned by one shard; `Send` only so it can be
/// moved onto the shard's thread at start-up.
pub struct ShardEnd {
    /// Which shard's end: the tokens it hands out carry it.
    id: u32,
    jobs: Producer<Job>,
    done: Consumer<Done>,
    slots: Arc<Slots>,
    free: Vec<u32>,
    /// Slots taken (acquired, in flight or awaiting release) that name each
    /// model entry: an entry is given another model only at zero.
    model_uses: Vec<u32>,
    /// The entry `set_model` last named: checked first, so a run of
    /// hand-offs to one model scans nothing.
    model_last: usize,
    wake: Arc<Wake>,
    slot_floats: usize,
    /// Only when the stage shares a shard's core (`shares_core`).
    bell: Option<Arc<Bell>>,
    /// The end of the bell the shard waits on, until its runtime takes it.
    bell_rx: Option<std::os::unix::net::UnixStream>,
}

impl ShardEnd {
    /// A free slot to fill, or `None` when every slot is in flight.
    pub fn acquire(&mut self) -> Option<SlotToken> {
        self.free.pop().map(|slot| SlotToken { slot, end: self.id })
    }

    /// The memory of the slot `token` holds, to read.
    pub fn slot(&self, token: &SlotToken) -> &SlotData {
        assert_eq!(token.end, self.id, "a slot token is used only with the end that issued it");
        // SAFETY: as in `slot_mut`; `&self` allows no `slot_mut` meanwhile.
        unsafe { &*self.slots.slots[token.slot as usize].get() }
    }

    /// The memory of the slot `token` holds.
    pub fn slot_mut(&mut self, token: &SlotToken) -> &mut SlotData {
        assert_eq!(token.end, self.id, "a slot token is used only with the end that issued it");
        // SAFETY: a token exists only while this shard owns its slot (from
        // `acquire` or a completion until `submit` or `release` consume it),
        // so the stage does not touch the slot; `&mut self` makes this the
        // only reference on this side.
        unsafe { &mut *self.slots.slots[token.slot as usize].get() }
    }

    /// The input rows of slot `slot`, whichever side holds it: the stage
    /// never writes a slot's rows, and the shard only through a token
    /// (`slot_mut`, which `&self` here excludes). For a request the shard
    /// still answers (a give-up while the stage holds its slot).
    pub fn rows_of(&self, slot: u32) -> &[f32] {
        // SAFETY: only the `x` field is borrowed (the stage writes only a
        // held slot's `logits`, through a borrow of that field alone); `x`
        // is written only through `slot_mut`, which needs `&mut self`.
        unsafe { &(*self.slots.slots[slot as usize].get()).x }
    }

    /// Names `model` as the one to score the slot `token` holds: the entry of
    /// the shard's model table that already holds it, else an entry no slot
    /// names, given `model` (the one refcount touched, once per model and
    /// entry, not per hand-off).
    pub fn set_model(&mut self, token: &SlotToken, model: &Arc<Model>) {
        let old = self.slot_mut(token).model.take();
        self.drop_use(old);
        // SAFETY: the shard alone writes entries; reading them here races
        // with no write, and the stage only reads.
        let entry = |i: usize| unsafe { &*self.slots.models[i].get() };
        let holds = |i: usize| entry(i).model.as_ref().is_some_and(|m| Arc::ptr_eq(m, model));
        let found =
            if holds(self.model_last) { Some(self.model_last) } else { (0..self.model_uses.len()).find(|&i| holds(i)) };
        let index = match found {
            Some(i) => i,
            None => {
                let i = self.model_uses.iter().position(|&u| u == 0).expect("an entry per slot: one is unused");
                // SAFETY: no slot names entry `i` (`model_uses` is 0), so
                // the stage holds no job that reads it.
                let e = unsafe { &mut *self.slots.models[i].get() };
                e.model = Some(Arc::clone(model));
                e.generation = e.generation.wrapping_add(1);
                i
            }
        };
        self.model_uses[index] += 1;
        self.model_last = index;
        // SAFETY: as above (read only).
        let generation = unsafe { (*self.slots.models[index].get()).generation };
        self.slot_mut(token).model = Some(ModelRef { index: index as u32, generation });
    }

    /// The model named for the slot `token` holds (`set_model`).
    pub fn model(&self, token: &SlotToken) -> Option<&Arc<Model>> {
        assert_eq!(token.end, self.id, "a slot token is used only with the end that issued it");
        // SAFETY: the token's holder owns the slot; the entry it names is
        // written by this shard only, and not while a slot names it.
        let r = unsafe { (*self.slots.slots[token.slot as usize].get()).model }?;
        // SAFETY: as above.
        let e = unsafe { &*self.slots.models[r.index as usize].get() };
        assert_eq!(e.generation, r.generation, "a named model entry is not rewritten");
        e.model.as_ref()
    }

    fn drop_use(&mut self, r: Option<ModelRef>) {
        if let Some(r) = r {
            self.model_uses[r.index as usize] -= 1;
        }
    }

    /// Hands the filled slot to the stage, to be scored by `deadline_ns`.
    /// On a full ring the token comes back and the slot stays with the shard.
    pub fn submit(&mut self, token: SlotToken, deadline_ns: u64, submitted_ns: u64) -> Result<(), SlotToken> {
        assert_eq!(token.end, self.id, "a slot token is used only with the end that issued it");
        let job = Job { slot: token.slot, deadline_ns, submitted_ns };
        if self.jobs.push(job).is_err() {
            return Err(token);
        }
        self.wake.nudge();
        Ok(())
    }

    /// A finished job and the slot it gives back to the shard.
    pub fn poll(&mut self) -> Option<(Done, SlotToken)> {
        self.done.pop().map(|d| (d, SlotToken { slot: d.slot, end: self.id }))
    }

    /// Returns a slot whose completion has been handled.
    pub fn release(&mut self, token: SlotToken) {
        let old = self.slot_mut(&token).model.take();
        // The entry keeps its model: the next hand-off of the same version
        // finds it there without a refcount touched.
        self.drop_use(old);
        self.free.push(token.slot);
    }

    pub fn in_flight(&self) -> usize {
        self.slots.slots.len() - self.free.len()
    }

    /// The socket the stage rings when this shard waits (`will_wait`): its
    /// runtime waits for it to be readable. Taken once.
    pub fn take_bell(&mut self) -> Option<std::os::unix::net::UnixStream> {
        self.bell_rx.take()
    }

    /// Announces that the shard is about to wait on the bell; `false` (and
    /// no wait) when a completion is already there.
    pub fn will_wait(&self) -> bool {
        let Some(bell) = &self.bell else { return false };
        bell.waiting.store(true, Ordering::SeqCst);
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.done.is_empty() {
            return true;
        }
        bell.waiting.store(false, Ordering::SeqCst);
        false
    }

    /// The wait on the bell ended (rung or timed out).
    pub fn woke(&self) {
        if let Some(bell) = &self.bell {
            bell.waiting.store(false, Ordering::SeqCst);
        }
    }

    /// Input floats one slot holds.
    pub fn slot_floats(&self) -> usize {
        self.slot_floats
    }

    /// Whether a job of `floats` input values fits a slot.
    pub fn fits(&self, floats: usize) -> bool {
        self.slot_floats >= floats
    }

    /// Number of job slots.
    pub fn slots(&self) -> usize {
        self.slots.slots.len()
    }
}

/// A running stage; dropping the handle does not stop it, `stop` does.
pub struct Stage {
    stop: Arc<AtomicBool>,
    wake: Vec<Arc<Wake>>,
    thread: Option<JoinHandle<()>>,
}

impl Stage {
    pub fn stop(mut self) {
        self.stop.store(true, Ordering::Release);
        for w in &self.wake {
            if let Some(t) = w.thread.get() {
                t.unpark();
            }
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct StageEnd {
    jobs: Consumer<Job>,
    done: Producer<Done>,
    slots: Arc<Slots>,
    bell: Option<Arc<Bell>>,
}

/// Starts the stage thread with one end per shard.
pub fn start(
    config: StageConfig,
    shards: usize,
    registry: Arc<Registry>,
    backend: BackendKind,
    faults: Arc<Faults>,
) -> Result<(Stage, Vec<ShardEnd>), std::io::Error> {
    let stop = Arc::new(AtomicBool::new(false));
    let wake = Arc::new(Wake { parked: AtomicBool::new(false), thread: std::sync::OnceLock::new() });
    let mut shard_ends = Vec::with_capacity(shards);
    let mut stage_ends = Vec::with_capacity(shards);
    for _ in 0..shards {
        // A shard polls a stage on a core of its own; only one sharing its
        // core sleeps on a bell.
        let (bell, bell_rx) = if config.shares_core {
            let (tx, rx) = std::os::unix::net::UnixStream::pair()?;
            tx.set_nonblocking(true)?;
            (Some(Arc::new(Bell { waiting: AtomicBool::new(false), tx })), Some(rx))
        } else {
            (None, None)
        };
        let (job_tx, job_rx) = ring::ring::<Job>(config.jobs_per_shard_max);
        let (done_tx, done_rx) = ring::ring::<Done>(config.jobs_per_shard_max);
        let slot_count = job_tx.capacity().min(done_tx.capacity());
        let slots = Arc::new(Slots {
            slots: (0..slot_count)
                .map(|_| {
                    UnsafeCell::new(SlotData {
                        model: None,
                        rows: 0,
                        x: vec![0.0; config.rows_per_job_max * config.row_dim_max],
                        logits: vec![0.0; config.rows_per_job_max],
                    })
                })
                .collect(),
            models: (0..slot_count).map(|_| UnsafeCell::new(ModelEntry { model: None, generation: 0 })).collect(),
        });
        shard_ends.push(ShardEnd {
            id: shard_ends.len() as u32,
            jobs: job_tx,
            done: done_rx,
            slots: slots.clone(),
            free: (0..slot_count as u32).rev().collect(),
            model_uses: vec![0; slot_count],
            model_last: 0,
            wake: wake.clone(),
            slot_floats: config.rows_per_job_max * config.row_dim_max,
            bell: bell.clone(),
            bell_rx,
        });
        stage_ends.push(StageEnd { jobs: job_rx, done: done_tx, slots, bell });
    }
    // The stage reports once it has built and measured a backend for every
    // served version; `start` returns only then, so the server does not
    // listen while the first jobs would wait for those builds (the cause of
    // thread mode's late first requests).
    let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel::<()>(1);
    let thread = std::thread::Builder::new().name("quiver-infer".into()).spawn({
        let (stop, wake) = (stop.clone(), wake.clone());
        move || {
            if let Some(core) = config.core {
                pin_to(core);
            }
            if config.shares_core {
                prefer_over_shards();
            }
            wake.thread.set(std::thread::current()).expect("set once");
            let controls = Controls { stop: &stop, wake: &wake, faults: &faults, ready: ready_tx };
            run(config, stage_ends, registry, backend, controls);
        }
    })?;
    // A stage that died before it was ready has dropped the sender.
    if ready_rx.recv().is_err() {
        let _ = thread.join();
        return Err(std::io::Error::other("the inference stage stopped before it was ready"));
    }
    Ok((Stage { stop, wake: vec![wake], thread: Some(thread) }, shard_ends))
}

/// A job waiting on the stage.
#[derive(Clone, Copy)]
struct Waiting {
    shard: usize,
    job: Job,
    rows: usize,
}

/// What the stage thread is steered by: the stop flag, its wake-up, the
/// fault hooks, and where it reports that it is ready.
struct Controls<'a> {
    stop: &'a AtomicBool,
    wake: &'a Wake,
    faults: &'a Faults,
    ready: std::sync::mpsc::SyncSender<()>,
}

fn run(config: StageConfig, ends: Vec<StageEnd>, registry: Arc<Registry>, kind: BackendKind, controls: Controls<'_>) {
    let Controls { stop, wake, faults, ready } = controls;
    let mut ready = Some(ready);
    let clock = MonotonicClock::new();
    let jobs_max = ends.len() * config.jobs_per_shard_max.next_power_of_two();
    let mut waiting: Vec<Waiting> = Vec::with_capacity(jobs_max);
    let mut spare: Vec<Waiting> = Vec::with_capacity(jobs_max);
    let mut batch: Vec<Waiting> = Vec::with_capacity(jobs_max);
    let mut x = vec![0.0f32; config.batch_rows_max.max(config.rows_per_job_max) * config.row_dim_max];
    let mut logits = vec![0.0f32; config.batch_rows_max.max(config.rows_per_job_max)];
    let mut backends: Vec<(Arc<Model>, Box<dyn Backend>, CostTable)> = Vec::new();
    // Build and measure a backend for every served version before the first
    // job, and again whenever the registry changes, so no job waits for one.
    let mut generation = 0;
    let mut idle_since_ns: Option<u64> = None;
    let slot = |end: &StageEnd, i: u32| -> *mut SlotData { end.slots.slots[i as usize].get() };
    // The model a held job's slot names, as its address: compared, never
    // cloned, so the stage touches no refcount per job. An address cannot
    // be reused by another model while the entry (or `backends`) holds it.
    let model_of = |end: &StageEnd, i: u32| -> Option<*const Model> {
        // SAFETY: called for a job the stage holds (popped, not yet
        // finished); the shard does not write the entry its slot names
        // while it is named.
        let r = unsafe { (*slot(end, i)).model }?;
        // SAFETY: as above.
        let e = unsafe { &*end.slots.models[r.index as usize].get() };
        assert_eq!(e.generation, r.generation, "a named model entry is not rewritten");
        e.model.as_ref().map(Arc::as_ptr)
    };

    while !stop.load(Ordering::Acquire) {
        if registry.generation() != generation {
            let snapshot = registry.snapshot();
            generation = snapshot.generation;
            let live: Vec<Arc<Model>> =
                snapshot.models.into_iter().chain(snapshot.canaries.into_iter().map(|(m, _)| m)).collect();
            backends.retain(|(m, _, _)| live.iter().any(|l| Arc::ptr_eq(l, m)));
            for model in live {
                if !backends.iter().any(|(m, _, _)| Arc::ptr_eq(m, &model)) {
                    let (backend, costs) = prepare(kind, &model, &config, &mut x, &mut logits, &clock);
                    backends.push((model, backend, costs));
                }
            }
        }
        if let Some(r) = ready.take() {
            let _ = r.send(());
        }
        // Gather.
        let waiting_before = waiting.len();
        for (shard, end) in ends.iter().enumerate() {
            while let Some(job) = end.jobs.pop() {
                // SAFETY: the stage owns the slot from this pop until it
                // pushes the completion.
                let rows = unsafe { (*slot(end, job.slot)).rows };
                waiting.push(Waiting { shard, job, rows });
            }
        }
        let now_ns = clock.now_ns();
        if waiting.is_empty() {
            let since = *idle_since_ns.get_or_insert(now_ns);
            if !config.shares_core && now_ns - since < config.spin_us * 1_000 {
                std::hint::spin_loop();
                continue;
            }
            wake.parked.store(true, Ordering::SeqCst);
            // Re-check after announcing: a shard that pushed before it could
            // see `parked` did not unpark us. The fence orders the store above
            // before the ring loads below (store-load, so SeqCst).
            std::sync::atomic::fence(Ordering::SeqCst);
            if ends.iter().all(|e| e.jobs.is_empty()) && !stop.load(Ordering::Acquire) {
                std::thread::park_timeout(Duration::from_millis(10));
            }
            wake.parked.store(false, Ordering::Release);
            continue;
        }
        idle_since_ns = None;

        // The oldest job decides the model of the next batch.
        let Some(model) = model_of(&ends[waiting[0].shard], waiting[0].job.slot) else {
            let w = waiting.remove(0);
            finish(&ends[w.shard], w.job, Outcome::Failed, now_ns, 0, 0);
            continue;
        };
        let b = match backends.iter().position(|(m, _, _)| Arc::as_ptr(m) == model) {
            Some(b) => b,
            None => {
                // A version the registry dropped while its jobs were queued:
                // the one clone, to keep it for its backend.
                let end = &ends[waiting[0].shard];
                // SAFETY: the stage holds this job; its entry is not written
                // while the slot names it.
                let r = unsafe { (*slot(end, waiting[0].job.slot)).model }.expect("checked above");
                // SAFETY: as above.
                let held = unsafe { &*end.slots.models[r.index as usize].get() };
                let held = Arc::clone(held.model.as_ref().expect("checked above"));
                let (backend, costs) = prepare(kind, &held, &config, &mut x, &mut logits, &clock);
                backends.push((held, backend, costs));
                backends.len() - 1
            }
        };
        let (batch_model, backend, costs) = &mut backends[b];
        let dim = batch_model.input_dim();

        // Which waiting jobs ride in this batch, and is it time to launch?
        let mut rows = 0;
        let mut earliest_deadline_ns = u64::MAX;
        for w in waiting.iter() {
            let same = model_of(&ends[w.shard], w.job.slot) == Some(model);
            if same && rows + w.rows <= config.batch_rows_max.max(w.rows) {
                rows += w.rows;
                earliest_deadline_ns = earliest_deadline_ns.min(w.job.deadline_ns);
            }
        }
        let oldest_wait_ns = now_ns.saturating_sub(waiting[0].job.submitted_ns);
        let expected_ns = costs.expected_ns(rows, now_ns);
        let full = rows >= config.batch_rows_max;
        let waited = oldest_wait_ns >= config.batch_wait_us_max * 1_000;
        // No company arrived since the last look: waiting is a guess.
        let quiet = waiting.len() == waiting_before;
        // Margin for the hand-back and the response after the kernel.
        let urgent = earliest_deadline_ns.saturating_sub(now_ns) <= expected_ns + expected_ns / 4 + 20_000;
        if !(full || waited || quiet || urgent) {
            std::hint::spin_loop();
            continue;
        }

        // Take the batch; drop what cannot finish in time.
        batch.clear();
        std::mem::swap(&mut waiting, &mut spare);
        let mut batch_rows = 0;
        for w in spare.drain(..) {
            let same = model_of(&ends[w.shard], w.job.slot) == Some(model);
            if !same || batch_rows + w.rows > config.batch_rows_max.max(w.rows) {
                waiting.push(w);
                continue;
            }
            if w.job.deadline_ns < now_ns + expected_ns {
                tracing::trace!(
                    slot = w.job.slot,
                    left_ns = w.job.deadline_ns.saturating_sub(now_ns),
                    expected_ns,
                    waited_ns = now_ns.saturating_sub(w.job.submitted_ns),
                    "expired"
                );
                finish(&ends[w.shard], w.job, Outcome::Expired, now_ns, 0, 0);
                continue;
            }
            batch_rows += w.rows;
            batch.push(w);
        }
        if batch.is_empty() {
            continue;
        }

        // Gather rows, run, scatter. The one copy of rows on the stage: a
        // batch's jobs sit in separate slots and the kernel takes one
        // contiguous matrix.
        let mut at = 0;
        for w in &batch {
            // SAFETY: as above.
            let data = unsafe { &*slot(&ends[w.shard], w.job.slot) };
            x[at * dim..(at + w.rows) * dim].copy_from_slice(&data.x[..w.rows * dim]);
            at += w.rows;
        }
        let started_ns = clock.now_ns();
        let delay_us = faults.stage_delay_us();
        if delay_us > 0 {
            std::thread::sleep(Duration::from_micros(delay_us));
        }
        let scored = backend.score(&x[..batch_rows * dim], batch_rows, &mut logits[..batch_rows]);
        let ended_ns = clock.now_ns();
        if scored.is_err() {
            // The shards step these requests down (reason model_error).
            for w in &batch {
                finish(&ends[w.shard], w.job, Outcome::Failed, started_ns, ended_ns - started_ns, batch_rows as u32);
            }
            continue;
        }
        costs.observe(batch_rows, ended_ns - started_ns, ended_ns);
        tracing::trace!(
            batch_rows,
            kernel_ns = ended_ns - started_ns,
            waited_ns = started_ns.saturating_sub(batch[0].job.submitted_ns),
            "batch"
        );
        let mut at = 0;
        for w in &batch {
            // SAFETY: as above.
            // Only the logits are borrowed: the shard may read the rows of a
            // slot the stage holds (`ShardEnd::rows_of`).
            let out = unsafe { &mut (*slot(&ends[w.shard], w.job.slot)).logits };
            out[..w.rows].copy_from_slice(&logits[at..at + w.rows]);
            at += w.rows;
            let outcome = if ended_ns > w.job.deadline_ns { Outcome::Late } else { Outcome::Scored };
            finish(&ends[w.shard], w.job, outcome, started_ns, ended_ns - started_ns, batch_rows as u32);
        }
    }
}

/// On a core it shares with a shard, the stage's work is short and the
/// shard waits for it: a higher scheduling priority lets a woken stage take
/// the core at once and finish its batch before the shard resumes, instead
/// of queueing behind it. Needs CAP_SYS_NICE; without it, logs and goes on.
fn prefer_over_shards() {
    const NICE: libc::c_int = -10;
    // SAFETY: setpriority on this thread's own id (gettid) changes only its
    // scheduling priority.
    let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, NICE) };
    if rc == 0 {
        tracing::info!(nice = NICE, "inference thread shares a shard's core: it runs at a higher priority");
    } else {
        tracing::warn!(error = %std::io::Error::last_os_error(),
            "inference thread shares a shard's core and could not raise its priority (CAP_SYS_NICE)");
    }
}

/// Pins the calling thread to `core`; logs and goes on unpinned on failure.
fn pin_to(core: usize) {
    match crate::cores::pin_current_thread(&[core]) {
        Ok(()) => tracing::info!(core, "inference thread pinned"),
        Err(error) => tracing::warn!(core, %error, "could not pin the inference thread"),
    }
}

/// Builds a backend for `model` and seeds its cost table with measured runs,
/// so the first deadline decisions are informed.
fn prepare(
    kind: BackendKind,
    model: &Arc<Model>,
    config: &StageConfig,
    x: &mut [f32],
    logits: &mut [f32],
    clock: &MonotonicClock,
) -> (Box<dyn Backend>, CostTable) {
    let rows_cap = config.batch_rows_max.max(config.rows_per_job_max);
    let mut backend = score::build(kind, model, rows_cap);
    let mut costs = CostTable::new(rows_cap);
    // Every bucket gets its own estimate, from warm runs: the first calls
    // touch fresh scratch pages and cold weights, and a bucket without a
    // sample borrowed a larger bucket's cost, so a cold or oversized
    // estimate made the stage drop the first jobs as unable to finish in
    // time. The median of a few warm runs seeds each bucket.
    const WARM_RUNS: usize = 2;
    const TIMED_RUNS: usize = 5;
    let dim = model.input_dim();
    let mut rows = 1;
    loop {
        let rows_now = rows.min(rows_cap);
        let mut ns = [0u64; TIMED_RUNS];
        for i in 0..WARM_RUNS + TIMED_RUNS {
            let started_ns = clock.now_ns();
            // A backend that cannot score fails at once, here and per batch.
            let _ = backend.score(&x[..rows_now * dim], rows_now, &mut logits[..rows_now]);
            if i >= WARM_RUNS {
                ns[i - WARM_RUNS] = clock.now_ns() - started_ns;
            }
        }
        ns.sort_unstable();
        costs.observe(rows_now, ns[TIMED_RUNS / 2], clock.now_ns());
        if rows_now == rows_cap {
            break;
        }
        rows *= 2;
    }
    (backend, costs)
}

fn finish(end: &StageEnd, job: Job, outcome: Outcome, started_ns: u64, kernel_ns: u64, batch_rows: u32) {
    let done =
        Done { slot: job.slot, outcome, queue_ns: started_ns.saturating_sub(job.submitted_ns), kernel_ns, batch_rows };
    // The completion ring has as many places as there are slots, and every
    // slot is in at most one place, so it cannot be full.
    assert!(end.done.push(done).is_ok(), "completion ring holds every slot");
    if let Some(bell) = &end.bell {
        bell.ring();
    }
}

/// Fault hooks for tests, set through the admin endpoint when
/// `faults_endpoint = true`. Read once per batch by the inference stage.
#[derive(Debug, Default)]
pub struct Faults {
    stage_delay_us: AtomicU64,
}

impl Faults {
    pub fn set_stage_delay_us(&self, us: u64) {
        self.stage_delay_us.store(us, Ordering::Relaxed);
    }

    pub fn stage_delay_us(&self) -> u64 {
        self.stage_delay_us.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::Fit;

    fn stage(batch_wait_us_max: u64) -> (Stage, Vec<ShardEnd>, Arc<Model>) {
        let fit = Fit::user_item(32, 32, 64);
        let registry =
            Arc::new(Registry::from_models(vec![crate::loadgen::demo::model()], fit, BackendKind::Int8, 32).unwrap());
        let model = registry.snapshot().models[0].clone();
        let config = StageConfig {
            batch_rows_max: 64,
            batch_wait_us_max,
            spin_us: 50,
            jobs_per_shard_max: 8,
            rows_per_job_max: 32,
            row_dim_max: model.input_dim(),
            core: None,
            shares_core: false,
        };
        let (stage, ends) = start(config, 2, registry, BackendKind::Int8, Arc::default()).unwrap();
        (stage, ends, model)
    }

    fn fill(end: &mut ShardEnd, model: &Arc<Model>, rows: usize, seed: u64) -> SlotToken {
        let token = end.acquire().unwrap();
        let data = end.slot_mut(&token);
        let mut rng = crate::loadgen::demo::SplitMix64::new(seed);
        for v in data.x[..rows * model.input_dim()].iter_mut() {
            *v = rng.normal();
        }
        data.rows = rows;
        end.set_model(&token, model);
        token
    }

    fn wait(end: &mut ShardEnd) -> (Done, SlotToken) {
        let until = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(d) = end.poll() {
                return d;
            }
            assert!(std::time::Instant::now() < until, "the stage never answered");
            std::hint::spin_loop();
        }
    }

    #[test]
    fn jobs_from_two_shards_are_scored_like_inline() {
        let (stage, mut ends, model) = stage(200);
        let clock = MonotonicClock::new();
        let mut slots = Vec::new();
        for (shard, end) in ends.iter_mut().enumerate() {
            for k in 0..3u64 {
                let token = fill(end, &model, 5 + k as usize, shard as u64 * 10 + k);
                let now = clock.now_ns();
                slots.push((shard, token.index(), 5 + k as usize));
                end.submit(token, now + 1_000_000_000, now).unwrap();
            }
        }
        let mut inline = score::build(BackendKind::Int8, &model, 32);
        for (shard, _, _) in &slots {
            let end = &mut ends[*shard];
            let (done, token) = wait(end);
            assert_eq!(token.index(), done.slot);
            let &(_, _, rows) = slots.iter().find(|(s, slot, _)| s == shard && *slot == done.slot).unwrap();
            let data = end.slot_mut(&token);
            assert_eq!((done.outcome, data.rows), (Outcome::Scored, rows));
            let mut want = vec![0.0; data.rows];
            inline.score(&data.x[..data.rows * model.input_dim()], data.rows, &mut want).unwrap();
            assert_eq!(data.logits[..data.rows], want[..], "batched results equal inline results");
            assert!(done.batch_rows as usize >= data.rows);
            end.release(token);
        }
        stage.stop();
    }

    #[test]
    fn expired_jobs_never_reach_the_kernel() {
        let (stage, mut ends, model) = stage(50);
        let clock = MonotonicClock::new();
        let end = &mut ends[0];
        let token = fill(end, &model, 32, 1);
        let now = clock.now_ns();
        end.submit(token, now.saturating_sub(1), now).unwrap();
        let (done, token) = wait(end);
        assert_eq!((done.outcome, done.kernel_ns, done.batch_rows), (Outcome::Expired, 0, 0));
        end.release(token);
        stage.stop();
    }

    #[test]
    fn a_token_opens_only_its_own_shards_slots() {
        let (stage, mut ends, model) = stage(1_000_000);
        let token = fill(&mut ends[0], &model, 1, 1);
        let (first, second) = ends.split_at_mut(1);
        let foreign = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _ = second[0].slot_mut(&token);
        }));
        assert!(foreign.is_err(), "shard 1 refuses shard 0's token");
        first[0].release(token);
        assert_eq!(first[0].in_flight(), 0);
        stage.stop();
    }

    #[test]
    fn slots_name_models_by_table_entry_without_a_clone_per_hand_off() {
        let (stage, mut ends, model) = stage(1_000_000);
        let other = Arc::new(crate::loadgen::demo::model());
        let end = &mut ends[0];
        let a = end.acquire().unwrap();
        end.set_model(&a, &model);
        let b = end.acquire().unwrap();
        end.set_model(&b, &other);
        let count = Arc::strong_count(&model);
        let c = end.acquire().unwrap();
        end.set_model(&c, &model);
        assert_eq!(Arc::strong_count(&model), count, "a model in the table is named without a clone");
        assert!(Arc::ptr_eq(end.model(&a).unwrap(), &model));
        assert!(Arc::ptr_eq(end.model(&b).unwrap(), &other));
        end.release(a);
        end.release(c);
        // Every slot taken, each naming `other`: entries are reused or
        // rewritten only where no slot names them, and `b` keeps its model.
        let mut held = vec![b];
        while let Some(t) = end.acquire() {
            end.set_model(&t, &other);
            held.push(t);
        }
        for t in &held {
            assert!(Arc::ptr_eq(end.model(t).unwrap(), &other));
        }
        for t in held {
            end.release(t);
        }
        stage.stop();
    }

    #[test]
    fn a_full_shard_end_refuses_more() {
        let (stage, mut ends, model) = stage(1_000_000);
        let end = &mut ends[1];
        let mut held = Vec::new();
        while let Some(token) = end.acquire() {
            held.push(token);
        }
        assert_eq!(held.len(), end.slots());
        assert_eq!(end.in_flight(), end.slots());
        for token in held {
            end.release(token);
        }
        let _ = model;
        stage.stop();
    }
}
