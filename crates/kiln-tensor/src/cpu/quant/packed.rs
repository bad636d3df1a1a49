//! Block weights repacked once at load into groups of 16 rows, so that a
//! product's vectors run along output rows.
//!
//! A GGML block format stores each row as blocks of small integer codes
//! with per-block (or per-sub-block) scales. Multiplying row by row means
//! dequantizing every block header per row and summing 16-lane partial
//! dots horizontally at the end; on this hardware that made the decode
//! product compute-bound at ~40 % of the read bandwidth. Here the 16 rows
//! of a group sit in the 16 lanes of a vector: each element of `x` is
//! broadcast once and multiplies one vector of 16 codes, the scales of a
//! sub-block are one vector load for all 16 rows, and nothing is reduced
//! horizontally.
//!
//! **The order of every output's sum** (the same in every path — AVX-512
//! decode, AVX-512 GEMM over a panel, the portable code — so a row's bits
//! do not depend on the batch, the path or the ISA): for each sub-block
//! `j` of `S` elements (16 or 32), in order,
//!
//! ```text
//! e = fma chain over the even k of the sub-block of value(k)·x[k], from 0
//! o = the same over the odd k
//! acc = fma(scale_j, e + o, acc)            (acc starts at 0)
//! acc = fma(offset_j, Σx_j, acc)            (formats with a min/offset)
//! ```
//!
//! where `value(k)` is the code's exact small value (a table entry for
//! 4-bit codes, the signed byte for wider ones), `scale_j` is the f16
//! scale or, for K-quants, `d · sub_scale` (exact in f32), and `Σx_j` is
//! [`sub_sums`]' fixed tree over the sub-block of `x`. This is the
//! factored form `Σ_j d_j Σ q·x + m_j Σ x` of the block formula, so it
//! differs from a dot of the dequantized row by rounding only (checked
//! against an f64 dot in the tests).
//!
//! 4-bit and smaller codes are stored as nibbles: per run of 8 elements
//! of a group, 64 bytes, lane `l`'s 32-bit word at `4l` holding elements
//! `8m + t` in bits `4t..4t + 4` ([`nibble_byte`]). One 64-byte load then
//! feeds 8 elements × 16 lanes; a lane's code for element `8m + t` is that
//! word shifted right by `4t`, which `vpermps` on the value table reads
//! by its low 4 bits (measured on Zen 4 in a replica of the decode loop:
//! +6–17 % against 16 bytes per pair widened by `vpmovzxbd`). 5-, 6- and
//! 8-bit codes are stored as signed bytes (so Q5_* and Q6_K take 8 bits a weight here against 5.5–6.6 in the
//! file; Q2_K and Q3_K take 4). Scales stay f16, K-quant sub-scales bytes.

use half::f16;
use kiln_quant::dequant::{q3_k_scale, scale_min_k4, IQ4_NL_VALUES};
use kiln_quant::{QuantFormat, QuantMatrix};
use rayon::prelude::*;

/// Rows in a group: the lanes of an AVX-512 f32 vector.
pub(crate) const LANES: usize = 16;

/// Where the 64-byte line of a group's nibble codes holding element `k`
/// (of every lane) starts.
#[inline(always)]
pub(crate) const fn nibble_line(k: usize) -> usize {
    (k / 8) * 64
}

/// The byte of a group's nibble codes holding elements `k` and `k ^ 1` of
/// lane `l` (the even one in the low nibble).
#[inline(always)]
pub(crate) const fn nibble_byte(k: usize, l: usize) -> usize {
    nibble_line(k) + 4 * l + (k % 8) / 2
}

/// A buffer of 16-float vectors aligned to cache lines (a vector load from
/// an unaligned buffer splits across two lines: half the L1 bandwidth).
pub(crate) struct Lines(Vec<Line>);

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([f32; LANES]);

impl Lines {
    pub fn new(lines: usize) -> Lines {
        Lines(vec![Line([0.0; LANES]); lines])
    }

    pub fn as_ptr(&self) -> *const f32 {
        self.0.as_ptr() as *const f32
    }

