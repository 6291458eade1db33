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
//! The limits on connections are held here too, since only here is the
//! whole server seen: `connections_per_shard_max` on the shard that will
//! serve a connection (not the one the kernel gave it to), and
//! `connections_per_source_max` over all shards.
//!
//! The counts are the one cross-thread state here: one atomic per shard and
//! one locked table of sources, written when a connection opens or closes,
//! read at accept; never on the request path.

use std::collections::HashMap;
use std::net::{IpAddr, TcpStream};
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};

/// A socket on its way to the shard that serves it, with the source it
/// was counted against.
pub struct HandedOver {
    pub stream: TcpStream,
    pub source: Source,
}

/// A connection's source as the per-source limit counts it: an IPv4
/// address, or an IPv6 /64 (one host's usual share, which it can fill with
/// addresses at will).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Source(IpAddr);

impl Source {
    pub fn of(ip: IpAddr) -> Source {
        match ip {
            IpAddr::V4(v4) => Source(IpAddr::V4(v4)),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => Source(IpAddr::V4(v4)),
                None => Source(IpAddr::V6((u128::from(v6) & !((1u128 << 64) - 1)).into())),
            },
        }
    }
}

/// Connections each source holds, over all shards. Invariant: an entry
/// exists only while its count is above zero, so the table never holds
/// more entries than the server holds connections (its capacity, reserved
/// at start-up).
struct Sources {
    counts: Mutex<HashMap<Source, u32>>,
    max: u32,
}

/// Why a connection was not placed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refused {
    /// Every shard it could go to serves `connections_per_shard_max`.
    ShardFull,
    /// Its source holds `connections_per_source_max`.
    SourceFull,
}

/// Where a connection a shard accepted is served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    Here,
    /// Handed to this shard, whose count already holds it.
    There(usize),
}

/// A shard's side: the shared counts, every shard's inbox, and its own.
pub struct ShardBalance {
    shard: usize,
    counts: Arc<Vec<AtomicUsize>>,
    sources: Arc<Sources>,
    per_shard_max: usize,
    inboxes: Vec<Sender<HandedOver>>,
    inbox: Receiver<HandedOver>,
    enabled: bool,
}

/// One side per shard; `enabled = false` keeps every connection where the
/// kernel put it (counts and limits are still kept).
pub fn sides(shards: usize, enabled: bool, per_shard_max: usize, per_source_max: usize) -> Vec<ShardBalance> {
    assert!(shards > 0 && per_shard_max > 0 && per_source_max > 0);
    let counts = Arc::new((0..shards).map(|_| AtomicUsize::new(0)).collect::<Vec<_>>());
    let capacity = shards.saturating_mul(per_shard_max).min(1 << 20);
    let sources = Arc::new(Sources {
        counts: Mutex::new(HashMap::with_capacity(capacity)),
        max: u32::try_from(per_source_max).unwrap_or(u32::MAX),
    });
    let (inboxes, rxs): (Vec<Sender<HandedOver>>, Vec<_>) = (0..shards).map(|_| mpsc::channel()).unzip();
    let enabled = enabled && shards > 1;
    rxs.into_iter()
        .enumerate()
        .map(|(shard, inbox)| ShardBalance {
            shard,
            counts: counts.clone(),
            sources: sources.clone(),
            per_shard_max,
            inboxes: inboxes.clone(),
            inbox,
            enabled,
        })
        .collect()
}

impl ShardBalance {
    /// Where a connection from `source` that this shard just accepted is
    /// served, counted there and against its source; or why it is refused
    /// (then nothing is counted). A placed connection must end in
    /// [`closed`](Self::closed) on the shard that serves it.
    pub fn place(&self, source: Source) -> Result<Placement, Refused> {
        if !self.sources.admit(source) {
            return Err(Refused::SourceFull);
        }
        let placed = self.place_counted();
        if placed.is_err() {
            self.sources.release(source);
        }
        placed
    }

    fn place_counted(&self) -> Result<Placement, Refused> {
        let take = |i: usize| {
            self.counts[i]
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| (c < self.per_shard_max).then_some(c + 1))
                .is_ok()
        };
        if self.enabled {
            let mine = self.counts[self.shard].load(Ordering::Relaxed);
            let (least, least_count) = self
                .counts
                .iter()
                .enumerate()
                .map(|(i, c)| (i, c.load(Ordering::Relaxed)))
                .min_by_key(|&(i, c)| (c, i != self.shard))
                .expect("at least one shard");
            // Reserve the place before the socket travels.
            if least != self.shard && mine >= least_count + 2 && take(least) {
                return Ok(Placement::There(least));
            }
            if take(self.shard) {
                return Ok(Placement::Here);
            }
            // This shard is full: any other with room serves it.
            return (0..self.counts.len())
                .filter(|&i| i != self.shard)
                .find(|&i| take(i))
                .map(Placement::There)
                .ok_or(Refused::ShardFull);
        }
        if take(self.shard) {
            Ok(Placement::Here)
        } else {
            Err(Refused::ShardFull)
        }
    }

    /// Sends `fd` (an accepted socket this shard no longer serves) to `to`.
    /// What `place` counted is given back if `to` is gone.
    pub fn hand_over(&self, to: usize, fd: OwnedFd, source: Source) {
        // SAFETY: `fd` is an open, connected TCP socket owned by this value.
        let stream = unsafe { TcpStream::from_raw_fd(std::os::fd::IntoRawFd::into_raw_fd(fd)) };
        if self.inboxes[to].send(HandedOver { stream, source }).is_err() {
            self.counts[to].fetch_sub(1, Ordering::Relaxed);
            self.sources.release(source);
        }
    }

    /// `place` chose `to`, but the connection stays here after all (over
    /// this shard's limit, by one, for as long as it lives).
    pub fn keep_instead(&self, to: usize) {
        self.counts[to].fetch_sub(1, Ordering::Relaxed);
        self.counts[self.shard].fetch_add(1, Ordering::Relaxed);
    }

    /// Sockets other shards handed to this one (already counted here).
    pub fn adopt(&self) -> impl Iterator<Item = HandedOver> + '_ {
        self.inbox.try_iter()
    }

    /// A connection this shard served, from `source`, has closed.
    pub fn closed(&self, source: Source) {
        self.counts[self.shard].fetch_sub(1, Ordering::Relaxed);
        self.sources.release(source);
    }

    /// Connections each shard serves now.
    #[cfg(test)]
    fn counts(&self) -> Vec<usize> {
        self.counts.iter().map(|c| c.load(Ordering::Relaxed)).collect()
    }
}

