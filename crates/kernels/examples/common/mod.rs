//! What the GPU benchmarks share.

use candle_core::{Device, Result};
use std::time::Instant;

/// Mean seconds of `f` over enough calls to take ~0.2 s, after two warm-up calls.
pub fn time(dev: &Device, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    f()?;
    dev.synchronize()?;
    let t0 = Instant::now();
    f()?;
    dev.synchronize()?;
    let one = t0.elapsed().as_secs_f64().max(1e-6);
    let iters = ((0.2 / one) as usize).clamp(3, 200);
    let t0 = Instant::now();
    for _ in 0..iters {
        f()?;
    }
    dev.synchronize()?;
    Ok(t0.elapsed().as_secs_f64() / iters as f64)
}