    pub fn as_mut_ptr(&mut self) -> *mut f32 {
        self.0.as_mut_ptr() as *mut f32
    }
}

/// How a sub-block's scale (or offset) is stored per lane.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ScaleKind {
    /// One f16 per sub-block (Q4_0 … Q8_0, IQ4_NL).
    F16,
    /// One f16 per super-block of `subs_per_super` sub-blocks and one
    /// signed byte per sub-block; the scale is their product (K-quants).
    Super { subs_per_super: usize },
}

/// A format's packing: code width, sub-block size, scale layout.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Scheme {
    pub nibble: bool,
    pub sub: usize,
    pub scales: ScaleKind,
    pub offsets: bool,
    /// The values of the 16 nibble codes (unused for byte codes).
    pub table: [f32; 16],
}

const fn ramp(start: f32) -> [f32; 16] {
    let mut t = [0f32; 16];
    let mut i = 0;
    while i < 16 {
        t[i] = start + i as f32;
        i += 1;
    }
    t
}

impl Scheme {
    /// The packing of `format`, or `None` for the formats kept as they are
    /// stored (F16, BF16: no codes or scales).
    pub(crate) fn of(format: QuantFormat) -> Option<Scheme> {
        use QuantFormat::*;
        let k = |n| ScaleKind::Super { subs_per_super: n };
        let (nibble, sub, scales, offsets, table) = match format {
            F16 | BF16 => return None,
            Q4_0 => (true, 32, ScaleKind::F16, false, ramp(-8.0)),
            Q4_1 => (true, 32, ScaleKind::F16, true, ramp(0.0)),
            IQ4NL => (
                true,
                32,
                ScaleKind::F16,
                false,
                IQ4_NL_VALUES.map(|v| v as f32),
            ),
            Q5_0 | Q8_0 => (false, 32, ScaleKind::F16, false, [0.0; 16]),
            Q5_1 => (false, 32, ScaleKind::F16, true, [0.0; 16]),
            Q2K => (true, 16, k(16), true, ramp(0.0)),
            Q3K => (true, 16, k(16), false, ramp(-4.0)),
            Q4K => (true, 32, k(8), true, ramp(0.0)),
            Q5K => (false, 32, k(8), true, [0.0; 16]),
            Q6K => (false, 16, k(16), false, [0.0; 16]),
        };
        Some(Scheme {
            nibble,
            sub,
            scales,
            offsets,
            table,
        })
    }
}

/// One sub-block's scale or offset as stored: f16 bits and a multiplier
/// (1 for [`ScaleKind::F16`]).
#[derive(Clone, Copy, Default)]
struct Factor {
    d: u16,
    mult: i8,
}

