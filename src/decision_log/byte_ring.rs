//! A bounded single-producer single-consumer ring of variable-length byte
//! records, from a shard to the decision-log writer.
//!
//! `infer/ring.rs` moves `Copy` descriptors; a logged decision is a few
//! hundred bytes to a few hundred kilobytes (the input rows), so this ring
//! carries the bytes themselves: the shard encodes a record straight into
//! the ring's memory (no copy through a buffer of its own, no allocation),
//! and the writer reads it in place. Each record is contiguous: one that
//! does not fit before the end of the buffer leaves a pad marker there and
//! starts again at offset 0. A record that does not fit in the free space
//! is refused at once (the caller counts it dropped); the producer never
//! waits.
//!
//! Frames are a `u32` length (or [`PAD`]) and the record, padded to
//! [`ALIGN_BYTES`], so every length word is aligned and a frame never
//! straddles the end.

use std::cell::{Cell, UnsafeCell};
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

/// The length word of a frame that only pads to the end of the buffer.
const PAD: u32 = u32::MAX;
/// Every frame starts at a multiple of this.
const ALIGN_BYTES: usize = 8;
/// The length word.
const HEADER_BYTES: usize = 4;
/// Smallest ring: a few records of an auction-32 decision.
pub const RING_BYTES_MIN: usize = 64 * 1024;
/// Largest ring per shard: allocated at start-up, so bounded.
pub const RING_BYTES_MAX: usize = 1 << 30;

/// Keeps the producer's and the consumer's positions on separate cache lines.
#[repr(align(128))]
struct Padded(AtomicUsize);

/// The ring's memory and positions, shared by its two ends.
///
/// Cross-thread: one producer (a shard) and one consumer (the writer
/// thread). Positions count bytes since the start and only grow.
struct Inner {
    /// Bytes the producer has published; only the producer stores it.
    head: Padded,
    /// Bytes the consumer has released; only the consumer stores it.
    tail: Padded,
    mask: usize,
    buf: Box<[UnsafeCell<u8>]>,
    /// Whether a producer was made ([`Ring::producer`]); there is one.
    producer_taken: AtomicBool,
    /// Whether a consumer was made ([`Ring::consumer`]); there is one:
    /// two would release each other's bytes.
    consumer_taken: AtomicBool,
}

// SAFETY: the producer writes only bytes in `[head, tail + capacity)` and
// publishes them with a Release store of `head`; the consumer reads only
// bytes in `[tail, head)` after an Acquire load of `head`, and gives them
// back with a Release store of `tail`, which the producer loads with
// Acquire before it writes them again. No byte is accessed by both ends at
// once.
unsafe impl Sync for Inner {}
// SAFETY: the bytes are plain data; which thread owns which byte is as above.
unsafe impl Send for Inner {}

impl Inner {
    fn capacity(&self) -> usize {
        self.mask + 1
    }

    fn base(&self) -> *mut u8 {
        // `UnsafeCell<u8>` has the layout of `u8`.
        UnsafeCell::raw_get(self.buf.as_ptr())
    }
}

/// A ring of `bytes` (a power of two, in
/// `RING_BYTES_MIN..=RING_BYTES_MAX`), whose two ends are taken once each.
#[derive(Clone)]
pub struct Ring {
    inner: Arc<Inner>,
}

impl Ring {
    /// Allocates the ring: `bytes` rounded up to a power of two, clamped to
    /// the bounds (the config checks them first).
    pub fn new(bytes: usize) -> Ring {
        let capacity = bytes.clamp(RING_BYTES_MIN, RING_BYTES_MAX).next_power_of_two();
        let buf = (0..capacity).map(|_| UnsafeCell::new(0u8)).collect();
        Ring {
            inner: Arc::new(Inner {
                head: Padded(AtomicUsize::new(0)),
                tail: Padded(AtomicUsize::new(0)),
                mask: capacity - 1,
                buf,
                producer_taken: AtomicBool::new(false),
                consumer_taken: AtomicBool::new(false),
            }),
        }
    }

    pub fn capacity(&self) -> usize {
        self.inner.capacity()
    }

