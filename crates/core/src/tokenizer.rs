//! Text <-> token ids: a thin wrapper over Hugging Face `tokenizers` plus a streaming
//! detokenizer with stop-string handling.
//!
//! This module owns loading `tokenizer.json`, encoding, decoding (with a check that every
//! id exists, so a bad id is an error rather than silently dropped) and turning a stream
//! of generated ids into UTF-8-safe text deltas. It does not apply chat templates, pick
//! stop *tokens* (EOS handling belongs to the scheduler) or sample.
//! Invariants of [`IncrementalDetokenizer`]: its text only grows by decoded pieces that do
//! not end in an incomplete character (U+FFFD), except in an explicit [`flush`] or after
//! `MAX_PENDING` tokens that cannot form a character (invalid bytes); once a
//! stop string is found the text is truncated and frozen; the concatenation of all
//! deltas returned by [`take_delta`] equals [`text`] after `take_delta(true)`, and no
//! delta ends with a proper prefix of a stop string unless the stream is finished.
//!
//! [`flush`]: IncrementalDetokenizer::flush
//! [`take_delta`]: IncrementalDetokenizer::take_delta
//! [`text`]: IncrementalDetokenizer::text

use crate::stop_strings::{StopScan, StopStrings};
use std::collections::HashSet;
use std::fmt;
use std::path::Path;
use std::sync::Arc;

/// Errors from loading a tokenizer, encoding or decoding.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("failed to load tokenizer from {origin}: {reason}")]
    Load { origin: String, reason: String },
    #[error("failed to encode text: {0}")]
    Encode(String),
    #[error("failed to decode token ids: {0}")]
    Decode(String),
    #[error("token id {id} is not in the vocabulary (size {vocab_size})")]
    UnknownId { id: u32, vocab_size: usize },
}

/// A loaded Hugging Face tokenizer.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    known_ids: HashSet<u32>,
    special_ids: HashSet<u32>,
    vocab_size: usize,
    max_token_chars: usize,
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size)
            .field("special_ids", &self.special_ids.len())
            .finish_non_exhaustive()
    }
}

impl Tokenizer {
    /// Loads a `tokenizer.json` file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, TokenizerError> {
        let path = path.as_ref();
        let origin = path.display().to_string();
        let bytes = std::fs::read(path).map_err(|e| TokenizerError::Load {
            origin: origin.clone(),
            reason: e.to_string(),
        })?;
        Self::parse(&bytes, origin)
    }

    /// Parses the contents of a `tokenizer.json` file.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, TokenizerError> {
        Self::parse(bytes, "in-memory tokenizer.json".to_owned())
    }

    fn parse(bytes: &[u8], origin: String) -> Result<Self, TokenizerError> {
        let inner = tokenizers::Tokenizer::from_bytes(bytes).map_err(|e| TokenizerError::Load {
            origin,
            reason: e.to_string(),
        })?;
        let vocab = inner.get_vocab(true);
        Ok(Self::with_vocab(
            inner,
            vocab.iter().map(|(t, &id)| (t.as_str(), id)),
        ))
    }

    /// A tokenizer built in memory, with its vocabulary (every token and its id, added tokens
    /// included) as the builder knows it.
    pub fn with_vocab<'a>(
        inner: tokenizers::Tokenizer,
        vocab: impl Iterator<Item = (&'a str, u32)>,
    ) -> Self {
        let mut known_ids = HashSet::new();
        let mut max_token_chars = 1;
        for (token, id) in vocab {
            // a token's stored form is at least as long as its text (byte-level BPE stores one
            // character per byte, SentencePiece's byte fallback six), so this bounds characters
            // per token from above
            max_token_chars = max_token_chars.max(token.chars().count());
            known_ids.insert(id);
        }
        let special_ids = inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter_map(|(id, token)| token.special.then_some(id))
            .collect();
        let vocab_size = inner.get_vocab_size(true);
        Self {
            inner,
            known_ids,
            special_ids,
            vocab_size,
            max_token_chars,
        }
    }

    /// The most characters of text one token can stand for: a text of more than
    /// `n * max_token_chars()` characters cannot encode to `n` tokens or fewer.
    pub fn max_token_chars(&self) -> usize {
        self.max_token_chars
    }

    /// The wrapped `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Encodes `text`; `add_special_tokens` applies the post-processor (e.g. BOS).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        let encoding = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(|e| TokenizerError::Encode(e.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Decodes `ids`; any id outside the vocabulary is an error.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError> {
        if let Some(&id) = ids.iter().find(|id| !self.known_ids.contains(id)) {
            return Err(self.unknown(id));
        }
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| TokenizerError::Decode(e.to_string()))
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Whether `id` is an added token marked special (skipped by `skip_special_tokens`).
    pub fn is_special(&self, id: u32) -> bool {
        self.special_ids.contains(&id)
    }

    fn unknown(&self, id: u32) -> TokenizerError {
        TokenizerError::UnknownId {
            id,
            vocab_size: self.vocab_size,
        }
    }
}

