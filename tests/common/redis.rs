//! Test harness: a real `redis-server` per test, on a free port with a scratch directory.
//!
//! Feed tests need Redis itself (Lua, streams, AUTH, persistence), not a mock, and must never
//! touch a Redis that happens to run on the machine. Each server is killed by PID and its
//! directory removed when the handle drops, so a failed test leaves nothing behind.

use std::collections::HashMap;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use quiver::features::feed::{contract, RedisConfig, RedisConn, Reply};

/// How long a fresh server may take to answer PING.
const START_TIMEOUT: Duration = Duration::from_secs(5);

pub struct RedisServer {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
    args: Vec<String>,
    password: Option<String>,
    paused: bool,
}

impl RedisServer {
    /// A server without persistence.
    pub fn start() -> RedisServer {
        RedisServer::start_opts(false, &[])
    }

    /// With `persist`, every write is fsynced to the append-only file before it is
    /// acknowledged, so `kill()` loses nothing that was acknowledged.
    pub fn start_with(persist: bool) -> RedisServer {
        RedisServer::start_opts(persist, &[])
    }

    /// `start_with`, plus extra `redis-server` arguments (e.g. `--requirepass secret`, which
    /// `conn()` and `url()` then use).
    pub fn start_opts(persist: bool, extra: &[&str]) -> RedisServer {
        static SERVERS: AtomicU64 = AtomicU64::new(0);
        let n = SERVERS.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("quiver-redis-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
        let port = free_port();
        let mut args: Vec<String> = [
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--dir",
            &dir.display().to_string(),
            "--save",
            "",
            "--daemonize",
            "no",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let persistence: &[&str] =
            if persist { &["--appendonly", "yes", "--appendfsync", "always"] } else { &["--appendonly", "no"] };
        args.extend(persistence.iter().chain(extra).map(|s| s.to_string()));
        let password =
            extra.iter().position(|a| *a == "--requirepass").and_then(|i| extra.get(i + 1)).map(|p| p.to_string());
        let mut server = RedisServer { child: None, port, dir, args, password, paused: false };
        server.spawn();
        server
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The server's URL, with its password when it has one.
    pub fn url(&self) -> String {
        match &self.password {
            Some(p) => format!("redis://:{p}@{}", self.addr()),
            None => format!("redis://{}", self.addr()),
        }
    }

    pub fn config(&self) -> RedisConfig {
        let mut c = RedisConfig::new(self.addr());
        c.password = self.password.clone();
        c
    }

    pub fn conn(&self) -> RedisConn {
        RedisConn::connect(&self.config()).unwrap_or_else(|e| panic!("connect to test redis: {e}\n{}", self.log()))
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// SIGKILL, then reap: the server gets no chance to flush or say goodbye.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            if self.paused {
                signal(child.id(), libc::SIGCONT);
                self.paused = false;
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGSTOP: the server keeps its connections but answers nothing.
    pub fn pause(&mut self) {
        let pid = self.pid().expect("pause a running server");
        signal(pid, libc::SIGSTOP);
        self.paused = true;
    }

    pub fn resume(&mut self) {
        let pid = self.pid().expect("resume a running server");
        signal(pid, libc::SIGCONT);
        self.paused = false;
    }

    /// Starts the server again on the same port and directory (killing it first if needed).
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// The server's own log, for failure messages.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("redis.log")).unwrap_or_default()
    }

    fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("redis.log"))
            .unwrap_or_else(|e| panic!("cannot create the redis log in {}: {e}", self.dir.display()));
        let log_err = log.try_clone().expect("duplicate the log file handle");
        let child = Command::new("redis-server")
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .spawn()
            .unwrap_or_else(|e| match e.kind() {
                std::io::ErrorKind::NotFound => {
                    panic!("redis-server is not on PATH: install Redis 7 (e.g. apt-get install redis-server) to run the feed tests")
                }
                _ => panic!("cannot start redis-server: {e}"),
            });
        self.child = Some(child);
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                self.child = None;
                panic!("redis-server exited at start ({status}):\n{}", self.log());
            }
            let mut config = self.config();
            config.connect_timeout_ms = 100;
            if let Ok(mut conn) = RedisConn::connect(&config) {
                if conn.command(&[b"PING"]).is_ok() {
                    return;
                }
            }
            if Instant::now() > deadline {
                self.kill();
                panic!(
                    "redis-server on port {} did not answer PING within {START_TIMEOUT:?}:\n{}",
                    self.port,
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A port nothing listens on right now (the OS picks it; the tiny window before redis-server
/// binds it is accepted).
pub fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    listener.local_addr().expect("local address of a bound listener").port()
}

fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: kill(2) with a PID we spawned and still hold (not yet reaped), so it cannot have
    // been reused by another process.
    let rc = unsafe { libc::kill(pid as libc::pid_t, sig) };
    assert_eq!(rc, 0, "kill({pid}, {sig}): {}", std::io::Error::last_os_error());
}

/// Every `{group}:*` key in Redis, decoded.
pub fn redis_entities(conn: &mut RedisConn, group: &str) -> HashMap<u64, Vec<u8>> {
    let mut out = HashMap::new();
    let mut cursor = b"0".to_vec();
    let pattern = format!("{group}:*");
    loop {
        let reply = conn.command(&[b"SCAN", &cursor, b"MATCH", pattern.as_bytes(), b"COUNT", b"1000"]).unwrap();
        let mut parts = reply.into_array().unwrap().into_iter();
        cursor = parts.next().unwrap().into_bytes().unwrap();
        let keys: Vec<Vec<u8>> =
            parts.next().unwrap().into_array().unwrap().into_iter().filter_map(Reply::into_bytes).collect();
        if !keys.is_empty() {
            let mut mget: Vec<&[u8]> = vec![b"MGET"];
            mget.extend(keys.iter().map(Vec::as_slice));
            let values = conn.command(&mget).unwrap().into_array().unwrap();
            for (k, v) in keys.iter().zip(values) {
                if let (Some(id), Reply::Bulk(bytes)) = (contract::parse_entity_key(group, k), v) {
                    out.insert(id, bytes);
                }
            }
        }
        if cursor == b"0" {
            return out;
        }
    }
}
