//! Quantized Hugging Face checkpoints: the layouts `quantization_config`
//! names, read as the dense `X.weight` matrices they stand for.
//!
//! - **AWQ** (`quant_method: "awq"`, GEMM layout): `X.qweight` I32
//!   `[in, out / 8]` (nibble `i` of column `j` is output `8 j + [0, 2, 4, 6,
//!   1, 3, 5, 7][i]`), `X.qzeros` I32 `[in / g, out / 8]` packed alike,
//!   `X.scales` `[in / g, out]`: `W[o, i] = (q − z) · s`.
//! - **GPTQ** (`quant_method: "gptq"`, 4 or 8 bits): `X.qweight` I32
//!   `[in · bits / 32, out]` packed along the input (low bits first),
//!   `X.qzeros` I32 `[groups, out · bits / 32]` packed along the output, stored
//!   one below the zero point (`checkpoint_format` `gptq`; `gptq_v2` stores
//!   it as is), `X.scales` `[groups, out]`, `X.g_idx` I32 `[in]` (each input's
//!   group: act-order checkpoints permute them): `W[o, i] = (q − z) · s` in
//!   group `g_idx[i]`.
//! - **compressed-tensors** `pack-quantized` (symmetric int4/int8, group or
//!   channel strategy): `X.weight_packed` I32 `[out, in · bits / 32]` of
//!   `q + 2^(bits−1)`, `X.weight_scale` `[out, in / g]` (or `[out, 1]`),
//!   `X.weight_shape`: `W = q · s`. `float-quantized` / `naive-quantized` FP8:
//!   `X.weight` F8_E4M3 with `X.weight_scale` per tensor (`[1]`) or per
//!   channel (`[out, 1]`).
//! - **FP8 blocks** (`quant_method: "fp8"`, `weight_block_size` `[bo, bi]`):
//!   `X.weight` F8_E4M3 `[out, in]`, `X.weight_scale_inv` F32
//!   `[⌈out / bo⌉, ⌈in / bi⌉]`: `W = w · scale_inv[o / bo, i / bi]`.
//!
//! Dequantization is exact in f32 (every scale and code is representable);
//! the parts a weight is made from are hidden from the tensor list.

use std::collections::{BTreeMap, BTreeSet};

use half::{bf16, f16};
use kiln_quant::dequant::e4m3_to_f32;
use kiln_quant::QuantFormat;
use serde_json::Value;

/// What a checkpoint's `quantization_config` says its matrices are.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Scheme {
    Awq { bits: usize, group: usize },
    Gptq { bits: usize, zero_offset: i32 },
    Packed { bits: usize },
    Fp8Scaled,
    Fp8Block { block: [usize; 2] },
}

/// A stored tensor, as the scheme reads it.
pub(crate) struct Stored<'a> {
    pub dtype: &'a str,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
}

