//! Resident-memory readings from /proc/self/status, for tests that bound peak RSS.
#![allow(dead_code)]

/// A /proc/self/status field (`"VmRSS:"`, `"VmHWM:"`) in bytes.
pub fn status(key: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = s.lines().find(|l| l.starts_with(key)).unwrap();
    line.split_whitespace()
        .nth(1)
        .unwrap()
        .parse::<u64>()
        .unwrap()
        * 1024
}