/// A block of `format` split into its codes (nibble indices or signed
/// byte values, one per element) and per-sub-block scale and offset.
fn decompose(
    format: QuantFormat,
    b: &[u8],
    codes: &mut [u8],
    sc: &mut [Factor],
    of: &mut [Factor],
) {
    use QuantFormat::*;
    let h = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
    let one = |d: u16| Factor { d, mult: 1 };
    let neg = |d: u16| d ^ 0x8000;
    match format {
        Q5_0 | Q5_1 => {
            let (qh, qs) = if format == Q5_1 {
                (u32::from_le_bytes([b[4], b[5], b[6], b[7]]), &b[8..24])
            } else {
                (u32::from_le_bytes([b[2], b[3], b[4], b[5]]), &b[6..22])
            };
            let bias = if format == Q5_0 { 16 } else { 0 };
            for j in 0..16 {
                let h0 = ((qh >> j) << 4) & 0x10;
                let h1 = (qh >> (j + 12)) & 0x10;
                codes[j] = ((((qs[j] & 0xF) as u32 | h0) as i32 - bias) as i8) as u8;
                codes[j + 16] = ((((qs[j] >> 4) as u32 | h1) as i32 - bias) as i8) as u8;
            }
            sc[0] = one(h(0));
            if format == Q5_1 {
                of[0] = one(h(2));
            }
        }
        Q8_0 => {
            codes[..32].copy_from_slice(&b[2..34]);
            sc[0] = one(h(0));
        }
        Q4K | Q5K => {
            let (d, dmin) = (h(0), h(2));
            let scales = &b[4..16];
            for j in 0..8 {
                let (s, m) = scale_min_k4(j, scales);
                sc[j] = Factor { d, mult: s as i8 };
                of[j] = Factor {
                    d: neg(dmin),
                    mult: m as i8,
                };
            }
            if format == Q4K {
                for (chunk, q) in b[16..144].chunks_exact(32).enumerate() {
                    for l in 0..32 {
                        codes[chunk * 64 + l] = q[l] & 0xF;
                        codes[chunk * 64 + 32 + l] = q[l] >> 4;
                    }
                }
            } else {
                let qh = &b[16..48];
                for (chunk, ql) in b[48..176].chunks_exact(32).enumerate() {
                    let (u1, u2) = (1u8 << (2 * chunk), 2u8 << (2 * chunk));
                    for l in 0..32 {
                        let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
                        let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
                        codes[chunk * 64 + l] = (ql[l] & 0xF) + h1;
                        codes[chunk * 64 + 32 + l] = (ql[l] >> 4) + h2;
                    }
                }
            }
        }
        Q6K => {
            let d = h(208);
            for (j, s) in sc.iter_mut().enumerate().take(16) {
                *s = Factor {
                    d,
                    mult: b[192 + j] as i8,
                };
            }
            for half in 0..2 {
                let ql = &b[half * 64..];
                let qh = &b[128 + half * 32..];
                let y = &mut codes[half * 128..];
                for l in 0..32 {
                    let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
                    let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                    let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                    let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                    y[l] = (q1 as i8) as u8;
                    y[l + 32] = (q2 as i8) as u8;
                    y[l + 64] = (q3 as i8) as u8;
                    y[l + 96] = (q4 as i8) as u8;
                }
            }
        }
        Q2K => {
            let (d, dmin) = (h(80), h(82));
            for j in 0..16 {
                let s = b[j];
                sc[j] = Factor {
                    d,
                    mult: (s & 0xF) as i8,
                };
                of[j] = Factor {
                    d: neg(dmin),
                    mult: (s >> 4) as i8,
                };
            }
            let qs = &b[16..80];
            for (e, c) in codes.iter_mut().enumerate().take(256) {
                *c = (qs[(e / 128) * 32 + e % 32] >> (2 * ((e / 32) % 4))) & 3;
            }
        }
        Q3K => {
            let d = h(108);
            for (j, s) in sc.iter_mut().enumerate().take(16) {
                *s = Factor {
                    d,
                    mult: q3_k_scale(&b[96..108], j),
                };
            }
            let (hmask, qs) = (&b[0..32], &b[32..96]);
            for (e, c) in codes.iter_mut().enumerate().take(256) {
                let lo = (qs[(e / 128) * 32 + e % 32] >> (2 * ((e / 32) % 4))) & 3;
                let high = (hmask[e % 32] >> (e / 32)) & 1;
                // Nibble index into ramp(-4): value lo - 4 (high clear) or lo.
                *c = lo + 4 * high;
            }
        }
        Q4_0 | Q4_1 | IQ4NL => unreachable!("packed by direct_nibbles"),
        F16 | BF16 => unreachable!("F16 and BF16 are not packed"),
    }
}

/// The 32-element nibble formats (Q4_0, Q4_1, IQ4_NL) written straight
/// from the block into lane `l` of a group's pairs `dst` (the file's byte
/// `j` holds element `j` low and `j + 16` high), with the block's scale
/// (and min); `false` for other formats. The same codes as [`decompose`]
/// then pairing, without the per-element detour (it dominated load time).
fn direct_nibbles(
    format: QuantFormat,
    b: &[u8],
    dst: &mut [u8],
    l: usize,
    sc: &mut [Factor],
    of: &mut [Factor],
) -> bool {
    use QuantFormat::*;
    let h = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
    let qs: &[u8; 16] = match format {
        Q4_0 | IQ4NL => b[2..18].try_into().expect("an 18-byte block"),
        Q4_1 => b[4..20].try_into().expect("a 20-byte block"),
        _ => return false,
    };
    for p in 0..8 {
        dst[nibble_byte(2 * p, l)] = (qs[2 * p] & 0xF) | (qs[2 * p + 1] << 4);
        dst[nibble_byte(2 * (p + 8), l)] = (qs[2 * p] >> 4) | (qs[2 * p + 1] & 0xF0);
    }
    sc[0] = Factor { d: h(0), mult: 1 };
    if format == Q4_1 {
        of[0] = Factor { d: h(2), mult: 1 };
    }
    true
}

