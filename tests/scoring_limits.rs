//! The scoring port's limits against clients that try to hold it: frames
//! dripped a byte at a time, responses drained a trickle at a time, one
//! host opening connection after connection, and the per-shard limit with
//! connections handed between shards.

mod common;

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::os::fd::FromRawFd;
use std::time::{Duration, Instant};

use common::{demo_request, Server};
use quiver::wire::{RequestEncoder, Status};

fn frame(request_id: u64, items: Vec<u64>) -> Vec<u8> {
    let mut out = Vec::new();
    RequestEncoder::new().encode(&demo_request(request_id, 1, items), &mut out);
    out
}

/// Whether the server answers one request on `s` (a refused connection is
/// closed at once, so the read ends in EOF or a reset; an answer may take a
/// busy machine a while).
fn served(s: &mut TcpStream) -> bool {
    s.set_read_timeout(Some(common::WAIT)).unwrap();
    if s.write_all(&frame(1, vec![1])).is_err() {
        return false;
    }
    let mut buf = [0u8; 4];
    s.read_exact(&mut buf).is_ok()
}

#[test]
fn a_dripped_frame_is_cut_off_and_slow_whole_frames_are_not() {
    let cfg = common::scratch("frame-timeout").join("q.toml");
    // The split frame below arrives within a tenth of this, a margin no
    // scheduling pause of a busy machine eats.
    std::fs::write(&cfg, "[limits]\nframe_timeout_ms = 1000\n").unwrap();
    let mut server = Server::start(&["--shards", "1", "--config", cfg.to_str().unwrap()]);

    // One byte every 100 ms: the frame is never complete in time. Before,
    // each byte reset the idle timeout and the slot was held for ever.
    let mut drip = TcpStream::connect(&server.addr).unwrap();
    drip.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
    let bytes = frame(1, (0..64).collect());
    let started = Instant::now();
    let mut closed_after = None;
    for b in &bytes {
        if drip.write_all(&[*b]).is_err() {
            closed_after = Some(started.elapsed());
            break;
        }
        let mut buf = [0u8; 64];
        match drip.read(&mut buf) {
            Ok(0) => {
                closed_after = Some(started.elapsed());
                break;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Ok(_) => panic!("a response to a frame that never completed"),
            Err(_) => {
                closed_after = Some(started.elapsed());
                break;
            }
        }
    }
    let closed_after = closed_after.expect("the dripping connection was never closed");
    assert!(closed_after >= Duration::from_millis(900) && closed_after < Duration::from_secs(5), "{closed_after:?}");
    assert_eq!(server.wait_metric("quiver_frames_timed_out_total", 1), 1);

    // Whole frames 1.2 s apart (longer than the frame timeout) are served:
    // the clock runs from a frame's first byte, not between frames.
    let mut slow = server.client();
    for i in 0..2 {
        std::thread::sleep(Duration::from_millis(1_200 * i));
        assert_eq!(slow.score(&demo_request(i, 1, vec![1, 2])).unwrap().status, Status::Ok);
    }
    // A frame split in two, the halves 100 ms apart, is within the limit.
    let mut split = TcpStream::connect(&server.addr).unwrap();
    let (a, b) = bytes.split_at(bytes.len() / 2);
    split.write_all(a).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    split.write_all(b).unwrap();
    split.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let mut prefix = [0u8; 4];
    split.read_exact(&mut prefix).expect("the split frame is answered");
    assert!(server.is_running());
}

#[test]
fn a_client_draining_a_trickle_is_closed_within_the_write_timeout() {
    let cfg = common::scratch("write-whole").join("q.toml");
    std::fs::write(&cfg, "[limits]\nwrite_timeout_ms = 300\noutput_bytes_max = 65536\n").unwrap();
    let mut server = Server::start(&["--shards", "1", "--config", cfg.to_str().unwrap()]);
    let addr = server.addr.clone();
    // Floods requests and reads 64 bytes every 20 ms: every write call
    // makes a little progress, so only a limit on the whole write ends it.
    // The server's close shows as the flood's writes failing (the reader
    // still has megabytes of answers buffered to trickle through).
    let trickler = std::thread::spawn(move || {
        let s = TcpStream::connect(&addr).unwrap();
        let mut reader = s.try_clone().unwrap();
        let mut writer = s;
        writer.set_write_timeout(Some(Duration::from_secs(20))).unwrap();
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let trickle = std::thread::spawn({
            let done = done.clone();
            move || {
                reader.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
                let mut buf = [0u8; 64];
                while !done.load(std::sync::atomic::Ordering::Relaxed) {
                    if matches!(reader.read(&mut buf), Ok(0)) {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        });
        let batch: Vec<u8> = frame(1, (0..32).collect()).repeat(200);
        let started = Instant::now();
        let closed = loop {
            if writer.write_all(&batch).is_err() {
                break Some(started.elapsed());
            }
            if started.elapsed() > Duration::from_secs(30) {
                break None;
            }
        };
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        let _ = trickle.join();
        closed
    });
    let closed = trickler.join().unwrap().expect("the trickling reader was never closed");
    assert!(closed < Duration::from_secs(20), "{closed:?}");
    assert!(server.wait_metric("quiver_writes_timed_out_total", 1) >= 1);
    assert_eq!(server.client().score(&demo_request(2, 1, vec![1])).unwrap().status, Status::Ok);
    assert!(server.is_running());
}

/// A TCP connection to `to` from the loopback address `from`.
fn connect_from(from: Ipv4Addr, to: &str) -> TcpStream {
    let to: SocketAddr = to.parse().unwrap();
    let SocketAddr::V4(to) = to else { panic!("the server listens on IPv4") };
    let sockaddr = |ip: Ipv4Addr, port: u16| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr { s_addr: u32::from(ip).to_be() },
        sin_zero: [0; 8],
    };
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: a new socket, bound and connected with valid sockaddr_in
    // values of the stated length; its fd is owned by the returned stream.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        assert!(fd >= 0);
        let local = sockaddr(from, 0);
        assert_eq!(libc::bind(fd, (&raw const local).cast(), len), 0, "bind {from}");
        let remote = sockaddr(*to.ip(), to.port());
        assert_eq!(libc::connect(fd, (&raw const remote).cast(), len), 0, "connect {to}");
        TcpStream::from_raw_fd(fd)
    }
}

#[test]
fn one_source_holds_at_most_its_share_of_connections() {
    let cfg = common::scratch("per-source").join("q.toml");
    std::fs::write(&cfg, "[limits]\nconnections_per_source_max = 4\n").unwrap();
    let mut server = Server::start(&["--shards", "2", "--config", cfg.to_str().unwrap()]);
    let ours = Ipv4Addr::new(127, 0, 0, 1);
    let mut held: Vec<TcpStream> = (0..4).map(|_| connect_from(ours, &server.addr)).collect();
    assert!(held.iter_mut().all(served), "the first four are served");
    let mut extra: Vec<TcpStream> = (0..3).map(|_| connect_from(ours, &server.addr)).collect();
    assert!(extra.iter_mut().all(|s| !served(s)), "past four, this source is refused");
    // Another host has its own share.
    let mut other = connect_from(Ipv4Addr::new(127, 0, 0, 2), &server.addr);
    assert!(served(&mut other), "another source is served");
    assert!(server.wait_metric("quiver_connections_refused_source_full_total", 3) >= 3);
    // A closed connection gives its source the place back.
    drop(held.pop());
    let until = Instant::now() + common::WAIT;
    while !served(&mut connect_from(ours, &server.addr)) {
        assert!(Instant::now() < until, "the freed place was never given back");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(server.is_running());
}

#[test]
fn the_per_shard_limit_holds_when_connections_are_handed_between_shards() {
    let cfg = common::scratch("shard-limit").join("q.toml");
    std::fs::write(&cfg, "[limits]\nconnections_per_shard_max = 8\n").unwrap();
    let mut server = Server::start(&["--shards", "2", "--config", cfg.to_str().unwrap()]);
    let mut conns: Vec<TcpStream> = (0..40).map(|_| TcpStream::connect(&server.addr).unwrap()).collect();
    let served = conns.iter_mut().map(served).filter(|&ok| ok).count();
    assert_eq!(served, 16, "two shards of 8 serve 16 of 40 (before: 23 to 26)");
    let s = server.stats();
    assert!(s.connections_active <= 16, "{s:?}");
    assert_eq!(server.wait_metric("quiver_connections_refused_shard_full_total", 24), 24);
    assert!(server.is_running());
}
