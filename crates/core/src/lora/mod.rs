//! LoRA adapters: PEFT directories read and checked against the base ([`peft`]); the names
//! callers use and the adapters kept in host memory ([`registry`]); which adapter sits in which
//! device slot ([`table`]); the device stacks ([`slots`]); and the linear method that adds each
//! row's adapter term ([`linear`]).

pub mod linear;
pub mod peft;
pub mod registry;
pub mod slots;
pub mod table;

pub use linear::LoraLinear;
pub use peft::{AdapterConfig, BaseShape, LoraAdapter, LoraError, LoraModule, Target};
pub use registry::{LoraRegistry, ResolvedLora};
pub use slots::{LoraSlots, ProjectionSlots};
pub use table::SlotTable;

use std::fmt;

/// The engine's name for a loaded adapter (stable while it stays registered).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AdapterId(pub u32);

impl fmt::Display for AdapterId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Multi-adapter serving limits (vLLM's flags).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoraOptions {
    /// Adapters resident on the device at once, and so the most distinct adapters in one step
    /// (`--max-loras`).
    pub max_loras: usize,
    /// The largest rank an adapter may have (`--max-lora-rank`).
    pub max_rank: usize,
    /// Adapters kept in host memory (`--max-cpu-loras`, at least `max_loras`).
    pub max_cpu_loras: usize,
}

impl Default for LoraOptions {
    fn default() -> Self {
        Self {
            max_loras: 1,
            max_rank: 16,
            max_cpu_loras: 1,
        }
    }
}

/// The most device slots `--max-loras` may ask for (each holds an adapter of `--max-lora-rank`
/// for every projection: ~84 MB at rank 16 for the 8B shape).
pub const MAX_LORAS: usize = 1024;

impl LoraOptions {
    /// Checks the limits; `max_cpu_loras` below `max_loras` is raised to it (as vLLM does).
    pub fn validated(mut self) -> Result<Self, String> {
        if self.max_loras == 0 || self.max_loras > MAX_LORAS {
            return Err(format!(
                "max_loras must be in 1..={MAX_LORAS}, got {}",
                self.max_loras
            ));
        }
        if self.max_rank == 0 || self.max_rank > 512 {
            return Err(format!(
                "max_lora_rank must be in 1..=512, got {}",
                self.max_rank
            ));
        }
        self.max_cpu_loras = self.max_cpu_loras.max(self.max_loras);
        Ok(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_are_checked_and_host_copies_cover_the_slots() {
        let opts = |max_loras, max_rank, max_cpu_loras| LoraOptions {
            max_loras,
            max_rank,
            max_cpu_loras,
        };
        for bad in [
            opts(0, 16, 1),
            opts(MAX_LORAS + 1, 16, 1),
            opts(1, 0, 1),
            opts(1, 513, 1),
        ] {
            assert!(bad.validated().is_err(), "{bad:?}");
        }
        let ok = opts(4, 16, 1).validated().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(ok.max_cpu_loras, 4);
    }
}
