//! `--cpu-matmul fast` on Intel AMX: batched products with packed weights
//! as bf16 tile products (`tdpbf16ps`, 16 × 16 outputs × 32 products per
//! instruction).
//!
//! A pair of groups' weights are dequantized once into bf16 panels
//! ([`super::bf16`]: per pair of elements `2i, 2i + 1` one 64-byte row of
//! 16 lanes × two bf16), so 16 such rows (32 elements of `k`) are one B
//! tile. The rows of
//! `x`, rounded to bf16 once per product, are A tiles of 16 rows × 32
//! elements. Four C tiles (32 rows of `x` × 32 weight rows) accumulate in
//! f32 over all of `k` and are stored once. The result is the f32-summed
//! product of the bf16-rounded weights and activations: each output within
//! about 2 · 2⁻⁹ of Σ|w·x| of the exact one, and a row's result depends on
//! how many rows share its product only through which path runs (decode
//! rows never come here).
//!
//! Linux hands a process the AMX tile state only after it asks
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`); [`available`]
//! asks once and says no when the CPU lacks AMX-BF16 or the kernel refuses,
//! so a process never executes a tile instruction it was not granted. Tile
//! instructions are written as inline assembly (Rust's AMX intrinsics are
//! not stable).

use std::arch::asm;
use std::arch::x86_64::*;

use super::bf16::bf16_panel;
use super::packed::{Lines, Packed, LANES};
use super::packed_avx512::lane_mask;

/// Whether this process may run AMX-BF16 tiles (detected and requested once).
pub(crate) fn available() -> bool {
    static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OK.get_or_init(|| {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            return false;
        }
        // CPUID leaf 7 exists on every CPU with AVX-512.
        let c = __cpuid_count(7, 0);
        let (bf16, tile) = ((c.edx >> 22) & 1 == 1, (c.edx >> 24) & 1 == 1);
        bf16 && tile && request_tile_permission()
    })
}

/// `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`: true when Linux
/// grants this process the tile data state.
#[cfg(target_os = "linux")]
fn request_tile_permission() -> bool {
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
    const XFEATURE_XTILEDATA: i64 = 18;
    let ret: i64;
    // SAFETY: a plain system call that only changes this process's
    // permitted xsave features; it clobbers rcx and r11.
    unsafe {
        asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL => ret,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack)
        );
    }
    ret == 0
}

#[cfg(not(target_os = "linux"))]
fn request_tile_permission() -> bool {
    false
}

/// Rows of `x` per block of A tiles (two tiles of 16).
pub(crate) const ROW_BLOCK: usize = 32;

/// The tile configuration: palette 1, every tile 16 rows × 64 bytes
/// (C: 16 × 16 f32; A: 16 rows × 32 bf16; B: 16 pair rows × 16 lanes).
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

impl TileConfig {
    fn all_16x64() -> Self {
        let mut c = [0u8; 64];
        c[0] = 1;
        for t in 0..8 {
            c[16 + 2 * t] = 64;
            c[48 + t] = 16;
        }
        TileConfig(c)
    }
}

/// Groups `groups` (at most two) times row blocks `blocks` (of
/// [`ROW_BLOCK`]) of `xb` (bf16 rows of `cols`, padded with zero rows to
/// whole blocks), into `out` (`out_stride` apart, column 0 = the first row
/// of `groups.start`), for the `n` real rows only.
///
/// # Safety
/// [`available`] returned true; AVX-512F; `xb` holds the padded rows;
/// `out` is writable at rows `< n` of those blocks for the groups' matrix
/// rows and nobody else writes there meanwhile.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn gemm_block(
    p: &Packed,
    groups: std::ops::Range<usize>,
    blocks: std::ops::Range<usize>,
    n: usize,
    xb: *const u16,
    out: *mut f32,
    out_stride: usize,
) {
    let k = p.cols;
    let ng = groups.len();
    debug_assert!((1..=2).contains(&ng) && k % 32 == 0);
    // Two groups' panels (a lone group's second is its own, unused).
    let mut panel = Lines::new(2 * k / 2);
    let mut c = Lines::new(4 * 16);
    let cfg = TileConfig::all_16x64();
    // SAFETY: as the function's contract: every tile load reads inside
    // `xb` (padded rows) or the panel, every store writes `c`.
    unsafe {
        let pp = panel.as_mut_ptr() as *mut u32;
        for gi in 0..2 {
            bf16_panel(p, groups.start + gi.min(ng - 1), pp.add(gi * k / 2 * LANES));
        }
        let (b0, b1) = (pp as *const u8, pp.add(k / 2 * LANES) as *const u8);
        let masks = [
            lane_mask(p, groups.start),
            lane_mask(p, groups.start + (ng - 1)),
        ];
        let row_bytes = k * 2;
        asm!("ldtilecfg [{0}]", in(reg) cfg.0.as_ptr(), options(nostack));
        for blk in blocks {
            let a0 = (xb as *const u8).add(blk * ROW_BLOCK * row_bytes);
            let a1 = a0.add(16 * row_bytes);
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                options(nostack)
            );
            for kc in 0..k / 32 {
                asm!(
                    "tileloadd tmm4, [{a0} + {rs}]",
                    "tileloadd tmm5, [{a1} + {rs}]",
                    "tileloadd tmm6, [{b0} + {bs}]",
                    "tileloadd tmm7, [{b1} + {bs}]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    a0 = in(reg) a0.add(kc * 64),
                    a1 = in(reg) a1.add(kc * 64),
                    b0 = in(reg) b0.add(kc * 16 * 64),
                    b1 = in(reg) b1.add(kc * 16 * 64),
                    rs = in(reg) row_bytes,
                    bs = in(reg) 64usize,
                    options(nostack)
                );
            }
            let cp = c.as_mut_ptr() as *mut u8;
            asm!(
                "tilestored [{c0} + {s}], tmm0",
                "tilestored [{c1} + {s}], tmm1",
                "tilestored [{c2} + {s}], tmm2",
                "tilestored [{c3} + {s}], tmm3",
                c0 = in(reg) cp,
                c1 = in(reg) cp.add(1024),
                c2 = in(reg) cp.add(2048),
                c3 = in(reg) cp.add(3072),
                s = in(reg) 64usize,
                options(nostack)
            );
            // C tile (half h of the rows, group gi) row r → out row.
            for h in 0..2 {
                for r in 0..16 {
                    let t = blk * ROW_BLOCK + h * 16 + r;
                    if t >= n {
                        break;
                    }
                    for (gi, &mask) in masks.iter().enumerate().take(ng) {
                        let v = _mm512_loadu_ps(c.as_ptr().add(((h * 2 + gi) * 16 + r) * LANES));
                        _mm512_mask_storeu_ps(out.add(t * out_stride + gi * LANES), mask, v);
                    }
                }
            }
        }
        asm!("tilerelease", options(nostack));
    }
}
