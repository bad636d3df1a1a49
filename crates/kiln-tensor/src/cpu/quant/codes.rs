//! The buffer a packed matrix keeps its codes in.
//!
//! A decode step streams every weight once, 4 KiB page after 4 KiB page,
//! so each page costs a TLB miss. Large buffers are therefore anonymous
//! mappings whose 2 MiB-aligned interior is offered to Linux's transparent
//! huge pages (`MADV_HUGEPAGE`, which takes effect where
//! `/sys/kernel/mm/transparent_hugepage/enabled` is `always` or `madvise`):
//! measured on Zen 4, two threads reading 512 MiB went from 31–32.6 to
//! 35–36.5 GB/s. The tail past the last whole huge page keeps small pages
//! and the alignment slack in front is never touched, so the resident size
//! is the bytes used, as for a `Vec`.

use std::ops::{Deref, DerefMut};

const HUGE: usize = 2 << 20;

/// Zeroed bytes: a `Vec` when small, a huge-page-advised mapping when at
/// least two huge pages long.
pub(crate) enum Codes {
    Heap(Vec<u8>),
    Mapped {
        map: memmap2::MmapMut,
        off: usize,
        len: usize,
    },
}

impl Codes {
    pub fn zeroed(len: usize) -> Codes {
        if len >= 2 * HUGE {
            if let Ok(map) = memmap2::MmapMut::map_anon(len + HUGE) {
                let off = (map.as_ptr() as usize).next_multiple_of(HUGE) - map.as_ptr() as usize;
                let whole = len / HUGE * HUGE;
                #[cfg(target_os = "linux")]
                let _ = map.advise_range(memmap2::Advice::HugePage, off, whole);
                let _ = whole;
                return Codes::Mapped { map, off, len };
            }
        }
        Codes::Heap(vec![0; len])
    }
}

impl Deref for Codes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Codes::Heap(v) => v,
            Codes::Mapped { map, off, len } => &map[*off..*off + *len],
        }
    }
}

impl DerefMut for Codes {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            Codes::Heap(v) => v,
            Codes::Mapped { map, off, len } => &mut map[*off..*off + *len],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_zeroed_writable_and_as_long_as_asked() {
        for len in [0, 1000, 5 * HUGE + 123] {
            let mut c = Codes::zeroed(len);
            assert_eq!(c.len(), len);
            assert!(c.iter().all(|&b| b == 0));
            if len > 0 {
                c[len - 1] = 7;
                c[0] = 9;
                assert_eq!((c[0], c[len - 1]), (9, 7));
            }
            if len >= 2 * HUGE {
                assert!(matches!(c, Codes::Mapped { .. }));
                assert_eq!(
                    c.as_ptr() as usize % HUGE,
                    0,
                    "the codes start on a huge page"
                );
            }
        }
    }
}