/// How many trailing prompt ids seed the decoding window, so the first generated token
/// is decoded in context (leading spaces of SentencePiece-style tokenizers).
const PROMPT_CONTEXT: usize = 5;

/// Once this many trailing tokens still decode to a final U+FFFD, it is not an incomplete
/// character (UTF-8 needs at most 4 bytes) but invalid output, and it is emitted as is.
const MAX_PENDING: usize = 8;

/// Streams generated ids into text, vLLM/TGI style, with stop strings and holdback.
#[derive(Debug, Clone)]
pub struct IncrementalDetokenizer {
    /// Trailing prompt ids followed by every generated id.
    ids: Vec<u32>,
    /// Start of the decoding window in `ids`.
    prefix_offset: usize,
    /// End of the ids whose text is already in `text`.
    read_offset: usize,
    skip_special_tokens: bool,
    text: String,
    /// Bytes of `text` already returned by `take_delta`.
    emitted: usize,
    stops: Arc<StopStrings>,
    /// The stop-string automaton's state after all of `text`.
    scan: StopScan,
    /// Whether a stop string found now ends the text (see `push_with`).
    stops_active: bool,
    include_stop_str_in_output: bool,
    stopped: Option<String>,
}

impl IncrementalDetokenizer {
    /// `prompt_ids` give decoding context only; their text is never part of the output (ids the
    /// tokenizer does not know are left out of it).
    pub fn new(
        tok: &Tokenizer,
        prompt_ids: &[u32],
        skip_special_tokens: bool,
        stops: Arc<StopStrings>,
        include_stop_str_in_output: bool,
    ) -> Self {
        let known: Vec<u32> = prompt_ids
            .iter()
            .rev()
            .filter(|id| tok.known_ids.contains(id))
            .take(PROMPT_CONTEXT)
            .copied()
            .collect();
        let ids: Vec<u32> = known.into_iter().rev().collect();
        Self {
            prefix_offset: 0,
            read_offset: ids.len(),
            ids,
            skip_special_tokens,
            text: String::new(),
            emitted: 0,
            stops,
            scan: StopScan::default(),
            stops_active: true,
            include_stop_str_in_output,
            stopped: None,
        }
    }

