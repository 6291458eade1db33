//! A generated connection's bytes: non-blocking plain TCP, or TLS over it
//! (`quiver bench --tls`), driven through rustls's sans-IO client so the one
//! spinning thread never blocks on a handshake record or a full socket.
//!
//! The handshake completes, blocking and bounded, before the run starts:
//! the run measures requests over established sessions, as bidders keep
//! their connections open.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::ServerName;

use crate::client::ClientError;

/// The bound on connecting and on the handshake.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// What TLS every connection of a run uses, built once.
#[derive(Clone)]
pub(super) struct Tls {
    pub config: Arc<rustls::ClientConfig>,
    pub name: ServerName<'static>,
}

pub(super) enum Transport {
    Plain(TcpStream),
    Tls { sock: TcpStream, conn: Box<rustls::ClientConnection> },
}

impl Transport {
    pub fn connect(addr: &str, tls: Option<&Tls>) -> Result<Transport, ClientError> {
        let s = TcpStream::connect(addr).map_err(|source| ClientError::Connect { addr: addr.into(), source })?;
        s.set_nodelay(true)?;
        let t = match tls {
            None => Transport::Plain(s),
            Some(tls) => {
                s.set_read_timeout(Some(CONNECT_TIMEOUT))?;
                s.set_write_timeout(Some(CONNECT_TIMEOUT))?;
                let owned = crate::tls::connect_with(s, tls.config.clone(), tls.name.clone())
                    .map_err(|what| ClientError::Tls { addr: addr.into(), what })?;
                Transport::Tls { sock: owned.sock, conn: Box::new(owned.conn) }
            }
        };
        t.sock().set_nonblocking(true)?;
        Ok(t)
    }

    fn sock(&self) -> &TcpStream {
        match self {
            Transport::Plain(s) => s,
            Transport::Tls { sock, .. } => sock,
        }
    }

    /// Takes what it can of `buf` without blocking; `WouldBlock` when it
    /// could take nothing.
    pub fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Transport::Plain(s) => s.write(buf),
            Transport::Tls { conn, .. } => {
                // rustls takes what fits its bounded send buffer.
                let n = conn.writer().write(buf)?;
                self.flush()?;
                if n == 0 {
                    return Err(io::ErrorKind::WouldBlock.into());
                }
                Ok(n)
            }
        }
    }

    /// Sends the records rustls holds, as far as the socket takes them; a
    /// no-op for plain TCP. Called every turn of the loop.
    pub fn flush(&mut self) -> io::Result<()> {
        let Transport::Tls { sock, conn } = self else {
            return Ok(());
        };
        while conn.wants_write() {
            match conn.write_tls(sock) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Reads what has arrived; 0 when the server closed, `WouldBlock` when
    /// nothing (or no whole record) has.
    pub fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let (sock, conn) = match self {
            Transport::Plain(s) => return s.read(buf),
            Transport::Tls { sock, conn } => (sock, conn),
        };
        loop {
            match conn.reader().read(buf) {
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
            if conn.read_tls(sock)? == 0 {
                return Ok(0);
            }
            conn.process_new_packets().map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("TLS: {e}")))?;
        }
    }
}
