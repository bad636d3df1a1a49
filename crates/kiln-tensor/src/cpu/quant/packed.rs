//! Block weights repacked once at load into groups of 16 rows, so that a
//! product's vectors run along output rows.
//!
//! A GGML block format stores each row as blocks of small integer codes
//! with per-block (or per-sub-block) scales. Here the 16 rows of a group
//! sit in the 16 lanes of a vector, the scales of a sub-block are one
//! vector load for all 16 rows, and nothing is reduced horizontally.
//!
//! **Codes.** Each weight is stored as an unsigned code `u` whose value is
//! `u − bias` (a constant of the format: 8 for Q4_0, 128 for Q8_0, 0 for
//! the formats with a min), or for IQ4_NL `lut[u] − 128`. Codes are laid
//! out so that one 32-bit word of a lane holds four consecutive elements,
//! the shape `vpdpbusd` multiplies. The low 4 bits of a code sit in nibble
//! lines — per run of 8 elements of a group 64 bytes, lane `l`'s word at
//! `4l`, byte `i` holding element `8m + i` in its low nibble and `8m + 4 +
//! i` in its high one ([`nibble_at`]) — and the 5- and 6-bit formats keep
//! the bits above in a plane after them ([`plane_at`]: per run of `32 /
//! high` elements 64 bytes, byte `i` of a lane's word holding the high bits
//! of elements `4r + i` at bit `high · r`), so they take 5.5–6.6 bits a
//! weight as in the file. Q8_0's codes are bytes, per run of 4 elements a
//! 64-byte line ([`byte_at`]); Q2_K and Q3_K take 4 bits. Scales stay f16,
//! K-quant sub-scales bytes.
//!
//! **The product.** A row of `x` is split, per sub-block of `S` elements
//! (16 or 32, the format's), into exact integers ([`super::limbs`]):
//! `x_i ≈ X_i · 2^e` with `X_i = 65536·a_i + 256·b_i + c_i` and bytes
//! `a, b, c` — 23 significant bits for the sub-block's largest element,
//! the same absolute step for the others. Then for each output, for each
//! sub-block `j` in order,
//!
//! ```text
//! T = 256·Σ v_i·a_i + Σ v_i·b_i,  C = Σ v_i·c_i     (exact integers)
//! s = fma(f32(T), 256, f32(C))                      (≈ Σ v_i·X_i)
//! acc = fma(scale_j · 2^e, s, acc)                  (acc starts at 0)
//! acc = fma(offset_j, f32(Σ X_i) · 2^e, acc)         (formats with a min)
//! ```
//!
//! where `v_i` is the code's value, `scale_j` the f16 scale or, for
//! K-quants, `d · sub_scale` (exact in f32). The integer sums are exact,
//! so every path — AVX-512 VNNI (`vpdpbusd`: 64 byte products an
//! instruction), AVX2, the portable code — and every batch gives the same
//! bits; the only roundings are the ones written above. Against an f64
//! dot of the dequantized row the result differs by f32 rounding of the
//! `S`-term partial sums and by the activations' representation (at most
//! `2^(e−1)` an element, `e` ≤ the sub-block's largest exponent − 21).

use half::f16;
use kiln_quant::dequant::{e8m0_half, q3_k_scale, scale_min_k4, IQ4_NL_VALUES, MXFP4_VALUES};
use kiln_quant::{QuantFormat, QuantMatrix};
use rayon::prelude::*;

use super::codes::Codes;
use super::limbs::Limbs;

/// Rows in a group: the lanes of an AVX-512 f32 vector.
pub(crate) const LANES: usize = 16;

/// Where the 64-byte line of a group's nibble codes holding element `k`
/// (of every lane) starts.
#[inline(always)]
pub(crate) const fn nibble_line(k: usize) -> usize {
    (k / 8) * 64
}

/// The byte of a group's nibble codes holding element `k` of lane `l`,
/// and the shift of its nibble (0 or 4).
#[inline(always)]
pub(crate) const fn nibble_at(k: usize, l: usize) -> (usize, u32) {
    (nibble_line(k) + 4 * l + k % 4, 4 * ((k % 8) / 4) as u32)
}

