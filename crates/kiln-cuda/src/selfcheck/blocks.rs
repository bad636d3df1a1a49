//! Block-quantized weights (`ops/matmul/blocks`): every GGUF format the
//! GPU keeps as stored, multiplied at decode batch sizes (the in-register
//! GEMV) and past them (dequantized slabs through cuBLAS), with a fused
//! residual, with a norm prologue and a gated epilogue over a packed
//! weight whose parts differ in format (Q4_K_M's q/k and v), and looked up
//! as an embedding table — each against the CPU backend on the same
//! blocks.

use kiln_tensor::prelude::*;
use kiln_tensor::{
    Activation, BlockWeight, Epilogue, NormPrologue, QuantFormat, QuantMatrix, SharedBytes, Weight,
    WeightKind,
};

use super::{e, Pair, Rng, R, TOL};

fn weight(p: &Pair, parts: &[(QuantFormat, usize, usize, u64)]) -> R<(Weight, Weight)> {
    let mut g = Vec::new();
    let mut c = Vec::new();
    for &(f, rows, cols, seed) in parts {
        let bytes = kiln_quant::random_blocks(f, rows * cols / f.block_size(), seed);
        let m = || QuantMatrix::new(f, rows, cols, SharedBytes::from_vec(bytes.clone()));
        g.push(p.gpu.upload_blocks(m()?).map_err(e)?);
        c.push(p.cpu.upload_blocks(m()?).map_err(e)?);
    }
    Ok((
        Weight::Blocks(BlockWeight::new(g).map_err(e)?),
        Weight::Blocks(BlockWeight::new(c).map_err(e)?),
    ))
}

pub(super) fn block_ops(p: &mut Pair, rng: &mut Rng) -> R<()> {
    for (i, f) in QuantFormat::ALL.into_iter().enumerate() {
        if !p.gpu.supports_weight(WeightKind::Blocks(f)) {
            continue;
        }
        let k = match f.block_size() {
            256 => 768,
            128 => 384,
            _ => 160,
        };
        let rows = 77;
        let (wg, wc) = weight(p, &[(f, rows, k, 100 + i as u64)])?;
        for n in [1usize, 2, 5, 8, 13] {
            let (xg, xc) = p.up(&[n, k], &rng.vec(n * k, 1.0))?;
            let g = p.gpu.matmul(&xg, &wg, None, Epilogue::NONE).map_err(e)?;
            let c = p.cpu.matmul(&xc, &wc, None, Epilogue::NONE).map_err(e)?;
            p.compare(format!("blocks {f} n={n} k={k} m={rows}"), &g, &c, TOL)?;
            let (rg, rc) = p.up(&[n, rows], &rng.vec(n * rows, 1.0))?;
            let g = p
                .gpu
                .matmul(&xg, &wg, None, Epilogue::NONE.with_residual(&rg))
                .map_err(e)?;
            let c = p
                .cpu
                .matmul(&xc, &wc, None, Epilogue::NONE.with_residual(&rc))
                .map_err(e)?;
            p.compare(format!("blocks {f} +residual n={n}"), &g, &c, TOL)?;
        }
        let ids = [0u32, rows as u32 - 1, 5, 5, 40];
        let g = p.gpu.embedding(&wg, &ids).map_err(e)?;
        let c = p.cpu.embedding(&wc, &ids).map_err(e)?;
        p.compare(format!("blocks {f} embedding"), &g, &c, TOL)?;
    }
    rows_a_warp(p, rng)?;
    // A packed gate/up weight of two formats behind a Gemma-style norm, and a
    // bias on a three-part q/k/v.
    let q4k = WeightKind::Blocks(QuantFormat::Q4K);
    let q6k = WeightKind::Blocks(QuantFormat::Q6K);
    if p.gpu.supports_weight(q4k) && p.gpu.supports_weight(q6k) {
        let k = 512;
        let (wg, wc) = weight(
            p,
            &[(QuantFormat::Q4K, 96, k, 7), (QuantFormat::Q6K, 96, k, 8)],
        )?;
        let (ng, nc) = p.up(&[k], &rng.vec(k, 0.5))?;
        for n in [1usize, 3, 11] {
            let (xg, xc) = p.up(&[n, k], &rng.vec(n * k, 2.0))?;
            let (rg, rc) = p.up(&[n, 96], &rng.vec(n * 96, 1.0))?;
            let pro = |w| NormPrologue {
                weight: w,
                eps: 1e-6,
                offset: 1.0,
            };
            let g = p
                .gpu
                .matmul(
                    &xg,
                    &wg,
                    Some(pro(&ng)),
                    Epilogue::gated(Activation::GeluTanh).with_residual(&rg),
                )
                .map_err(e)?;
            let c = p
                .cpu
                .matmul(
                    &xc,
                    &wc,
                    Some(pro(&nc)),
                    Epilogue::gated(Activation::GeluTanh).with_residual(&rc),
                )
                .map_err(e)?;
            p.compare(
                format!("blocks q4_k+q6_k norm·gated+residual n={n}"),
                &g,
                &c,
                TOL,
            )?;
        }
        let (wg, wc) = weight(
            p,
            &[
                (QuantFormat::Q4K, 64, k, 9),
                (QuantFormat::Q4K, 16, k, 10),
                (QuantFormat::Q6K, 16, k, 11),
            ],
        )?;
        let (bg, bc) = p.up(&[96], &rng.vec(96, 0.5))?;
        for n in [1usize, 9] {
            let (xg, xc) = p.up(&[n, k], &rng.vec(n * k, 1.0))?;
            let g = p
                .gpu
                .matmul(&xg, &wg, None, Epilogue::bias(Some(&bg)))
                .map_err(e)?;
            let c = p
                .cpu
                .matmul(&xc, &wc, None, Epilogue::bias(Some(&bc)))
                .map_err(e)?;
            p.compare(format!("blocks q4_k·q4_k·q6_k qkv+bias n={n}"), &g, &c, TOL)?;
        }
    }
    Ok(())
}

