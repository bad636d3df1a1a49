//! Row and column gathers (`gather.cu`): embedding lookups, the rows that
//! need logits, and column blocks of a packed projection.

use kiln_tensor::{Result, Tensor, TensorError};

use crate::backend::CudaBackend;
use crate::driver::device::{dev_err, elems_cfg, ptr, rows_cfg, wrap};

pub(crate) fn embedding(cuda: &CudaBackend, table: &Tensor, ids: &[u32]) -> Result<Tensor> {
    let (vocab, d) = table.dims2("embedding")?;
    if let Some(&bad) = ids.iter().find(|&&i| i as usize >= vocab) {
        return Err(TensorError::Shape {
            op: "embedding",
            detail: format!("token id {bad} outside vocabulary of {vocab}"),
        });
    }
    let out = cuda.alloc(ids.len() * d, "embeddings")?;
    if !ids.is_empty() {
        let dids = cuda.dev_u32(ids, |m| m.tok)?;
        let (t, di) = (ptr(table, "embedding")?, d as i32);
        // SAFETY: table [vocab, d], ids < vocab (checked), out [len, d].
        unsafe {
            cuda.dev
                .launch(cuda.dev.func("embedding_bf16")?)
                .arg(&t)
                .arg(&dids.ptr)
                .arg(&out.ptr)
                .arg(&di)
                .launch(rows_cfg(ids.len(), 256, 0))
                .map_err(dev_err)?;
        }
    }
    Ok(wrap(vec![ids.len(), d], out))
}

pub(crate) fn gather_rows(cuda: &CudaBackend, x: &Tensor, rows: &[u32]) -> Result<Tensor> {
    let (n, d) = x.dims2("gather_rows")?;
    if let Some(&r) = rows.iter().find(|&&r| r as usize >= n) {
        return Err(TensorError::Shape {
            op: "gather_rows",
            detail: format!("row {r} of {n}"),
        });
    }
    // Every row in order (decode steps): the rows themselves.
    if rows.len() == n && rows.iter().enumerate().all(|(i, &r)| r as usize == i) {
        return Ok(x.clone());
    }
    let out = cuda.alloc(rows.len() * d, "gathered rows")?;
    if !rows.is_empty() {
        let drows = cuda.dev_u32(rows, |m| m.logits)?;
        let (xp, di) = (ptr(x, "gather_rows")?, d as i32);
        // SAFETY: rows < n (checked); out [len, d].
        unsafe {
            cuda.dev
                .launch(cuda.dev.func("gather_rows_bf16")?)
                .arg(&xp)
                .arg(&drows.ptr)
                .arg(&out.ptr)
                .arg(&di)
                .launch(rows_cfg(rows.len(), 256, 0))
                .map_err(dev_err)?;
        }
    }
    Ok(wrap(vec![rows.len(), d], out))
}

pub(crate) fn split_cols(cuda: &CudaBackend, x: &Tensor, widths: &[usize]) -> Result<Vec<Tensor>> {
    let (n, d) = x.dims2("split_cols")?;
    if widths.iter().sum::<usize>() != d {
        return Err(TensorError::Shape {
            op: "split_cols",
            detail: format!("{widths:?} out of {d} columns"),
        });
    }
    let xp = ptr(x, "split_cols")?;
    let mut start = 0;
    let mut out = Vec::with_capacity(widths.len());
    for &w in widths {
        let part = cuda.alloc(n * w, "a column block")?;
        let (src, ss, wi, nl) = (xp + 2 * start as u64, d as i64, w as i32, n as i64);
        if n * w > 0 {
            // SAFETY: columns start..start + w of every row of x [n, d] into part [n, w].
            unsafe {
                cuda.dev
                    .launch(cuda.dev.func("copy_cols_bf16")?)
                    .arg(&src)
                    .arg(&ss)
                    .arg(&part.ptr)
                    .arg(&wi)
                    .arg(&nl)
                    .launch(elems_cfg(n * w))
                    .map_err(dev_err)?;
            }
        }
        out.push(wrap(vec![n, w], part));
        start += w;
    }
    Ok(out)
}
