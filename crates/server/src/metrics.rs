//! Prometheus metrics in the text exposition format, under vLLM's names so existing dashboards and
//! gateways read them: gauges and counters come from the engine's live stats, latency histograms
//! are observed by the HTTP layer as outputs stream.

use rserve_core::engine::EngineStats;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// A fixed-bucket histogram.
#[derive(Debug)]
pub struct Histogram {
    name: &'static str,
    help: &'static str,
    bounds: &'static [f64],
    counts: Vec<AtomicU64>,
    sum: Mutex<f64>,
}

impl Histogram {
    fn new(name: &'static str, help: &'static str, bounds: &'static [f64]) -> Self {
        Self {
            name,
            help,
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum: Mutex::new(0.0),
        }
    }

    pub fn observe(&self, v: f64) {
        let i = self
            .bounds
            .iter()
            .position(|&b| v <= b)
            .unwrap_or(self.bounds.len());
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        if let Ok(mut s) = self.sum.lock() {
            *s += v;
        }
    }

    fn render(&self, out: &mut String, labels: &str) {
        let _ = writeln!(
            out,
            "# HELP {} {}\n# TYPE {} histogram",
            self.name, self.help, self.name
        );
        let mut cum = 0u64;
        for (i, b) in self.bounds.iter().enumerate() {
            cum += self.counts[i].load(Ordering::Relaxed);
            let _ = writeln!(out, "{}_bucket{{{labels},le=\"{b}\"}} {cum}", self.name);
        }
        cum += self.counts[self.bounds.len()].load(Ordering::Relaxed);
        let _ = writeln!(out, "{}_bucket{{{labels},le=\"+Inf\"}} {cum}", self.name);
        let sum = self.sum.lock().map(|s| *s).unwrap_or(0.0);
        let _ = writeln!(
            out,
            "{}_sum{{{labels}}} {sum}\n{}_count{{{labels}}} {cum}",
            self.name, self.name
        );
    }
}

const LATENCY: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
];
const ITL: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
];

/// Histograms observed by the HTTP layer.
#[derive(Debug)]
pub struct Metrics {
    pub ttft: Histogram,
    pub itl: Histogram,
    pub tpot: Histogram,
    pub e2e: Histogram,
    pub queue: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            ttft: Histogram::new(
                "vllm:time_to_first_token_seconds",
                "Time to first token in seconds.",
                LATENCY,
            ),
            itl: Histogram::new(
                "vllm:inter_token_latency_seconds",
                "Time between streamed tokens in seconds.",
                ITL,
            ),
            tpot: Histogram::new(
                "vllm:time_per_output_token_seconds",
                "Mean time per output token of a request in seconds.",
                ITL,
            ),
            e2e: Histogram::new(
                "vllm:e2e_request_latency_seconds",
                "End-to-end request latency in seconds.",
                LATENCY,
            ),
            queue: Histogram::new(
                "vllm:request_queue_time_seconds",
                "Time a request waited before its first step in seconds.",
                LATENCY,
            ),
        }
    }
}