/// Where, after a group's nibble lines (`cols / 2 · 16` bytes), the
/// 64-byte line of its `high`-bit plane holding element `k` starts.
#[inline(always)]
pub(crate) const fn plane_line(cols: usize, high: u32, k: usize) -> usize {
    cols / 2 * LANES + (k / (32 / high as usize)) * 64
}

/// The byte of a group's `high`-bit plane holding the high bits of element
/// `k` of lane `l`, and their shift.
#[inline(always)]
pub(crate) const fn plane_at(cols: usize, high: u32, k: usize, l: usize) -> (usize, u32) {
    let r = k % (32 / high as usize);
    (
        plane_line(cols, high, k) + 4 * l + r % 4,
        high * (r / 4) as u32,
    )
}

/// Where the 64-byte line of a group's byte codes holding element `k`
/// (of every lane) starts.
#[inline(always)]
pub(crate) const fn byte_line(k: usize) -> usize {
    (k / 4) * 64
}

/// The byte of a group's byte codes holding element `k` of lane `l`.
#[inline(always)]
pub(crate) const fn byte_at(k: usize, l: usize) -> usize {
    byte_line(k) + 4 * l + k % 4
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

/// A format's packing: code width, sub-block size, scale layout, and how
/// a code maps to its value.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Scheme {
    /// Low 4 bits in nibble lines (else whole bytes).
    pub nibble: bool,
    /// Bits above the nibble, in a plane (0, 1 or 2).
    pub high: u32,
    pub sub: usize,
    pub scales: ScaleKind,
    pub offsets: bool,
    /// A code's value is `u − bias` (`lut[u] − bias` with a table).
    pub bias: i32,
    /// The unsigned byte each nibble code stands for (IQ4_NL's values
    /// plus 128); `None`: the code itself.
    pub lut: Option<[u8; 16]>,
    /// The values of the 16 nibble codes as f32 (for 4-bit formats).
    pub table: [f32; 16],
}

impl Scheme {
    /// The packing of `format`, or `None` for the formats kept as they are
    /// stored (F16, BF16: no codes or scales; FP8: codes read through no
    /// linear map).
    pub(crate) fn of(format: QuantFormat) -> Option<Scheme> {
        use QuantFormat::*;
        let k = |n| ScaleKind::Super { subs_per_super: n };
        let f = ScaleKind::F16;
        let (nibble, high, sub, scales, offsets, bias) = match format {
            F16 | BF16 | FP8 => return None,
            Q4_0 => (true, 0, 32, f, false, 8),
            Q4_1 => (true, 0, 32, f, true, 0),
            // Scale d and offset −d·z a sub-block: f16 times a multiplier
            // (1 and z), a "super-block" of one sub-block.
            Q4Z | Q4Z32 => (true, 0, 32, k(1), true, 0),
            IQ4NL => (true, 0, 32, f, false, 128),
            // e2m1 codes (doubled) through a table; the e8m0 scale, halved,
            // as the f16 scale (exact: `mxfp4_scales_fit`).
            MXFP4 => (true, 0, 32, f, false, 128),
            Q5_0 => (true, 1, 32, f, false, 16),
            Q8_0 => (false, 0, 32, f, false, 128),
            Q5_1 => (true, 1, 32, f, true, 0),
            Q2K => (true, 0, 16, k(16), true, 0),
            Q3K => (true, 0, 16, k(16), false, 4),
            Q4K => (true, 0, 32, k(8), true, 0),
            Q5K => (true, 1, 32, k(8), true, 0),
            Q6K => (true, 2, 16, k(16), false, 32),
        };
        let lut = match format {
            IQ4NL => Some(IQ4_NL_VALUES.map(|v| (v as i16 + 128) as u8)),
            MXFP4 => Some(MXFP4_VALUES.map(|v| (v as i16 + 128) as u8)),
            _ => None,
        };
        let table = std::array::from_fn(|u| match lut {
            Some(t) => (t[u] as i32 - bias) as f32,
            None => (u as i32 - bias) as f32,
        });
        Some(Scheme {
            nibble,
            high,
            sub,
            scales,
            offsets,
            bias,
            lut,
            table,
        })
    }

