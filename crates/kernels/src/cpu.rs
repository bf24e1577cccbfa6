//! What the CPU offers the kernels, detected once: every kernel (and the merge's row
//! conversion) chooses its build from [`caps`], so a process takes one answer for all of them
//! and a new feature is read in one place. The choice of build stays with each kernel (the
//! dense product, the quantized products and their panels do not want the same features), in
//! the words of one [`Isa`].

use std::sync::OnceLock;

/// The CPU features the kernels choose by (all false off x86-64: the portable builds run).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[allow(clippy::struct_excessive_bools)] // one flag per feature, as CPUID reports them
pub struct Caps {
    /// AVX2 (256-bit integer and float vectors).
    pub avx2: bool,
    /// Fused multiply-add on 256-bit vectors.
    pub fma: bool,
    /// Half-precision conversion (`vcvtph2ps`).
    pub f16c: bool,
    /// AVX-VNNI: the VEX-encoded `vpdpbusd` on 256-bit vectors.
    pub avxvnni: bool,
    /// AVX-512 Foundation.
    pub avx512f: bool,
    /// AVX-512 byte and word instructions.
    pub avx512bw: bool,
    /// AVX-512 VNNI: `vpdpbusd` on 512-bit vectors.
    pub avx512vnni: bool,
}

impl Caps {
    /// Asks the CPU.
    fn detect() -> Caps {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            Caps {
                avx2: has!("avx2"),
                fma: has!("fma"),
                f16c: has!("f16c"),
                avxvnni: has!("avxvnni"),
                avx512f: has!("avx512f"),
                avx512bw: has!("avx512bw"),
                avx512vnni: has!("avx512vnni"),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        Caps::default()
    }

    /// AVX2 and FMA: the kernels' fast build (see the `kernel!` macro).
    pub fn avx2_fma(&self) -> bool {
        self.avx2 && self.fma
    }

    /// AVX2, FMA and F16C: the fast build of the kernels that read half-precision values
    /// (every AVX2 CPU has F16C).
    pub fn avx2_fma_f16c(&self) -> bool {
        self.avx2_fma() && self.f16c
    }
}

/// This CPU's features, detected on the first call.
pub fn caps() -> &'static Caps {
    static CAPS: OnceLock<Caps> = OnceLock::new();
    CAPS.get_or_init(Caps::detect)
}

/// The instruction set a kernel runs with. Each kernel picks among the ones it has a build
/// for ([`super::dense::available`], [`super::quant::isa`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// Portable Rust (the quantized products: equal to [`Isa::Avx2`] bit for bit).
    Scalar,
    /// AVX2, FMA and F16C: 8 lanes, 16 registers.
    Avx2,
    /// [`Isa::Avx2`] and AVX-VNNI: the 32-wide formats' pair sums in one instruction
    /// (`vpdpbusd`), bit for bit AVX2's (the k-quants take the AVX2 build).
    AvxVnni,
    /// AVX-512 F: 16 lanes, 32 registers.
    Avx512,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table holds what the CPU answers, and one answer for every caller.
    #[test]
    fn caps_are_the_cpus() {
        assert_eq!(*caps(), Caps::detect());
        assert!(std::ptr::eq(caps(), caps()));
        #[cfg(target_arch = "x86_64")]
        assert_eq!(caps().avx2, std::arch::is_x86_feature_detected!("avx2"));
    }
}
