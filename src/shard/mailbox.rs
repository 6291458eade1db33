//! Shard-local plumbing for responses that complete after their read round
//! (when scoring is handed to the inference stage): a mailbox per
//! connection, and a notification that wakes the completion poller.
//!
//! Single-threaded on purpose (`Rc`, `Cell`, `RefCell`): each shard has its own.

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

/// Responses waiting for one connection to write them.
#[derive(Default)]
pub struct Mailbox {
    out: RefCell<Vec<u8>>,
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

    fn deliver(&self, bytes: &[u8]) {
        self.out.borrow_mut().extend_from_slice(bytes);
        self.pending.set(self.pending.get() - 1);
        if let Some(w) = self.waker.borrow_mut().take() {
            w.wake();
        }
    }

    /// Moves delivered responses to the end of `out`.
    pub fn take_into(&self, out: &mut Vec<u8>) {
        let mut mine = self.out.borrow_mut();
        out.extend_from_slice(&mine);
        mine.clear();
    }

    /// Resolves once a response has been delivered.
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
        if !self.mailbox.out.borrow().is_empty() {
            return Poll::Ready(());
        }
        *self.mailbox.waker.borrow_mut() = Some(cx.waker().clone());
        Poll::Pending
    }
}

/// Mailboxes by connection id; ids are reused only after a connection has
/// collected every response it was owed.
#[derive(Default)]
pub struct Mailboxes {
    slots: RefCell<Vec<Option<Rc<Mailbox>>>>,
    free: RefCell<Vec<u32>>,
}

impl Mailboxes {
    pub fn open(&self) -> (u32, Rc<Mailbox>) {
        let mailbox = Rc::new(Mailbox::default());
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
        self.free.borrow_mut().push(id);
    }

    pub fn deliver(&self, id: u32, bytes: &[u8]) {
        let mailbox = self.slots.borrow()[id as usize].clone().expect("responses go to open connections");
        mailbox.deliver(bytes);
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
