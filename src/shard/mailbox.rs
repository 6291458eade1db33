//! Shard-local plumbing for requests that complete after their read round
//! (when scoring is handed to the inference stage): a mailbox per
//! connection holding what came back for it, completions as the stage
//! returned them and give-ups the shard decided, which the connection
//! answers into its own output through the request path; and a
//! notification that wakes the completion poller.
//!
//! No response bytes pass through here: a completion is a job slot and its
//! outcome, answered where the connection writes.
//!
//! Single-threaded on purpose (`Rc`, `Cell`, `RefCell`): each shard has its own.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

use crate::infer::{Done, SlotToken};

/// What came back for one of a connection's handed-off requests.
pub enum Returned {
    /// The stage finished the job in this slot (`RequestPath::complete`).
    Completed(Done, SlotToken),
    /// The request in this job slot waited past its give-up time: it is
    /// answered from the lower rungs (`RequestPath::give_up`), and its
    /// completion, which follows, is dropped.
    GiveUp(u32),
}

/// What came back for one connection, in order.
pub struct Mailbox {
    returned: RefCell<VecDeque<Returned>>,
    /// Completions still owed by the stage.
    pending: Cell<usize>,
    waker: RefCell<Option<Waker>>,
}

impl Mailbox {
    /// One more request of this connection is in the stage.
    pub fn expect(&self) {
        self.pending.set(self.pending.get() + 1);
    }

    pub fn pending(&self) -> usize {
        self.pending.get()
    }

    fn deliver(&self, returned: Returned) {
        if matches!(returned, Returned::Completed(..)) {
            self.pending.set(self.pending.get() - 1);
        }
        self.returned.borrow_mut().push_back(returned);
        if let Some(w) = self.waker.borrow_mut().take() {
            w.wake();
        }
    }

    /// The oldest of what came back, to be answered.
    pub fn take(&self) -> Option<Returned> {
        self.returned.borrow_mut().pop_front()
    }

    /// Resolves once something has come back.
    pub fn delivered(&self) -> Delivered<'_> {
        Delivered { mailbox: self }
    }
}

pub struct Delivered<'a> {
    mailbox: &'a Mailbox,
}

impl Future for Delivered<'_> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if !self.mailbox.returned.borrow().is_empty() {
            return Poll::Ready(());
        }
        *self.mailbox.waker.borrow_mut() = Some(cx.waker().clone());
        Poll::Pending
    }
}

/// Mailboxes by connection id; ids are reused only after a connection has
/// answered everything it was owed.
pub struct Mailboxes {
    slots: RefCell<Vec<Option<Rc<Mailbox>>>>,
    free: RefCell<Vec<u32>>,
    /// Room each mailbox is opened with: a completion and a give-up per
    /// job slot, so delivering never allocates.
    returned_max: usize,
}

impl Mailboxes {
    /// For a shard with `job_slots` job slots (0 without a stage).
    pub fn new(job_slots: usize) -> Mailboxes {
        Mailboxes { slots: RefCell::default(), free: RefCell::default(), returned_max: 2 * job_slots }
    }

    pub fn open(&self) -> (u32, Rc<Mailbox>) {
        let mailbox = Rc::new(Mailbox {
            returned: RefCell::new(VecDeque::with_capacity(self.returned_max)),
            pending: Cell::new(0),
            waker: RefCell::new(None),
        });
        let mut slots = self.slots.borrow_mut();
        let id = match self.free.borrow_mut().pop() {
            Some(id) => id,
            None => {
                slots.push(None);
                (slots.len() - 1) as u32
            }
        };
        slots[id as usize] = Some(mailbox.clone());
        (id, mailbox)
    }

    pub fn close(&self, id: u32) {
        let mut slots = self.slots.borrow_mut();
        let mailbox = slots[id as usize].take().expect("closing an open mailbox");
        assert_eq!(mailbox.pending(), 0, "a connection closes only when owed nothing");
        assert!(mailbox.returned.borrow().is_empty(), "a connection closes only once it answered what came back");
        self.free.borrow_mut().push(id);
    }

    pub fn deliver(&self, id: u32, returned: Returned) {
        let slots = self.slots.borrow();
        let mailbox = slots[id as usize].as_ref().expect("completions go to open connections");
        mailbox.deliver(returned);
    }
}

/// Wakes one waiting task; a notification before the wait is not lost.
#[derive(Default)]
pub struct Notify {
    set: Cell<bool>,
    waker: RefCell<Option<Waker>>,
}

impl Notify {
    pub fn notify(&self) {
        self.set.set(true);
        if let Some(w) = self.waker.borrow_mut().take() {
            w.wake();
        }
    }

    pub fn notified(&self) -> Notified<'_> {
        Notified { notify: self }
    }
}

pub struct Notified<'a> {
    notify: &'a Notify,
}

impl Future for Notified<'_> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.notify.set.replace(false) {
            return Poll::Ready(());
        }
        *self.notify.waker.borrow_mut() = Some(cx.waker().clone());
        Poll::Pending
    }
}
