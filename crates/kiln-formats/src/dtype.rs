//! GGML tensor types as stored in GGUF files, with their block geometry.

/// A GGML storage type. Quantized types store `block_size` elements in
/// `type_size` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    IQ4NL,
    MXFP4,
    I8,
    I16,
    I32,
    I64,
    F64,
    BF16,
}

impl GgmlType {
    pub fn from_u32(v: u32) -> Option<Self> {
        use GgmlType::*;
        Some(match v {
            0 => F32,
            1 => F16,
            2 => Q4_0,
            3 => Q4_1,
            6 => Q5_0,
            7 => Q5_1,
            8 => Q8_0,
            9 => Q8_1,
            10 => Q2K,
            11 => Q3K,
            12 => Q4K,
            13 => Q5K,
            14 => Q6K,
            15 => Q8K,
            20 => IQ4NL,
            39 => MXFP4,
            24 => I8,
            25 => I16,
            26 => I32,
            27 => I64,
            28 => F64,
            30 => BF16,
            _ => return None,
        })
    }

    pub fn to_u32(self) -> u32 {
        use GgmlType::*;
        match self {
            F32 => 0,
            F16 => 1,
            Q4_0 => 2,
            Q4_1 => 3,
            Q5_0 => 6,
            Q5_1 => 7,
            Q8_0 => 8,
            Q8_1 => 9,
            Q2K => 10,
            Q3K => 11,
            Q4K => 12,
            Q5K => 13,
            Q6K => 14,
            Q8K => 15,
            IQ4NL => 20,
            MXFP4 => 39,
            I8 => 24,
            I16 => 25,
            I32 => 26,
            I64 => 27,
            F64 => 28,
            BF16 => 30,
        }
    }

    pub fn name(self) -> &'static str {
        use GgmlType::*;
        match self {
            F32 => "F32",
            F16 => "F16",
            Q4_0 => "Q4_0",
            Q4_1 => "Q4_1",
            Q5_0 => "Q5_0",
            Q5_1 => "Q5_1",
            Q8_0 => "Q8_0",
            Q8_1 => "Q8_1",
            Q2K => "Q2_K",
            Q3K => "Q3_K",
            Q4K => "Q4_K",
            Q5K => "Q5_K",
            Q6K => "Q6_K",
            Q8K => "Q8_K",
            IQ4NL => "IQ4_NL",
            MXFP4 => "MXFP4",
            I8 => "I8",
            I16 => "I16",
            I32 => "I32",
            I64 => "I64",
            F64 => "F64",
            BF16 => "BF16",
        }
    }

    /// Elements per block (1 for plain types).
    pub fn block_size(self) -> u64 {
        use GgmlType::*;
        match self {
            Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q8_1 | IQ4NL | MXFP4 => 32,
            Q2K | Q3K | Q4K | Q5K | Q6K | Q8K => 256,
            _ => 1,
        }
    }

    /// Bytes per block.
    pub fn type_size(self) -> u64 {
        use GgmlType::*;
        match self {
            F32 | I32 => 4,
            F16 | BF16 | I16 => 2,
            I8 => 1,
            I64 | F64 => 8,
            Q4_0 | IQ4NL => 18,
            MXFP4 => 17,
            Q4_1 => 20,
            Q5_0 => 22,
            Q5_1 => 24,
            Q8_0 => 34,
            Q8_1 => 36,
            Q2K => 84,
            Q3K => 110,
            Q4K => 144,
            Q5K => 176,
            Q6K => 210,
            Q8K => 292,
        }
    }

    /// The block format a weight of this type is stored in, for the types
    /// a backend can multiply by in place (`None` for F32, integer types
    /// and Q8_0's activation-only relatives Q8_1 / Q8_K).
    pub fn quant_format(self) -> Option<kiln_quant::QuantFormat> {
        use kiln_quant::QuantFormat as Q;
        use GgmlType::*;
        Some(match self {
            F16 => Q::F16,
            BF16 => Q::BF16,
            Q4_0 => Q::Q4_0,
            Q4_1 => Q::Q4_1,
            Q5_0 => Q::Q5_0,
            Q5_1 => Q::Q5_1,
            Q8_0 => Q::Q8_0,
            Q2K => Q::Q2K,
            Q3K => Q::Q3K,
            Q4K => Q::Q4K,
            Q5K => Q::Q5K,
            Q6K => Q::Q6K,
            IQ4NL => Q::IQ4NL,
            MXFP4 => Q::MXFP4,
            _ => return None,
        })
    }

    /// The GGUF type a block format is stored as (`None` for Kiln's own
    /// Q4_Z and FP8, which no GGUF file holds).
    pub fn from_quant_format(f: kiln_quant::QuantFormat) -> Option<Self> {
        use kiln_quant::QuantFormat as Q;
        Some(match f {
            Q::F16 => GgmlType::F16,
            Q::BF16 => GgmlType::BF16,
            Q::Q4_0 => GgmlType::Q4_0,
            Q::Q4_1 => GgmlType::Q4_1,
            Q::Q5_0 => GgmlType::Q5_0,
            Q::Q5_1 => GgmlType::Q5_1,
            Q::Q8_0 => GgmlType::Q8_0,
            Q::Q2K => GgmlType::Q2K,
            Q::Q3K => GgmlType::Q3K,
            Q::Q4K => GgmlType::Q4K,
            Q::Q5K => GgmlType::Q5K,
            Q::Q6K => GgmlType::Q6K,
            Q::IQ4NL => GgmlType::IQ4NL,
            Q::MXFP4 => GgmlType::MXFP4,
            Q::Q4Z | Q::Q4Z32 | Q::FP8 => return None,
        })
    }

    /// Bytes a tensor of GGUF dims `ne` occupies, or `None` when the rows do not
    /// split into whole blocks or the size overflows.
    pub fn bytes_for(self, ne: &[u64]) -> Option<u64> {
        let row = *ne.first()?;
        if row % self.block_size() != 0 {
            return None;
        }
        let n: u64 = ne.iter().try_fold(1u64, |a, &d| a.checked_mul(d))?;
        (n / self.block_size()).checked_mul(self.type_size())
    }
}
