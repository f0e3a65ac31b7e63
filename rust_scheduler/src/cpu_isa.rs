//! Which SIMD instruction set the CPU kernels (`cpu_linear`, `cpu_quant_linear`,
//! `cpu_attention`, `cpu_amx_linear`) use: the widest this CPU has, detected at run time, capped
//! by `FERROBATCH_CPU_ISA` (read once per process) and by the caller (tests force each path;
//! the float32 kernels ask for at most `Avx512`; `cpu_amx_linear` and the prefill kernel's AMX
//! path, `cpu_amx_prefill`, for `Amx`).
//!
//! Invariant: a kernel runs a SIMD path only for an `Isa` returned by [`Isa::detect`], so the
//! `target_feature` functions it calls are only ever reached on a CPU with those features.

/// The widest instruction set a call may use (tests force the narrower ones).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Isa {
    Portable,
    /// AVX2 with FMA and F16C (every AVX2 CPU has the other two)
    Avx2,
    Avx512,
    /// AVX-512 plus AMX tiles (`cpu_amx_linear`, `cpu_amx_prefill`), only where Linux grants
    /// their state
    Amx,
}

impl Isa {
    /// The cap set by `FERROBATCH_CPU_ISA` (`amx`, `avx512`, `avx2` or `portable`; read once), if
    /// any: to compare the paths on one machine, or to avoid AVX-512 where it slows the clock.
    fn env_cap() -> Isa {
        static CAP: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *CAP.get_or_init(|| match std::env::var("FERROBATCH_CPU_ISA").as_deref() {
            Ok("avx2") => Isa::Avx2,
            Ok("portable") => Isa::Portable,
            Ok("avx512") => Isa::Avx512,
            _ => Isa::Amx,
        })
    }

    /// Its name, as `FERROBATCH_CPU_ISA` spells it (the Python binding `linear_isa`).
    #[cfg_attr(not(feature = "python"), allow(dead_code))]
    pub(crate) fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Amx => "amx",
        }
    }

    /// The widest of `Amx` / `Avx512` / `Avx2` / `Portable` that this CPU has (`Amx`: also
    /// granted by Linux, `cpu_amx_linear::amx_permitted`), at most `max` (and at most
    /// `FERROBATCH_CPU_ISA`).
    pub(crate) fn detect(max: Isa) -> Isa {
        let max = max.min(Isa::env_cap());
        #[cfg(target_arch = "x86_64")]
        {
            if max >= Isa::Amx && crate::cpu_amx_linear::amx_permitted() {
                return Isa::Amx;
            }
            if max >= Isa::Avx512 && std::is_x86_feature_detected!("avx512f") {
                return Isa::Avx512;
            }
            if max >= Isa::Avx2
                && std::is_x86_feature_detected!("avx2")
                && std::is_x86_feature_detected!("fma")
                && std::is_x86_feature_detected!("f16c")
            {
                return Isa::Avx2;
            }
        }
        let _ = max;
        Isa::Portable
    }

    /// For tests: the portable path and each SIMD path up to AVX-512 this CPU has, so a kernel
    /// is checked on every path it can take here.
    #[cfg(test)]
    pub(crate) fn every_path() -> Vec<Isa> {
        let mut out = vec![Isa::Portable];
        for isa in [Isa::Avx2, Isa::Avx512] {
            if Isa::detect(isa) == isa {
                out.push(isa);
            }
        }
        out
    }
}
