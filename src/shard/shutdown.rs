//! A shard-local, one-shot broadcast: every waiter wakes when it is triggered.
//!
//! Single-threaded on purpose (`Cell`, `RefCell`): each shard has its own.
//! Waiters occupy slots that are freed when their future is dropped, so a
//! connection that waits on every read does not grow the list.

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

#[derive(Default)]
pub struct ShutdownSignal {
    triggered: Cell<bool>,
    slots: RefCell<Slots>,
}

#[derive(Default)]
struct Slots {
    wakers: Vec<Option<Waker>>,
    free: Vec<usize>,
}

impl ShutdownSignal {
    pub fn trigger(&self) {
        self.triggered.set(true);
        let wakers: Vec<Waker> = self.slots.borrow_mut().wakers.iter_mut().filter_map(Option::take).collect();
        for w in wakers {
            w.wake();
        }
    }

    pub fn is_triggered(&self) -> bool {
        self.triggered.get()
    }

    /// Resolves once `trigger` has been called.
    pub fn wait(&self) -> Wait<'_> {
        Wait { signal: self, slot: None }
    }
}

pub struct Wait<'a> {
    signal: &'a ShutdownSignal,
    slot: Option<usize>,
}

impl Future for Wait<'_> {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.signal.triggered.get() {
            return Poll::Ready(());
        }
        let signal = self.signal;
        let mut slots = signal.slots.borrow_mut();
        let slot = match self.slot {
            Some(s) => s,
            None => {
                let s = slots.free.pop().unwrap_or_else(|| {
                    slots.wakers.push(None);
                    slots.wakers.len() - 1
                });
                self.slot = Some(s);
                s
            }
        };
        slots.wakers[slot] = Some(cx.waker().clone());
        Poll::Pending
    }
}

impl Drop for Wait<'_> {
    fn drop(&mut self) {
        if let Some(s) = self.slot {
            let mut slots = self.signal.slots.borrow_mut();
            slots.wakers[s] = None;
            slots.free.push(s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::task::Wake;

    struct Flag(std::sync::atomic::AtomicBool);
    impl Wake for Flag {
        fn wake(self: Arc<Self>) {
            self.0.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }

    #[test]
    fn wakes_waiters_and_reuses_slots() {
        let signal = ShutdownSignal::default();
        let flag = Arc::new(Flag(false.into()));
        let waker = Waker::from(flag.clone());
        let mut cx = Context::from_waker(&waker);
        for _ in 0..100 {
            let mut w = Box::pin(signal.wait());
            assert!(w.as_mut().poll(&mut cx).is_pending());
        }
        assert_eq!(signal.slots.borrow().wakers.len(), 1, "dropped waiters free their slot");
        let mut w = Box::pin(signal.wait());
        assert!(w.as_mut().poll(&mut cx).is_pending());
        signal.trigger();
        assert!(flag.0.load(std::sync::atomic::Ordering::SeqCst));
        assert!(w.as_mut().poll(&mut cx).is_ready());
        assert!(signal.is_triggered());
    }
}