    /// The pushing end, made on the thread that will use it (a shard):
    /// `None` once one was made.
    pub fn producer(&self) -> Option<Producer> {
        if self.inner.producer_taken.swap(true, Ordering::AcqRel) {
            return None;
        }
        Some(Producer { inner: self.inner.clone(), cached_tail: Cell::new(0), _shard_local: PhantomData })
    }
}

/// The pushing end. `!Send`: made on its shard's thread and used there
/// only, so its cached tail needs no synchronisation.
pub struct Producer {
    inner: Arc<Inner>,
    cached_tail: Cell<usize>,
    _shard_local: PhantomData<*const ()>,
}

/// Why a record was not put in the ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refused {
    /// Not enough free space now: the writer is behind.
    Full,
    /// Larger than the ring could ever hold.
    TooLarge,
}

fn frame_bytes(len: usize) -> usize {
    (HEADER_BYTES + len).next_multiple_of(ALIGN_BYTES)
}

impl Producer {
    /// Writes one record of exactly `len` bytes through `fill`, which must
    /// write every byte of the slice it is given, or refuses it.
    pub fn push(&self, len: usize, fill: impl FnOnce(&mut [u8])) -> Result<(), Refused> {
        let inner = &*self.inner;
        let capacity = inner.capacity();
        let frame = frame_bytes(len);
        // At most half the ring, so a record always fits after one pad.
        if frame > capacity / 2 || len >= PAD as usize {
            return Err(Refused::TooLarge);
        }
        let head = inner.head.0.load(Ordering::Relaxed);
        let at = head & inner.mask;
        let to_end = capacity - at;
        let (pad, total) = if frame > to_end { (to_end, to_end + frame) } else { (0, frame) };
        if head + total - self.cached_tail.get() > capacity {
            self.cached_tail.set(inner.tail.0.load(Ordering::Acquire));
            if head + total - self.cached_tail.get() > capacity {
                return Err(Refused::Full);
            }
        }
        let base = inner.base();
        let start = if pad > 0 {
            // SAFETY: `[head, head + total)` is free (checked above) and
            // `at + 4 <= capacity` (both multiples of 8), so the pad's
            // length word is inside the buffer and the consumer does not
            // read it until `head` is published below.
            unsafe { base.add(at).cast::<u32>().write(PAD) };
            0
        } else {
            at
        };
        // SAFETY: `[start, start + frame)` lies inside the buffer (`frame
        // <= to_end`, or it starts at 0 and `frame <= capacity / 2`) and
        // inside the free bytes checked above; no one else touches it
        // until it is published.
        unsafe {
            base.add(start).cast::<u32>().write(len as u32);
            let body = std::slice::from_raw_parts_mut(base.add(start + HEADER_BYTES), len);
            fill(body);
        }
        inner.head.0.store(head + total, Ordering::Release);
        Ok(())
    }

    pub fn capacity(&self) -> usize {
        self.inner.capacity()
    }
}

/// The popping end: the writer thread's. `Send` (it is made where the
/// rings are and moved to the writer), not `Clone`: there is one per ring.
pub struct Consumer {
    inner: Arc<Inner>,
}

impl Ring {
    /// The popping end (the writer's): `None` once one was made.
    pub fn consumer(&self) -> Option<Consumer> {
        if self.inner.consumer_taken.swap(true, Ordering::AcqRel) {
            return None;
        }
        Some(Consumer { inner: self.inner.clone() })
    }
}

impl Consumer {
    /// Reads the oldest record in place through `read`, then releases its
    /// bytes; `None` when the ring is empty.
    pub fn pop<R>(&mut self, read: impl FnOnce(&[u8]) -> R) -> Option<R> {
        let inner = &*self.inner;
        let capacity = inner.capacity();
        let mut tail = inner.tail.0.load(Ordering::Relaxed);
        let head = inner.head.0.load(Ordering::Acquire);
        if tail == head {
            return None;
        }
        let base = inner.base();
        // SAFETY: `tail < head`: the frame at `tail` was published by the
        // Release store the Acquire load above saw.
        let mut len = unsafe { base.add(tail & inner.mask).cast::<u32>().read() };
        if len == PAD {
            tail += capacity - (tail & inner.mask);
            // A pad is always followed by its record in the same push.
            // SAFETY: as above, at offset 0.
            len = unsafe { base.cast::<u32>().read() };
        }
        let at = tail & inner.mask;
        // SAFETY: the record's bytes were published with its length word.
        let body = unsafe { std::slice::from_raw_parts(base.add(at + HEADER_BYTES), len as usize) };
        let out = read(body);
        inner.tail.0.store(tail + frame_bytes(len as usize), Ordering::Release);
        Some(out)
    }

