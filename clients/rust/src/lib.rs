//! quiver-client: the client side of the Quiver scoring server's wire
//! protocol (docs/PROTOCOL.md), apart from the server so that a Rust caller
//! depends on FlatBuffers and the standard library (and rustls, with the
//! `tls` feature), not on the server's runtime, importers and kernels.
//!
//! - [`wire`]: framing, the request and response encoders and decoders
//!   (the server's own: it uses this crate);
//! - [`client`]: a sans-IO [`client::Codec`] and a blocking, pipelining
//!   [`client::Client`] over one connection; [`client::cluster`]: many
//!   nodes from one thread, balanced, with failover and hedges;
//! - [`feast`]: the string key of a Feast view keyed by several entities;
//! - [`tls`] (feature `tls`): TLS to servers with `[tls]`.

pub mod client;
pub mod feast;
pub mod stream;
#[cfg(feature = "tls")]
pub mod tls;
pub mod wire;
