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

/// Swap the two existing entries `a` and `b` (files or directories) in one atomic step
/// (Linux `renameat2(RENAME_EXCHANGE)`): every observer, and every state the file system
/// can recover to, sees either both old entries or both swapped.
///
/// # Errors
/// `ErrorKind::Unsupported` where the system or the file system has no such call (other
/// systems, `ENOSYS`, `EINVAL` from a file system without it); otherwise the call's `errno`
/// (`NotFound` when either entry is missing, `EXDEV` across file systems, ...).
pub(crate) fn rename_exchange(a: &std::path::Path, b: &std::path::Path) -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        use std::ffi::CString;
        use std::io::{Error, ErrorKind};
        use std::os::unix::ffi::OsStrExt;
        let c = |p: &std::path::Path| {
            CString::new(p.as_os_str().as_bytes())
                .map_err(|_| Error::new(ErrorKind::InvalidInput, "path holds a NUL byte"))
        };
        let (ca, cb) = (c(a)?, c(b)?);
        // SAFETY: `renameat2` reads the two NUL-terminated strings, which `ca` and `cb` own
        // and keep alive for the duration of the call; it writes no memory of ours. Relative
        // paths resolve against the working directory (`AT_FDCWD`), as `std::fs::rename`'s
        // do. Failures come back as -1 with `errno`, which we read at once.
        let rc = unsafe {
            libc::renameat2(
                libc::AT_FDCWD,
                ca.as_ptr(),
                libc::AT_FDCWD,
                cb.as_ptr(),
                libc::RENAME_EXCHANGE,
            )
        };
        if rc == 0 {
            return Ok(());
        }
        let e = Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::ENOSYS) | Some(libc::EINVAL) | Some(libc::EOPNOTSUPP) => {
                Err(Error::new(ErrorKind::Unsupported, e))
            }
            _ => Err(e),
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (a, b);
        Err(std::io::Error::from(std::io::ErrorKind::Unsupported))
    }
}
