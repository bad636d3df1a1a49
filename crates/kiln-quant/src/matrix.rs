//! [`QuantMatrix`]: a matrix's rows in one [`QuantFormat`], over
//! [`SharedBytes`] (a memory-mapped file's range or an owned buffer), as a
//! weight source hands it to a backend without converting it.

use std::ops::Range;
use std::sync::Arc;

use crate::QuantFormat;

/// Read-only bytes kept alive by their owner: a range of a memory-mapped
/// file (the weights are read in place) or a buffer of their own.
#[derive(Clone)]
pub struct SharedBytes {
    owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
    range: Range<usize>,
    /// The read-only file mapping the bytes lie in, when they do.
    map: Option<Arc<memmap2::Mmap>>,
}

impl SharedBytes {
    /// `range` of `owner`'s bytes, or `None` when it is out of bounds.
    pub fn new(owner: Arc<dyn AsRef<[u8]> + Send + Sync>, range: Range<usize>) -> Option<Self> {
        let len = (*owner).as_ref().len();
        (range.start <= range.end && range.end <= len).then_some(SharedBytes {
            owner,
            range,
            map: None,
        })
    }

    /// `range` of a read-only file mapping (whose pages [`Self::release_pages`]
    /// may drop), or `None` when it is out of bounds.
    pub fn mapped(map: Arc<memmap2::Mmap>, range: Range<usize>) -> Option<Self> {
        let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = map.clone();
        let mut s = Self::new(owner, range)?;
        s.map = Some(map);
        Some(s)
    }

    /// Tells the kernel this process no longer needs the mapped pages that
    /// lie wholly inside the bytes (after a backend copied them into a form
    /// of its own), so they leave its resident set; reading them again
    /// faults them back in from the file. Bytes of their own are kept.
    pub fn release_pages(&self) {
        let Some(map) = &self.map else { return };
        const PAGE: usize = 4096;
        let base = map.as_ptr() as usize;
        let start = (base + self.range.start).next_multiple_of(PAGE) - base;
        let end = (base + self.range.end) / PAGE * PAGE;
        if end > base + start {
            // SAFETY: the mapping is read-only and file-backed, so dropping
            // its pages loses nothing: a later read faults the file's bytes
            // back in. The range lies inside the mapping.
            let _ = unsafe {
                map.unchecked_advise_range(
                    memmap2::UncheckedAdvice::DontNeed,
                    start,
                    end - base - start,
                )
            };
        }
    }

    /// Bytes of their own.
    pub fn from_vec(bytes: Vec<u8>) -> Self {
        let range = 0..bytes.len();
        SharedBytes {
            owner: Arc::new(bytes),
            range,
            map: None,
        }
    }

    pub fn as_slice(&self) -> &[u8] {
        &(*self.owner).as_ref()[self.range.clone()]
    }

    pub fn len(&self) -> usize {
        self.range.len()
    }

    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }
}

impl std::fmt::Debug for SharedBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SharedBytes({} bytes)", self.len())
    }
}

/// A `[rows, cols]` matrix stored row by row in `format`: each row is
/// `cols / block_size` whole blocks.
#[derive(Debug, Clone)]
pub struct QuantMatrix {
    format: QuantFormat,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    bytes: SharedBytes,
}

impl QuantMatrix {
    /// The matrix over `bytes`, or an error saying why they cannot hold it.
    pub fn new(
        format: QuantFormat,
        rows: usize,
        cols: usize,
        bytes: SharedBytes,
    ) -> Result<Self, String> {
        let row_bytes = format.row_bytes(cols).ok_or_else(|| {
            format!(
                "{format}: a row of {cols} elements is not a whole number of {}-element blocks",
                format.block_size()
            )
        })?;
        if rows.checked_mul(row_bytes) != Some(bytes.len()) {
            return Err(format!(
                "{format}: {} bytes do not hold {rows} rows of {cols}",
                bytes.len()
            ));
        }
        Ok(QuantMatrix {
            format,
            rows,
            cols,
            row_bytes,
            bytes,
        })
    }

    pub fn format(&self) -> QuantFormat {
        self.format
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// Bytes of the whole matrix.
    pub fn num_bytes(&self) -> usize {
        self.bytes.len()
    }

    /// The stored bytes of rows `rows`.
    pub fn rows_bytes(&self, rows: Range<usize>) -> &[u8] {
        &self.bytes.as_slice()[rows.start * self.row_bytes..rows.end * self.row_bytes]
    }

    /// See [`SharedBytes::release_pages`].
    pub fn release_pages(&self) {
        self.bytes.release_pages();
    }

    /// Row `r`'s reference values (see [`crate::dequant`]) into `out`
    /// (`cols` long).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let f = crate::dequant::block_fn(self.format);
        let (bs, ts) = (self.format.block_size(), self.format.block_bytes());
        for (o, b) in out
            .chunks_exact_mut(bs)
            .zip(self.rows_bytes(r..r + 1).chunks_exact(ts))
        {
            f(b, o);
        }
    }

    /// Every element's reference value, row-major.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        crate::dequant::dequantize_into(self.format, self.bytes.as_slice(), &mut out)
            .expect("sizes were checked when the matrix was made; this is a bug");
        out
    }
}
