//! The shard's tasks besides its connections: the watcher (shutdown flag,
//! model swaps, admission exchange, the stall detector's timer), the
//! publisher of its metrics interval, the completion poller of hand-off
//! mode, the shadow task and the adopter of connections other shards hand
//! over. Each is spawned here and returns its handle; `run_shard` drops them
//! when it stops.

use std::cell::{Cell, RefCell};
use std::os::fd::FromRawFd;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use futures_lite::io::AsyncReadExt;
use glommio::net::TcpStream;
use glommio::task::JoinHandle;
use glommio::TaskQueueHandle;

use super::balance::{self, ShardBalance};
use super::connection::Conns;
use super::mailbox::{Mailboxes, Notify, Returned};
use super::stall::StallMeter;
use super::{refresh, ShutdownSignal, BELL_WAIT_MAX, POLL_BACKOFF, POLL_SPIN, SHUTDOWN_POLL};
use crate::deadline::{Clock, MonotonicClock};
use crate::metrics::{ShardPublisher, StallTask};
use crate::request::ladder::BreakerState;
use crate::request::RequestPath;

type Path = Rc<RefCell<RequestPath<MonotonicClock>>>;

/// Watches the process-wide `stop` flag and triggers `shutdown` once it is
/// set; between, swaps in new model versions and trades admission demand.
pub(super) fn watcher(
    shard: usize,
    stop: Arc<AtomicBool>,
    shutdown: &Rc<ShutdownSignal>,
    path: &Path,
    stalls: &Rc<StallMeter>,
) -> JoinHandle<()> {
    let (shutdown, path, stalls) = (shutdown.clone(), path.clone(), stalls.clone());
    let clock = MonotonicClock::new();
    glommio::spawn_local(async move {
        while !stop.load(Ordering::Relaxed) {
            let due_ns = clock.now_ns() + SHUTDOWN_POLL.as_nanos() as u64;
            glommio::timer::sleep(SHUTDOWN_POLL).await;
            // This timer firing late is the one sign of a stall that no
            // task of ours caused.
            stalls.timer_fired(due_ns);
            // New model versions are usually picked up here, between
            // requests, rather than at the start of a read round; and
            // the shards trade configured clients' demand here (timed
            // with the model swap, as housekeeping).
            let t = stalls.start();
            refresh(&path, shard);
            path.borrow_mut().exchange_admission(clock.now_ns());
            stalls.end(StallTask::Refresh, t);
        }
        shutdown.trigger();
    })
    .detach()
}

/// Publishes this shard's interval to the collector every
/// `PUBLISH_INTERVAL`, off the request path; the publisher stays in its
/// cell for the final publication when the shard stops.
pub(super) fn publisher(
    shard: usize,
    queue: TaskQueueHandle,
    path: &Path,
    active: &Rc<Cell<usize>>,
    shutdown: &Rc<ShutdownSignal>,
    publisher: &Rc<RefCell<Option<ShardPublisher>>>,
    stalls: &Rc<StallMeter>,
) -> Result<JoinHandle<()>, String> {
    let (path, active, shutdown) = (path.clone(), active.clone(), shutdown.clone());
    let (publisher, stalls) = (publisher.clone(), stalls.clone());
    let task = glommio::spawn_local_into(
        async move {
            while !shutdown.is_triggered() {
                glommio::timer::sleep(crate::metrics::PUBLISH_INTERVAL).await;
                let t = stalls.start();
                let mut p = path.borrow_mut();
                let mut counters = p.telemetry.counters.clone();
                let longest = stalls.drain_into(p.times_mut(), &mut counters);
                let open = p.breaker_state() != BreakerState::Closed;
                let versions = p.version_report();
                p.refresh_replicas();
                if let Some(publisher) = publisher.borrow_mut().as_mut() {
                    publisher.publish(p.times_mut(), &counters, active.get() as u64, open, versions, longest);
                }
                drop(p);
                stalls.end(StallTask::Publish, t);
            }
        },
        queue,
    )
    .map_err(|e| format!("shard {shard}: spawning the publisher: {e}"))?;
    Ok(task.detach())
}

