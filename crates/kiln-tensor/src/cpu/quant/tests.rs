use kiln_quant::{random_blocks, QuantFormat, QuantMatrix, SharedBytes};

use super::*;
use crate::cpu::matmul::{self as dense, TileFn};

fn matrix(format: QuantFormat, rows: usize, cols: usize, seed: u64) -> QuantMatrix {
    let blocks = rows * cols / format.block_size();
    let bytes = SharedBytes::from_vec(random_blocks(format, blocks, seed));
    QuantMatrix::new(format, rows, cols, bytes).expect("sizes fit")
}

fn pseudo(len: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2654435761).wrapping_add(1);
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s % 2000) as f32 / 1000.0 - 1.0
        })
        .collect()
}

/// Every (tile, row dequantizer) pair this CPU runs for `format`.
fn paths(format: QuantFormat) -> Vec<(String, TileFn, RowFn)> {
    let mut v: Vec<(String, TileFn, RowFn)> = Vec::new();
    for (tname, tile) in dense::tile_paths() {
        v.push((format!("{tname}+reference"), tile, reference_row));
        #[cfg(target_arch = "x86_64")]
        if let Some(row) = avx2::row_fn(format) {
            v.push((format!("{tname}+avx2"), tile, row));
        }
    }
    v
}

/// A width that is a whole number of blocks and, where blocks allow it,
/// not a multiple of 256.
fn width(format: QuantFormat, blocks: usize) -> usize {
    format.block_size() * blocks + if format.block_size() == 1 { 3 } else { 0 }
}

/// The formats kept as stored (the raw path).
const RAW: [QuantFormat; 3] = [QuantFormat::F16, QuantFormat::BF16, QuantFormat::FP8];

#[test]
fn vectorized_rows_are_the_reference_values_bit_for_bit() {
    for format in RAW {
        let cols = width(format, 9);
        let m = matrix(format, 5, cols, 11);
        let mut want = vec![0f32; cols];
        let mut got = vec![0f32; cols];
        for (name, _, row) in paths(format) {
            for r in 0..5 {
                m.dequantize_row(r, &mut want);
                row(&m, r, &mut got);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        g.to_bits() == w.to_bits(),
                        "{format} {name} row {r} element {i}: {g} vs {w}"
                    );
                }
            }
        }
    }
}

#[test]
fn products_are_the_dense_product_of_the_dequantized_matrix() {
    for format in RAW {
        for &(n, blocks, m) in &[(1, 3, 37), (3, 7, 9), (5, 1, 64), (17, 2, 75), (64, 4, 130)] {
            let k = width(format, blocks);
            let w = matrix(format, m, k, (n * 1000 + m) as u64);
            let wf = w.dequantize();
            let x = pseudo(n * k, (n + m) as u32);
            for (name, tile, row) in paths(format) {
                let want = dense::matmul_t_with(tile, &x, n, k, &wf, m);
                let mut got = vec![f32::NAN; n * m];
                // SAFETY: `got` holds n × m outputs, row stride m.
                unsafe { matmul_with(tile, row, &x, n, &w, got.as_mut_ptr(), m) };
                assert!(
                    got.iter()
                        .zip(&want)
                        .all(|(g, e)| g.to_bits() == e.to_bits()),
                    "{format} {name} {n}x{k}x{m}: not the dense product"
                );
            }
        }
    }
}

#[test]
fn each_row_is_bit_identical_alone_or_batched() {
    for format in RAW {
        let (n, m) = (9, 70);
        let k = width(format, 5);
        let w = matrix(format, m, k, 3);
        let x = pseudo(n * k, 4);
        let mut batched = vec![0f32; n * m];
        // SAFETY: n × m outputs, row stride m.
        unsafe { matmul(&x, n, &w, batched.as_mut_ptr(), m) };
        for i in 0..n {
            let mut alone = vec![0f32; m];
            // SAFETY: one row of m outputs.
            unsafe { matmul(&x[i * k..(i + 1) * k], 1, &w, alone.as_mut_ptr(), m) };
            assert!(
                alone == batched[i * m..(i + 1) * m],
                "{format}: row {i} differs alone vs batched"
            );
        }
    }
}

