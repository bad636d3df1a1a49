//! Dequantization of GGUF tensor bytes to f32: F32 as it is, every block
//! format through kiln-quant's reference formulas (checked against the
//! `gguf` Python package's numpy dequantizers in the tests).

use crate::dtype::GgmlType;

/// Dequantize `n` elements of type `ty` from `bytes`. The caller guarantees
/// `bytes` has exactly the size `ty` needs for `n` elements; the error string
/// names an unsupported type.
pub fn dequantize(ty: GgmlType, bytes: &[u8], n: usize) -> Result<Vec<f32>, String> {
    let mut out = vec![0f32; n];
    dequantize_into(ty, bytes, &mut out)?;
    Ok(out)
}

/// Dequantize into `out`, whose length gives the element count.
pub fn dequantize_into(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<(), String> {
    if ty == GgmlType::F32 {
        if bytes.len() != out.len() * 4 {
            return Err(format!(
                "F32: {} bytes do not hold {} elements",
                bytes.len(),
                out.len()
            ));
        }
        for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
            *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
        return Ok(());
    }
    let format = ty.quant_format().ok_or_else(|| ty.name().to_string())?;
    kiln_quant::dequant::dequantize_into(format, bytes, out)
}