    /// Appends a generated token. Returns `Some(stop)` when a stop string now appears in
    /// the text (which is then truncated); after that, further pushes are ignored. An id the
    /// tokenizer does not know (a model whose vocabulary is larger than its tokenizer's)
    /// decodes to nothing.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<Option<String>, TokenizerError> {
        self.push_with(tok, id, true)
    }

    /// [`IncrementalDetokenizer::push`], with stop strings ending the text only when
    /// `stops_active` (before `min_tokens` a stop string is ordinary text).
    pub fn push_with(
        &mut self,
        tok: &Tokenizer,
        id: u32,
        stops_active: bool,
    ) -> Result<Option<String>, TokenizerError> {
        if self.stopped.is_some() || !tok.known_ids.contains(&id) {
            return Ok(None);
        }
        self.ids.push(id);
        self.stops_active = stops_active;
        self.advance(tok, false)
    }

    /// Decodes tokens still held back because they end in an incomplete character (the
    /// text then ends with U+FFFD, as a full `decode` would). Call once generation ends.
    pub fn flush(&mut self, tok: &Tokenizer) -> Result<Option<String>, TokenizerError> {
        if self.stopped.is_some() || self.read_offset == self.ids.len() {
            return Ok(None);
        }
        self.advance(tok, true)
    }

    /// All generated text so far (truncated at a stop string, if one was found).
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The stop string that ended the text, if any.
    pub fn stopped(&self) -> Option<&str> {
        self.stopped.as_deref()
    }

    /// Returns the text not returned yet. Unless `finished` (or stopped), a tail that
    /// could be the beginning of a stop string is held back for a later call.
    pub fn take_delta(&mut self, finished: bool) -> String {
        let end = if finished || self.stopped.is_some() {
            self.text.len()
        } else {
            self.text.len() - self.holdback()
        };
        if end <= self.emitted {
            return String::new();
        }
        let delta = self
            .text
            .get(self.emitted..end)
            .unwrap_or_default()
            .to_owned();
        self.emitted = end;
        delta
    }

    fn advance(&mut self, tok: &Tokenizer, force: bool) -> Result<Option<String>, TokenizerError> {
        let skip = self.skip_special_tokens;
        let prefix_text = tok.decode(&self.ids[self.prefix_offset..self.read_offset], skip)?;
        let new_text = tok.decode(&self.ids[self.prefix_offset..], skip)?;
        let pending = self.ids.len() - self.read_offset;
        let incomplete = new_text.ends_with('\u{FFFD}') && pending < MAX_PENDING;
        if !force && (new_text.len() <= prefix_text.len() || incomplete) {
            return Ok(None);
        }
        let delta = suffix_after(&prefix_text, &new_text);
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        let new_start = self.text.len();
        self.text.push_str(delta);
        Ok(self.check_stop(new_start))
    }

    /// Finds the earliest stop string that ends in the text added at `new_start` (linear in the
    /// new text, whatever the number and length of the stop strings).
    fn check_stop(&mut self, new_start: usize) -> Option<String> {
        let new = self.text.as_bytes().get(new_start..)?;
        let m = self.stops.feed(&mut self.scan, new, new_start)?;
        if !self.stops_active {
            return None;
        }
        let stop = self.stops.pattern(m.pattern).to_string();
        let end = if self.include_stop_str_in_output {
            m.start + stop.len()
        } else {
            m.start
        };
        self.text.truncate(end);
        self.emitted = self.emitted.min(end);
        self.stopped = Some(stop.clone());
        Some(stop)
    }

    /// Length of the longest tail of the text that is a proper prefix of a stop string.
    fn holdback(&self) -> usize {
        self.stops.holdback(self.scan)
    }
}