    /// The value of a stored code.
    #[inline]
    pub(crate) fn value(&self, u: u8) -> i32 {
        match self.lut {
            Some(t) => t[u as usize & 15] as i32 - self.bias,
            None => u as i32 - self.bias,
        }
    }

    /// Whether operands pass 127 (Q8_0's codes, IQ4_NL's table), which
    /// AVX2's `vpmaddubsw` cannot pair without overflowing i16.
    pub(crate) fn wide(&self) -> bool {
        self.bias >= 128
    }

    /// The unsigned byte a product multiplies for a stored code (the code,
    /// or its table entry).
    #[inline]
    pub(crate) fn operand(&self, u: u8) -> u8 {
        match self.lut {
            Some(t) => t[u as usize & 15],
            None => u,
        }
    }
}

/// One sub-block's scale or offset as stored: f16 bits and a multiplier
/// (1 for [`ScaleKind::F16`]).
#[derive(Clone, Copy, Default)]
struct Factor {
    d: u16,
    mult: i8,
}

/// A block of `format` split into its stored codes (one unsigned byte per
/// element, see [`Scheme::value`]) and per-sub-block scale and offset.
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
            for j in 0..16 {
                let h0 = ((qh >> j) << 4) & 0x10;
                let h1 = (qh >> (j + 12)) & 0x10;
                codes[j] = ((qs[j] & 0xF) as u32 | h0) as u8;
                codes[j + 16] = ((qs[j] >> 4) as u32 | h1) as u8;
            }
            sc[0] = one(h(0));
            if format == Q5_1 {
                of[0] = one(h(2));
            }
        }
        Q8_0 => {
            for (c, &q) in codes[..32].iter_mut().zip(&b[2..34]) {
                *c = q ^ 0x80;
            }
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
                    y[l] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
                    y[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
                    y[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                    y[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
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
                // Value lo - 4 (high clear) or lo: the code less the bias 4.
                *c = lo + 4 * high;
            }
        }
        Q4_0 | Q4_1 | IQ4NL | MXFP4 | Q4Z | Q4Z32 => unreachable!("packed by direct_nibbles"),
        F16 | BF16 | FP8 => unreachable!("F16, BF16 and FP8 are not packed"),
    }
}

