//! Write-back hints for the writer.

use std::fs::File;

/// Ask the kernel to start writing `[offset, offset + len)` of `file` to the device now,
/// without waiting (Linux `sync_file_range(SYNC_FILE_RANGE_WRITE)`), so that the final
/// `fsync` finds most of the file already on its way: the disk works while the writer
/// computes checksums and copies the next chunk. A hint only: it guarantees nothing about
/// durability (the commit protocol's `fsync`s do), and failures are ignored. A no-op on
/// other systems.
pub(crate) fn start_writeback(file: &File, offset: u64, len: u64) {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        let (Ok(off), Ok(n)) = (i64::try_from(offset), i64::try_from(len)) else {
            return;
        };
        // SAFETY: `sync_file_range` reads no memory of ours; it takes a file descriptor
        // that `file` keeps open for the duration of the call, two integers and a flag,
        // and only schedules I/O on pages of that file. Any failure (EBADF, EINVAL, EIO)
        // is reported through the return value, which we ignore: this is a hint.
        let _ =
            unsafe { libc::sync_file_range(file.as_raw_fd(), off, n, libc::SYNC_FILE_RANGE_WRITE) };
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (file, offset, len);
}