    /// Bytes waiting, as seen now.
    pub fn waiting_bytes(&self) -> usize {
        self.inner.head.0.load(Ordering::Acquire) - self.inner.tail.0.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(seq: u32) -> impl FnOnce(&mut [u8]) {
        move |b: &mut [u8]| {
            for (i, x) in b.iter_mut().enumerate() {
                *x = (seq as usize + i) as u8;
            }
        }
    }

    fn check(seq: u32, b: &[u8]) {
        for (i, x) in b.iter().enumerate() {
            assert_eq!(*x, (seq as usize + i) as u8, "record {seq} byte {i}");
        }
    }

    #[test]
    fn records_come_out_whole_and_in_order_across_many_wraps() {
        let ring = Ring::new(RING_BYTES_MIN);
        let p = ring.producer().unwrap();
        assert!(ring.producer().is_none(), "one producer per ring");
        let mut c = ring.consumer().unwrap();
        assert!(ring.consumer().is_none(), "one consumer per ring");
        let mut next_out = 0u32;
        // Lengths that do not divide the ring, so records wrap at every
        // offset and pads are written.
        for seq in 0..20_000u32 {
            let len = 1 + (seq as usize * 7919) % 3001;
            while p.push(len, record(seq)).is_err() {
                let got = c.pop(|b| (b.len(), b.to_vec())).unwrap();
                check(next_out, &got.1);
                next_out += 1;
            }
        }
        while let Some(b) = c.pop(<[u8]>::to_vec) {
            check(next_out, &b);
            next_out += 1;
        }
        assert_eq!(next_out, 20_000);
        assert_eq!(c.waiting_bytes(), 0);
    }

    #[test]
    fn a_full_ring_refuses_without_waiting_and_takes_again_once_drained() {
        let ring = Ring::new(RING_BYTES_MIN);
        let p = ring.producer().unwrap();
        let mut c = ring.consumer().unwrap();
        let len = 1000;
        let mut pushed = 0;
        while p.push(len, record(pushed)).is_ok() {
            pushed += 1;
        }
        // 1008-byte frames: 65 fit in 64 KiB.
        assert_eq!(pushed, (RING_BYTES_MIN / frame_bytes(len)) as u32);
        assert_eq!(p.push(len, record(0)), Err(Refused::Full));
        check(0, &c.pop(<[u8]>::to_vec).unwrap());
        assert!(p.push(len, record(pushed)).is_ok());
    }

    #[test]
    fn a_record_over_half_the_ring_is_too_large() {
        let ring = Ring::new(RING_BYTES_MIN);
        let p = ring.producer().unwrap();
        assert_eq!(p.push(RING_BYTES_MIN / 2, |_| {}), Err(Refused::TooLarge));
        assert!(p.push(RING_BYTES_MIN / 2 - 8, |b| b.fill(1)).is_ok());
    }

    #[test]
    fn records_cross_threads_intact() {
        let ring = Ring::new(RING_BYTES_MIN);
        let mut c = ring.consumer().unwrap();
        let producer_ring = ring.clone();
        let t = std::thread::spawn(move || {
            let p = producer_ring.producer().unwrap();
            let mut dropped = 0u32;
            for seq in 0..50_000u32 {
                let len = 8 + (seq as usize % 200);
                if p.push(len, record(seq)).is_err() {
                    dropped += 1;
                    std::thread::yield_now();
                }
            }
            dropped
        });
        let mut got = 0u32;
        loop {
            match c.pop(|b| {
                // The first byte is the sequence number's low byte.
                let seq = u32::from(b[0]);
                for (i, x) in b.iter().enumerate() {
                    assert_eq!(*x, (seq as usize + i) as u8);
                }
            }) {
                Some(()) => got += 1,
                None if t.is_finished() && c.waiting_bytes() == 0 => break,
                None => std::thread::yield_now(),
            }
        }
        let dropped = t.join().unwrap();
        assert_eq!(got + dropped, 50_000);
    }
}