/// The kernels that take 2 output rows a warp (`blocks.rs`'s
/// `rows_per_warp` picks them where one row a warp would not launch in one
/// wave): row counts just past that boundary and twice it, a few rows past a
/// whole warp's (a warp's second row out of range), plain and gated (one
/// gate row a warp still), one and two rows of x.
fn rows_a_warp(p: &mut Pair, rng: &mut Rng) -> R<()> {
    let wave = 8 * 2 * p.gpu.dev.sms.max(1);
    let k = 256;
    for (i, f) in [
        QuantFormat::Q4K,
        QuantFormat::Q8_0,
        QuantFormat::Q6K,
        QuantFormat::Q4Z,
    ]
    .into_iter()
    .enumerate()
    {
        if !p.gpu.supports_weight(WeightKind::Blocks(f)) {
            continue;
        }
        for (rows_out, gated) in [(wave + 3, false), (2 * wave + 3, false), (wave + 3, true)] {
            let rows = if gated { 2 * rows_out } else { rows_out };
            let (wg, wc) = weight(p, &[(f, rows, k, 300 + i as u64)])?;
            for n in [1usize, 2] {
                let (xg, xc) = p.up(&[n, k], &rng.vec(n * k, 1.0))?;
                let (rg, rc) = p.up(&[n, rows_out], &rng.vec(n * rows_out, 1.0))?;
                let epi = |r| match gated {
                    true => Epilogue::gated(Activation::Silu).with_residual(r),
                    false => Epilogue::NONE.with_residual(r),
                };
                let g = p.gpu.matmul(&xg, &wg, None, epi(&rg)).map_err(e)?;
                let c = p.cpu.matmul(&xc, &wc, None, epi(&rc)).map_err(e)?;
                let what = if gated { "gated" } else { "plain" };
                p.compare(
                    format!("blocks {f} {what} {rows_out} rows n={n} (rows a warp)"),
                    &g,
                    &c,
                    TOL,
                )?;
            }
        }
    }
    Ok(())
}