#[test]
fn products_write_only_their_columns_of_a_wider_output() {
    // A part of a stacked weight writes its columns of the full row and
    // leaves the others alone.
    let (n, k, m, stride, offset) = (3, 64, 10, 25, 7);
    let w = matrix(QuantFormat::F16, m, k, 9);
    let x = pseudo(n * k, 1);
    let mut out = vec![-1f32; n * stride];
    // SAFETY: columns offset..offset + m of n rows of `stride`.
    unsafe { matmul(&x, n, &w, out.as_mut_ptr().add(offset), stride) };
    let want = dense::matmul_t(&x, n, k, &w.dequantize(), m);
    for i in 0..n {
        for j in 0..stride {
            let v = out[i * stride + j];
            if (offset..offset + m).contains(&j) {
                assert_eq!(v, want[i * m + j - offset]);
            } else {
                assert_eq!(v, -1.0, "column {j} of row {i} was written");
            }
        }
    }
}

#[test]
fn lookups_dequantize_the_rows_asked_for() {
    let w = matrix(QuantFormat::BF16, 7, 512, 2);
    let full = w.dequantize();
    let mut out = vec![42.0];
    assert_eq!(lookup(&w, &[6, 0, 6], &mut out), None);
    assert_eq!(out[0], 42.0);
    for (i, id) in [6usize, 0, 6].into_iter().enumerate() {
        assert_eq!(
            &out[1 + i * 512..1 + (i + 1) * 512],
            &full[id * 512..(id + 1) * 512]
        );
    }
    assert_eq!(lookup(&w, &[1, 7], &mut out), Some(7));
}

/// The formats [`packed`] repacks.
fn packed_formats() -> Vec<QuantFormat> {
    QuantFormat::ALL
        .into_iter()
        .filter(|&f| packed::Scheme::of(f).is_some())
        .collect()
}

#[test]
fn packed_rows_are_the_reference_values_bit_for_bit() {
    let formats = packed_formats();
    assert_eq!(formats.len(), 14);
    for format in formats {
        let k = width(format, 9);
        let m = matrix(format, 37, k, 21);
        let p = packed::pack(&m).expect("a packed format");
        assert_eq!(p.num_bytes(), packed_bytes(format, 37, k).unwrap());
        let (mut want, mut got) = (vec![0f32; k], vec![0f32; k]);
        for r in 0..37 {
            m.dequantize_row(r, &mut want);
            p.dequantize_row(r, &mut got);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    g.to_bits() == w.to_bits(),
                    "{format} row {r} element {i}: {g} vs {w}"
                );
            }
        }
        // Lookups read the same rows, and name an id past the table.
        let stored = Stored::Packed(p);
        let mut out = vec![7.0];
        assert_eq!(stored.lookup(&[36, 0], &mut out), None);
        m.dequantize_row(36, &mut want);
        assert_eq!(&out[1..1 + k], &want[..]);
        assert_eq!(stored.lookup(&[2, 37], &mut out), Some(37));
    }
}