impl Metrics {
    /// The whole exposition text.
    pub fn render(&self, model: &str, stats: Option<&EngineStats>) -> String {
        let labels = format!(
            "model_name=\"{}\"",
            model.replace('\\', "\\\\").replace('"', "\\\"")
        );
        let mut out = String::new();
        let z = AtomicU64::new(0);
        let zu = std::sync::atomic::AtomicUsize::new(0);
        let (running, waiting, kv, prompt, gen, stop, length, abort, preempt) = match stats {
            Some(s) => (
                &s.running,
                &s.waiting,
                &s.kv_usage_ppm,
                &s.prompt_tokens,
                &s.generation_tokens,
                &s.finished_stop,
                &s.finished_length,
                &s.finished_abort,
                &s.preemptions,
            ),
            None => (&zu, &zu, &z, &z, &z, &z, &z, &z, &z),
        };
        let gauge = |out: &mut String, name: &str, help: &str, v: f64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{{labels}}} {v}"
            );
        };
        gauge(
            &mut out,
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            running.load(Ordering::Relaxed) as f64,
        );
        gauge(
            &mut out,
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            waiting.load(Ordering::Relaxed) as f64,
        );
        gauge(
            &mut out,
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            kv.load(Ordering::Relaxed) as f64 / 1e6,
        );
        let counter = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name}{{{labels}}} {v}"
            );
        };
        counter(
            &mut out,
            "vllm:prompt_tokens_total",
            "Number of prefill tokens processed.",
            prompt.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "vllm:generation_tokens_total",
            "Number of generation tokens processed.",
            gen.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "vllm:num_preemptions_total",
            "Cumulative number of preemptions.",
            preempt.load(Ordering::Relaxed),
        );
        let (queries, hits) = match stats {
            Some(s) => (&s.prefix_cache_queries, &s.prefix_cache_hits),
            None => (&z, &z),
        };
        counter(
            &mut out,
            "vllm:prefix_cache_queries_total",
            "Prefix cache queries, in terms of number of queried tokens.",
            queries.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "vllm:prefix_cache_hits_total",
            "Prefix cache hits, in terms of number of cached tokens.",
            hits.load(Ordering::Relaxed),
        );
        let (masks, mask_us) = match stats {
            Some(s) => (&s.mask_rows, &s.mask_micros),
            None => (&z, &z),
        };
        counter(
            &mut out,
            "rserve:structured_output_masks_total",
            "Token masks computed for structured output (one per constrained row and step).",
            masks.load(Ordering::Relaxed),
        );
        let _ = writeln!(
            out,
            "# HELP rserve:structured_output_mask_seconds_total Host time spent computing token masks.\n# TYPE rserve:structured_output_mask_seconds_total counter\nrserve:structured_output_mask_seconds_total{{{labels}}} {}",
            mask_us.load(Ordering::Relaxed) as f64 * 1e-6
        );
        counter(
            &mut out,
            "rserve:images_encoded_total",
            "Images the vision encoder has run on (each image of a request once).",
            stats.map_or(0, |s| s.images_encoded.load(Ordering::Relaxed)),
        );
        let _ = writeln!(out, "# HELP vllm:request_success_total Count of finished requests by finish reason.\n# TYPE vllm:request_success_total counter");
        for (reason, c) in [("stop", stop), ("length", length), ("abort", abort)] {
            let _ = writeln!(
                out,
                "vllm:request_success_total{{{labels},finished_reason=\"{reason}\"}} {}",
                c.load(Ordering::Relaxed)
            );
        }
        for h in [&self.ttft, &self.itl, &self.tpot, &self.e2e, &self.queue] {
            h.render(&mut out, &labels);
        }
        if let Some(l) = stats.and_then(|s| s.lora.lock().ok().and_then(|l| l.clone())) {
            // vLLM's form: the labels carry the state, the value is when it was read
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            let list = |v: &[String]| v.join(",").replace('\\', "\\\\").replace('"', "\\\"");
            let _ = writeln!(
                out,
                "# HELP vllm:lora_requests_info Running stats on lora requests.\n# TYPE vllm:lora_requests_info gauge\nvllm:lora_requests_info{{max_lora=\"{}\",running_lora_adapters=\"{}\",waiting_lora_adapters=\"{}\"}} {now}",
                l.max_loras,
                list(&l.running),
                list(&l.waiting)
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let m = Metrics::default();
        m.ttft.observe(0.003);
        m.ttft.observe(0.5);
        m.ttft.observe(1000.0);
        let text = m.render("m", None);
        assert!(text
            .contains("vllm:time_to_first_token_seconds_bucket{model_name=\"m\",le=\"0.005\"} 1"));
        assert!(
            text.contains("vllm:time_to_first_token_seconds_bucket{model_name=\"m\",le=\"0.5\"} 2")
        );
        assert!(text
            .contains("vllm:time_to_first_token_seconds_bucket{model_name=\"m\",le=\"+Inf\"} 3"));
        assert!(text.contains("vllm:time_to_first_token_seconds_count{model_name=\"m\"} 3"));
        assert!(text.contains("vllm:num_requests_running{model_name=\"m\"} 0"));
        assert!(!text.contains("lora_requests_info"));
    }

    #[test]
    fn lora_activity_is_reported_as_vllm_does() {
        let stats = EngineStats::default();
        *stats.lora.lock().unwrap() = Some(rserve_core::engine::LoraActivity {
            max_loras: 4,
            running: vec!["a".into(), "b".into()],
            waiting: vec!["c".into()],
        });
        let text = Metrics::default().render("m", Some(&stats));
        assert!(
            text.contains("# TYPE vllm:lora_requests_info gauge"),
            "{text}"
        );
        assert!(text.contains(
            "vllm:lora_requests_info{max_lora=\"4\",running_lora_adapters=\"a,b\",waiting_lora_adapters=\"c\"} "
        ));
    }
}