impl Sources {
    fn admit(&self, source: Source) -> bool {
        let mut counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        let count = counts.entry(source).or_insert(0);
        if *count >= self.max {
            return false;
        }
        *count += 1;
        true
    }

    fn release(&self, source: Source) {
        let mut counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(count) = counts.get_mut(&source) {
            *count -= 1;
            if *count == 0 {
                counts.remove(&source);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source(i: u8) -> Source {
        Source::of(IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, i)))
    }

    #[test]
    fn a_shard_over_its_share_hands_new_connections_to_the_least_loaded() {
        let sides = sides(3, true, 100, 100);
        // The kernel sends all twelve to shard 0.
        let placed: Vec<_> = (0..12).map(|_| sides[0].place(source(1)).unwrap()).collect();
        let counts = sides[0].counts();
        assert_eq!(counts.iter().sum::<usize>(), 12);
        assert!(counts.iter().all(|&c| c.abs_diff(4) <= 1), "{counts:?} after {placed:?}");
        // Shard 2 loses two: the next one shard 0 accepts goes there.
        sides[2].closed(source(1));
        sides[2].closed(source(1));
        assert_eq!(sides[0].place(source(1)), Ok(Placement::There(2)), "{:?}", sides[0].counts());
    }

    #[test]
    fn disabled_it_keeps_every_connection_where_it_landed() {
        let sides = sides(2, false, 100, 100);
        assert!((0..10).all(|_| sides[0].place(source(1)) == Ok(Placement::Here)));
        assert_eq!(sides[0].counts(), vec![10, 0]);
    }

    #[test]
    fn the_shard_limit_holds_on_the_serving_shard_whoever_accepted() {
        let sides = sides(2, true, 8, 1000);
        // The kernel gives 40 connections to shard 0: 16 are placed, 8 a shard.
        let placed = (0..40).filter(|i| sides[0].place(source(*i as u8)).is_ok()).count();
        assert_eq!(placed, 16);
        assert_eq!(sides[0].counts(), vec![8, 8]);
        assert_eq!(sides[1].place(source(200)), Err(Refused::ShardFull));
        sides[1].closed(source(1));
        assert_eq!(sides[0].place(source(201)), Ok(Placement::There(1)));
        // Without balancing, the limit is the accepting shard's.
        let alone = super::sides(2, false, 8, 1000);
        assert_eq!((0..40).filter(|i| alone[0].place(source(*i as u8)).is_ok()).count(), 8);
    }

    #[test]
    fn one_source_holds_at_most_its_share_and_gets_it_back_on_close() {
        let sides = sides(2, true, 100, 3);
        for _ in 0..3 {
            sides[0].place(source(1)).unwrap();
        }
        assert_eq!(sides[1].place(source(1)), Err(Refused::SourceFull));
        assert!(sides[1].place(source(2)).is_ok(), "another source has its own share");
        sides[0].closed(source(1));
        assert!(sides[1].place(source(1)).is_ok());
        // A refusal for a full shard gives the source its place back.
        let tight = super::sides(1, false, 1, 5);
        tight[0].place(source(9)).unwrap();
        assert_eq!(tight[0].place(source(1)), Err(Refused::ShardFull));
        assert_eq!(tight[0].sources.counts.lock().unwrap().get(&source(1)), None);
        // IPv6 counts by /64; an IPv4-mapped address counts as IPv4.
        let a: IpAddr = "2001:db8::1".parse().unwrap();
        let b: IpAddr = "2001:db8::ffff:2".parse().unwrap();
        let c: IpAddr = "2001:db8:0:1::1".parse().unwrap();
        assert_eq!(Source::of(a), Source::of(b));
        assert_ne!(Source::of(a), Source::of(c));
        assert_eq!(Source::of("::ffff:10.0.0.1".parse().unwrap()), source(1));
    }

    #[test]
    fn a_handed_over_socket_arrives_in_the_inbox() {
        let sides = sides(2, true, 100, 100);
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let _client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (accepted, _) = listener.accept().unwrap();
        sides[0].hand_over(1, OwnedFd::from(accepted), source(1));
        let adopted: Vec<_> = sides[1].adopt().collect();
        assert_eq!(adopted.len(), 1);
        assert!(adopted[0].stream.peer_addr().is_ok());
        assert_eq!(adopted[0].source, source(1));
        assert_eq!(sides[0].adopt().count(), 0);
    }
}