/// `x · wᵀ` of the dequantized matrix in f64, and for each output a
/// bound on an f32 evaluation's rounding: `4·k·ε` times the sum of the
/// magnitudes of the products, plus the same for the offsets' share
/// (`max|w|·Σ|x|`), which the factored order sums separately.
fn f64_product(x: &[f32], n: usize, w: &[f32], m: usize, k: usize) -> (Vec<f64>, Vec<f64>) {
    let (mut want, mut tol) = (vec![0f64; n * m], vec![0f64; n * m]);
    let eps = 4.0 * k as f64 * f32::EPSILON as f64;
    for i in 0..n {
        let xr = &x[i * k..(i + 1) * k];
        let sx: f64 = xr.iter().map(|v| v.abs() as f64).sum();
        for j in 0..m {
            let wr = &w[j * k..(j + 1) * k];
            let wmax = wr.iter().fold(0f64, |a, v| a.max(v.abs() as f64));
            want[i * m + j] = xr.iter().zip(wr).map(|(a, b)| *a as f64 * *b as f64).sum();
            let mag: f64 = xr
                .iter()
                .zip(wr)
                .map(|(a, b)| (*a as f64 * *b as f64).abs())
                .sum();
            tol[i * m + j] = eps * (mag + wmax * sx) + 1e-30;
        }
    }
    (want, tol)
}

/// [`f64_product`]'s bound widened by the activations' representation in
/// the packed products ([`limbs`]): each element within half a step of at
/// most `2^-21` of its sub-block's largest magnitude, so an output moves
/// by at most `Σ |w_i| · amax_j · 2^-22` (the offsets' share likewise).
fn packed_bound(
    x: &[f32],
    n: usize,
    w: &[f32],
    m: usize,
    k: usize,
    s: usize,
) -> (Vec<f64>, Vec<f64>) {
    let (want, mut tol) = f64_product(x, n, w, m, k);
    for i in 0..n {
        let xr = &x[i * k..(i + 1) * k];
        for r in 0..m {
            let wr = &w[r * k..(r + 1) * k];
            let wmax = wr.iter().fold(0f64, |a, v| a.max(v.abs() as f64));
            let mut extra = 0f64;
            for (xs, ws) in xr.chunks_exact(s).zip(wr.chunks_exact(s)) {
                let amax = xs.iter().fold(0f64, |a, v| a.max(v.abs() as f64));
                let wsum: f64 = ws.iter().map(|v| v.abs() as f64).sum();
                extra += (wsum + wmax * s as f64) * amax * 2f64.powi(-22);
            }
            tol[i * m + r] += extra;
        }
    }
    (want, tol)
}

#[test]
fn packed_products_are_within_rounding_of_the_exact_product() {
    for format in packed_formats() {
        for &(n, blocks, m) in &[(1, 3, 37), (2, 9, 16), (3, 7, 9), (9, 1, 64), (17, 2, 75)] {
            let k = width(format, blocks);
            let w = matrix(format, m, k, (n * 1000 + m) as u64);
            let p = packed::pack(&w).unwrap();
            let x = pseudo(n * k, (n + m) as u32);
            let (want, tol) = packed_bound(&x, n, &w.dequantize(), m, k, p.scheme.sub);
            let mut got = vec![f32::NAN; n * m];
            // SAFETY: n × m outputs, row stride m.
            unsafe { packed_matmul(&p, &x, n, got.as_mut_ptr(), m) };
            for (i, ((g, e), t)) in got.iter().zip(&want).zip(&tol).enumerate() {
                assert!(
                    (*g as f64 - e).abs() <= *t,
                    "{format} {n}x{k}x{m} output {i}: {g} vs {e} (bound {t})"
                );
            }
        }
    }
}