/// The scheme of `config`, `None` for an unquantized checkpoint, or why
/// Kiln cannot read it.
pub(crate) fn scheme(config: &Value) -> Result<Option<Scheme>, String> {
    let Some(q) = config.get("quantization_config") else {
        return Ok(None);
    };
    let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("");
    let int = |keys: &[&str], default: usize| {
        keys.iter()
            .find_map(|k| q.get(*k).and_then(Value::as_u64))
            .map_or(default, |v| v as usize)
    };
    match method {
        "awq" => {
            let version = q.get("version").and_then(Value::as_str).unwrap_or("gemm");
            if !version.eq_ignore_ascii_case("gemm") {
                return Err(format!(
                    "AWQ version {version:?} (Kiln reads the GEMM layout)"
                ));
            }
            if q.get("zero_point").and_then(Value::as_bool) == Some(false) {
                return Err("AWQ without zero points".into());
            }
            let bits = int(&["bits", "w_bit"], 4);
            if bits != 4 {
                return Err(format!("{bits}-bit AWQ (Kiln reads 4-bit)"));
            }
            let group = int(&["group_size", "q_group_size"], 128);
            Ok(Some(Scheme::Awq { bits, group }))
        }
        "gptq" => {
            let bits = int(&["bits"], 4);
            if bits != 4 && bits != 8 {
                return Err(format!("{bits}-bit GPTQ (Kiln reads 4 and 8 bits)"));
            }
            let format = q
                .get("checkpoint_format")
                .and_then(Value::as_str)
                .unwrap_or("gptq");
            let zero_offset = match format {
                "gptq" => 1,
                "gptq_v2" => 0,
                other => return Err(format!("GPTQ checkpoint_format {other:?}")),
            };
            Ok(Some(Scheme::Gptq { bits, zero_offset }))
        }
        "compressed-tensors" => {
            let format = q.get("format").and_then(Value::as_str).unwrap_or("");
            let weights: Vec<&Value> = q
                .get("config_groups")
                .and_then(Value::as_object)
                .map(|g| g.values().filter_map(|v| v.get("weights")).collect())
                .unwrap_or_default();
            let Some(w) = weights.first() else {
                return Err("compressed-tensors config without weight quantization".into());
            };
            let get = |k: &str| w.get(k);
            let kind = get("type").and_then(Value::as_str).unwrap_or("int");
            let bits = get("num_bits").and_then(Value::as_u64).unwrap_or(8) as usize;
            match (format, kind) {
                ("pack-quantized", "int") => {
                    if get("symmetric").and_then(Value::as_bool) == Some(false) {
                        return Err("asymmetric pack-quantized weights".into());
                    }
                    if bits != 4 && bits != 8 {
                        return Err(format!("{bits}-bit pack-quantized weights"));
                    }
                    Ok(Some(Scheme::Packed { bits }))
                }
                ("float-quantized" | "naive-quantized", "float") if bits == 8 => {
                    Ok(Some(Scheme::Fp8Scaled))
                }
                _ => Err(format!(
                    "compressed-tensors format {format:?} with {bits}-bit {kind} weights"
                )),
            }
        }
        "fp8" => {
            let block = q
                .get("weight_block_size")
                .and_then(Value::as_array)
                .and_then(|a| Some([a.first()?.as_u64()? as usize, a.get(1)?.as_u64()? as usize]));
            match block {
                Some(b) if b[0] > 0 && b[1] > 0 => Ok(Some(Scheme::Fp8Block { block: b })),
                _ => Ok(Some(Scheme::Fp8Scaled)),
            }
        }
        // gpt-oss's MXFP4 experts: the family reads their blocks and scales itself.
        "mxfp4" => Ok(None),
        "" => Err("quantization_config without quant_method".into()),
        other => Err(format!("quant_method {other:?}")),
    }
}

/// The parts a matrix `X.weight` of this scheme is stored as (the first
/// names the matrix's presence).
fn parts(s: &Scheme) -> &'static [&'static str] {
    match s {
        Scheme::Awq { .. } => &["qweight", "qzeros", "scales"],
        Scheme::Gptq { .. } => &["qweight", "qzeros", "scales", "g_idx"],
        Scheme::Packed { .. } => &["weight_packed", "weight_scale", "weight_shape"],
        Scheme::Fp8Scaled => &["weight", "weight_scale"],
        Scheme::Fp8Block { .. } => &["weight", "weight_scale_inv"],
    }
}

/// The matrices the scheme makes: `X.weight` → its `[out, in]` shape, read
/// from the stored shapes; and the stored names they hide.
pub(crate) fn logical(
    s: &Scheme,
    shapes: &BTreeMap<String, (String, Vec<usize>)>,
) -> (BTreeMap<String, Vec<usize>>, BTreeSet<String>) {
    let mut out = BTreeMap::new();
    let mut hidden = BTreeSet::new();
    let first = parts(s)[0];
    for (name, (dtype, shape)) in shapes {
        let Some(base) = name.strip_suffix(&format!(".{first}")) else {
            continue;
        };
        let &[r, c] = shape.as_slice() else {
            continue;
        };
        let dims = match s {
            Scheme::Awq { bits, .. } => [c * 32 / bits, r],
            Scheme::Gptq { bits, .. } => [c, r * 32 / bits],
            Scheme::Packed { bits } => [r, c * 32 / bits],
            Scheme::Fp8Scaled | Scheme::Fp8Block { .. } => {
                if dtype != "F8_E4M3" {
                    continue;
                }
                [r, c]
            }
        };
        // Quantized only where every part is there (an ignored layer keeps
        // a plain `weight`).
        if !parts(s)[1..]
            .iter()
            .all(|p| shapes.contains_key(&format!("{base}.{p}")))
        {
            continue;
        }
        for p in parts(s) {
            hidden.insert(format!("{base}.{p}"));
        }
        for extra in ["weight_zero_point", "input_scale"] {
            let n = format!("{base}.{extra}");
            if shapes.contains_key(&n) {
                hidden.insert(n);
            }
        }
        out.insert(format!("{base}.weight"), dims.to_vec());
    }
    (out, hidden)
}

