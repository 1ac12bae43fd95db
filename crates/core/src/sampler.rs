//! The sampling policy, and its host executor.
//!
//! [`row_sampling`] is the one place a request's parameters become what a row asks of a sampler
//! ([`RowSampling`]: sparse logit edits for bias, suppressed ids and repetition / presence /
//! frequency penalties; temperature, min-p, top-k, top-p; a seed). The engine decides per row
//! where it runs: on the device (`rserve_kernels::sampling`) or on the host ([`sample_row`],
//! for rows that want top-N logprobs, and on the CPU). Both apply the same rules and draw with
//! the same counter hash of the seed and the token id ([`uniform`], Gumbel-max), so a seeded row
//! picks the same token alone or in any batch, and on either sampler up to float rounding (the
//! device's fast `exp`/`log` and f32 sums can settle a near-tie at a threshold or between two
//! noisy scores the other way; non-finite logits are read as `-inf` here).
//!
//! Pure functions over host rows; no tensors, no locks, no request state (the caller keeps
//! prompt / output ids and decides which ids to suppress, e.g. EOS and stop ids before
//! `min_tokens`). Invariants: logprobs (chosen token and top alternatives) always come from the
//! raw row, before any processing, as in vLLM v1; every non-greedy row takes exactly one draw
//! from the sequence's own [`SeqRng`] (its seed) and greedy rows take none; a row used as scratch
//! holds its raw values again on return; NaN is read as `-inf`, and nothing here panics on
//! non-finite or out-of-range input.

use crate::request::{SamplingParams, TokenLogprob};
use rayon::prelude::*;
pub use rserve_kernels::sampling::{LogitEdit, RowSampling};
use std::cmp::Ordering;
use std::collections::BTreeMap;

const NEG_INF: f32 = f32::NEG_INFINITY;

/// Total logits (rows x vocab) from which [`sample_rows_host`] spreads rows over rayon's pool.
const PAR_MIN_WORK: usize = 1 << 17;

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A sequence's own random stream (xoshiro256++ seeded through SplitMix64).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqRng {
    s: [u64; 4],
}

impl SeqRng {
    /// The stream for `seed`; equal seeds give equal streams on every platform.
    pub fn new(seed: u64) -> Self {
        let mut sm = seed;
        let mut next = || splitmix64(&mut sm);
        Self {
            s: [next(), next(), next(), next()],
        }
    }

    /// The stream of completion `index` of a request seeded with `seed`; index 0 is `new(seed)`.
    pub fn for_sample(seed: u64, index: usize) -> Self {
        if index == 0 {
            return Self::new(seed);
        }
        let mut st = seed ^ (index as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
        Self::new(splitmix64(&mut st))
    }

    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[0].wrapping_add(s[3]).rotate_left(23).wrapping_add(s[0]);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1) with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in [0, 1) with 24 random bits.
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u32 << 24) as f32)
    }
}

/// NaN as `-inf` (`f32::max` ignores a NaN operand).
fn clean(x: f32) -> f32 {
    x.max(NEG_INF)
}

/// Most likely first, lower id first on ties (values are never NaN here).
fn rank(a: &(u32, f32), b: &(u32, f32)) -> Ordering {
    b.1.partial_cmp(&a.1)
        .unwrap_or(Ordering::Equal)
        .then(a.0.cmp(&b.0))
}

/// The normaliser of a row's log-softmax: max-subtracted, summed in f64.
struct LogZ {
    max: f32,
    log_sum: f64,
}

impl LogZ {
    fn of(row: &[f32]) -> Self {
        let max = row.iter().fold(NEG_INF, |m, &x| m.max(clean(x)));
        let log_sum = if max == f32::INFINITY {
            // The +inf entries share all the mass equally.
            (row.iter().filter(|&&x| x == max).count() as f64).ln()
        } else if max == NEG_INF {
            0.0
        } else {
            let sum: f64 = row.iter().map(|&x| f64::from((clean(x) - max).exp())).sum();
            sum.ln()
        };
        Self { max, log_sum }
    }

    fn logprob(&self, x: f32) -> f32 {
        let x = clean(x);
        if self.max == f32::INFINITY {
            if x == self.max {
                -self.log_sum as f32
            } else {
                NEG_INF
            }
        } else if self.max == NEG_INF || x == NEG_INF {
            NEG_INF
        } else {
            (f64::from(x - self.max) - self.log_sum) as f32
        }
    }
}

/// The `n` largest entries of `row` as (id, cleaned value), most likely first, ties by lower id.
/// One pass with a sorted buffer of `n` (small: at most `MAX_LOGPROBS` after validation).
fn top_n(row: &[f32], n: usize) -> Vec<(u32, f32)> {
    let n = n.min(row.len());
    if n == 0 {
        return Vec::new();
    }
    let items = row.iter().enumerate().map(|(i, &x)| (i as u32, clean(x)));
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
    for item in items {
        if best.len() == n {
            match best.last() {
                Some(last) if rank(&item, last) == Ordering::Less => {
                    best.pop();
                }
                _ => continue,
            }
        }
        let pos = best.partition_point(|b| rank(b, &item) == Ordering::Less);
        best.insert(pos, item);
    }
    best
}