#[test]
fn packed_rows_are_bit_identical_alone_batched_and_portable() {
    for format in packed_formats() {
        let (n, m) = (21, 53);
        let k = width(format, 10);
        let w = matrix(format, m, k, 5);
        let p = packed::pack(&w).unwrap();
        let mut x = pseudo(n * k, 8);
        // Rows at the edges of the activations' representation: one large
        // element among small ones, a largest element just under a power
        // of two (the exponent's bump), tiny values, and every limb at its
        // extremes (±8355711 steps).
        x[3 * k + 5] = 1.0e4;
        x[5 * k + 2] = -1.999_999_9;
        for v in &mut x[7 * k..8 * k] {
            *v *= 1e-30;
        }
        for (i, v) in x[9 * k..10 * k].iter_mut().enumerate() {
            let top = 8_355_711.0 / 4_194_304.0;
            *v = if i % 3 == 0 { -top } else { top };
        }
        let run_on = |isa: Isa, rows: std::ops::Range<usize>| {
            let mut out = vec![f32::NAN; rows.len() * m];
            let x = &x[rows.start * k..rows.end * k];
            // SAFETY: rows.len() × m outputs, row stride m; `isa` runs here.
            unsafe {
                packed_matmul_on(
                    isa,
                    &[(&p, 0)],
                    x,
                    rows.len(),
                    out.as_mut_ptr(),
                    m,
                    CpuMatmul::Exact,
                )
            };
            out
        };
        let run = |rows| run_on(Isa::best(), rows);
        let all = run(0..n);
        for isa in Isa::available() {
            assert!(
                run_on(isa, 0..n)
                    .iter()
                    .zip(&all)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{format}: the batch on {isa:?} differs from {:?}",
                Isa::best()
            );
        }
        for i in 0..n {
            let xr = &x[i * k..(i + 1) * k];
            let mut portable = vec![f32::NAN; m];
            p.gemv_portable(
                0..p.groups,
                &Limbs::new(xr, 1, k, p.scheme.sub),
                0,
                &mut portable,
            );
            let want = &all[i * m..(i + 1) * m];
            let mut pairs = vec![("alone", run(i..i + 1)), ("portable", portable)];
            for isa in Isa::available() {
                pairs.push(("alone on another ISA", run_on(isa, i..i + 1)));
            }
            for (how, len) in [("in a pair", 2), ("in three", 3)] {
                if i + len <= n {
                    pairs.push((how, run(i..i + len)[..m].to_vec()));
                }
            }
            for (how, got) in pairs {
                for j in 0..m {
                    assert!(
                        got[j].to_bits() == want[j].to_bits(),
                        "{format} row {i} output {j} {how}: {} vs {} batched",
                        got[j],
                        want[j]
                    );
                }
            }
        }
    }
}

#[test]
fn stacked_parts_write_their_own_columns_each_as_alone() {
    // q/k/v-like parts in different formats (two packed, one kept raw),
    // into columns 3.. of a wider output, for decode and batch sizes.
    let k = 512;
    let parts: Vec<Stored> = [
        (QuantFormat::Q4K, 40),
        (QuantFormat::Q6K, 17),
        (QuantFormat::BF16, 9),
    ]
    .into_iter()
    .enumerate()
    .map(|(i, (f, rows))| Stored::new(matrix(f, rows, k, 40 + i as u64)))
    .collect();
    let refs: Vec<&Stored> = parts.iter().collect();
    let width = 3 + 40 + 17 + 9 + 2;
    for n in [1, 2, 5] {
        let x = pseudo(n * k, n as u32);
        let mut out = vec![-1f32; n * width];
        // SAFETY: n rows of `width`, the parts' 66 columns from column 3.
        unsafe {
            matmul_stacked(
                &refs,
                &x,
                n,
                out.as_mut_ptr().add(3),
                width,
                CpuMatmul::Exact,
            )
        };
        let mut col = 3;
        for part in &parts {
            let rows = part.rows();
            let mut alone = vec![0f32; n * rows];
            // SAFETY: n × rows outputs, row stride rows.
            unsafe { matmul_stacked(&[part], &x, n, alone.as_mut_ptr(), rows, CpuMatmul::Exact) };
            for i in 0..n {
                assert_eq!(
                    &out[i * width + col..i * width + col + rows],
                    &alone[i * rows..(i + 1) * rows]
                );
            }
            col += rows;
        }
        for i in 0..n {
            let row = &out[i * width..(i + 1) * width];
            assert!(row[..3].iter().chain(&row[width - 2..]).all(|&v| v == -1.0));
        }
    }
}