/// A matrix in 16-row groups (see the module docs). Rows past `rows` in
/// the last group have zero scales.
pub(crate) struct Packed {
    pub scheme: Scheme,
    pub rows: usize,
    pub cols: usize,
    pub groups: usize,
    /// Sub-blocks per row.
    pub subs: usize,
    /// Per group: `cols / 2` pairs × 16 bytes (nibbles) or `cols` × 16
    /// signed bytes.
    pub codes: Vec<u8>,
    /// Per group: per sub-block (F16) or super-block (Super) × 16 f16.
    pub scale_d: Vec<u16>,
    /// Per group: per sub-block × 16 multipliers (Super only).
    pub scale_m: Vec<i8>,
    pub offs_d: Vec<u16>,
    pub offs_m: Vec<i8>,
}

impl Packed {
    /// Bytes of codes of one group.
    pub fn group_code_bytes(&self) -> usize {
        group_code_bytes(&self.scheme, self.cols)
    }

    /// f16 scale entries per group.
    pub fn d_per_group(&self) -> usize {
        d_per_group(&self.scheme, self.subs)
    }

    /// Stored bytes.
    pub fn num_bytes(&self) -> usize {
        self.codes.len()
            + 2 * (self.scale_d.len() + self.offs_d.len())
            + self.scale_m.len()
            + self.offs_m.len()
    }

    /// The f16 index (into `scale_d`/`offs_d`) of sub-block `j` of group
    /// `g`, lane 0.
    #[inline]
    pub fn d_index(&self, g: usize, j: usize) -> usize {
        let per = match self.scheme.scales {
            ScaleKind::F16 => j,
            ScaleKind::Super { subs_per_super } => j / subs_per_super,
        };
        (g * self.d_per_group() + per) * LANES
    }

    /// The multiplier index of sub-block `j` of group `g`, lane 0.
    #[inline]
    pub fn m_index(&self, g: usize, j: usize) -> usize {
        (g * self.subs + j) * LANES
    }

    /// Lane `l`'s scale and offset of sub-block `j` of group `g`.
    fn factors(&self, g: usize, j: usize, l: usize) -> (f32, f32) {
        let get = |d: &[u16], m: &[i8]| {
            let v = f16::from_bits(d[self.d_index(g, j) + l]).to_f32();
            match self.scheme.scales {
                ScaleKind::F16 => v,
                ScaleKind::Super { .. } => v * m[self.m_index(g, j) + l] as f32,
            }
        };
        let s = get(&self.scale_d, &self.scale_m);
        let o = if self.scheme.offsets {
            get(&self.offs_d, &self.offs_m)
        } else {
            0.0
        };
        (s, o)
    }

    /// The exact value of the code of element `k` in lane `l` of group `g`.
    #[inline]
    fn value(&self, g: usize, k: usize, l: usize) -> f32 {
        let base = g * self.group_code_bytes();
        if self.scheme.nibble {
            let b = self.codes[base + nibble_byte(k, l)];
            self.scheme.table[((b >> (4 * (k % 2))) & 0xF) as usize]
        } else {
            self.codes[base + k * LANES + l] as i8 as f32
        }
    }

