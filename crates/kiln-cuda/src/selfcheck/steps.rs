//! Device argmax and sampling, and recorded (graph) decode steps of a toy
//! model replayed against fresh metadata.

use super::*;

/// The device argmax of `logits` against the host's on the same values.
pub(super) fn argmax_check(p: &mut Pair, logits: &Tensor, it: usize) -> R<()> {
    let (rows, vocab) = logits.dims2("argmax").map_err(e)?;
    let host = p.gpu.to_host(logits).map_err(e)?;
    let Some(picked) = p.gpu.argmax_rows(logits).map_err(e)? else {
        return Err("argmax_rows is not available".into());
    };
    let mut worst = 0f64;
    let mut ok = picked.len() == rows;
    for (r, &(id, lp)) in picked.iter().enumerate().take(rows) {
        let row = &host[r * vocab..(r + 1) * vocab];
        let (best, max) = row
            .iter()
            .enumerate()
            .fold(
                (0, f32::NEG_INFINITY),
                |acc, (i, &v)| if v > acc.1 { (i, v) } else { acc },
            );
        let lse = max as f64
            + row
                .iter()
                .map(|&v| ((v - max) as f64).exp())
                .sum::<f64>()
                .ln();
        ok &= id as usize == best;
        worst = worst.max((lp as f64 - (max as f64 - lse)).abs());
    }
    p.checks.push(Check {
        op: format!("argmax_rows step {it}"),
        rel_err: if ok { 0.0 } else { 1.0 },
        max_abs_err: worst,
        tolerance: 1e-4,
        pass: ok && worst <= 1e-4,
    });
    Ok(())
}

/// The device's masked argmax against the host's (`masked_argmax`) on the
/// same values: every other row masked to a pseudo-random third of the ids
/// (the top id forbidden in some), one row masked to nothing.
fn masked_argmax_check(p: &mut Pair, logits: &Tensor, it: usize) -> R<()> {
    let (rows, vocab) = logits.dims2("argmax").map_err(e)?;
    let host = p.gpu.to_host(logits).map_err(e)?;
    let words = vocab.div_ceil(32);
    let masks: Vec<Option<Vec<u32>>> = (0..rows)
        .map(|r| match r % 3 {
            0 => None,
            1 => Some(
                (0..words)
                    .map(|w| (0x9e37_79b9u32.wrapping_mul((w + r + it) as u32 | 1)) & 0x4924_9249)
                    .collect(),
            ),
            _ if r == 2 => Some(vec![0; words]),
            _ => Some(vec![u32::MAX; words]),
        })
        .collect();
    let refs: Vec<Option<&[u32]>> = masks.iter().map(|m| m.as_deref()).collect();
    let Some(picked) = p.gpu.argmax_rows_masked(logits, &refs).map_err(e)? else {
        return Err("argmax_rows_masked is not available".into());
    };
    let mut ok = picked.len() == rows;
    let mut worst = 0f64;
    for (r, &(id, lp)) in picked.iter().enumerate().take(rows) {
        let want = kiln_tensor::backend::masked_argmax(&host[r * vocab..(r + 1) * vocab], refs[r]);
        ok &= id == want.0;
        worst = worst.max((lp as f64 - want.1 as f64).abs());
    }
    p.checks.push(Check {
        op: format!("argmax_rows_masked step {it}"),
        rel_err: if ok { 0.0 } else { 1.0 },
        max_abs_err: worst,
        tolerance: 1e-4,
        pass: ok && worst <= 1e-4,
    });
    Ok(())
}

/// The toy model of [`recorded_steps`]: width, heads, sequences decoded,
/// then sequences left.
pub(super) struct Toy {
    d: usize,
    heads: usize,
    kv_heads: usize,
    hd: usize,
    seqs: usize,
    after: usize,
}

impl Toy {
    pub(super) const SMALL: Toy = Toy {
        d: 256,
        heads: 4,
        kv_heads: 2,
        hd: 64,
        seqs: 3,
        after: 2,
    };
    pub(super) const WIDE: Toy = Toy {
        d: 1024,
        heads: 8,
        kv_heads: 4,
        hd: 128,
        seqs: 40,
        after: 20,
    };
}

