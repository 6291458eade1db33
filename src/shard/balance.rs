//! Connections spread evenly over the shards.
//!
//! Every shard has its own SO_REUSEPORT listener, and the kernel picks one
//! by a hash of the connection's addresses: with the few long-lived
//! connections bidders keep, one shard can get twice another's share. So a
//! shard that accepts a connection while it serves two more than the
//! least-loaded shard hands it over, as Seastar's connection distribution
//! does: the socket goes through that shard's inbox, and the destination's
//! count is raised at the hand-over, so two shards cannot both pick the same
//! one as least loaded. Connection set-up is not latency-critical; the
//! destination adopts handed-over sockets on its next watcher tick.
//!
//! The counts are the one cross-thread state here: one atomic per shard,
//! written when a connection opens or closes, read at accept; never on the
//! request path.

use std::net::TcpStream;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;

/// A shard's side: the shared counts, every shard's inbox, and its own.
pub struct ShardBalance {
    shard: usize,
    counts: Arc<Vec<AtomicUsize>>,
    inboxes: Vec<Sender<TcpStream>>,
    inbox: Receiver<TcpStream>,
    enabled: bool,
}

/// One side per shard; `enabled = false` keeps every connection where the
/// kernel put it (counts are still kept).
pub fn sides(shards: usize, enabled: bool) -> Vec<ShardBalance> {
    let counts = Arc::new((0..shards).map(|_| AtomicUsize::new(0)).collect::<Vec<_>>());
    let (inboxes, rxs): (Vec<Sender<TcpStream>>, Vec<_>) = (0..shards).map(|_| mpsc::channel()).unzip();
    let enabled = enabled && shards > 1;
    rxs.into_iter()
        .enumerate()
        .map(|(shard, inbox)| ShardBalance { shard, counts: counts.clone(), inboxes: inboxes.clone(), inbox, enabled })
        .collect()
}

impl ShardBalance {
    /// Where a connection this shard just accepted should be served: `None`
    /// for here (counted here), or the shard it must be handed to (counted
    /// there already).
    pub fn place(&self) -> Option<usize> {
        let mine = self.counts[self.shard].load(Ordering::Relaxed);
        if self.enabled {
            let (least, least_count) = self
                .counts
                .iter()
                .enumerate()
                .map(|(i, c)| (i, c.load(Ordering::Relaxed)))
                .min_by_key(|&(i, c)| (c, i != self.shard))
                .expect("at least one shard");
            if least != self.shard && mine >= least_count + 2 {
                // Reserve the place before the socket travels.
                self.counts[least].fetch_add(1, Ordering::Relaxed);
                return Some(least);
            }
        }
        self.counts[self.shard].fetch_add(1, Ordering::Relaxed);
        None
    }

    /// Sends `fd` (an accepted socket this shard no longer serves) to `to`.
    /// The place reserved by `place` is given back if `to` is gone.
    pub fn hand_over(&self, to: usize, fd: OwnedFd) {
        // SAFETY: `fd` is an open, connected TCP socket owned by this value.
        let stream = unsafe { TcpStream::from_raw_fd(std::os::fd::IntoRawFd::into_raw_fd(fd)) };
        if self.inboxes[to].send(stream).is_err() {
            self.counts[to].fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// `place` chose `to`, but the connection stays here after all.
    pub fn keep_instead(&self, to: usize) {
        self.counts[to].fetch_sub(1, Ordering::Relaxed);
        self.counts[self.shard].fetch_add(1, Ordering::Relaxed);
    }

    /// Sockets other shards handed to this one (already counted here).
    pub fn adopt(&self) -> impl Iterator<Item = TcpStream> + '_ {
        self.inbox.try_iter()
    }

    /// A connection this shard served has closed.
    pub fn closed(&self) {
        self.counts[self.shard].fetch_sub(1, Ordering::Relaxed);
    }

    /// Connections each shard serves now.
    #[cfg(test)]
    fn counts(&self) -> Vec<usize> {
        self.counts.iter().map(|c| c.load(Ordering::Relaxed)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shard_over_its_share_hands_new_connections_to_the_least_loaded() {
        let sides = sides(3, true);
        // The kernel sends all twelve to shard 0.
        let placed: Vec<Option<usize>> = (0..12).map(|_| sides[0].place()).collect();
        let counts = sides[0].counts();
        assert_eq!(counts.iter().sum::<usize>(), 12);
        assert!(counts.iter().all(|&c| c.abs_diff(4) <= 1), "{counts:?} after {placed:?}");
        // Shard 2 loses two: the next one shard 0 accepts goes there.
        sides[2].closed();
        sides[2].closed();
        assert_eq!(sides[0].place(), Some(2), "{:?}", sides[0].counts());
    }

    #[test]
    fn disabled_it_keeps_every_connection_where_it_landed() {
        let sides = sides(2, false);
        assert!((0..10).all(|_| sides[0].place().is_none()));
        assert_eq!(sides[0].counts(), vec![10, 0]);
    }

    #[test]
    fn a_handed_over_socket_arrives_in_the_inbox() {
        let sides = sides(2, true);
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let _client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (accepted, _) = listener.accept().unwrap();
        sides[0].hand_over(1, OwnedFd::from(accepted));
        let adopted: Vec<_> = sides[1].adopt().collect();
        assert_eq!(adopted.len(), 1);
        assert!(adopted[0].peer_addr().is_ok());
        assert_eq!(sides[0].adopt().count(), 0);
    }
}