    /// Row `r`'s element values, equal bit for bit to the reference
    /// dequantizer's (each is one rounding of `scale·value + offset`).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let (g, l) = (r / LANES, r % LANES);
        let s = self.scheme.sub;
        for (j, o) in out.chunks_exact_mut(s).enumerate() {
            let (sc, of) = self.factors(g, j, l);
            for (i, v) in o.iter_mut().enumerate() {
                let q = self.value(g, j * s + i, l);
                *v = if self.scheme.offsets {
                    sc.mul_add(q, of)
                } else {
                    sc * q
                };
            }
        }
    }

    /// The portable product of rows `g0 * 16 ..` of groups `groups` with
    /// one row of `x` (and its [`sub_sums`] `sx`), written to `out` from
    /// the first row of group `groups.start`: the defining order of the
    /// module docs, lane by lane.
    pub fn gemv_portable(
        &self,
        groups: std::ops::Range<usize>,
        x: &[f32],
        sx: &[f32],
        out: &mut [f32],
    ) {
        let s = self.scheme.sub;
        for g in groups.clone() {
            for l in 0..LANES {
                let r = g * LANES + l;
                if r >= self.rows {
                    break;
                }
                let mut acc = 0f32;
                for j in 0..self.subs {
                    let (mut e, mut o) = (0f32, 0f32);
                    for p in 0..s / 2 {
                        let k = j * s + 2 * p;
                        e = self.value(g, k, l).mul_add(x[k], e);
                        o = self.value(g, k + 1, l).mul_add(x[k + 1], o);
                    }
                    let (sc, of) = self.factors(g, j, l);
                    acc = sc.mul_add(e + o, acc);
                    if self.scheme.offsets {
                        acc = of.mul_add(sx[j], acc);
                    }
                }
                out[r - groups.start * LANES] = acc;
            }
        }
    }
}

fn group_code_bytes(s: &Scheme, cols: usize) -> usize {
    if s.nibble {
        cols / 2 * LANES
    } else {
        cols * LANES
    }
}

fn d_per_group(s: &Scheme, subs: usize) -> usize {
    match s.scales {
        ScaleKind::F16 => subs,
        ScaleKind::Super { subs_per_super } => subs / subs_per_super,
    }
}

/// Bytes [`pack`] stores for a `rows × cols` matrix of `format` (`None`
/// for formats kept as stored), for the memory plan.
pub fn packed_bytes(format: QuantFormat, rows: usize, cols: usize) -> Option<usize> {
    let s = Scheme::of(format)?;
    let groups = rows.div_ceil(LANES);
    let subs = cols / s.sub;
    let d = d_per_group(&s, subs) * LANES * 2;
    let m = match s.scales {
        ScaleKind::F16 => 0,
        ScaleKind::Super { .. } => subs * LANES,
    };
    let per = group_code_bytes(&s, cols) + d + m + if s.offsets { d + m } else { 0 };
    Some(groups * per)
}

