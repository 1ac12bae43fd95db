//! What chat and completions share in turning a finished request into choices: `best_of`
//! selection and vLLM's `prompt_logprobs` shape.

use super::chat::token_text;
use rserve_core::request::{RequestOutput, TokenLogprob};
use rserve_core::tokenizer::Tokenizer;
use serde_json::{json, Map, Value};

/// Keeps the `n` completions with the highest cumulative log-probability (vLLM's `best_of`),
/// renumbered `0..n` in that order. Does nothing when there are no more than `n`.
pub fn keep_best(out: &mut RequestOutput, n: usize) {
    if out.outputs.len() <= n {
        return;
    }
    out.outputs.sort_by(|a, b| {
        b.cumulative_logprob
            .total_cmp(&a.cumulative_logprob)
            .then(a.index.cmp(&b.index))
    });
    out.outputs.truncate(n);
    for (i, c) in out.outputs.iter_mut().enumerate() {
        c.index = i;
    }
}

fn entry(tok: &Tokenizer, id: u32, logprob: f32, rank: u32, as_ids: bool) -> Value {
    json!({"logprob": logprob, "rank": rank, "decoded_token": token_text(tok, id, as_ids)})
}

/// vLLM's `prompt_logprobs`: per prompt position, `null` for the first, else an object keyed by
/// token id holding the actual prompt token and the top alternatives, each with its logprob,
/// rank and text.
pub fn prompt_logprobs_json(
    tok: &Tokenizer,
    ids: &[u32],
    lps: Option<&[Option<TokenLogprob>]>,
    as_ids: bool,
) -> Value {
    let lps = lps.unwrap_or(&[]);
    let rows = (0..ids.len()).map(|i| match lps.get(i).and_then(Option::as_ref) {
        None => Value::Null,
        Some(l) => {
            let mut m = Map::new();
            for (r, &(t, lp)) in l.top.iter().enumerate() {
                let rank = u32::try_from(r + 1).unwrap_or(u32::MAX);
                m.insert(t.to_string(), entry(tok, t, lp, rank, as_ids));
            }
            let rank = l.rank.unwrap_or_else(|| {
                let above = l.top.iter().filter(|&&(_, lp)| lp > l.logprob).count();
                u32::try_from(above + 1).unwrap_or(u32::MAX)
            });
            m.insert(
                l.token_id.to_string(),
                entry(tok, l.token_id, l.logprob, rank, as_ids),
            );
            Value::Object(m)
        }
    });
    Value::Array(rows.collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rserve_core::request::CompletionOutput;

    fn completion(index: usize, lp: f32) -> CompletionOutput {
        CompletionOutput {
            index,
            text: format!("c{index}"),
            delta: String::new(),
            token_ids: vec![1],
            cumulative_logprob: lp,
            logprobs: None,
            finish_reason: None,
            stop_reason: None,
        }
    }

    #[test]
    fn best_of_keeps_the_most_likely() {
        let mut out = RequestOutput {
            request_id: rserve_core::RequestId(0),
            prompt_token_ids: vec![1],
            prompt_logprobs: None,
            outputs: vec![
                completion(0, -3.0),
                completion(1, -1.0),
                completion(2, -2.0),
            ],
            finished: true,
            queue_time: None,
            num_cached_tokens: None,
        };
        keep_best(&mut out, 2);
        let texts: Vec<&str> = out.outputs.iter().map(|c| c.text.as_str()).collect();
        assert_eq!(texts, ["c1", "c2"]);
        assert_eq!(out.outputs[1].index, 1);
    }
}