/// Hand-off mode: routes completions, and give-ups at their time, to their
/// connections, which answer them. While requests
/// are in flight the poller yields between polls (bounded spinning: it only
/// spins while the stage owes this shard something); idle, it sleeps until
/// a connection submits. Sharing its core with the stage (`shares_stage`),
/// it sleeps on the stage's bell instead of polling.
pub(super) fn poller(
    path: &Path,
    mailboxes: &Rc<Mailboxes>,
    submitted: &Rc<Notify>,
    stalls: &Rc<StallMeter>,
    shares_stage: bool,
) -> JoinHandle<()> {
    let (path, mailboxes, submitted) = (path.clone(), mailboxes.clone(), submitted.clone());
    let stalls = stalls.clone();
    let bell = if shares_stage { path.borrow_mut().take_stage_bell() } else { None };
    let mut bell = bell.map(|std| {
        // SAFETY: `into_raw_fd` hands over sole ownership of an open
        // socket, which the glommio stream now owns and closes.
        unsafe {
            <glommio::net::UnixStream as std::os::fd::FromRawFd>::from_raw_fd(std::os::fd::IntoRawFd::into_raw_fd(std))
        }
    });
    glommio::spawn_local(async move {
        let mut rung = [0u8; 64];
        let clock = MonotonicClock::new();
        let mut last_delivery_ns = 0;
        loop {
            let mut delivered = 0;
            let t = stalls.start();
            {
                let mut p = path.borrow_mut();
                while let Some((conn, done, token)) = p.poll_stage() {
                    mailboxes.deliver(conn, Returned::Completed(done, token));
                    delivered += 1;
                }
                // Requests the stage is too slow for are answered from
                // the lower rungs at their give-up time.
                let now_ns = clock.now_ns();
                p.give_up_overdue(now_ns, &mut |conn, slot| {
                    mailboxes.deliver(conn, Returned::GiveUp(slot));
                    delivered += 1;
                });
            }
            stalls.end(StallTask::Poller, t);
            let now_ns = clock.now_ns();
            if delivered > 0 {
                last_delivery_ns = now_ns;
            } else if path.borrow().in_flight() == 0 {
                submitted.notified().await;
                last_delivery_ns = clock.now_ns();
            } else if let Some(bell) = &mut bell {
                if path.borrow().stage_will_wait() {
                    // Woken by the stage, or in time for the next give-up.
                    futures_lite::future::or(
                        async {
                            let _ = bell.read(&mut rung).await;
                        },
                        glommio::timer::sleep(BELL_WAIT_MAX),
                    )
                    .await;
                    path.borrow().stage_woke();
                }
            } else if now_ns - last_delivery_ns < POLL_SPIN.as_nanos() as u64 {
                futures_lite::future::yield_now().await;
            } else {
                // The stage is slow to answer: stop spinning so a stage
                // thread sharing this core gets to run.
                glommio::timer::sleep(POLL_BACKOFF).await;
            }
        }
    })
    .detach()
}

/// Shadow versions score sampled requests after their responses are out,
/// when a connection says so (`shadow_wanted`).
pub(super) fn shadowing(
    shard: usize,
    queue: TaskQueueHandle,
    path: &Path,
    shadow_wanted: &Rc<Notify>,
    shutdown: &Rc<ShutdownSignal>,
    stalls: &Rc<StallMeter>,
) -> Result<JoinHandle<()>, String> {
    let (path, shadow_wanted, shutdown, stalls) =
        (path.clone(), shadow_wanted.clone(), shutdown.clone(), stalls.clone());
    let task = glommio::spawn_local_into(
        async move {
            loop {
                let wanted = futures_lite::future::or(
                    async {
                        shadow_wanted.notified().await;
                        true
                    },
                    async {
                        shutdown.wait().await;
                        false
                    },
                )
                .await;
                if !wanted {
                    break;
                }
                let t = stalls.start();
                path.borrow_mut().run_shadows();
                stalls.end(StallTask::Shadow, t);
            }
        },
        queue,
    )
    .map_err(|e| format!("shard {shard}: spawning the shadow task: {e}"))?;
    Ok(task.detach())
}

/// Adopts sockets other shards handed over, on a slow tick: connection
/// set-up is not latency-critical.
pub(super) fn adopter(
    shard: usize,
    queue: TaskQueueHandle,
    conns: &Rc<Conns>,
    balance: &Rc<ShardBalance>,
    shutdown: &Rc<ShutdownSignal>,
) -> Result<JoinHandle<()>, String> {
    let (conns, balance, shutdown) = (conns.clone(), balance.clone(), shutdown.clone());
    let task = glommio::spawn_local_into(
        async move {
            while !shutdown.is_triggered() {
                glommio::timer::sleep(SHUTDOWN_POLL).await;
                for balance::HandedOver { stream, source } in balance.adopt() {
                    // SAFETY: `into_raw_fd` hands over sole ownership of an
                    // open socket, which the glommio stream now owns.
                    let stream = unsafe { TcpStream::from_raw_fd(std::os::fd::IntoRawFd::into_raw_fd(stream)) };
                    conns.spawn(stream, source);
                }
            }
        },
        queue,
    )
    .map_err(|e| format!("shard {shard}: spawning the adopter: {e}"))?;
    Ok(task.detach())
}
