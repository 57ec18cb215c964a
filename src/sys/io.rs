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

/// Drop the clean cached pages of `file` from the page cache (Linux
/// `posix_fadvise(POSIX_FADV_DONTNEED)` over the whole file), so that the next read comes
/// from the device. Dirty pages cannot be dropped: call `sync_data` first. Pages that a
/// live memory map has faulted in stay cached. A no-op elsewhere.
///
/// # Errors
/// The `errno` of a failed call.
pub(crate) fn drop_cached(file: &File) -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: `posix_fadvise` reads no memory of ours: it takes a file descriptor that
        // `file` keeps open for the call, an offset and length (0, 0 = the whole file) and
        // a flag. It only changes what the kernel caches; errors come back as the result.
        let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        if rc != 0 {
            return Err(std::io::Error::from_raw_os_error(rc));
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = file;
    Ok(())
}
