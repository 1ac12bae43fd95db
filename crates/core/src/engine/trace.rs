//! Step tracing: where each engine step's time goes ([`StepTiming`], logged at debug level every
//! 200 steps and per step at trace level) and the CUDA profiler's range ([`StepProfile`]).

use candle_core::Device;
use std::time::Instant;

/// `RSERVE_CUDA_PROFILE_STEPS=START:COUNT` brackets engine steps START..START+COUNT with the CUDA
/// profiler's start and stop, so `ncu --profile-from-start off` sees exactly those steps.
#[derive(Debug, Default)]
pub(super) struct StepProfile {
    step: u64,
    range: Option<(u64, u64)>,
}

impl StepProfile {
    pub(super) fn from_env() -> Self {
        let range = std::env::var("RSERVE_CUDA_PROFILE_STEPS")
            .ok()
            .and_then(|v| {
                let (a, b) = v.split_once(':')?;
                Some((a.trim().parse().ok()?, b.trim().parse().ok()?))
            });
        Self { step: 0, range }
    }

    /// Called before each step with the device; switches the profiler at the range's edges.
    pub(super) fn tick(&mut self, device: &Device) {
        let step = self.step;
        self.step += 1;
        let on = match self.range {
            Some((start, _)) if step == start => true,
            Some((start, count)) if step == start + count => false,
            _ => return,
        };
        #[cfg(feature = "cuda")]
        if let Device::Cuda(d) = device {
            if let Err(e) = crate::device::gpu::profiler(d, on) {
                tracing::warn!("{e}");
            }
        }
        #[cfg(not(feature = "cuda"))]
        let _ = (device, on);
    }
}

/// Where a step's time goes, averaged and logged at debug level every 200 steps: host work up to
/// the last kernel issued (schedule and batch inputs, then the forward pass's launches), waiting
/// for the device and reading the sampled tokens (or logits), of which the previous step's
/// detokenizing and sending done while the device runs, and the host work after (token stops, and
/// the text work of a step with nothing after it). With async scheduling a step issued ahead waits
/// for the tokens of the step before it, and its text work comes after. At trace level every step
/// is logged with its shape (with the images its inputs encoded: their encoder is issued while
/// the step is prepared) and the host time since the previous step ended
/// (`rserve_core::engine=trace`).
#[derive(Debug, Default)]
pub(super) struct StepTiming {
    pub(super) steps: u32,
    pub(super) tokens: usize,
    /// This step's sequences, tokens, one-token (decode) rows and images encoded, for the trace.
    pub(super) shape: (usize, usize, usize, u64),
    /// When the previous step ended and how many steps ran so far, for the trace.
    pub(super) last_end: Option<Instant>,
    pub(super) count: u64,
    pub(super) prepare_s: f64,
    pub(super) issue_s: f64,
    pub(super) wait_s: f64,
    pub(super) after_s: f64,
    pub(super) settle_s: f64,
    pub(super) prepared: Option<Instant>,
    pub(super) issued: Option<Instant>,
    pub(super) sampled: Option<Instant>,
}

impl StepTiming {
    pub(super) fn finish(&mut self, started: Instant) {
        let end = Instant::now();
        let (Some(prepared), Some(issued), Some(sampled)) = (
            self.prepared.take(),
            self.issued.take(),
            self.sampled.take(),
        ) else {
            return;
        };
        let (seqs, tokens, decodes, images) = std::mem::take(&mut self.shape);
        tracing::trace!(
            "step {}: {seqs} seqs, {tokens} tokens, {decodes} decode rows, {images} images; {:.2} ms since the last step, {:.2} ms issue (of which {:.2} ms prepare), {:.2} ms wait, {:.2} ms after",
            self.count,
            self.last_end
                .map_or(0.0, |t| started.duration_since(t).as_secs_f64() * 1e3),
            issued.duration_since(started).as_secs_f64() * 1e3,
            prepared.duration_since(started).as_secs_f64() * 1e3,
            sampled.duration_since(issued).as_secs_f64() * 1e3,
            end.duration_since(sampled).as_secs_f64() * 1e3
        );
        self.count += 1;
        self.last_end = Some(end);
        self.steps += 1;
        self.prepare_s += prepared.duration_since(started).as_secs_f64();
        self.issue_s += issued.duration_since(started).as_secs_f64();
        self.wait_s += sampled.duration_since(issued).as_secs_f64();
        self.after_s += end.duration_since(sampled).as_secs_f64();
        if self.steps == 200 {
            let n = f64::from(self.steps);
            tracing::debug!(
                "steps: {:.1} tokens/step; per step {:.3} ms host issue (of which {:.3} ms schedule + inputs), {:.3} ms device wait + read (of which {:.3} ms detokenize + send), {:.3} ms host after",
                self.tokens as f64 / n,
                self.issue_s / n * 1e3,
                self.prepare_s / n * 1e3,
                self.wait_s / n * 1e3,
                self.settle_s / n * 1e3,
                self.after_s / n * 1e3
            );
            *self = Self {
                last_end: self.last_end,
                count: self.count,
                ..Self::default()
            };
        }
    }
}