/// A toy model step (embedding → norm and packed qkv → attention → output
/// projection into the residual → norm and gated MLP into the residual →
/// norm and logits, each norm fused into its projection) run through
/// `run_step`, so decode steps are recorded and replayed, against the CPU
/// step by step. `Toy::WIDE` decodes 40 then 20 sequences (buckets 48
/// and 24): recorded steps whose products run on cuBLAS.
pub(super) fn recorded_steps(p: &mut Pair, rng: &mut Rng, toy: &Toy) -> R<()> {
    let (vocab, d, heads, kv_heads, hd) = (512usize, toy.d, toy.heads, toy.kv_heads, toy.hd);
    let qkv_w = (heads + 2 * kv_heads) * hd;
    let (emb_g, emb_c) = p.up(&[vocab, d], &rng.vec(vocab * d, 1.0))?;
    let (wqkv_g, wqkv_c) = p.up(&[qkv_w, d], &rng.vec(qkv_w * d, 0.06))?;
    let (wo_g, wo_c) = p.up(&[d, heads * hd], &rng.vec(d * heads * hd, 0.06))?;
    let (head_g, head_c) = p.up(&[vocab, d], &rng.vec(vocab * d, 0.06))?;
    let (norm_g, norm_c) = p.up(&[d], &rng.vec(d, 1.0))?;
    let (gu_g, gu_c) = p.up(&[2 * d, d], &rng.vec(2 * d * d, 0.06))?;
    let (down_g, down_c) = p.up(&[d, d], &rng.vec(d * d, 0.06))?;
    let spec = KvPoolShape {
        num_layers: 1,
        num_groups: 1,
        num_blocks: 64.max(4 * toy.seqs),
        block_size: 16,
        kv_row: kv_heads * hd,
    };
    let ap = AttentionParams {
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim: hd,
        scale: 0.125,
        sliding_window: None,
        softcap: None,
        kv_group: 0,
        causal: true,
    };
    let inv_freq: Vec<f32> = (0..hd / 2)
        .map(|i| 1e4f32.powf(-((2 * i) as f32) / hd as f32))
        .collect();
    let rope = RopeParams {
        num_heads: heads,
        head_dim: hd,
        inv_freq: &inv_freq,
        attention_scaling: 1.0,
    };
    fn step(
        b: &dyn Backend,
        batch: &ForwardBatch,
        cache: &mut KvCache,
        w: [&Tensor; 7],
        ap: &AttentionParams,
        rope: &RopeParams,
    ) -> kiln_tensor::Result<Tensor> {
        let [emb, wqkv, wo, head, norm, gu, down] = w;
        let x = b.embedding(&Weight::Dense(emb.clone()), &batch.token_ids)?;
        let qkv = rms_norm_linear(b, &x, norm, 1e-6, 0.0, wqkv, None)?;
        let a = b.qkv_attention(&qkv, cache, 0, batch, ap, rope, None)?;
        let x = linear_add(b, &a, wo, None, &x)?;
        let h = rms_norm_gated_linear(b, &x, norm, 1e-6, 1.0, gu, Activation::Silu)?;
        let x = linear_add(b, &h, down, None, &x)?;
        let x = b.gather_rows(&x, &batch.logits_rows)?;
        rms_norm_linear(b, &x, norm, 1e-6, 0.0, head, None)
    }
    let mut gc = p.gpu.alloc_kv_cache(spec).map_err(e)?;
    let mut cc = p.cpu.alloc_kv_cache(spec).map_err(e)?;
    let per = (spec.num_blocks / toy.seqs) as u32;
    let tables: Vec<Vec<u32>> = (0..toy.seqs as u32)
        .map(|s| (s * per..s * per + per).collect())
        .collect();
    let mut lens: Vec<usize> = (0..toy.seqs).map(|s| [5, 9, 30][s % 3] + s % 5).collect();
    // Prompts, eagerly (not graphable).
    let mut b = ForwardBatch {
        block_size: 16,
        ..ForwardBatch::default()
    };
    for (s, &l) in lens.iter().enumerate() {
        let toks: Vec<u32> = (0..l).map(|_| rng.below(vocab) as u32).collect();
        b.push_seq(&toks, 0, tables[s].clone(), true);
    }
    let wg = [&emb_g, &wqkv_g, &wo_g, &head_g, &norm_g, &gu_g, &down_g];
    let wc = [&emb_c, &wqkv_c, &wo_c, &head_c, &norm_c, &gu_c, &down_c];
    let g = p
        .gpu
        .run_step(&b, &mut gc, &mut |bt, c| step(p.gpu, bt, c, wg, &ap, &rope))
        .map_err(e)?;
    let c = p
        .cpu
        .run_step(&b, &mut cc, &mut |bt, c| {
            step(&p.cpu, bt, c, wc, &ap, &rope)
        })
        .map_err(e)?;
    p.compare("run_step prefill".into(), &g, &c, TOL_ATTN)?;
    // Decode steps: all sequences (3: bucket 4), the first records, the
    // rest replay; then fewer (2: bucket 2) after some finish.
    let pos = &mut lens;
    for it in 0..6 {
        let live = if it < 4 { toy.seqs } else { toy.after };
        let mut b = ForwardBatch {
            block_size: 16,
            ..ForwardBatch::default()
        };
        for s in 0..live {
            b.push_seq(&[rng.below(vocab) as u32], pos[s], tables[s].clone(), true);
            pos[s] += 1;
        }
        let g = p
            .gpu
            .run_step(&b, &mut gc, &mut |bt, c| step(p.gpu, bt, c, wg, &ap, &rope))
            .map_err(e)?;
        let c = p
            .cpu
            .run_step(&b, &mut cc, &mut |bt, c| {
                step(&p.cpu, bt, c, wc, &ap, &rope)
            })
            .map_err(e)?;
        p.compare(
            format!("run_step decode {it} ({live} seqs, d={d})"),
            &g,
            &c,
            TOL_ATTN,
        )?;
        argmax_check(p, &g, it)?;
        masked_argmax_check(p, &g, it)?;
    }
    let recorded = p.gpu.num_recordings();
    p.checks.push(Check {
        op: format!("decode steps recorded as graphs ({recorded})"),
        rel_err: 0.0,
        max_abs_err: 0.0,
        tolerance: 0.0,
        pass: !p.gpu.graphs_enabled() || recorded >= 2,
    });
    Ok(())
}
