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

pub(super) fn weight(p: &Pair, parts: &[(QuantFormat, usize, usize, u64)]) -> R<(Weight, Weight)> {
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
    ring(p, rng)?;
    fp8_products(p, rng)?;
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

/// The decode products' rings (`qgemv_ring`, and FP8's over tiles and
/// steps): warps that take several rows (a wave's rows and a few more, and
/// two and a half waves), rows whose units are not a multiple of a warp's
/// 32 lanes (40: the last slot of a row half full; FP8: a last step of 512
/// partly past the row) or fewer than 32 (the ring crossing rows within one
/// depth), plain and gated, one and two rows of x; FP8 also behind a norm
/// and with three and eight rows of x.
fn ring(p: &mut Pair, rng: &mut Rng) -> R<()> {
    let wave = 8 * p.gpu.options.qgemv_blocks_per_sm.max(1) * p.gpu.dev.sms.max(1);
    for (i, f) in [
        QuantFormat::Q4K,
        QuantFormat::Q8_0,
        QuantFormat::Q6K,
        QuantFormat::Q4Z,
        QuantFormat::Q4_0,
        QuantFormat::Q3K,
        QuantFormat::FP8,
    ]
    .into_iter()
    .enumerate()
    {
        if !p.gpu.supports_weight(WeightKind::Blocks(f)) {
            continue;
        }
        // Units of 32, 64 (Q4_K, Q4_Z) or 128 (Q6_K, Q3_K) elements.
        let unit = match f {
            QuantFormat::Q6K | QuantFormat::Q3K | QuantFormat::FP8 => 128usize,
            QuantFormat::Q4K | QuantFormat::Q4Z => 64,
            _ => 32,
        };
        for (rows_out, units, gated) in [
            (wave + 3, 40, false),
            (5 * wave / 2, 40, true),
            (5 * wave / 2 + 1, 6, false),
            (7, 40, true),
        ] {
            let k: usize = (units * unit as usize).next_multiple_of(f.block_size());
            let rows = if gated { 2 * rows_out } else { rows_out };
            let (wg, wc) = weight(p, &[(f, rows, k, 300 + i as u64)])?;
            let fp8 = f == QuantFormat::FP8;
            let (ng, nc) = p.up(&[k], &rng.vec(k, 0.5))?;
            let ns: &[usize] = if fp8 { &[1, 2, 3, 8] } else { &[1, 2] };
            for &n in ns {
                // Activations of a few hundred (the FP8 kernel scales each row
                // of x into f16's range).
                let scale = if fp8 && n == 3 { 300.0 } else { 1.0 };
                let (xg, xc) = p.up(&[n, k], &rng.vec(n * k, scale))?;
                let (rg, rc) = p.up(&[n, rows_out], &rng.vec(n * rows_out, 1.0))?;
                let epi = |r| match gated {
                    true => Epilogue::gated(Activation::Silu).with_residual(r),
                    false => Epilogue::NONE.with_residual(r),
                };
                let norms: &[bool] = if fp8 { &[false, true] } else { &[false] };
                for &norm in norms {
                    let pro = |w| NormPrologue {
                        weight: w,
                        eps: 1e-6,
                        offset: 1.0,
                    };
                    let (pg, pc) = match norm {
                        true => (Some(pro(&ng)), Some(pro(&nc))),
                        false => (None, None),
                    };
                    let g = p.gpu.matmul(&xg, &wg, pg, epi(&rg)).map_err(e)?;
                    let c = p.cpu.matmul(&xc, &wc, pc, epi(&rc)).map_err(e)?;
                    let what = if gated { "gated" } else { "plain" };
                    let what = if norm {
                        format!("norm·{what}")
                    } else {
                        what.to_string()
                    };
                    p.compare(
                        format!("blocks {f} {what} {rows_out} rows k={k} n={n} (ring)"),
                        &g,
                        &c,
                        TOL,
                    )?;
                }
            }
        }
    }
    Ok(())
}

/// `x`'s first `rows` rows (of `k`) as `quant_e4m3_rows` rounds them: runs
/// of 128 as E4M3 codes (nearest, saturating) under amax / 448 (1 below
/// 448 times the least normal float), read back.
fn e4m3_rows(x: &[f32], k: usize, rows: usize) -> Vec<f32> {
    use kiln_quant::{dequant::e4m3_to_f32, quantize::f32_to_e4m3};
    let mut out = x.to_vec();
    for run in out[..rows * k].chunks_mut(128) {
        let amax = run.iter().fold(0f32, |a, v| a.max(v.abs()));
        let scale = if amax > 448.0 * f32::MIN_POSITIVE {
            amax / 448.0
        } else {
            1.0
        };
        let inv = 1.0 / scale;
        for v in run {
            *v = e4m3_to_f32(f32_to_e4m3(*v * inv)) * scale;
        }
    }
    out
}

/// FP8 products past the decode rows: on Hopper cuBLASLt's block-scaled
/// FP8 GEMM over activations quantized 1x128 on the device, checked
/// against the CPU on the same weights and on x rounded the same way (so
/// the check sees the product and the scale layouts, not the activations'
/// rounding; rows past the last multiple of 4 go through the exact decode
/// kernel and stay exact); elsewhere dequantized slabs against the exact x.
/// A three-part q/k/v, rows of x in and out of fours, a residual, a gate; a
/// part of rows not a multiple of 16, which stays on slabs (measured: a
/// 36-row part found no cuBLASLt algorithm on an H100).
fn fp8_products(p: &mut Pair, rng: &mut Rng) -> R<()> {
    use QuantFormat::FP8;
    if !p.gpu.supports_weight(WeightKind::Blocks(FP8)) {
        return Ok(());
    }
    let tensor_cores = p.gpu.fp8_tensor_cores();
    let k = 512;
    let (wg, wc) = weight(p, &[(FP8, 128, k, 21), (FP8, 32, k, 22), (FP8, 48, k, 23)])?;
    let (gg, gc) = weight(p, &[(FP8, 2 * 64, k, 24)])?;
    // Rows not a multiple of 16 stay on dequantized slabs: exact activations.
    let (og, oc) = weight(p, &[(FP8, 36, k, 25)])?;
    for n in [12usize, 13, 64, 131] {
        let x = rng.vec(n * k, 2.0);
        let rounded = if tensor_cores { n - n % 4 } else { 0 };
        let xg = p.gpu.upload(&[n, k], &x).map_err(e)?;
        let xc = p
            .cpu
            .upload(&[n, k], &e4m3_rows(&x, k, rounded))
            .map_err(e)?;
        let g = p.gpu.matmul(&xg, &wg, None, Epilogue::NONE).map_err(e)?;
        let c = p.cpu.matmul(&xc, &wc, None, Epilogue::NONE).map_err(e)?;
        p.compare(format!("fp8 product qkv n={n}"), &g, &c, TOL)?;
        let (rg, rc) = p.up(&[n, 208], &rng.vec(n * 208, 1.0))?;
        let res = |r| Epilogue::NONE.with_residual(r);
        let g = p.gpu.matmul(&xg, &wg, None, res(&rg)).map_err(e)?;
        let c = p.cpu.matmul(&xc, &wc, None, res(&rc)).map_err(e)?;
        p.compare(format!("fp8 product qkv+residual n={n}"), &g, &c, TOL)?;
        let gate = Epilogue::gated(Activation::Silu);
        let g = p.gpu.matmul(&xg, &gg, None, gate).map_err(e)?;
        let c = p.cpu.matmul(&xc, &gc, None, gate).map_err(e)?;
        p.compare(format!("fp8 product gated n={n}"), &g, &c, TOL)?;
        let xe = p.cpu.upload(&[n, k], &x).map_err(e)?;
        let g = p.gpu.matmul(&xg, &og, None, Epilogue::NONE).map_err(e)?;
        let c = p.cpu.matmul(&xe, &oc, None, Epilogue::NONE).map_err(e)?;
        p.compare(format!("fp8 product of 36 rows (slabs) n={n}"), &g, &c, TOL)?;
    }
    Ok(())
}