fn with_logprobs(row: &[f32], z: &LogZ, n: usize) -> Vec<(u32, f32)> {
    top_n(row, n)
        .into_iter()
        .map(|(id, x)| (id, z.logprob(x)))
        .collect()
}

/// Sparse in-place edits of a row that remember the values they overwrote.
struct Edits<'a> {
    row: &'a mut [f32],
    saved: Vec<(u32, f32)>,
}

impl<'a> Edits<'a> {
    fn edit(&mut self, id: u32, f: impl FnOnce(f32) -> f32) {
        if let Some(x) = self.row.get_mut(id as usize) {
            self.saved.push((id, *x));
            *x = f(*x);
        }
    }

    /// Puts back every overwritten value and hands the row back.
    fn restore(self) -> &'a mut [f32] {
        for &(id, x) in self.saved.iter().rev() {
            self.row[id as usize] = x;
        }
        self.row
    }
}

/// Arg-max with the lowest id on ties; 0 when every entry is `-inf` / NaN.
fn argmax(row: &[f32]) -> u32 {
    let mut best = (0u32, NEG_INF);
    for (i, &x) in row.iter().enumerate() {
        let x = clean(x);
        if x > best.1 {
            best = (i as u32, x);
        }
    }
    best.0
}

/// Sorts the best prefix of `cands` just far enough to find the smallest one whose weight
/// reaches `target`, and returns its length (at least 1 unless `cands` is empty).
fn nucleus(cands: &mut [(u32, f32)], weight: &impl Fn(f32) -> f64, target: f64) -> usize {
    let n = cands.len();
    let (mut sorted, mut cum) = (0, 0.0);
    let mut k = n.min(64);
    while sorted < n {
        let rest = &mut cands[sorted..];
        let take = k - sorted;
        if take < rest.len() {
            rest.select_nth_unstable_by(take - 1, rank);
        }
        rest[..take].sort_unstable_by(rank);
        for (i, c) in cands.iter().enumerate().take(k).skip(sorted) {
            cum += weight(c.1);
            if cum >= target {
                return i + 1;
            }
        }
        sorted = k;
        k = (k * 8).min(n);
    }
    n
}

/// The uniform in (0, 1) of token `i` in a row seeded with `seed`: the same counter hash as the
/// device sampler's (`csrc/sampling.cu`), so a seeded row draws alike on both.
pub fn uniform(seed: u64, i: u32) -> f32 {
    let mix = |x: u64| {
        let mut s = x;
        splitmix64(&mut s)
    };
    let h = mix(seed ^ mix(u64::from(i)));
    ((h >> 40) as f32 + 0.5) * (1.0 / 16_777_216.0)
}

/// Temperature, min-p, top-k and top-p as one threshold on the edited logits (ties at a boundary
/// are kept), then a Gumbel-max draw among the survivors with [`uniform`]: the device sampler's
/// rules, so it samples exactly in proportion to `exp(logit / T)` among the survivors.
fn draw(row: &[f32], s: &RowSampling) -> u32 {
    let max = row.iter().fold(NEG_INF, |m, &x| m.max(clean(x)));
    if max == NEG_INF {
        return 0;
    }
    let t = s.temperature;
    let pos_inf = max == f32::INFINITY;
    // log(prob / max prob) after temperature
    let rel = move |x: f32| {
        let x = clean(x);
        match (pos_inf, x == f32::INFINITY) {
            (true, true) => 0.0,
            (true, false) => NEG_INF,
            _ => (x - max) / t,
        }
    };
    let mut thr = NEG_INF;
    if s.min_p > 0.0 && !pos_inf {
        thr = max + s.min_p.ln().min(0.0) * t;
    }
    if s.top_k > 0 && s.top_k < row.len() {
        let mut vals: Vec<f32> = row.iter().map(|&x| clean(x)).collect();
        let (_, kth, _) = vals.select_nth_unstable_by(s.top_k - 1, |a, b| b.total_cmp(a));
        thr = thr.max(*kth);
    }
    if s.top_p < 1.0 {
        let weight = move |x: f32| f64::from(rel(x).exp());
        let mut cands: Vec<(u32, f32)> = row
            .iter()
            .enumerate()
            .map(|(i, &x)| (i as u32, clean(x)))
            .filter(|&(_, x)| x >= thr && x > NEG_INF)
            .collect();
        let total: f64 = cands.iter().map(|c| weight(c.1)).sum();
        let n = nucleus(&mut cands, &weight, f64::from(s.top_p) * total);
        if let Some(&(_, v)) = cands.get(n.wrapping_sub(1)) {
            thr = thr.max(v);
        }
    }
    let mut best = (0u32, NEG_INF);
    for (i, &x) in row.iter().enumerate() {
        let x = clean(x);
        if x == NEG_INF || x < thr {
            continue;
        }
        let g = rel(x) - (-uniform(s.seed, i as u32).ln()).ln();
        if g > best.1 {
            best = (i as u32, g);
        }
    }
    best.0
}

