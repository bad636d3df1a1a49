//! Greedy sampling on the device: the argmax of every row of logits and
//! its log-probability, optionally under per-row token masks (an output
//! format's allowed ids), so only ids cross to the host.

use kiln_tensor::{DType, Result, Tensor};

use crate::driver::device::{dev_err, ptr, rows_cfg, Device};

/// `None` when the kernel is missing or the logits are not bf16 (the
/// caller samples on the host).
pub(crate) fn argmax_rows(
    dev: &Device,
    logits: &Tensor,
    masks: Option<&[Option<&[u32]>]>,
) -> Result<Option<Vec<(u32, f32)>>> {
    let (rows, vocab) = logits.dims2("argmax_rows")?;
    let name = if masks.is_some() {
        "argmax_logprob_masked_bf16"
    } else {
        "argmax_logprob_bf16"
    };
    if !dev.has(name) || logits.dtype() != DType::BF16 || masks.is_some_and(|m| m.len() != rows) {
        return Ok(None);
    }
    if rows == 0 {
        return Ok(Some(Vec::new()));
    }
    let ids = dev.alloc(rows, 4, "sampled ids")?;
    let lps = dev.alloc(rows, 4, "sampled logprobs")?;
    let (lp, v) = (ptr(logits, "argmax_rows")?, vocab as i32);
    let Some(masks) = masks else {
        // SAFETY: logits [rows, vocab]; ids and lps hold `rows` words.
        unsafe {
            dev.launch(dev.func(name)?)
                .arg(&lp)
                .arg(&v)
                .arg(&ids.ptr)
                .arg(&lps.ptr)
                .launch(rows_cfg(rows, 1024, 0))
                .map_err(dev_err)?;
        }
        return read(dev, ids.ptr, lps.ptr, rows);
    };
    // One mask per row; free rows allow every id.
    let words = vocab.div_ceil(32);
    let mut host = vec![u32::MAX; rows * words];
    for (r, m) in masks.iter().enumerate() {
        if let Some(m) = m {
            let dst = &mut host[r * words..(r + 1) * words];
            let n = m.len().min(words);
            dst[..n].copy_from_slice(&m[..n]);
            dst[n..].fill(0);
        }
    }
    let bits = dev.alloc(rows * words, 4, "sampling masks")?;
    dev.htod(bits.ptr, &host)?;
    let w = words as i32;
    // SAFETY: logits [rows, vocab]; masks [rows, words]; ids and lps hold `rows` words.
    unsafe {
        dev.launch(dev.func(name)?)
            .arg(&lp)
            .arg(&v)
            .arg(&ids.ptr)
            .arg(&lps.ptr)
            .arg(&bits.ptr)
            .arg(&w)
            .launch(rows_cfg(rows, 1024, 0))
            .map_err(dev_err)?;
    }
    read(dev, ids.ptr, lps.ptr, rows)
}

fn read(dev: &Device, ids: u64, lps: u64, rows: usize) -> Result<Option<Vec<(u32, f32)>>> {
    let ids = dev.dtoh::<u32>(ids, rows)?;
    let lps = dev.dtoh::<f32>(lps, rows)?;
    Ok(Some(ids.into_iter().zip(lps).collect()))
}
