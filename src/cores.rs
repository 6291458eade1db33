//! Which cores run what: the cores this process may use, pinning the
//! calling thread to a set of them, and making it yield its core to every
//! other thread there (`SCHED_IDLE`).
//!
//! Shards own their cores (glommio pins them), the inference stage pins
//! itself to its own, and every other thread (admin, metrics collector,
//! Redis feed and flusher, model watcher) runs on the housekeeping cores, so
//! none of them can preempt a shard. Threads inherit the affinity of the
//! thread that spawns them: `main` pins itself to the housekeeping cores
//! before it starts any, and they all follow.

/// Cores in this process's affinity mask (what `taskset` allowed), in order.
pub fn allowed() -> Vec<usize> {
    // SAFETY: `set` is a plain bit array on the stack, initialised by
    // CPU_ZERO; sched_getaffinity(0, ..) only writes into it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_ZERO(&mut set);
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            let n = std::thread::available_parallelism().map_or(1, |n| n.get());
            return (0..n).collect();
        }
        (0..libc::CPU_SETSIZE as usize).filter(|&c| libc::CPU_ISSET(c, &set)).collect()
    }
}

/// The default housekeeping cores: the allowed ones no shard or stage uses.
/// Empty when there are none (the threads then stay unpinned).
pub fn spare(allowed: &[usize], busy: &[usize]) -> Vec<usize> {
    allowed.iter().copied().filter(|c| !busy.contains(c)).collect()
}

/// Pins the calling thread to `cores` (and the threads it spawns after).
pub fn pin_current_thread(cores: &[usize]) -> std::io::Result<()> {
    assert!(!cores.is_empty(), "pin to at least one core");
    if let Some(&c) = cores.iter().find(|&&c| c >= libc::CPU_SETSIZE as usize) {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("core {c} is out of range")));
    }
    // SAFETY: as in `allowed`; every core is below CPU_SETSIZE (checked
    // above), and sched_setaffinity(0, ..) affects only this thread.
    let ok = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_ZERO(&mut set);
        for &c in cores {
            libc::CPU_SET(c, &mut set);
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    };
    if ok {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// `SCHED_IDLE` was refused for the calling thread (a seccomp filter, a
/// kernel without it): it keeps the default policy.
#[derive(Debug, thiserror::Error)]
#[error("sched_setscheduler(SCHED_IDLE) was refused: {0}")]
pub struct IdleRefused(#[source] pub std::io::Error);

/// Makes the calling thread `SCHED_IDLE`: it runs only when no other
/// thread of its core is runnable, and any thread that wakes there
/// preempts it at once (the decision-log writer, which must never delay a
/// shard sharing its core). Needs no privilege: it only lowers.
pub fn make_current_thread_idle() -> Result<(), IdleRefused> {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: `param` is a valid `sched_param` for the call's duration;
    // pid 0 names the calling thread (a task of its own on Linux), so only
    // it changes.
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) } == 0 {
        Ok(())
    } else {
        Err(IdleRefused(std::io::Error::last_os_error()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spare_cores_are_the_unused_allowed_ones() {
        assert_eq!(spare(&[0, 1, 2, 3], &[0, 2]), vec![1, 3]);
        assert!(spare(&[0, 1], &[0, 1]).is_empty());
    }

    #[test]
    fn a_thread_pinned_stays_within_its_cores_and_its_children_inherit() {
        let allowed = allowed();
        assert!(!allowed.is_empty());
        let first = allowed[0];
        std::thread::spawn(move || {
            pin_current_thread(&[first]).unwrap();
            assert_eq!(super::allowed(), vec![first]);
            let child = std::thread::spawn(super::allowed).join().unwrap();
            assert_eq!(child, vec![first], "spawned threads inherit the mask");
        })
        .join()
        .unwrap();
        assert!(pin_current_thread(&[1 << 20]).is_err());
    }
}
