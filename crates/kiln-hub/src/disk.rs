//! Free space on the filesystem that holds a path.

use std::path::Path;

/// Bytes available to this user on the filesystem holding `path`, or `None`
/// where that cannot be asked (then the check is skipped).
pub(crate) fn free_bytes(path: &Path) -> Option<u64> {
    imp::free_bytes(path)
}

#[cfg(unix)]
mod imp {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    use std::path::Path;

    pub(super) fn free_bytes(path: &Path) -> Option<u64> {
        let c = CString::new(path.as_os_str().as_bytes()).ok()?;
        let mut st = std::mem::MaybeUninit::<libc::statvfs>::zeroed();
        // SAFETY: `c` is a NUL-terminated path and `st` is a writable statvfs
        // that the call fills on success; it is read only then.
        let rc = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
        if rc != 0 {
            return None;
        }
        // SAFETY: statvfs returned 0, so it initialised `st`.
        let st = unsafe { st.assume_init() };
        #[allow(clippy::unnecessary_cast)] // the field types differ between platforms
        Some((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
    }
}

#[cfg(not(unix))]
mod imp {
    pub(super) fn free_bytes(_path: &std::path::Path) -> Option<u64> {
        None
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn reports_space_where_the_os_can_say() {
        let dir = std::env::temp_dir();
        if cfg!(unix) {
            assert!(super::free_bytes(&dir).is_some_and(|n| n > 0));
            assert!(super::free_bytes(&dir.join("no/such/dir")).is_none());
        }
    }
}
