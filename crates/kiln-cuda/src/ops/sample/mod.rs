//! Sampling on the device (`sample.cu`): bias, penalties, masks,
//! temperature, top-k, top-p, min-p and the draw with the host's uniform
//! number, so only ids and the requested log-probabilities cross to the
//! host. The semantics are the host sampler's (kiln-sampling's `sampler`
//! module documentation), drawing in its *device order*; `reference.rs`
//! holds the host reference and `check.rs` the GPU check.

pub(crate) mod check;
mod reference;

use kiln_tensor::{DType, Result, SampleRow, SampledRow, Tensor, TensorError};

use crate::driver::device::{dev_err, ptr, rows_cfg, Device};

/// Header words per row (`sample.cu`'s `HDR`).
const HDR: usize = 16;
/// Result words per row (`sample.cu`'s `OUT`).
const OUT: usize = 44;
/// The most top alternatives a row may ask for (`sample.cu`'s `MAX_TOP`).
pub(crate) const MAX_TOP: u32 = 20;
/// No mask (`sample.cu`'s `NONE`).
const NO_MASK: u32 = u32::MAX;

/// `None` when the kernel is missing or the logits are not bf16 (the
/// caller samples on the host).
pub(crate) fn sample_rows(
    dev: &Device,
    logits: &Tensor,
    rows: &[SampleRow<'_>],
) -> Result<Option<Vec<Option<SampledRow>>>> {
    let (num_rows, vocab) = logits.dims2("sample_rows")?;
    if !dev.has("sample_bf16") || logits.dtype() != DType::BF16 || vocab > i32::MAX as usize {
        return Ok(None);
    }
    if rows.len() != num_rows {
        return Err(TensorError::Shape {
            op: "sample_rows",
            detail: format!("{} sampling rows for {num_rows} rows of logits", rows.len()),
        });
    }
    if num_rows == 0 {
        return Ok(Some(Vec::new()));
    }
    let meta = pack(rows, vocab)?;
    let meta_buf = dev.alloc(meta.len(), 4, "sampling parameters")?;
    dev.htod(meta_buf.ptr, &meta)?;
    let scratch = dev.alloc(num_rows * vocab, 4, "sampling scratch")?;
    let out = dev.alloc(num_rows * OUT, 4, "sampled tokens")?;
    let (lp, v) = (ptr(logits, "sample_rows")?, vocab as i32);
    // SAFETY: logits [rows, vocab] bf16; scratch [rows, vocab] f32; meta as
    // `pack` lays it out (every offset inside it); out [rows, OUT] words.
    unsafe {
        dev.launch(dev.func("sample_bf16")?)
            .arg(&lp)
            .arg(&v)
            .arg(&scratch.ptr)
            .arg(&meta_buf.ptr)
            .arg(&out.ptr)
            .launch(rows_cfg(num_rows, 1024, 0))
            .map_err(dev_err)?;
    }
    let words = dev.dtoh::<u32>(out.ptr, num_rows * OUT)?;
    Ok(Some(unpack(&words, num_rows)))
}

/// The kernel's parameter words: one header per row, then each row's bias
/// pairs, penalty pairs and mask words, at the offsets its header names.
pub(crate) fn pack(rows: &[SampleRow<'_>], vocab: usize) -> Result<Vec<u32>> {
    let words = vocab.div_ceil(32);
    let lists: usize = rows
        .iter()
        .map(|r| 2 * r.logit_bias.len() + 2 * r.penalties.len() + r.mask.map_or(0, |_| words))
        .sum();
    let len = rows.len() * HDR + lists;
    if u32::try_from(len).is_err() {
        return Err(TensorError::Shape {
            op: "sample_rows",
            detail: format!("{len} words of sampling parameters"),
        });
    }
    let mut meta = vec![0u32; rows.len() * HDR];
    meta.reserve(lists);
    for (r, row) in rows.iter().enumerate() {
        let bias_off = meta.len() as u32;
        for &(token, bias) in row.logit_bias {
            meta.extend([token, bias.to_bits()]);
        }
        let pen_off = meta.len() as u32;
        for &(token, count, in_prompt) in row.penalties {
            meta.extend([token, count.min(0x7fff_ffff) | (u32::from(in_prompt) << 31)]);
        }
        let mask_off = match row.mask {
            Some(m) => {
                let off = meta.len() as u32;
                let n = m.len().min(words);
                meta.extend_from_slice(&m[..n]);
                meta.resize(meta.len() + words - n, 0);
                off
            }
            None => NO_MASK,
        };
        let u = row.u.to_bits();
        let header = [
            row.temperature.to_bits(),
            row.top_k,
            row.top_p.to_bits(),
            row.min_p.to_bits(),
            u as u32,
            (u >> 32) as u32,
            row.repetition_penalty.to_bits(),
            row.frequency_penalty.to_bits(),
            row.presence_penalty.to_bits(),
            bias_off,
            row.logit_bias.len() as u32,
            pen_off,
            row.penalties.len() as u32,
            mask_off,
            row.top_logprobs.min(MAX_TOP),
            0,
        ];
        meta[r * HDR..(r + 1) * HDR].copy_from_slice(&header);
    }
    Ok(meta)
}

/// The rows' results from the kernel's output words.
fn unpack(words: &[u32], num_rows: usize) -> Vec<Option<SampledRow>> {
    words
        .chunks_exact(OUT)
        .take(num_rows)
        .map(|o| {
            if o[0] != 0 {
                return None;
            }
            let num_top = (o[3] as usize).min(MAX_TOP as usize);
            let top = o[4..4 + 2 * num_top]
                .chunks_exact(2)
                .map(|p| (p[0], f32::from_bits(p[1])))
                .collect();
            Some(SampledRow {
                token: o[1],
                logprob: f32::from_bits(o[2]),
                top,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_pack_into_headers_and_lists_at_their_offsets() {
        let bias = [(3, -100.0), (7, 0.5)];
        let penalties = [(2, 1, true), (5, 0, true)];
        let mask = [0b1010u32];
        let rows = [
            SampleRow {
                temperature: 0.7,
                top_k: 5,
                u: 0.25,
                logit_bias: &bias,
                repetition_penalty: 1.3,
                penalties: &penalties,
                top_logprobs: 99,
                ..SampleRow::GREEDY
            },
            SampleRow {
                mask: Some(&mask),
                ..SampleRow::GREEDY
            },
        ];
        let meta = pack(&rows, 40).expect("packs");
        let (a, b) = (&meta[..HDR], &meta[HDR..2 * HDR]);
        assert_eq!(f32::from_bits(a[0]), 0.7);
        assert_eq!(a[1], 5);
        assert_eq!(
            f64::from_bits(u64::from(a[4]) | u64::from(a[5]) << 32),
            0.25
        );
        assert_eq!(a[14], MAX_TOP, "top logprobs are capped");
        let bias_at = a[9] as usize;
        assert_eq!(a[10], 2);
        assert_eq!(
            meta[bias_at..bias_at + 4],
            [3, (-100f32).to_bits(), 7, 0.5f32.to_bits()]
        );
        let pen_at = a[11] as usize;
        assert_eq!(meta[pen_at..pen_at + 4], [2, 1 | 1 << 31, 5, 1 << 31]);
        assert_eq!(a[13], NO_MASK);
        // Two mask words for 40 ids: the missing one forbids.
        let mask_at = b[13] as usize;
        assert_eq!(meta[mask_at..], [0b1010, 0]);
        assert_eq!(meta.len(), 2 * HDR + 8 + 2);
    }

    #[test]
    fn results_unpack_with_failures_as_none() {
        let mut words = vec![0u32; 2 * OUT];
        words[..6].copy_from_slice(&[0, 9, (-0.5f32).to_bits(), 1, 4, (-1f32).to_bits()]);
        words[OUT] = 1;
        let rows = unpack(&words, 2);
        assert_eq!(
            rows,
            [
                Some(SampledRow {
                    token: 9,
                    logprob: -0.5,
                    top: vec![(4, -1.0)],
                }),
                None
            ]
        );
    }
}
