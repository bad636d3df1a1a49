//! Runs every kernel of `elementwise.cu` on the GPU against a CPU reference
//! (f32 math on the same bf16 inputs) and prints one JSON line per op with
//! the relative error ‖gpu − ref‖ / ‖ref‖. Run on a machine with a GPU:
//!
//!     cargo run --release -p kiln-cuda --example op_check -- [PTX_FILE]
//!
//! Without PTX_FILE the kernels are compiled with NVRTC there (NVRTC must
//! load); with it, PTX compiled elsewhere is loaded. `--emit-ptx PATH`
//! compiles the PTX on a machine without a GPU (NVRTC from `$KILN_CUDA_HOME`).

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use half::bf16;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<bf16> {
        (0..n)
            .map(|_| bf16::from_f32(self.next() * scale))
            .collect()
    }
}

fn rel_err(gpu: &[bf16], want: &[f32]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (g, w) in gpu.iter().zip(want) {
        let d = g.to_f32() as f64 - *w as f64;
        num += d * d;
        den += (*w as f64) * (*w as f64);
    }
    if gpu.iter().any(|g| !g.to_f32().is_finite()) {
        return f64::INFINITY;
    }
    (num / den.max(1e-30)).sqrt()
}

fn f(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

fn report(op: &str, err: f64, tol: f64) -> bool {
    let pass = err <= tol;
    println!(
        "{{\"op\": \"{op}\", \"rel_err\": {err:.3e}, \"tolerance\": {tol:.0e}, \"pass\": {pass}}}"
    );
    pass
}

type R<T> = Result<T, Box<dyn std::error::Error>>;

fn up<T: cudarc::driver::DeviceRepr>(s: &Arc<CudaStream>, v: &[T]) -> R<CudaSlice<T>> {
    Ok(s.clone_htod(v)?)
}

fn main() -> R<()> {
    // `--emit-ptx PATH`: compile here (NVRTC and headers from $KILN_CUDA_HOME) and write the PTX.
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--emit-ptx") {
        let home = std::path::PathBuf::from(std::env::var("KILN_CUDA_HOME")?);
        let inc = home.join("nvidia/cu13/include");
        let c = kiln_cuda::KernelCompiler {
            arch: "compute_90",
            include_paths: vec![inc.clone(), inc.join("cccl")],
            cache_dir: None,
            defines: String::new(),
        };
        let k = c.compile("elementwise", kiln_cuda::kernels::SOURCES[0].1)?;
        std::fs::write(args.get(2).ok_or("--emit-ptx needs a path")?, k.ptx)?;
        return Ok(());
    }
    let ptx = match std::env::args().nth(1) {
        Some(path) => Ptx::from_src(std::fs::read_to_string(path)?),
        None => {
            let c = kiln_cuda::KernelCompiler {
                arch: "compute_90",
                include_paths: Vec::new(),
                cache_dir: None,
                defines: String::new(),
            };
            Ptx::from_src(
                c.compile("elementwise", kiln_cuda::kernels::SOURCES[0].1)?
                    .ptx,
            )
        }
    };
    let ctx = CudaContext::new(0)?;
    let s = ctx.default_stream();
    let m = ctx.load_module(ptx)?;
    let mut rng = Rng(0x9E3779B97F4A7C15);
    let mut all = true;
    let (n, d) = (37usize, 896usize); // odd token count, Qwen-sized rows

    // Fused residual add + RMSNorm.
    let x = rng.vec(n * d, 1.0);
    let res = rng.vec(n * d, 1.0);
    let w = rng.vec(d, 1.0);
    let (dx, mut dres, dw) = (up(&s, &x)?, up(&s, &res)?, up(&s, &w)?);
    let mut dout = s.alloc_zeros::<bf16>(n * d)?;
    let func = m.load_function("add_rms_norm_bf16")?;
    let cfg = LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let (di, eps, off) = (d as i32, 1e-6f32, 0f32);
    unsafe {
        s.launch_builder(&func)
            .arg(&dx)
            .arg(&mut dres)
            .arg(&dw)
            .arg(&mut dout)
            .arg(&di)
            .arg(&eps)
            .arg(&off)
            .launch(cfg)?;
    }
    let (out, res_out) = (s.clone_dtoh(&dout)?, s.clone_dtoh(&dres)?);
    let mut want = vec![0f32; n * d];
    let mut want_res = vec![0f32; n * d];
    for r in 0..n {
        let sum: Vec<f32> = (0..d)
            .map(|i| bf16::from_f32(x[r * d + i].to_f32() + res[r * d + i].to_f32()).to_f32())
            .collect();
        let ss: f32 = sum.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let inv = 1.0 / (ss + eps).sqrt();
        for i in 0..d {
            want_res[r * d + i] = sum[i];
            want[r * d + i] = sum[i] * inv * w[i].to_f32();
        }
    }
    all &= report(
        "add_rms_norm_bf16.residual",
        rel_err(&res_out, &want_res),
        1e-6,
    );
    all &= report("add_rms_norm_bf16", rel_err(&out, &want), 8e-3);

    // Gated activations.
    let nn = n * 4864;
    let (g, u) = (rng.vec(nn, 3.0), rng.vec(nn, 1.0));
    let (dg, du) = (up(&s, &g)?, up(&s, &u)?);
    let func = m.load_function("gated_act_bf16")?;
    for (act, name) in [(0i32, "silu"), (1, "gelu_tanh")] {
        let mut dout = s.alloc_zeros::<bf16>(nn)?;
        let nl = nn as i64;
        let cfg = LaunchConfig {
            grid_dim: (1024, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        unsafe {
            s.launch_builder(&func)
                .arg(&dg)
                .arg(&du)
                .arg(&mut dout)
                .arg(&nl)
                .arg(&act)
                .launch(cfg)?;
        }
        let out = s.clone_dtoh(&dout)?;
        let want: Vec<f32> = f(&g)
            .iter()
            .zip(f(&u))
            .map(|(&gv, uv)| {
                let a = if act == 0 {
                    gv / (1.0 + (-gv).exp())
                } else {
                    0.5 * gv * (1.0 + (0.797_884_6 * (gv + 0.044715 * gv * gv * gv)).tanh())
                };
                a * uv
            })
            .collect();
        all &= report(
            &format!("gated_act_bf16.{name}"),
            rel_err(&out, &want),
            8e-3,
        );
    }

    // RoPE (rotate-half) at scattered positions.
    let (heads, hd) = (14usize, 64usize);
    let half = hd / 2;
    let xr = rng.vec(n * heads * hd, 1.0);
    let positions: Vec<u32> = (0..n as u32).map(|i| i * 97 % 4099).collect();
    let inv_freq: Vec<f32> = (0..half)
        .map(|i| 1.0 / 1e6f32.powf((2 * i) as f32 / hd as f32))
        .collect();
    let mut dxr = up(&s, &xr)?;
    let (dpos, dfreq) = (up(&s, &positions)?, up(&s, &inv_freq)?);
    let func = m.load_function("rope_bf16")?;
    let (hi, hdi, halfi, scale) = (heads as i32, hd as i32, half as i32, 1f32);
    let cfg = LaunchConfig {
        grid_dim: (n as u32, heads as u32, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: 0,
    };
    unsafe {
        s.launch_builder(&func)
            .arg(&mut dxr)
            .arg(&dpos)
            .arg(&dfreq)
            .arg(&hi)
            .arg(&hdi)
            .arg(&halfi)
            .arg(&scale)
            .launch(cfg)?;
    }
    let out = s.clone_dtoh(&dxr)?;
    let mut want = f(&xr);
    for t in 0..n {
        for h in 0..heads {
            let b = (t * heads + h) * hd;
            for i in 0..half {
                let (sn, cs) = (inv_freq[i] * positions[t] as f32).sin_cos();
                let (a, bb) = (xr[b + i].to_f32(), xr[b + i + half].to_f32());
                want[b + i] = a * cs - bb * sn;
                want[b + i + half] = bb * cs + a * sn;
            }
        }
    }
    all &= report("rope_bf16", rel_err(&out, &want), 8e-3);

    // Embedding gather and KV writes (exact copies).
    let (vocab, ed) = (1000usize, 576usize);
    let table = rng.vec(vocab * ed, 1.0);
    let ids: Vec<u32> = (0..n as u32).map(|i| (i * 7919) % vocab as u32).collect();
    let (dt, dids) = (up(&s, &table)?, up(&s, &ids)?);
    let mut dout = s.alloc_zeros::<bf16>(n * ed)?;
    let func = m.load_function("embedding_bf16")?;
    let edi = ed as i32;
    let cfg = LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    unsafe {
        s.launch_builder(&func)
            .arg(&dt)
            .arg(&dids)
            .arg(&mut dout)
            .arg(&edi)
            .launch(cfg)?;
    }
    let out = s.clone_dtoh(&dout)?;
    let want: Vec<f32> = ids
        .iter()
        .flat_map(|&i| {
            table[i as usize * ed..(i as usize + 1) * ed]
                .iter()
                .map(|v| v.to_f32())
        })
        .collect();
    all &= report("embedding_bf16", rel_err(&out, &want), 0.0);

    let kv_row = 2 * 64;
    let (k, v) = (rng.vec(n * kv_row, 1.0), rng.vec(n * kv_row, 1.0));
    let slots: Vec<u32> = (0..n as u32).map(|i| 160 + i * 3).collect();
    let num_slots = 160 + 3 * n + 1;
    let (dk, dv, dslots) = (up(&s, &k)?, up(&s, &v)?, up(&s, &slots)?);
    let mut kc = s.alloc_zeros::<bf16>(num_slots * kv_row)?;
    let mut vc = s.alloc_zeros::<bf16>(num_slots * kv_row)?;
    let func = m.load_function("write_kv_bf16")?;
    let kvi = kv_row as i32;
    unsafe {
        s.launch_builder(&func)
            .arg(&dk)
            .arg(&dv)
            .arg(&mut kc)
            .arg(&mut vc)
            .arg(&dslots)
            .arg(&kvi)
            .launch(cfg)?;
    }
    let (kh, vh) = (s.clone_dtoh(&kc)?, s.clone_dtoh(&vc)?);
    let ok = (0..n).all(|t| {
        let sl = slots[t] as usize;
        kh[sl * kv_row..(sl + 1) * kv_row] == k[t * kv_row..(t + 1) * kv_row]
            && vh[sl * kv_row..(sl + 1) * kv_row] == v[t * kv_row..(t + 1) * kv_row]
    });
    all &= report("write_kv_bf16", if ok { 0.0 } else { 1.0 }, 0.0);
    println!("{{\"all_pass\": {all}}}");
    if !all {
        std::process::exit(1);
    }
    Ok(())
}
