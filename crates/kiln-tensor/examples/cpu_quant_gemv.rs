//! Decode-shaped products with block weights on the CPU: GB/s of weight
//! bytes streamed, against a plain read of the same bytes. A benchmark,
//! not a test: `cargo run --release -p kiln-tensor --example cpu_quant_gemv
//! -- [threads] [format] [rows] [cols] [n] [MiB]` (MiB: the blocks
//! in all, 64 by default to leave the caches; a small size measures the
//! kernel on cached weights).

use std::time::Instant;

use kiln_tensor::cpu::CpuBackend;
use kiln_tensor::prelude::*;
use kiln_tensor::{BlockWeight, Epilogue, QuantFormat, QuantMatrix, SharedBytes, Weight};

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let threads: usize = a.get(1).and_then(|s| s.parse().ok()).unwrap_or(2);
    let format: QuantFormat = a
        .get(2)
        .and_then(|s| QuantFormat::from_name(s))
        .unwrap_or(QuantFormat::Q4_1);
    let rows: usize = a.get(3).and_then(|s| s.parse().ok()).unwrap_or(3072);
    let cols: usize = a.get(4).and_then(|s| s.parse().ok()).unwrap_or(576);
    let n: usize = a.get(5).and_then(|s| s.parse().ok()).unwrap_or(1);
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()
        .unwrap();
    let be = CpuBackend::new();
    let mib: usize = a.get(6).and_then(|s| s.parse().ok()).unwrap_or(64);
    // Enough distinct matrices to leave the caches (~64 MiB of blocks).
    let one = format.row_bytes(cols).unwrap() * rows;
    let copies = (mib << 20) / one + 1;
    let ms: Vec<QuantMatrix> = (0..copies)
        .map(|s| {
            let blocks = kiln_quant::random_blocks(format, one / format.block_bytes(), s as u64);
            QuantMatrix::new(format, rows, cols, SharedBytes::from_vec(blocks)).unwrap()
        })
        .collect();
    // Storing them as the backend multiplies by them (the load-time cost).
    let t = Instant::now();
    let ws: Vec<Weight> = ms
        .into_iter()
        .map(|m| Weight::Blocks(BlockWeight::new(vec![be.upload_blocks(m).unwrap()]).unwrap()))
        .collect();
    let secs = t.elapsed().as_secs_f64();
    println!(
        "stored {} MB of blocks in {:.3} s ({:.0} MB/s)",
        (copies * one) >> 20,
        secs,
        (copies * one) as f64 / secs / 1e6
    );
    // The same bytes read plainly (summed as u64s, in parallel by matrix
    // rows split like the product), the ceiling for the product.
    let raw: Vec<Vec<u8>> = (0..copies)
        .map(|s| kiln_quant::random_blocks(format, one / format.block_bytes(), s as u64))
        .collect();
    for _ in 0..2 {
        use rayon::prelude::*;
        let t = Instant::now();
        let mut acc = 0u64;
        for _ in 0..20 {
            for r in &raw {
                acc = acc.wrapping_add(
                    r.par_chunks(16 << 10)
                        .map(|c| {
                            c.chunks_exact(64).fold(0u64, |a, l| {
                                let mut s = a;
                                for w in l.chunks_exact(8) {
                                    s = s.wrapping_add(u64::from_le_bytes(w.try_into().unwrap()));
                                }
                                s
                            })
                        })
                        .sum::<u64>(),
                );
            }
        }
        let s = t.elapsed().as_secs_f64();
        std::hint::black_box(acc);
        println!(
            "plain read: {:.2} GB/s",
            20.0 * (copies * one) as f64 / s / 1e9
        );
    }
    let x = be.upload(&[n, cols], &vec![0.5f32; n * cols]).unwrap();
    let reps = 20;
    // On a pool worker, as the CPU backend runs a model's steps.
    for _ in 0..2 {
        rayon::scope(|_| {
            let t = Instant::now();
            for _ in 0..reps {
                for w in &ws {
                    std::hint::black_box(be.matmul(&x, w, None, Epilogue::NONE).unwrap());
                }
            }
            let s = t.elapsed().as_secs_f64();
            let calls = (reps * copies) as f64;
            println!(
                "{format} {rows}x{cols} n={n} threads={threads}: {:.1} us/call, {:.2} GB/s",
                s / calls * 1e6,
                calls * one as f64 / s / 1e9
            );
        })
    }
}