fn bad(name: &str, what: impl std::fmt::Display) -> String {
    format!("{name}: {what}")
}

fn i32s(t: &Stored<'_>, name: &str) -> Result<Vec<i32>, String> {
    match t.dtype {
        "I32" | "U32" => Ok(t
            .bytes
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()),
        "I64" => Ok(t
            .bytes
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap_or([0; 8])) as i32)
            .collect()),
        other => Err(bad(name, format!("integer part stored as {other}"))),
    }
}

fn floats(t: &Stored<'_>, name: &str) -> Result<Vec<f32>, String> {
    Ok(match t.dtype {
        "F32" => t
            .bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        "F16" => t
            .bytes
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        "BF16" => t
            .bytes
            .chunks_exact(2)
            .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        other => return Err(bad(name, format!("scale stored as {other}"))),
    })
}

/// An FP8 `X.weight`'s E4M3 bytes (`[out, in]` = `dims`) and the scale of
/// element `(o, i)`: per tensor (`[1]`), per output channel, or per block
/// of the scheme's `[bo, bi]`.
type Fp8Scale = Box<dyn Fn(usize, usize) -> f32>;

fn fp8<'a>(
    s: &Scheme,
    base: &str,
    dims: [usize; 2],
    fetch: &dyn Fn(&str) -> Option<Stored<'a>>,
) -> Result<(&'a [u8], Fp8Scale), String> {
    let [out, inp] = dims;
    let get = |p: &str| {
        let n = format!("{base}.{p}");
        fetch(&n)
            .map(|t| (n.clone(), t))
            .ok_or_else(|| format!("{n}: missing"))
    };
    let (wn, wt) = get("weight")?;
    let block = match *s {
        Scheme::Fp8Block { block } => Some(block),
        _ => None,
    };
    let (sn, st) = get(if block.is_some() {
        "weight_scale_inv"
    } else {
        "weight_scale"
    })?;
    let sc = floats(&st, &sn)?;
    if wt.bytes.len() != out * inp {
        return Err(bad(&wn, "FP8 weight does not match its shape"));
    }
    let expect = match block {
        Some([bo, bi]) => out.div_ceil(bo) * inp.div_ceil(bi),
        None if sc.len() == 1 => 1,
        None => out,
    };
    if sc.len() != expect {
        return Err(bad(&sn, format!("{} scales for [{out}, {inp}]", sc.len())));
    }
    let scale: Fp8Scale = match block {
        Some([bo, bi]) => {
            let cols = inp.div_ceil(bi);
            Box::new(move |o, i| sc[(o / bo) * cols + i / bi])
        }
        None if expect == 1 => Box::new(move |_, _| sc[0]),
        None => Box::new(move |o, _| sc[o]),
    };
    Ok((wt.bytes, scale))
}

/// FP8 `X.weight` as Kiln's FP8 blocks (runs of 128 of a row under one
/// f32 scale), where every run of 128 lies under one stored scale: rows a
/// whole number of runs, and block scales `[bo, bi]` with `bi` a multiple
/// of 128. The bytes are the checkpoint's; the scales its f32 values.
fn fp8_blocks<'a>(
    s: &Scheme,
    base: &str,
    dims: [usize; 2],
    fetch: &dyn Fn(&str) -> Option<Stored<'a>>,
) -> Result<Option<(QuantFormat, Vec<u8>)>, String> {
    if !fp8_fits_blocks(s, dims) {
        return Ok(None);
    }
    let [out, inp] = dims;
    let (q, scale) = fp8(s, base, dims, fetch)?;
    let f = QuantFormat::FP8;
    let runs = inp / 128;
    let mut b = vec![0u8; out * runs * f.block_bytes()];
    for (r, blk) in b.chunks_exact_mut(f.block_bytes()).enumerate() {
        let (o, c) = (r / runs, r % runs);
        blk[..4].copy_from_slice(&scale(o, 128 * c).to_le_bytes());
        blk[4..].copy_from_slice(&q[o * inp + 128 * c..o * inp + 128 * (c + 1)]);
    }
    Ok(Some((f, b)))
}

fn fp8_fits_blocks(s: &Scheme, [_, inp]: [usize; 2]) -> bool {
    inp > 0
        && inp.is_multiple_of(128)
        && match *s {
            Scheme::Fp8Block { block: [_, bi] } => bi.is_multiple_of(128),
            _ => true,
        }
}

