//! A bounded single-producer single-consumer ring of `Copy` values.
//!
//! The hand-off between a shard and the inference thread moves small
//! descriptors (a slot index and a few numbers), never the feature rows
//! themselves, so the ring only needs `Copy` payloads. Capacity is fixed at
//! construction and a full ring refuses the push: the caller turns that into
//! `Overloaded`, never a wait. Each side caches the other side's index so
//! that a push or pop touches the shared cache lines only when it must.

use std::cell::{Cell, UnsafeCell};
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Keeps the producer's and the consumer's indices on separate cache lines.
#[repr(align(128))]
struct Padded(AtomicUsize);

struct Inner<T> {
    /// Next slot the producer writes; only the producer stores it.
    head: Padded,
    /// Next slot the consumer reads; only the consumer stores it.
    tail: Padded,
    mask: usize,
    slots: Box<[UnsafeCell<MaybeUninit<T>>]>,
}

// SAFETY: a slot is written only by the single producer before it publishes
// `head` with Release, and read only by the single consumer after it loads
// `head` with Acquire (and the reverse for `tail`), so no slot is accessed by
// both sides at once. `T: Send` lets the values cross threads.
unsafe impl<T: Send> Sync for Inner<T> {}

/// The pushing end. `Send` but not `Clone`: there is exactly one.
pub struct Producer<T> {
    inner: Arc<Inner<T>>,
    cached_tail: Cell<usize>,
}

/// The popping end. `Send` but not `Clone`: there is exactly one.
pub struct Consumer<T> {
    inner: Arc<Inner<T>>,
    cached_head: Cell<usize>,
}

// SAFETY: each end is used by one thread at a time (it is not `Sync`), and
// the shared `Inner` is `Sync` for `T: Send`.
unsafe impl<T: Send> Send for Producer<T> {}
// SAFETY: as for `Producer`.
unsafe impl<T: Send> Send for Consumer<T> {}

/// A ring holding up to `capacity` values (rounded up to a power of two).
pub fn ring<T: Copy>(capacity: usize) -> (Producer<T>, Consumer<T>) {
    let capacity = capacity.max(2).next_power_of_two();
    let slots = (0..capacity).map(|_| UnsafeCell::new(MaybeUninit::uninit())).collect();
    let inner = Arc::new(Inner {
        head: Padded(AtomicUsize::new(0)),
        tail: Padded(AtomicUsize::new(0)),
        mask: capacity - 1,
        slots,
    });
    (Producer { inner: inner.clone(), cached_tail: Cell::new(0) }, Consumer { inner, cached_head: Cell::new(0) })
}

impl<T: Copy> Producer<T> {
    /// Appends `value`, or hands it back when the ring is full.
    pub fn push(&self, value: T) -> Result<(), T> {
        let inner = &*self.inner;
        let head = inner.head.0.load(Ordering::Relaxed);
        if head - self.cached_tail.get() > inner.mask {
            self.cached_tail.set(inner.tail.0.load(Ordering::Acquire));
            if head - self.cached_tail.get() > inner.mask {
                return Err(value);
            }
        }
        // SAFETY: `head - tail <= mask`, so this slot is not readable by the
        // consumer until the Release store below publishes it.
        unsafe { (*inner.slots[head & inner.mask].get()).write(value) };
        inner.head.0.store(head.wrapping_add(1), Ordering::Release);
        Ok(())
    }

    pub fn capacity(&self) -> usize {
        self.inner.mask + 1
    }
}

impl<T: Copy> Consumer<T> {
    /// Takes the oldest value, if any.
    pub fn pop(&self) -> Option<T> {
        let inner = &*self.inner;
        let tail = inner.tail.0.load(Ordering::Relaxed);
        if tail == self.cached_head.get() {
            self.cached_head.set(inner.head.0.load(Ordering::Acquire));
            if tail == self.cached_head.get() {
                return None;
            }
        }
        // SAFETY: `tail < head`, and the Acquire load of `head` that showed it
        // makes the producer's write of this slot visible.
        let value = unsafe { (*inner.slots[tail & inner.mask].get()).assume_init() };
        inner.tail.0.store(tail.wrapping_add(1), Ordering::Release);
        Some(value)
    }

    /// Values waiting, as seen now (a hint: the producer may add more).
    pub fn len(&self) -> usize {
        let inner = &*self.inner;
        inner.head.0.load(Ordering::Acquire) - inner.tail.0.load(Ordering::Relaxed)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fifo_and_full() {
        let (p, c) = ring::<u32>(3);
        assert_eq!(p.capacity(), 4);
        for i in 0..4 {
            p.push(i).unwrap();
        }
        assert_eq!(p.push(9), Err(9));
        assert_eq!(c.len(), 4);
        assert_eq!(c.pop(), Some(0));
        p.push(4).unwrap();
        let rest: Vec<_> = std::iter::from_fn(|| c.pop()).collect();
        assert_eq!(rest, vec![1, 2, 3, 4]);
        assert!(c.is_empty());
    }

    #[test]
    fn two_threads_see_every_value_once_in_order() {
        const N: u64 = 2_000_000;
        let (p, c) = ring::<(u64, u64)>(64);
        let producer = std::thread::spawn(move || {
            for i in 0..N {
                let mut v = (i, i.wrapping_mul(0x9E37_79B9_7F4A_7C15));
                loop {
                    match p.push(v) {
                        Ok(()) => break,
                        Err(back) => {
                            v = back;
                            std::hint::spin_loop();
                        }
                    }
                }
            }
        });
        let mut next = 0;
        while next < N {
            match c.pop() {
                Some((i, check)) => {
                    assert_eq!(i, next);
                    assert_eq!(check, i.wrapping_mul(0x9E37_79B9_7F4A_7C15));
                    next += 1;
                }
                None => std::hint::spin_loop(),
            }
        }
        producer.join().unwrap();
        assert!(c.pop().is_none());
    }
}