/// The part of `new` after the already-decoded `prefix`. Normally `new` starts with
/// `prefix`; if `prefix` ended in an incomplete character that `new` completes, the
/// completed character belongs to the result; otherwise fall back to the byte length.
fn suffix_after<'a>(prefix: &str, new: &'a str) -> &'a str {
    if let Some(rest) = new.strip_prefix(prefix) {
        return rest;
    }
    if let Some(rest) = new.strip_prefix(prefix.trim_end_matches('\u{FFFD}')) {
        return rest;
    }
    let mut start = prefix.len().min(new.len());
    while !new.is_char_boundary(start) {
        start += 1;
    }
    new.get(start..).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenizer() -> Tokenizer {
        let root = std::env::var("RSERVE_REPO")
            .unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/../..").to_owned());
        let path = Path::new(&root).join("crates/core/assets/tokenizer.json");
        Tokenizer::from_file(&path)
            .unwrap_or_else(|e| panic!("{e}; set RSERVE_REPO to the repository root"))
    }

    /// GPT-2's byte-to-unicode map, to address the single-byte tokens directly.
    fn byte_char(b: u8) -> char {
        let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        if printable(b) {
            return char::from(b);
        }
        let n = (0..b).filter(|&x| !printable(x)).count() as u32;
        char::from_u32(256 + n).expect("valid char")
    }

    /// One token per byte, so multi-byte characters and stop strings split everywhere.
    fn byte_ids(tok: &Tokenizer, text: &str) -> Vec<u32> {
        let id = |b: u8| {
            tok.token_to_id(&byte_char(b).to_string())
                .expect("byte token")
        };
        text.bytes().map(id).collect()
    }

    /// Pushes every id with a `take_delta(false)` after each push and a final
    /// `take_delta(true)`; returns the deltas and the index of the push that hit a stop.
    fn stream(
        tok: &Tokenizer,
        det: &mut IncrementalDetokenizer,
        ids: &[u32],
    ) -> (Vec<String>, Option<usize>) {
        let mut deltas = Vec::new();
        let mut hit = None;
        for (i, &id) in ids.iter().enumerate() {
            if det.push(tok, id).expect("push").is_some() {
                assert!(hit.is_none(), "stop reported twice");
                hit = Some(i);
            }
            deltas.push(det.take_delta(false));
        }
        deltas.push(det.take_delta(true));
        (deltas, hit)
    }

    fn stops(list: &[&str]) -> Arc<StopStrings> {
        Arc::new(StopStrings::new(
            list.iter().map(|s| s.to_string()).collect(),
        ))
    }

    #[test]
    fn loads_encodes_and_decodes() {
        let tok = tokenizer();
        let ids = tok.encode("Hello world", true).expect("encode");
        let bos = tok.token_to_id("<|begin_of_text|>").expect("bos");
        assert_eq!(ids[0], bos);
        assert!(tok.is_special(bos));
        assert_eq!(tok.id_to_token(bos).as_deref(), Some("<|begin_of_text|>"));
        assert_eq!(tok.decode(&ids, true).expect("decode"), "Hello world");
        assert_eq!(
            tok.decode(&ids, false).expect("decode"),
            "<|begin_of_text|>Hello world"
        );
        assert!(!tok.is_special(byte_ids(&tok, "a")[0]));
        assert!(tok.vocab_size() >= 256 + 13);
        assert_eq!(tok.encode("Hello world", false).expect("encode"), ids[1..]);
    }

    #[test]
    fn load_errors_name_the_source() {
        let err = Tokenizer::from_file("/nonexistent/dir/tokenizer.json").expect_err("missing");
        assert!(
            err.to_string().contains("/nonexistent/dir/tokenizer.json"),
            "{err}"
        );
        let err = Tokenizer::from_bytes(b"{\"model\": 1}").expect_err("invalid");
        assert!(matches!(err, TokenizerError::Load { .. }), "{err}");
    }

    #[test]
    fn unknown_ids_are_errors_to_decode_and_nothing_to_stream() {
        let tok = tokenizer();
        let bad = u32::try_from(tok.vocab_size()).expect("fits") + 7;
        let err = tok
            .decode(&[byte_ids(&tok, "a")[0], bad], false)
            .expect_err("bad id");
        assert!(
            matches!(err, TokenizerError::UnknownId { id, .. } if id == bad),
            "{err}"
        );
        // a model whose vocabulary is larger than its tokenizer's still streams
        let mut det = IncrementalDetokenizer::new(&tok, &[bad, 5], true, stops(&[]), false);
        assert_eq!(det.push(&tok, u32::MAX).expect("no error"), None);
        let mut ids = byte_ids(&tok, "ok");
        ids.insert(1, bad);
        let (deltas, _) = stream(&tok, &mut det, &ids);
        assert_eq!(deltas.concat(), "ok");
    }

    #[test]
    fn multibyte_characters_never_stream_replacement_chars() {
        let tok = tokenizer();
        let text = "héllo 中文 👋🏽 naïve café — Größe 日本語!";
        for ids in [
            byte_ids(&tok, text),
            tok.encode(text, false).expect("encode"),
        ] {
            let mut det = IncrementalDetokenizer::new(&tok, &[], true, stops(&[]), false);
            let (deltas, _) = stream(&tok, &mut det, &ids);
            assert!(deltas.iter().all(|d| !d.contains('\u{FFFD}')), "{deltas:?}");
            assert_eq!(deltas.concat(), tok.decode(&ids, true).expect("decode"));
            assert_eq!(deltas.concat(), text);
        }
        let mut det = IncrementalDetokenizer::new(&tok, &[], true, stops(&[]), false);
        let (deltas, _) = stream(&tok, &mut det, &byte_ids(&tok, "中"));
        assert_eq!(deltas, ["", "", "中", ""]);
    }

    #[test]
    fn prompt_context_and_special_tokens() {
        let tok = tokenizer();
        let prompt = tok.encode("<|start_header_id|>assistant<|end_header_id|>\n\nSay", true);
        let prompt = prompt.expect("encode");
        let eot = tok.token_to_id("<|eot_id|>").expect("eot");
        let mut gen = tok.encode(" hello there", false).expect("encode");
        gen.push(eot);
        for (skip, expected) in [(true, " hello there"), (false, " hello there<|eot_id|>")] {
            let mut det = IncrementalDetokenizer::new(&tok, &prompt, skip, stops(&[]), false);
            let (deltas, _) = stream(&tok, &mut det, &gen);
            assert_eq!(deltas.concat(), expected);
            assert_eq!(det.text(), expected);
        }
    }

    #[test]
    fn stop_string_split_across_tokens() {
        let tok = tokenizer();
        let ids = byte_ids(&tok, "abc STOP def");
        for (include, expected) in [(false, "abc "), (true, "abc STOP")] {
            let mut det = IncrementalDetokenizer::new(&tok, &[], true, stops(&["STOP"]), include);
            let (deltas, hit) = stream(&tok, &mut det, &ids);
            assert_eq!(hit, Some(7), "stop completes with the 'P' byte");
            assert_eq!(det.stopped(), Some("STOP"));
            assert_eq!(det.text(), expected);
            assert_eq!(deltas.concat(), expected);
            let early: String = deltas[..7].concat();
            assert_eq!(early, "abc ", "the partial stop string is held back");
        }
    }

    #[test]
    fn holdback_is_released_when_the_prefix_stops_matching() {
        let tok = tokenizer();
        let mut det =
            IncrementalDetokenizer::new(&tok, &[], true, stops(&["STOP", "中文!"]), false);
        let (deltas, hit) = stream(&tok, &mut det, &byte_ids(&tok, "a ST b 中文 c"));
        assert_eq!(hit, None);
        assert_eq!(deltas[..4].concat(), "a ");
        assert_eq!(deltas[4], "ST ");
        assert!(deltas.iter().all(|d| !d.contains('\u{FFFD}')), "{deltas:?}");
        assert_eq!(deltas[..13].concat(), "a ST b ", "'中文' is held back");
        assert_eq!(deltas.concat(), "a ST b 中文 c");
        let mut det = IncrementalDetokenizer::new(&tok, &[], true, stops(&["STOP"]), false);
        let (deltas, _) = stream(&tok, &mut det, &byte_ids(&tok, "xST"));
        assert_eq!(
            deltas,
            ["x", "", "", "ST"],
            "finishing releases the held tail"
        );
    }

    #[test]
    fn stop_spanning_two_pushes_earliest_wins() {
        let tok = tokenizer();
        let ids = tok.encode("hello world, the end", false).expect("encode");
        let stop = stops(&["the end", "o w"]);
        let mut det = IncrementalDetokenizer::new(&tok, &[], true, stop, false);
        let (deltas, hit) = stream(&tok, &mut det, &ids);
        let hit = hit.expect("stop found");
        let before = tok.decode(&ids[..hit], true).expect("decode");
        assert!(
            before.ends_with('o') && !before.contains("o w"),
            "{before:?}"
        );
        assert_eq!((det.text(), det.stopped()), ("hell", Some("o w")));
        assert_eq!(deltas.concat(), "hell");
        assert_eq!(
            det.push(&tok, ids[0]).expect("push"),
            None,
            "frozen after a stop"
        );
        assert_eq!(det.text(), "hell");
    }

    #[test]
    fn flush_decodes_an_incomplete_tail() {
        let tok = tokenizer();
        let mut ids = byte_ids(&tok, "ok中");
        ids.pop();
        let mut det = IncrementalDetokenizer::new(&tok, &[], true, stops(&[]), false);
        let (deltas, _) = stream(&tok, &mut det, &ids);
        assert_eq!(deltas.concat(), "ok");
        assert_eq!(det.flush(&tok).expect("flush"), None);
        assert_eq!(det.text(), tok.decode(&ids, true).expect("decode"));
        assert_eq!(det.take_delta(true), "\u{FFFD}");
        assert_eq!(suffix_after("ab\u{FFFD}", "ab中x"), "中x");
    }

    #[test]
    fn invalid_bytes_are_emitted_after_a_bounded_wait() {
        let tok = tokenizer();
        let lone = tok
            .token_to_id(&byte_char(0x80).to_string())
            .expect("byte token");
        let mut det = IncrementalDetokenizer::new(&tok, &[], true, stops(&[]), false);
        let (deltas, _) = stream(&tok, &mut det, &[lone; MAX_PENDING + 1]);
        assert_eq!(deltas[MAX_PENDING - 1], "\u{FFFD}".repeat(MAX_PENDING));
        assert_eq!(deltas.concat(), "\u{FFFD}".repeat(MAX_PENDING));
        assert_eq!(det.flush(&tok).expect("flush"), None);
        assert_eq!(det.take_delta(true), "\u{FFFD}");
    }
}