/// `X.weight` (`[out, in]` = `dims`) dequantized from its parts, fetched by
/// name.
pub(crate) fn dequantize<'a>(
    s: &Scheme,
    base: &str,
    dims: [usize; 2],
    fetch: &dyn Fn(&str) -> Option<Stored<'a>>,
) -> Result<Vec<f32>, String> {
    let get = |p: &str| {
        let n = format!("{base}.{p}");
        fetch(&n)
            .map(|t| (n.clone(), t))
            .ok_or_else(|| format!("{n}: missing"))
    };
    let [out, inp] = dims;
    let mut w = vec![0f32; out * inp];
    match *s {
        Scheme::Awq { bits, group } => {
            let (qn, qt) = get("qweight")?;
            let (zn, zt) = get("qzeros")?;
            let (sn, st) = get("scales")?;
            let (q, z, sc) = (i32s(&qt, &qn)?, i32s(&zt, &zn)?, floats(&st, &sn)?);
            let pack = 32 / bits;
            let groups = inp.div_ceil(group);
            if q.len() != inp * out / pack
                || z.len() != groups * out / pack
                || sc.len() != groups * out
            {
                return Err(bad(base, "AWQ parts do not match their shapes"));
            }
            // Output 8 j + k sits in nibble AWQ_REV[k] of column j.
            let mask = (1u32 << bits) - 1;
            let nib = |v: i32, o: usize| ((v as u32) >> (bits * AWQ_REV[o % pack])) & mask;
            for i in 0..inp {
                let g = i / group;
                for o in 0..out {
                    let qv = nib(q[i * out / pack + o / pack], o);
                    let zv = nib(z[g * out / pack + o / pack], o);
                    w[o * inp + i] = (qv as f32 - zv as f32) * sc[g * out + o];
                }
            }
        }
        Scheme::Gptq { bits, zero_offset } => {
            let (qn, qt) = get("qweight")?;
            let (zn, zt) = get("qzeros")?;
            let (sn, st) = get("scales")?;
            let (gn, gt) = get("g_idx")?;
            let (q, z, sc, gi) = (
                i32s(&qt, &qn)?,
                i32s(&zt, &zn)?,
                floats(&st, &sn)?,
                i32s(&gt, &gn)?,
            );
            let pack = 32 / bits;
            let mask = (1u32 << bits) - 1;
            let groups = st.shape.first().copied().unwrap_or(0);
            if q.len() != inp * out / pack
                || sc.len() != groups * out
                || z.len() != groups * out / pack
                || gi.len() != inp
            {
                return Err(bad(base, "GPTQ parts do not match their shapes"));
            }
            for i in 0..inp {
                let g = gi[i];
                if g < 0 || g as usize >= groups {
                    return Err(bad(&gn, format!("group {g} of {groups}")));
                }
                let g = g as usize;
                for o in 0..out {
                    let qv = ((q[(i / pack) * out + o] as u32) >> (bits * (i % pack))) & mask;
                    let zv = ((z[g * out / pack + o / pack] as u32) >> (bits * (o % pack))) & mask;
                    let zero = zv as i32 + zero_offset;
                    w[o * inp + i] = (qv as i32 - zero) as f32 * sc[g * out + o];
                }
            }
        }
        Scheme::Packed { bits } => {
            let (qn, qt) = get("weight_packed")?;
            let (sn, st) = get("weight_scale")?;
            let (q, sc) = (i32s(&qt, &qn)?, floats(&st, &sn)?);
            let pack = 32 / bits;
            let mask = (1u32 << bits) - 1;
            let half = 1i32 << (bits - 1);
            let groups = st.shape.get(1).copied().unwrap_or(1).max(1);
            if q.len() != out * inp / pack || sc.len() != out * groups || inp % groups != 0 {
                return Err(bad(base, "pack-quantized parts do not match their shapes"));
            }
            let g = inp / groups;
            for o in 0..out {
                for i in 0..inp {
                    let v = ((q[o * inp / pack + i / pack] as u32) >> (bits * (i % pack))) & mask;
                    w[o * inp + i] = (v as i32 - half) as f32 * sc[o * groups + i / g];
                }
            }
        }
        Scheme::Fp8Scaled | Scheme::Fp8Block { .. } => {
            let (q, scale) = fp8(s, base, dims, fetch)?;
            for o in 0..out {
                for i in 0..inp {
                    w[o * inp + i] = e4m3_to_f32(q[o * inp + i]) * scale(o, i);
                }
            }
        }
    }
    Ok(w)
}