/// `m` repacked into 16-row groups, in parallel over groups (`None` for
/// formats kept as stored).
pub(crate) fn pack(m: &QuantMatrix) -> Option<Packed> {
    let format = m.format();
    let scheme = Scheme::of(format)?;
    let (rows, cols) = (m.rows(), m.cols());
    let groups = rows.div_ceil(LANES);
    let subs = cols / scheme.sub;
    let gcb = group_code_bytes(&scheme, cols);
    let dpg = d_per_group(&scheme, subs) * LANES;
    let mpg = match scheme.scales {
        ScaleKind::F16 => 0,
        ScaleKind::Super { .. } => subs * LANES,
    };
    let (opg_d, opg_m) = if scheme.offsets { (dpg, mpg) } else { (0, 0) };
    let mut p = Packed {
        scheme,
        rows,
        cols,
        groups,
        subs,
        codes: vec![0u8; groups * gcb],
        scale_d: vec![0u16; groups * dpg],
        scale_m: vec![0i8; groups * mpg],
        offs_d: vec![0u16; groups * opg_d],
        offs_m: vec![0i8; groups * opg_m],
    };
    let (bs, bb) = (format.block_size(), format.block_bytes());
    let subs_per_block = bs / scheme.sub;
    let spd = match scheme.scales {
        ScaleKind::F16 => 1,
        ScaleKind::Super { subs_per_super } => subs_per_super,
    };
    struct Out(*mut u8, *mut u16, *mut i8, *mut u16, *mut i8);
    // SAFETY: each group writes only its own disjoint ranges below.
    unsafe impl Sync for Out {}
    let out = Out(
        p.codes.as_mut_ptr(),
        p.scale_d.as_mut_ptr(),
        p.scale_m.as_mut_ptr(),
        p.offs_d.as_mut_ptr(),
        p.offs_m.as_mut_ptr(),
    );
    let out = &out;
    (0..groups).into_par_iter().for_each(|g| {
        // SAFETY: group g's ranges [g·len, (g+1)·len) of each buffer are in
        // bounds (the buffers hold `groups` of them) and no other group
        // touches them.
        let (codes, sd, sm, od, om) = unsafe {
            (
                std::slice::from_raw_parts_mut(out.0.add(g * gcb), gcb),
                std::slice::from_raw_parts_mut(out.1.add(g * dpg), dpg),
                std::slice::from_raw_parts_mut(out.2.add(g * mpg), mpg),
                std::slice::from_raw_parts_mut(out.3.add(g * opg_d), opg_d),
                std::slice::from_raw_parts_mut(out.4.add(g * opg_m), opg_m),
            )
        };
        let mut c = [0u8; 256];
        let mut sc = [Factor::default(); 16];
        let mut of = [Factor::default(); 16];
        let lanes = (rows - g * LANES).min(LANES);
        let row: Vec<&[u8]> = (0..lanes)
            .map(|l| m.rows_bytes(g * LANES + l..g * LANES + l + 1))
            .collect();
        // Block column by block column, so the 16 rows' writes of one
        // column land in one small span of the group's codes.
        for bi in 0..cols / bs {
            let k0 = bi * bs;
            for (l, row) in row.iter().enumerate() {
                let c = &mut c[..bs];
                let blk = &row[bi * bb..bi * bb + bb];
                if scheme.nibble {
                    let dst = &mut codes[nibble_line(k0)..nibble_line(k0 + bs)];
                    if direct_nibbles(format, blk, dst, l, &mut sc, &mut of) {
                        for s in 0..subs_per_block {
                            let j = bi * subs_per_block + s;
                            sd[(j / spd) * LANES + l] = sc[s].d;
                            if opg_d > 0 {
                                od[(j / spd) * LANES + l] = of[s].d;
                            }
                        }
                        continue;
                    }
                }
                decompose(format, blk, c, &mut sc, &mut of);
                if scheme.nibble {
                    let dst = &mut codes[nibble_line(k0)..nibble_line(k0 + bs)];
                    for (i, two) in c.chunks_exact(2).enumerate() {
                        dst[nibble_byte(2 * i, l)] = two[0] | (two[1] << 4);
                    }
                } else {
                    let dst = &mut codes[k0 * LANES..(k0 + bs) * LANES];
                    for (d, &code) in dst.chunks_exact_mut(LANES).zip(c.iter()) {
                        d[l] = code;
                    }
                }
                for s in 0..subs_per_block {
                    let j = bi * subs_per_block + s;
                    sd[(j / spd) * LANES + l] = sc[s].d;
                    if mpg > 0 {
                        sm[j * LANES + l] = sc[s].mult;
                    }
                    if opg_d > 0 {
                        od[(j / spd) * LANES + l] = of[s].d;
                    }
                    if opg_m > 0 {
                        om[j * LANES + l] = of[s].mult;
                    }
                }
            }
        }
    });
    Some(p)
}

/// The sum of each sub-block of `s` elements of `x` (a whole number of
/// them), in a fixed tree: lanes `v[i] = x[i] + x[i + 16]` (`v = x` for
/// 16), then halves added (`v[i] + v[i + 8]`, `+ 4`, `+ 2`, `+ 1`) — the
/// order the vector code takes.
pub(crate) fn sub_sums(x: &[f32], s: usize, out: &mut [f32]) {
    for (o, c) in out.iter_mut().zip(x.chunks_exact(s)) {
        let mut v = [0f32; 16];
        for i in 0..16 {
            v[i] = if s == 32 { c[i] + c[i + 16] } else { c[i] };
        }
        let mut w = 8;
        while w >= 1 {
            for i in 0..w {
                v[i] += v[i + w];
            }
            w /= 2;
        }
        *o = v[0];
    }
}