/// The one sampling policy: what a row of `params` asks of a sampler, for either the device
/// or the host. `prompt` and `output` are the sequence's known tokens (the repetition penalty
/// reads both, presence and frequency penalties the output); `suppress` are ids forbidden now
/// (EOS and stop ids before `min_tokens`). A random row takes exactly one draw from `rng` as its
/// seed; a greedy row takes none.
pub fn row_sampling(
    params: &SamplingParams,
    prompt: &[u32],
    output: &[u32],
    suppress: &[u32],
    rng: &mut SeqRng,
) -> RowSampling {
    let mut edits: BTreeMap<u32, LogitEdit> = BTreeMap::new();
    let blank = |token| LogitEdit {
        token,
        bias: 0.0,
        repetition_penalty: 1.0,
        subtract: 0.0,
    };
    for (&t, &b) in &params.logit_bias {
        edits.entry(t).or_insert_with(|| blank(t)).bias = b;
    }
    let rp = params.repetition_penalty;
    if rp != 1.0 && rp > 0.0 {
        for &t in prompt.iter().chain(output) {
            edits
                .entry(t)
                .or_insert_with(|| blank(t))
                .repetition_penalty = rp;
        }
    }
    let (pp, fp) = (params.presence_penalty, params.frequency_penalty);
    if pp != 0.0 || fp != 0.0 {
        let mut counts: BTreeMap<u32, u32> = BTreeMap::new();
        for &t in output {
            *counts.entry(t).or_default() += 1;
        }
        for (t, c) in counts {
            edits.entry(t).or_insert_with(|| blank(t)).subtract += pp + fp * c as f32;
        }
    }
    for &t in suppress {
        edits.entry(t).or_insert_with(|| blank(t)).subtract = f32::INFINITY;
    }
    let greedy = params.is_greedy();
    RowSampling {
        temperature: if greedy { 0.0 } else { params.temperature },
        top_k: params.top_k,
        top_p: params.top_p,
        min_p: params.min_p,
        seed: if greedy { 0 } else { rng.next_u64() },
        edits: edits.into_values().collect(),
    }
}

/// Samples one row on the host as [`RowSampling`] describes it; returns the token with its raw
/// logprob and the raw top `logprobs` alternatives. `row` is scratch and holds its raw values
/// again on return.
pub fn sample_row(row: &mut [f32], s: &RowSampling, logprobs: usize) -> TokenLogprob {
    let z = LogZ::of(row);
    let top = with_logprobs(row, &z, logprobs);
    let mut edits = Edits {
        row,
        saved: Vec::new(),
    };
    for e in &s.edits {
        edits.edit(e.token, |x| {
            let b = x + e.bias;
            let r = if b > 0.0 {
                b / e.repetition_penalty
            } else {
                b * e.repetition_penalty
            };
            r - e.subtract
        });
    }
    let token_id = if s.temperature < 1e-5 {
        argmax(edits.row)
    } else {
        draw(edits.row, s)
    };
    let row = edits.restore();
    let logprob = row
        .get(token_id as usize)
        .map_or(NEG_INF, |&x| z.logprob(x));
    TokenLogprob {
        token_id,
        logprob,
        top,
        rank: None,
    }
}

/// A prompt position's entry from its row of log-probabilities (log-softmax already applied, on
/// the device): the next prompt token's and the top `k` alternatives.
pub fn prompt_logprob_of(logprobs: &[f32], next_token: u32, k: Option<usize>) -> TokenLogprob {
    let logprob = logprobs
        .get(next_token as usize)
        .map_or(NEG_INF, |&x| clean(x));
    TokenLogprob {
        token_id: next_token,
        logprob,
        top: top_n(logprobs, k.unwrap_or(0)),
        rank: Some(rank_of(logprobs, logprob)),
    }
}

/// 1 + the number of entries of `row` above `value`.
pub fn rank_of(row: &[f32], value: f32) -> u32 {
    let above = row.iter().filter(|&&x| clean(x) > value).count();
    u32::try_from(above).unwrap_or(u32::MAX).saturating_add(1)
}

/// Samples each row of `rows` on the host with its settings and number of top logprobs
/// ([`sample_row`]), spread over rayon's pool when the batch is large.
pub fn sample_rows_host(
    rows: &mut [Vec<f32>],
    plans: &[(&RowSampling, usize)],
) -> Vec<TokenLogprob> {
    let work: usize = rows.iter().map(Vec::len).sum();
    if rows.len() > 1 && work >= PAR_MIN_WORK {
        rows.par_iter_mut()
            .zip(plans.par_iter())
            .map(|(row, &(s, k))| sample_row(row, s, k))
            .collect()
    } else {
        rows.iter_mut()
            .zip(plans)
            .map(|(row, &(s, k))| sample_row(row, s, k))
            .collect()
    }
}

#[cfg(test)]
#[path = "sampler_tests.rs"]
mod tests;
