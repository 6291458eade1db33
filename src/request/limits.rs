//! The request path's limits (`[limits]`): what one frame, one request and
//! one connection may hold, and the time bounds of a connection. The
//! request path and the shards read them; the config file sets them.

use serde::{Deserialize, Serialize};

/// A limit set outside the range it may take.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("limits.{field} = {value} is outside {range}")]
pub struct LimitError {
    pub field: &'static str,
    pub value: u64,
    pub range: &'static str,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Largest request frame, excluding the 4-byte length prefix.
    pub frame_bytes_max: usize,
    pub candidates_max: usize,
    pub context_len_max: usize,
    /// Connections a shard serves, handed-over ones included: held on the
    /// shard that serves them.
    pub connections_per_shard_max: usize,
    /// Connections one source holds on the whole server (an IPv4 address,
    /// or an IPv6 /64, which one host can fill), so one host cannot take
    /// every slot.
    pub connections_per_source_max: usize,
    /// Budget for requests that send `budget_us = 0`.
    pub budget_us_default: u32,
    /// Larger budgets are clamped to this.
    pub budget_us_max: u32,
    /// Responses buffered per connection before the shard stops decoding
    /// and flushes; bounds memory per pipelining client.
    pub output_bytes_max: usize,
    /// Frames a connection answers before its responses are written and it
    /// yields the reactor to the shard's other connections and tasks: a
    /// client pipelining thousands of requests cannot hold the shard for
    /// the whole burst.
    pub frames_per_round_max: usize,
    /// A connection that sends nothing for this long is closed.
    pub idle_timeout_ms: u64,
    /// A frame must be complete this long after its first byte arrived,
    /// however its bytes trickle in; else the connection is closed.
    pub frame_timeout_ms: u64,
    /// A round's responses must be written whole within this, however the
    /// client drains them; else the connection is closed.
    pub write_timeout_ms: u64,
    /// After SIGTERM, how long connections get to finish before the
    /// process exits anyway.
    pub shutdown_grace_ms: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            frame_bytes_max: 64 * 1024,
            candidates_max: 256,
            context_len_max: 256,
            connections_per_shard_max: 1024,
            connections_per_source_max: 256,
            budget_us_default: 10_000,
            budget_us_max: 10_000_000,
            output_bytes_max: 1 << 20,
            frames_per_round_max: 64,
            idle_timeout_ms: 60_000,
            frame_timeout_ms: 5_000,
            write_timeout_ms: 5_000,
            shutdown_grace_ms: 5_000,
        }
    }
}

impl Limits {
    pub fn validate(&self) -> Result<(), LimitError> {
        let check = |field: &'static str, value: u64, lo: u64, hi: u64, range: &'static str| {
            if value < lo || value > hi {
                return Err(LimitError { field, value, range });
            }
            Ok(())
        };
        check("frame_bytes_max", self.frame_bytes_max as u64, 64, 16 << 20, "64..=16777216")?;
        check("candidates_max", self.candidates_max as u64, 1, 8192, "1..=8192")?;
        check("context_len_max", self.context_len_max as u64, 0, 4096, "0..=4096")?;
        check("connections_per_shard_max", self.connections_per_shard_max as u64, 1, 1 << 20, "1..=1048576")?;
        check("connections_per_source_max", self.connections_per_source_max as u64, 1, 1 << 20, "1..=1048576")?;
        check("budget_us_default", u64::from(self.budget_us_default), 1, u64::from(u32::MAX), "1..")?;
        check(
            "budget_us_max",
            u64::from(self.budget_us_max),
            u64::from(self.budget_us_default),
            u64::from(u32::MAX),
            "budget_us_default..",
        )?;
        check("output_bytes_max", self.output_bytes_max as u64, 4096, 1 << 30, "4096..=1073741824")?;
        check("frames_per_round_max", self.frames_per_round_max as u64, 1, 1 << 16, "1..=65536")?;
        check("idle_timeout_ms", self.idle_timeout_ms, 1, 86_400_000, "1..=86400000")?;
        check("frame_timeout_ms", self.frame_timeout_ms, 1, 3_600_000, "1..=3600000")?;
        check("write_timeout_ms", self.write_timeout_ms, 1, 86_400_000, "1..=86400000")?;
        check("shutdown_grace_ms", self.shutdown_grace_ms, 0, 600_000, "0..=600000")?;
        Ok(())
    }
}