/// How an int4 layout orders its codes (`code(o, i)` of output `o`, input
/// `i`; `q` its words).
#[derive(Clone, Copy)]
enum Int4Order {
    /// AWQ GEMM: `[in, out / 8]`, output 8 j + k in nibble `AWQ_REV[k]` of
    /// column j.
    Awq,
    /// GPTQ: `[in / 8, out]`, input `i` in nibble `i % 8`.
    Gptq,
    /// compressed-tensors: `[out, in / 8]`, input `i` in nibble `i % 8`.
    Packed,
}

/// An int4 matrix's parts: codes (still packed), and per (output, group)
/// the f16 scale and the zero point.
struct Int4 {
    order: Int4Order,
    q: Vec<i32>,
    out: usize,
    inp: usize,
    groups: usize,
    /// `[out, groups]`.
    scales: Vec<f16>,
    /// `[out, groups]`.
    zeros: Vec<u8>,
}

/// The nibble of an AWQ column that holds output `8 j + k`: `AWQ_REV[k]`.
const AWQ_REV: [usize; 8] = [0, 4, 1, 5, 2, 6, 3, 7];

impl Int4 {
    /// The block format these groups are exactly: Q4_0 where every zero
    /// point is 8 and groups are a multiple of 32, else Q4_Z where they are
    /// a multiple of 128 and Q4_Z32 where of 32; `None` otherwise.
    fn format(&self) -> Option<QuantFormat> {
        let group = self.inp / self.groups;
        if self.zeros.iter().all(|&z| z == 8) && group.is_multiple_of(32) {
            Some(QuantFormat::Q4_0)
        } else if !self.zeros.iter().all(|&z| z <= 31) {
            None
        } else if group.is_multiple_of(128) {
            Some(QuantFormat::Q4Z)
        } else if group.is_multiple_of(32) {
            Some(QuantFormat::Q4Z32)
        } else {
            None
        }
    }

    /// The codes of rows `rows` (`[rows.len(), inp]`, one a byte), read a
    /// tile of rows at a time so that each word is loaded once.
    fn codes(&self, rows: std::ops::Range<usize>) -> Vec<u8> {
        let (out, inp) = (self.out, self.inp);
        let n = rows.len();
        let mut c = vec![0u8; n * inp];
        let nib = |w: i32, k: usize| (((w as u32) >> (4 * k)) & 15) as u8;
        match self.order {
            Int4Order::Awq => {
                // rows start at a multiple of 8 (the caller's tiles).
                for i in 0..inp {
                    for j in rows.start / 8..rows.end.div_ceil(8) {
                        let w = self.q[i * out / 8 + j];
                        for k in 0..8 {
                            let o = 8 * j + k;
                            if rows.contains(&o) {
                                c[(o - rows.start) * inp + i] = nib(w, AWQ_REV[k]);
                            }
                        }
                    }
                }
            }
            Int4Order::Gptq => {
                for i8 in 0..inp / 8 {
                    for o in rows.clone() {
                        let w = self.q[i8 * out + o];
                        for k in 0..8 {
                            c[(o - rows.start) * inp + 8 * i8 + k] = nib(w, k);
                        }
                    }
                }
            }
            Int4Order::Packed => {
                for o in rows.clone() {
                    for i8 in 0..inp / 8 {
                        let w = self.q[o * inp / 8 + i8];
                        for k in 0..8 {
                            c[(o - rows.start) * inp + 8 * i8 + k] = nib(w, k);
                        }
                    }
                }
            }
        }
        c
    }

