//! The shard's accept loop: each connection its listener accepts is
//! refused (not ready, or over a connection limit), served here, or handed
//! to a less loaded shard. Once shutdown is triggered, connections already
//! queued in the backlog are still accepted (a client that saw the
//! listening line and connected gets its requests answered); then the
//! listener closes.

use std::os::fd::{AsRawFd, FromRawFd};
use std::rc::Rc;

use glommio::net::TcpListener;

use super::balance;
use super::connection::Conns;
use super::{NotReadyPolicy, QUEUED_WAIT};
use crate::metrics::Readiness;

/// Accepts until shutdown, then for what is queued; closes the listener.
pub(super) async fn accept(listener: TcpListener, conns: &Rc<Conns>, not_ready: NotReadyPolicy, readiness: &Readiness) {
    let (shard, shutdown, balance, report) = (conns.shard, &conns.shutdown, &conns.balance, &conns.report);
    loop {
        let closing = shutdown.is_triggered();
        let accepted = futures_lite::future::or(async { Some(listener.accept().await) }, async {
            if closing {
                glommio::timer::sleep(QUEUED_WAIT).await;
            } else {
                shutdown.wait().await;
            }
            None
        })
        .await;
        let stream = match accepted {
            None if closing => break,
            None => continue,
            Some(Ok(s)) => s,
            Some(Err(e)) => {
                tracing::warn!(shard, error = %e, "accept failed");
                continue;
            }
        };
        if not_ready == NotReadyPolicy::Refuse && !readiness.is_ready() {
            report.borrow_mut().connections_refused += 1;
            drop(stream);
            continue;
        }
        let Ok(peer) = stream.peer_addr() else {
            // Reset before it was served: nothing to count.
            continue;
        };
        let source = balance::Source::of(peer.ip());
        match balance.place(source) {
            Err(refused) => {
                let mut path = conns.path.borrow_mut();
                match refused {
                    balance::Refused::ShardFull => path.telemetry.counters.connections_refused_shard_full += 1,
                    balance::Refused::SourceFull => path.telemetry.counters.connections_refused_source_full += 1,
                }
                report.borrow_mut().connections_refused += 1;
                tracing::debug!(shard, ?refused, %peer, "connection limit reached; closing new connection");
                drop(stream);
            }
            Ok(balance::Placement::Here) => conns.spawn(stream, source),
            Ok(balance::Placement::There(to)) => {
                // SAFETY: dup of an open socket's fd; the new fd is owned
                // here and closed by its OwnedFd.
                let fd = unsafe { libc::dup(stream.as_raw_fd()) };
                if fd < 0 {
                    balance.keep_instead(to);
                    conns.spawn(stream, source);
                    continue;
                }
                // SAFETY: `fd` was just returned by dup and is owned by no one else.
                let owned = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
                drop(stream);
                balance.hand_over(to, owned, source);
                report.borrow_mut().connections_handed_over += 1;
            }
        }
    }
    drop(listener);
}