/// The nibble formats of Q4_0's byte order (Q4_0, Q4_1, IQ4_NL, MXFP4, and
/// Q4_Z's four runs) written straight from the block into lane `l` of a
/// group's nibble lines `dst` (the file's byte `j` of a 32-element run
/// holds element `j` low and `j + 16` high), with the block's scales (and
/// offsets); `false` for other formats. The same codes as [`decompose`]
/// then placing, without the per-element detour (it dominated load time).
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
    let runs: &[u8] = match format {
        Q4_0 | IQ4NL => &b[2..18],
        Q4_1 => &b[4..20],
        MXFP4 => &b[1..17],
        Q4Z => &b[4..68],
        Q4Z32 => &b[4..20],
        _ => return false,
    };
    for (r, qs) in runs.chunks_exact(16).enumerate() {
        // Element e of the run: byte e's low nibble (e < 16) or byte
        // e − 16's high one.
        let nib = |e: usize| if e < 16 { qs[e] & 0xF } else { qs[e - 16] >> 4 };
        for m in 0..4 {
            for i in 0..4 {
                let (at, _) = nibble_at(32 * r + 8 * m + i, l);
                dst[at] = nib(8 * m + i) | (nib(8 * m + 4 + i) << 4);
            }
        }
    }
    match format {
        MXFP4 => {
            sc[0] = Factor {
                d: half::f16::from_f32(e8m0_half(b[0])).to_bits(),
                mult: 1,
            }
        }
        Q4Z | Q4Z32 => {
            let z = (b[2] & 0x1F) as i8;
            for s in 0..runs.len() / 16 {
                sc[s] = Factor { d: h(0), mult: 1 };
                of[s] = Factor {
                    d: h(0) ^ 0x8000,
                    mult: z,
                };
            }
        }
        _ => sc[0] = Factor { d: h(0), mult: 1 },
    }
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
    /// Per group: `cols / 8` nibble lines or `cols / 4` byte lines of 64
    /// bytes (see the module docs).
    pub codes: Codes,
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
            // A power of two (8 or 16): no division in the kernels' loops.
            ScaleKind::Super { subs_per_super } => j >> subs_per_super.trailing_zeros(),
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

    /// The stored code of element `k` in lane `l` of group `g`.
    #[inline]
    pub fn code(&self, g: usize, k: usize, l: usize) -> u8 {
        let base = g * self.group_code_bytes();
        if self.scheme.nibble {
            let (at, shift) = nibble_at(k, l);
            let low = (self.codes[base + at] >> shift) & 0xF;
            let high = self.scheme.high;
            if high == 0 {
                return low;
            }
            let (at, shift) = plane_at(self.cols, high, k, l);
            low | (((self.codes[base + at] >> shift) & ((1 << high) - 1)) << 4)
        } else {
            self.codes[base + byte_at(k, l)]
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
                let q = self.scheme.value(self.code(g, j * s + i, l)) as f32;
                *v = if self.scheme.offsets {
                    sc.mul_add(q, of)
                } else {
                    sc * q
                };
            }
        }
    }

    /// The portable product of groups `groups` with row `t` of `x` (as
    /// [`Limbs`] of this format's sub-block), written to `out` from the
    /// first row of group `groups.start`: the defining arithmetic of the
    /// module docs, lane by lane.
    pub fn gemv_portable(
        &self,
        groups: std::ops::Range<usize>,
        x: &Limbs,
        t: usize,
        out: &mut [f32],
    ) {
        let s = self.scheme.sub;
        debug_assert_eq!(x.sub, s);
        for g in groups.clone() {
            for l in 0..LANES {
                let r = g * LANES + l;
                if r >= self.rows {
                    break;
                }
                let mut acc = 0f32;
                for j in 0..self.subs {
                    let info = x.info(t, j);
                    let (a, b, c) = x.limbs(t, j);
                    let (mut ta, mut tb, mut tc) = (0i32, 0i32, 0i32);
                    for i in 0..s {
                        let u = self.scheme.operand(self.code(g, j * s + i, l)) as i32;
                        ta += u * a[i] as i32;
                        tb += u * b[i] as i32;
                        tc += u * c[i] as i32;
                    }
                    let bias = self.scheme.bias;
                    let big = (ta << 8) + tb - bias * info.t;
                    let small = tc - bias * info.c;
                    let sum = (big as f32).mul_add(256.0, small as f32);
                    let (sc, of) = self.factors(g, j, l);
                    acc = (sc * info.scale).mul_add(sum, acc);
                    if self.scheme.offsets {
                        acc = of.mul_add(info.sum, acc);
                    }
                }
                out[r - groups.start * LANES] = acc;
            }
        }
    }
}
fn group_code_bytes(s: &Scheme, cols: usize) -> usize {
    if s.nibble {
        cols / 2 * LANES + cols * s.high as usize / 8 * LANES
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
/// Whether every MXFP4 block scale of `m`, halved (`2^(e-128)`), is an f16
/// (exponents −24 to 15): the packed form keeps scales as f16.
pub(crate) fn mxfp4_scales_fit(m: &QuantMatrix) -> bool {
    m.rows_bytes(0..m.rows())
        .chunks_exact(17)
        .all(|b| (104..=143).contains(&b[0]))
}

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
        codes: Codes::zeroed(groups * gcb),
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
                    let direct = {
                        let dst = &mut codes[nibble_line(k0)..nibble_line(k0 + bs)];
                        direct_nibbles(format, blk, dst, l, &mut sc, &mut of)
                    };
                    if !direct {
                        decompose(format, blk, c, &mut sc, &mut of);
                        for (i, &code) in c.iter().enumerate() {
                            let (at, shift) = nibble_at(k0 + i, l);
                            codes[at] |= (code & 0xF) << shift;
                            if scheme.high > 0 {
                                let (at, shift) = plane_at(cols, scheme.high, k0 + i, l);
                                codes[at] |= (code >> 4) << shift;
                            }
                        }
                    }
                } else {
                    decompose(format, blk, c, &mut sc, &mut of);
                    let dst = &mut codes[byte_line(k0)..byte_line(k0 + bs)];
                    for (i, &code) in c.iter().enumerate() {
                        dst[byte_at(i, l)] = code;
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