    /// Every row as blocks of `format` (Q4_0, Q4_Z or Q4_Z32), in parallel over
    /// tiles of 64 rows.
    fn blocks(&self, format: QuantFormat) -> Vec<u8> {
        use rayon::prelude::*;
        const TILE: usize = 64;
        let (bs, bb) = (format.block_size(), format.block_bytes());
        let row_bytes = self.inp / bs * bb;
        let group = self.inp / self.groups;
        let mut bytes = vec![0u8; self.out * row_bytes];
        bytes
            .par_chunks_mut(TILE * row_bytes)
            .enumerate()
            .for_each(|(t, dst)| {
                let rows = t * TILE..(t * TILE + TILE).min(self.out);
                let codes = self.codes(rows.clone());
                for (r, o) in rows.enumerate() {
                    let c = &codes[r * self.inp..(r + 1) * self.inp];
                    let at = |g: usize| o * self.groups + g;
                    for (b, blk) in dst[r * row_bytes..(r + 1) * row_bytes]
                        .chunks_exact_mut(bb)
                        .enumerate()
                    {
                        let e0 = b * bs;
                        let g = e0 / group;
                        let (head, runs) = match format {
                            QuantFormat::Q4_0 => blk.split_at_mut(2),
                            _ => blk.split_at_mut(4),
                        };
                        head[..2].copy_from_slice(&self.scales[at(g)].to_le_bytes());
                        if format != QuantFormat::Q4_0 {
                            head[2] = self.zeros[at(g)];
                        }
                        for (run, d) in runs.chunks_exact_mut(16).enumerate() {
                            let e = e0 + 32 * run;
                            for j in 0..16 {
                                d[j] = c[e + j] | (c[e + 16 + j] << 4);
                            }
                        }
                    }
                }
            });
        bytes
    }
}

/// An int4 layout's parts, checked against `dims`; `None` where the layout
/// is not int4 groups in input order with f16 scales (act-order GPTQ,
/// scales no f16 holds, another scheme).
/// (`codes`: read the packed codes too; else `q` is left empty.)
fn int4<'a>(
    s: &Scheme,
    base: &str,
    dims: [usize; 2],
    fetch: &dyn Fn(&str) -> Option<Stored<'a>>,
    codes: bool,
) -> Result<Option<Int4>, String> {
    let [out, inp] = dims;
    let part =
        |p: &str| fetch(&format!("{base}.{p}")).ok_or_else(|| format!("{base}.{p}: missing"));
    let nib = |w: i32, k: usize| (((w as u32) >> (4 * k)) & 15) as i32;
    // The packed words (their count only, without `codes`).
    let words = |t: &Stored<'_>| -> Result<(Vec<i32>, usize), String> {
        let n = t.bytes.len() / if t.dtype == "I64" { 8 } else { 4 };
        Ok((if codes { i32s(t, base)? } else { Vec::new() }, n))
    };
    // scales and zeros as stored ([groups, out] or [out, groups]), the group count.
    let (order, q, sc, zeros, groups): (Int4Order, Vec<i32>, Vec<f32>, Vec<i32>, usize) = match *s {
        Scheme::Awq { bits: 4, group } => {
            let (q, z, st) = (part("qweight")?, part("qzeros")?, part("scales")?);
            if group == 0 || inp % group != 0 || out % 8 != 0 {
                return Ok(None);
            }
            let groups = inp / group;
            let ((qs, nq), zs, sc) = (words(&q)?, i32s(&z, base)?, floats(&st, base)?);
            if nq != inp * out / 8 || zs.len() != groups * out / 8 || sc.len() != groups * out {
                return Err(bad(base, "AWQ parts do not match their shapes"));
            }
            let zeros = (0..groups * out)
                .map(|k| {
                    let (g, o) = (k / out, k % out);
                    nib(zs[g * out / 8 + o / 8], AWQ_REV[o % 8])
                })
                .collect();
            (Int4Order::Awq, qs, sc, zeros, groups)
        }
        Scheme::Gptq {
            bits: 4,
            zero_offset,
        } => {
            let (q, z, st, g) = (
                part("qweight")?,
                part("qzeros")?,
                part("scales")?,
                part("g_idx")?,
            );
            let groups = st.shape.first().copied().unwrap_or(0);
            if groups == 0 || inp % groups != 0 || out % 8 != 0 || inp % 8 != 0 {
                return Ok(None);
            }
            let gi = i32s(&g, base)?;
            let group = inp / groups;
            if gi.len() != inp || gi.iter().enumerate().any(|(i, &g)| g as usize != i / group) {
                return Ok(None); // act-order
            }
            let (zs, (qs, nq), sc) = (i32s(&z, base)?, words(&q)?, floats(&st, base)?);
            if zs.len() != groups * out / 8 || nq != inp * out / 8 || sc.len() != groups * out {
                return Err(bad(base, "GPTQ parts do not match their shapes"));
            }
            let zeros = (0..groups * out)
                .map(|k| {
                    let (g, o) = (k / out, k % out);
                    nib(zs[g * out / 8 + o / 8], o % 8) + zero_offset
                })
                .collect();
            (Int4Order::Gptq, qs, sc, zeros, groups)
        }
        Scheme::Packed { bits: 4 } => {
            let (q, st) = (part("weight_packed")?, part("weight_scale")?);
            let groups = st.shape.get(1).copied().unwrap_or(1).max(1);
            let (qs, nq) = words(&q)?;
            if nq != out * inp / 8 || inp % 8 != 0 {
                return Err(bad(base, "pack-quantized weight does not match its shape"));
            }
            let sc = floats(&st, base)?; // [out, groups]
            if inp % groups != 0 || sc.len() != out * groups {
                return Ok(None);
            }
            // As [groups, out], as the others store them.
            let sc = (0..groups * out)
                .map(|k| sc[(k % out) * groups + k / out])
                .collect();
            (Int4Order::Packed, qs, sc, vec![8; groups * out], groups)
        }
        _ => return Ok(None),
    };
    // To [out, groups], checking each scale is an f16 and each zero a byte.
    let mut scales = Vec::with_capacity(out * groups);
    let mut zs = Vec::with_capacity(out * groups);
    for o in 0..out {
        for g in 0..groups {
            let v = sc[g * out + o];
            let h = f16::from_f32(v);
            let z = zeros[g * out + o];
            if h.to_f32() != v || !(0..=255).contains(&z) {
                return Ok(None);
            }
            scales.push(h);
            zs.push(z as u8);
        }
    }
    Ok(Some(Int4 {
        order,
        q,
        out,
        inp,
        groups,
        scales,
        zeros: zs,
    }))
}