#[test]
fn a_matrix_of_no_rows_writes_nothing() {
    let w = Stored::new(matrix(QuantFormat::Q4K, 0, 256, 1));
    for n in [1, 5] {
        let x = pseudo(n * 256, 2);
        let mut out = vec![-1f32; n];
        // SAFETY: no columns are written; `out` is n rows of one.
        unsafe { matmul_stacked(&[&w], &x, n, out.as_mut_ptr(), 1, CpuMatmul::Exact) };
        assert!(out.iter().all(|&v| v == -1.0));
    }
}

/// `--cpu-matmul fast` (each kernel this CPU has: AMX, AVX512-BF16): a
/// batched product is the f32-summed product of the bf16-rounded weights
/// and activations (to f32 rounding, and one bf16 step on a weight where
/// its two roundings can tie differently), so within 2 · 2⁻⁹ of Σ|w·x| of
/// the exact product; the mode runs the best kernel; decode rows are the
/// exact path's bits. Where the CPU has no such kernel the fast mode is the
/// exact one, bit for bit.
#[test]
fn fast_products_are_the_product_in_bf16() {
    let to_bf16 = |v: f32| half::bf16::from_f32(v).to_f32();
    for format in packed_formats() {
        for &(n, blocks, m) in &[(3, 7, 9), (9, 2, 64), (17, 3, 75), (40, 1, 33), (70, 1, 20)] {
            let k = width(format, blocks);
            let w = matrix(format, m, k, (n * 77 + m) as u64);
            let p = packed::pack(&w).unwrap();
            let x = pseudo(n * k, (n + 3 * m) as u32);
            let run = |mode, rows: usize| {
                let mut out = vec![f32::NAN; rows * m];
                // SAFETY: rows × m outputs, row stride m; the best ISA runs here.
                unsafe {
                    packed_matmul_on(
                        Isa::best(),
                        &[(&p, 0)],
                        &x[..rows * k],
                        rows,
                        out.as_mut_ptr(),
                        m,
                        mode,
                    )
                };
                out
            };
            let (fast, exact) = (run(CpuMatmul::Fast, n), run(CpuMatmul::Exact, n));
            if !CpuMatmul::fast_available() {
                assert!(fast
                    .iter()
                    .zip(&exact)
                    .all(|(a, b)| a.to_bits() == b.to_bits()));
                continue;
            }
            let on = |kernel| {
                let mut out = vec![f32::NAN; n * m];
                // SAFETY: n × m outputs, row stride m; the kernel runs here.
                unsafe { fast_matmul(kernel, &[(&p, 0)], &x[..n * k], n, out.as_mut_ptr(), m) };
                out
            };
            let best = on(FastKernel::best().unwrap());
            assert!(
                fast.iter()
                    .zip(&best)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{format}: the mode runs the best kernel"
            );
            for kernel in FastKernel::available() {
                let fast = on(kernel);
                let wd = w.dequantize();
                let wb: Vec<f32> = wd.iter().map(|&v| to_bf16(v)).collect();
                let xb: Vec<f32> = x[..n * k].iter().map(|&v| to_bf16(v)).collect();
                let (want_b, tol_b) = f64_product(&xb, n, &wb, m, k);
                let (want, _) = f64_product(&x[..n * k], n, &wd, m, k);
                for i in 0..n * m {
                    let (r, j) = (i / m, i % m);
                    let terms = (0..k).map(|e| (x[r * k + e] as f64 * wd[j * k + e] as f64).abs());
                    let (mag, big) = terms.fold((0f64, 0f64), |(s, b), t| (s + t, b.max(t)));
                    let g = fast[i] as f64;
                    assert!(
                        (g - want_b[i]).abs() <= tol_b[i] + big * 2f64.powi(-8),
                        "{format} {n}x{k}x{m} output {i}: {g} vs the bf16 product {}",
                        want_b[i]
                    );
                    assert!(
                        (g - want[i]).abs() <= mag * 2f64.powi(-8) + tol_b[i],
                        "{format} {n}x{k}x{m} output {i}: {g} vs the exact {}",
                        want[i]
                    );
                }
                assert!(fast != exact, "{format} {kernel:?}: the fast path ran");
            }
            // Decode rows (fewer than FAST_MIN_ROWS) keep the exact path's bits.
            let (f2, e2) = (run(CpuMatmul::Fast, 2), run(CpuMatmul::Exact, 2));
            assert!(f2.iter().zip(&e2).all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }
}

#[test]
fn packed_products_of_activations_that_are_not_finite_are_nan() {
    // As an f32 product: a NaN or an infinity in x makes every output it
    // reaches NaN (an infinity times codes of both signs has no sum), on
    // every path, alone and batched.
    for format in packed_formats() {
        let (n, m) = (4, 19);
        let k = width(format, 2);
        let w = matrix(format, m, k, 12);
        let p = packed::pack(&w).unwrap();
        let mut x = pseudo(n * k, 6);
        x[k + 3] = f32::NAN;
        x[2 * k + k - 1] = f32::INFINITY;
        for isa in Isa::available() {
            for rows in [1, n] {
                let mut out = vec![0f32; rows * m];
                // SAFETY: rows × m outputs, row stride m; `isa` runs here.
                unsafe {
                    packed_matmul_on(
                        isa,
                        &[(&p, 0)],
                        &x[..rows * k],
                        rows,
                        out.as_mut_ptr(),
                        m,
                        CpuMatmul::Exact,
                    )
                };
                for (i, v) in out.iter().enumerate() {
                    let bad_row = matches!(i / m, 1 | 2);
                    assert_eq!(v.is_nan(), bad_row, "{format} {isa:?} output {i}: {v}");
                }
            }
        }
    }
}

/// MXFP4 whose scales an f16 holds is packed; one whose scales it does not
/// is kept as bf16 (exact for MXFP4's values), whose product is the dense
/// product of the reference values bit for bit; the packed product (exact
/// integer sums in its own order) is within f32 rounding of the f64 one,
/// and each row's is the same alone and in a batch.
#[test]
fn mxfp4_is_packed_or_kept_as_bf16_and_multiplies_exactly() {
    let (rows, k) = (19, 96);
    for big in [false, true] {
        let mut bytes = random_blocks(QuantFormat::MXFP4, rows * k / 32, 5);
        if big {
            bytes[17 * 7] = 200; // a block scaled by 2^72
        }
        let m =
            QuantMatrix::new(QuantFormat::MXFP4, rows, k, SharedBytes::from_vec(bytes)).unwrap();
        let reference = m.dequantize();
        let w = Stored::new(m);
        assert_eq!(matches!(w, Stored::Packed(_)), !big);
        let mut first_row = None;
        for n in [1, 4] {
            let x = pseudo(n * k, 3);
            let mut out = vec![0f32; n * rows];
            // SAFETY: n rows of `rows` columns.
            unsafe { matmul_stacked(&[&w], &x, n, out.as_mut_ptr(), rows, CpuMatmul::Exact) };
            let want = dense::matmul_t(&x, n, k, &reference, rows);
            if big {
                assert_eq!(out, want, "{n} rows");
            }
            for i in 0..n {
                for j in 0..rows {
                    let exact: f64 = (0..k)
                        .map(|t| x[i * k + t] as f64 * reference[j * k + t] as f64)
                        .sum();
                    let mag: f64 = (0..k)
                        .map(|t| (x[i * k + t] as f64 * reference[j * k + t] as f64).abs())
                        .sum();
                    let got = out[i * rows + j] as f64;
                    assert!(
                        (got - exact).abs() <= 1e-6 * mag + 1e-30,
                        "{got} vs {exact}"
                    );
                }
            }
            let row0 = out[..rows].to_vec();
            assert_eq!(
                *first_row.get_or_insert(row0.clone()),
                row0,
                "row 0 alone vs batched"
            );
        }
    }
}
