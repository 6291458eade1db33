//! Reads that say when the kernel received the bytes.
//!
//! The server's own stages start when a shard reads a frame; a request can
//! wait well before that, in the socket, while its shard is busy or parked.
//! With `SO_TIMESTAMPNS` set, `recvmsg` returns the kernel's software
//! receive time of the newest bytes it hands over; the difference to the
//! time of the read is the request's `socket_wait`. Only the non-blocking
//! read lives here; waiting for readiness stays with the runtime.

use std::io;
use std::os::fd::AsRawFd;

/// Room for one `SCM_TIMESTAMPNS` control message (a `timespec`), aligned.
#[repr(C, align(8))]
struct Control([u8; 64]);

/// Asks the kernel to stamp what this socket receives.
pub fn enable(socket: &impl AsRawFd) -> io::Result<()> {
    let on: libc::c_int = 1;
    // SAFETY: `on` outlives the call and its size is passed with it.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_TIMESTAMPNS,
            (&on as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// What one non-blocking read got: the bytes read (0 at end of stream) and
/// the kernel's receive time of the newest of them, ns since the Unix epoch.
pub type Stamped = (usize, Option<u64>);

/// Reads what `socket` has without waiting: `Ok(None)` when it has nothing.
pub fn try_recv(socket: &impl AsRawFd, buf: &mut [u8]) -> io::Result<Option<Stamped>> {
    let mut control = Control([0; 64]);
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // SAFETY: an all-zero msghdr is valid (no name, no iovecs, no control).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.0.as_mut_ptr().cast();
    msg.msg_controllen = control.0.len() as _;
    // SAFETY: `iov` points into `buf` with its length and `msg_control` into
    // `control` with its length; both outlive the call, which writes at most
    // that much into each. The fd is borrowed from a live socket.
    let n = unsafe { libc::recvmsg(socket.as_raw_fd(), &mut msg, libc::MSG_DONTWAIT) };
    if n < 0 {
        let e = io::Error::last_os_error();
        return match e.kind() {
            io::ErrorKind::WouldBlock => Ok(None),
            _ => Err(e),
        };
    }
    let mut stamp = None;
    // SAFETY: the CMSG_* macros walk the control buffer the kernel filled,
    // within `msg_controllen`; the payload of an SCM_TIMESTAMPNS message is
    // one `timespec`, read unaligned.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_TIMESTAMPNS {
                let ts = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<libc::timespec>());
                stamp = Some(ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64);
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    Ok(Some((n as usize, stamp)))
}

/// The wall clock, in ns since the Unix epoch: the clock the stamps use.
pub fn realtime_ns() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// The kernel turns receive stamping on through a deferred work item
    /// the first time any socket asks for it (`net_enable_timestamp`), so
    /// bytes that arrive in the first moments after `enable` may come
    /// unstamped; the test sends again until they are stamped, within a bound.
    #[test]
    fn a_read_says_how_long_the_bytes_waited() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        enable(&server).unwrap();
        let mut buf = [0u8; 64];
        assert!(try_recv(&server, &mut buf).unwrap().is_none(), "nothing sent yet");
        let mut unstamped = 0;
        let waited_ns = loop {
            client.write_all(b"hello").unwrap();
            std::thread::sleep(std::time::Duration::from_millis(20));
            let (n, stamp) = try_recv(&server, &mut buf).unwrap().expect("bytes wait");
            assert_eq!(&buf[..n], b"hello");
            match stamp {
                Some(stamp) => break realtime_ns() - stamp,
                None => unstamped += 1,
            }
            assert!(unstamped < 100, "no read was stamped in 100 tries");
        };
        assert!(waited_ns >= 15_000_000, "{waited_ns} ns");
        assert!(waited_ns < 10_000_000_000, "{waited_ns} ns");
        drop(client);
        assert_eq!(try_recv(&server, &mut buf).unwrap(), Some((0, None)), "end of stream");
    }
}