/// `X.weight` as blocks a backend multiplies in place, where the layout
/// holds exactly their values: int4 groups of a multiple of 32 inputs in
/// order (`g_idx` the identity grouping, not act-order) with scales f16
/// holds — as GGUF Q4_0 where every zero point is 8 (GPTQ symmetric,
/// compressed-tensors pack-quantized int4: `W = d · (q − 8)`), else as
/// Kiln's Q4_Z where groups are a multiple of 128, Q4_Z32 where of 32 (AWQ,
/// GPTQ asymmetric: `W = d · (q − z)`). So the CPU and GPU keep 4.25–5 bits
/// a weight and their block products. `None` where the layout is anything else (read
/// dense instead).
pub(crate) fn as_blocks<'a>(
    s: &Scheme,
    base: &str,
    dims: [usize; 2],
    fetch: &dyn Fn(&str) -> Option<Stored<'a>>,
) -> Result<Option<(QuantFormat, Vec<u8>)>, String> {
    if matches!(s, Scheme::Fp8Scaled | Scheme::Fp8Block { .. }) {
        return fp8_blocks(s, base, dims, fetch);
    }
    let Some(m) = int4(s, base, dims, fetch, true)? else {
        return Ok(None);
    };
    Ok(m.format().map(|f| (f, m.blocks(f))))
}

