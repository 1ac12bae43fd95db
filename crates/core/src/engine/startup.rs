//! The phases of an engine's start, each timed and logged on one line as it ends
//! (`startup: weights 1.234 s`), so a slow start shows where its time went.

use std::sync::OnceLock;
use std::time::Instant;

/// One timed phase of a start.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct StartupPhase {
    pub name: &'static str,
    pub seconds: f64,
}

static PROCESS_START: OnceLock<Instant> = OnceLock::new();

/// Records the process's start; the binary calls it first thing in `main`. Later calls are no-ops.
pub fn mark_process_start() {
    PROCESS_START.get_or_init(Instant::now);
}

/// Seconds since [`mark_process_start`] (or since the first call here, if it never ran).
pub fn since_process_start() -> f64 {
    PROCESS_START
        .get_or_init(Instant::now)
        .elapsed()
        .as_secs_f64()
}

/// Times consecutive phases.
pub(crate) struct PhaseClock {
    last: Instant,
    phases: Vec<StartupPhase>,
}

impl PhaseClock {
    pub(crate) fn new() -> Self {
        Self {
            last: Instant::now(),
            phases: Vec::new(),
        }
    }

    /// Ends the phase running since the previous one ended.
    pub(crate) fn done(&mut self, name: &'static str) {
        let now = Instant::now();
        self.push(name, (now - self.last).as_secs_f64());
        self.last = now;
    }

    fn push(&mut self, name: &'static str, seconds: f64) {
        tracing::info!("startup: {name} {seconds:.3} s");
        self.phases.push(StartupPhase { name, seconds });
    }

    pub(crate) fn finish(self) -> Vec<StartupPhase> {
        self.phases
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_are_consecutive_and_in_order() {
        let mut c = PhaseClock::new();
        std::thread::sleep(std::time::Duration::from_millis(5));
        c.done("a");
        c.done("b");
        let p = c.finish();
        assert_eq!(p.iter().map(|p| p.name).collect::<Vec<_>>(), ["a", "b"]);
        assert!(p[0].seconds >= 0.005 && p[1].seconds < p[0].seconds);
        assert!(since_process_start() >= 0.0);
    }
}
