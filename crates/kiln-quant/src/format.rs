//! [`QuantFormat`]: a weight storage format as its bytes are laid out, and
//! its block geometry.

/// How a weight matrix's rows are stored: runs of `block_size` elements in
/// `block_bytes` bytes each (GGML's block layouts), or plain 16-bit floats
/// (blocks of one element). A row of a matrix in a format is a whole number
/// of blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuantFormat {
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    IQ4NL,
    /// OCP microscaling FP4: 32 e2m1 values under one power-of-two scale
    /// (an e8m0 byte), gpt-oss's expert format.
    MXFP4,
    /// Kiln's own (no GGUF type): 128 unsigned 4-bit codes with an integer
    /// zero point and an f16 scale, `w = d · (q − z)` — AWQ's and GPTQ's
    /// asymmetric int4 groups of 128 (or any multiple), repacked at load.
    /// Block: f16 `d`, the zero point `z` (a byte's low 5 bits), a zero byte, then
    /// four runs of 16 bytes as Q4_0's (byte `16 c + j`: element `32 c + j`
    /// in its low nibble, `32 c + j + 16` in its high one).
    Q4Z,
    /// Q4_Z's groups of 32 (AWQ's and GPTQ's groups of 32 or 64): 32 codes,
    /// f16 `d`, the zero point byte, a zero byte, then Q4_0's 16 bytes.
    Q4Z32,
    /// Kiln's own (no GGUF type): FP8 E4M3 weights (the OCP `e4m3fn`
    /// encoding: no infinities, `0x7F`/`0xFF` NaN, largest 448) in runs of
    /// 128 of a row under an f32 scale, `w = s · e4m3(q)`: FP8 checkpoints'
    /// per-tensor, per-channel and 128×128 block scales all repacked to
    /// it, and `--quantize fp8`. Block: the f32 scale (little-endian), then
    /// the 128 E4M3 bytes in element order.
    FP8,
}

impl QuantFormat {
    pub const ALL: [QuantFormat; 17] = [
        QuantFormat::F16,
        QuantFormat::BF16,
        QuantFormat::Q4_0,
        QuantFormat::Q4_1,
        QuantFormat::Q5_0,
        QuantFormat::Q5_1,
        QuantFormat::Q8_0,
        QuantFormat::Q2K,
        QuantFormat::Q3K,
        QuantFormat::Q4K,
        QuantFormat::Q5K,
        QuantFormat::Q6K,
        QuantFormat::IQ4NL,
        QuantFormat::MXFP4,
        QuantFormat::Q4Z,
        QuantFormat::Q4Z32,
        QuantFormat::FP8,
    ];

    /// The name GGML and llama.cpp use (`Q4_K`, `IQ4_NL`, `BF16`).
    pub fn name(self) -> &'static str {
        use QuantFormat::*;
        match self {
            F16 => "F16",
            BF16 => "BF16",
            Q4_0 => "Q4_0",
            Q4_1 => "Q4_1",
            Q5_0 => "Q5_0",
            Q5_1 => "Q5_1",
            Q8_0 => "Q8_0",
            Q2K => "Q2_K",
            Q3K => "Q3_K",
            Q4K => "Q4_K",
            Q5K => "Q5_K",
            Q6K => "Q6_K",
            IQ4NL => "IQ4_NL",
            MXFP4 => "MXFP4",
            Q4Z => "Q4_Z",
            Q4Z32 => "Q4_Z32",
            FP8 => "FP8",
        }
    }

    /// The format named `name` (case-insensitive, `q4_k` or `Q4_K`).
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|f| f.name().eq_ignore_ascii_case(name))
    }

    /// Elements per block.
    pub fn block_size(self) -> usize {
        use QuantFormat::*;
        match self {
            F16 | BF16 => 1,
            Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | IQ4NL | MXFP4 | Q4Z32 => 32,
            Q4Z | FP8 => 128,
            Q2K | Q3K | Q4K | Q5K | Q6K => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        use QuantFormat::*;
        match self {
            F16 | BF16 => 2,
            Q4_0 | IQ4NL => 18,
            MXFP4 => 17,
            Q4_1 | Q4Z32 => 20,
            Q5_0 => 22,
            Q5_1 => 24,
            Q8_0 => 34,
            Q2K => 84,
            Q3K => 110,
            Q4K => 144,
            Q5K => 176,
            Q6K => 210,
            Q4Z => 68,
            FP8 => 132,
        }
    }

    /// Bytes of one row of `cols` elements, or `None` when `cols` is not a
    /// whole number of blocks.
    pub fn row_bytes(self, cols: usize) -> Option<usize> {
        if cols % self.block_size() != 0 {
            return None;
        }
        (cols / self.block_size()).checked_mul(self.block_bytes())
    }

    /// Bits a weight costs, scales included.
    pub fn bits_per_weight(self) -> f64 {
        (self.block_bytes() * 8) as f64 / self.block_size() as f64
    }
}

impl std::fmt::Display for QuantFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_rows_are_whole_blocks() {
        for f in QuantFormat::ALL {
            assert_eq!(QuantFormat::from_name(f.name()), Some(f));
            assert_eq!(QuantFormat::from_name(&f.name().to_lowercase()), Some(f));
            assert_eq!(f.row_bytes(f.block_size() * 3), Some(f.block_bytes() * 3));
        }
        assert_eq!(QuantFormat::Q4K.row_bytes(128), None);
        assert_eq!(QuantFormat::Q4_0.row_bytes(33), None);
        assert_eq!(QuantFormat::from_name("q9_9"), None);
        assert_eq!(QuantFormat::Q4K.bits_per_weight(), 4.5);
        assert_eq!(QuantFormat::Q4Z.bits_per_weight(), 4.25);
        assert_eq!(QuantFormat::Q4Z32.bits_per_weight(), 5.0);
        assert_eq!(QuantFormat::FP8.bits_per_weight(), 8.25);
    }
}