/// The block format [`as_blocks`] gives `X.weight` (from its scales, zero
/// points and grouping; the codes are not read), for the memory plan.
pub(crate) fn block_format<'a>(
    s: &Scheme,
    base: &str,
    dims: [usize; 2],
    fetch: &dyn Fn(&str) -> Option<Stored<'a>>,
) -> Option<QuantFormat> {
    if matches!(s, Scheme::Fp8Scaled | Scheme::Fp8Block { .. }) {
        return fp8_fits_blocks(s, dims).then_some(QuantFormat::FP8);
    }
    int4(s, base, dims, fetch, false).ok().flatten()?.format()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_values() {
        assert_eq!(e4m3_to_f32(0x00), 0.0);
        assert_eq!(e4m3_to_f32(0x38), 1.0); // e = 7, m = 0
        assert_eq!(e4m3_to_f32(0xC0), -2.0);
        assert_eq!(e4m3_to_f32(0x7E), 448.0); // the largest
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9)); // the smallest subnormal
        assert!(e4m3_to_f32(0x7F).is_nan());
    }

    #[test]
    fn schemes_from_configs() {
        let s = |q: Value| scheme(&serde_json::json!({ "quantization_config": q }));
        assert_eq!(
            s(
                serde_json::json!({"quant_method": "awq", "bits": 4, "group_size": 64, "version": "gemm", "zero_point": true})
            ),
            Ok(Some(Scheme::Awq { bits: 4, group: 64 }))
        );
        assert_eq!(
            s(serde_json::json!({"quant_method": "gptq", "bits": 8, "desc_act": true})),
            Ok(Some(Scheme::Gptq {
                bits: 8,
                zero_offset: 1
            }))
        );
        assert_eq!(
            s(serde_json::json!({"quant_method": "fp8", "weight_block_size": [128, 128]})),
            Ok(Some(Scheme::Fp8Block { block: [128, 128] }))
        );
        assert!(
            s(serde_json::json!({"quant_method": "awq", "version": "gemv"}))
                .unwrap_err()
                .contains("GEMM")
        );
        assert!(s(serde_json::json!({"quant_method": "bitsandbytes"}))
            .unwrap_err()
            .contains("bitsandbytes"));
        assert_eq!(scheme(&serde_json::json!({})), Ok(None));
        assert_eq!(s(serde_json::json!({"quant_method": "mxfp4"})), Ok(None));
    }

    /// FP8 with per-tensor, per-channel and 128×128 block scales comes out
    /// as FP8 blocks worth the dense reading value for value; block scales
    /// narrower than 128 (a run would span several) and rows that are not
    /// whole runs stay dense.
    #[test]
    fn fp8_runs_of_128_under_one_scale_are_blocks() {
        let (out, inp) = (256usize, 384usize);
        // Every code but the NaNs, over and over.
        let q: Vec<u8> = (0..out * inp)
            .map(|i| (i * 7 % 256) as u8)
            .map(|b| if b & 0x7F == 0x7F { 0 } else { b })
            .collect();
        let le = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let per_tensor = le(&[0.0123]);
        let per_channel = le(&(0..out)
            .map(|o| 1e-3 * (1 + o % 5) as f32)
            .collect::<Vec<_>>());
        let blocks128 = le(&(0..2 * 3)
            .map(|b| 0.01 * (b + 1) as f32)
            .collect::<Vec<_>>());
        let blocks64 = le(&(0..4 * 6)
            .map(|b| 0.01 * (b + 1) as f32)
            .collect::<Vec<_>>());
        let shape = [out, inp];
        for (scheme, part, scales, dims, blocks) in [
            (
                Scheme::Fp8Scaled,
                "weight_scale",
                &per_tensor,
                vec![1],
                true,
            ),
            (
                Scheme::Fp8Scaled,
                "weight_scale",
                &per_channel,
                vec![out, 1],
                true,
            ),
            (
                Scheme::Fp8Block { block: [128, 128] },
                "weight_scale_inv",
                &blocks128,
                vec![2, 3],
                true,
            ),
            (
                Scheme::Fp8Block { block: [64, 64] },
                "weight_scale_inv",
                &blocks64,
                vec![4, 6],
                false,
            ),
        ] {
            let fetch = |n: &str| {
                if n == "x.weight" {
                    Some(Stored {
                        dtype: "F8_E4M3",
                        shape: &shape,
                        bytes: &q,
                    })
                } else if n == format!("x.{part}") {
                    Some(Stored {
                        dtype: "F32",
                        shape: &dims,
                        bytes: scales,
                    })
                } else {
                    None
                }
            };
            let dense = dequantize(&scheme, "x", shape, &fetch).unwrap();
            let got = as_blocks(&scheme, "x", shape, &fetch).unwrap();
            assert_eq!(
                block_format(&scheme, "x", shape, &fetch),
                got.as_ref().map(|g| g.0)
            );
            match got {
                Some((f, bytes)) => {
                    assert!(blocks, "{scheme:?}");
                    assert_eq!(f, QuantFormat::FP8);
                    let v = kiln_quant::dequant::dequantize(f, &bytes, out * inp).unwrap();
                    assert!(v.iter().zip(&dense).all(|(a, b)| a == b), "{scheme:?}");
                }
                None => assert!(!blocks, "{scheme:?}"),
            }
        }
        // Rows of 200: not whole runs.
        let fetch = |n: &str| match n {
            "x.weight" => Some(Stored {
                dtype: "F8_E4M3",
                shape: &[4, 200],
                bytes: &q[..800],
            }),
            "x.weight_scale" => Some(Stored {
                dtype: "F32",
                shape: &[1],
                bytes: &per_tensor,
            }),
            _ => None,
        };
        assert!(as_blocks(&Scheme::Fp8Scaled, "x", [4, 200], &fetch)
            .unwrap()
            .is_none());
    }
}
