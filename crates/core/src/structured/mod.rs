//! Structured output: a request's JSON schema, regex, choice list or Lark grammar, compiled by
//! the grammar engine (`llguidance`) against the model's vocabulary, and one matcher per
//! completion that gives the tokens allowed next as a bitmask and follows the sampled ones.
//!
//! [`StructuredOutputs`] is the request form (vLLM's `structured_outputs` fields). [`Grammars`]
//! compiles it once per distinct text (a bounded cache; compilation is limited in size and work,
//! so a hostile schema fails fast with a [`GrammarError`]) into a [`CompiledGrammar`], which starts
//! a [`RowMatcher`] per completion. JSON is generated compact by default: no free whitespace
//! between tokens, so a weak model cannot loop in blanks (`disable_any_whitespace: false` allows
//! it).

mod tok_env;

use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::toktrie::TokEnv;
use llguidance::{JsonCompileOptions, Matcher, ParserFactory, TokenParser};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use crate::request::InvalidParam;
use crate::tokenizer::Tokenizer;

/// Longest constraint text (a schema, regex, grammar or the choices together) in bytes.
pub const MAX_GRAMMAR_BYTES: usize = 256 * 1024;
/// Most choices of `choice`.
pub const MAX_CHOICES: usize = 1024;
/// Compiled grammars kept for reuse.
const CACHE_ENTRIES: usize = 256;

/// What a request's output must match: exactly one of the kinds (vLLM's `structured_outputs`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StructuredOutputs {
    /// A JSON schema (an object, or a string holding one).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub json: Option<Value>,
    /// A regular expression the whole output matches.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub regex: Option<String>,
    /// The output is exactly one of these strings.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub choice: Option<Vec<String>>,
    /// A context-free grammar in Lark syntax.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grammar: Option<String>,
    /// Any JSON object.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub json_object: Option<bool>,
    /// JSON without free whitespace (the default); `false` allows it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disable_any_whitespace: Option<bool>,
}

/// The one constraint a [`StructuredOutputs`] names.
#[derive(Debug, Clone, PartialEq)]
enum Kind {
    Json(Value),
    Regex(String),
    Choice(Vec<String>),
    Grammar(String),
}

fn invalid(message: impl Into<String>) -> InvalidParam {
    InvalidParam {
        field: "structured_outputs",
        message: message.into(),
    }
}

impl StructuredOutputs {
    /// The constraint, checked for shape and size (not compiled).
    fn kind(&self) -> Result<Kind, InvalidParam> {
        let json_object = self.json_object.unwrap_or(false);
        let set = [
            self.json.is_some(),
            self.regex.is_some(),
            self.choice.is_some(),
            self.grammar.is_some(),
            json_object,
        ]
        .iter()
        .filter(|&&b| b)
        .count();
        if set != 1 {
            return Err(invalid(format!(
                "exactly one of json, regex, choice, grammar and json_object must be given, got {set}"
            )));
        }
        let too_long = |len: usize| {
            (len > MAX_GRAMMAR_BYTES).then(|| {
                invalid(format!(
                    "the constraint may have at most {MAX_GRAMMAR_BYTES} bytes, got {len}"
                ))
            })
        };
        if json_object {
            return Ok(Kind::Json(serde_json::json!({"type": "object"})));
        }
        if let Some(j) = &self.json {
            let schema = match j {
                Value::String(s) => {
                    if let Some(e) = too_long(s.len()) {
                        return Err(e);
                    }
                    serde_json::from_str(s)
                        .map_err(|e| invalid(format!("the JSON schema is not valid JSON: {e}")))?
                }
                other => other.clone(),
            };
            let schema = match schema {
                Value::Bool(true) => serde_json::json!({}),
                Value::Object(_) => schema,
                _ => return Err(invalid("the JSON schema must be an object")),
            };
            if let Some(e) = too_long(schema.to_string().len()) {
                return Err(e);
            }
            return Ok(Kind::Json(schema));
        }
        if let Some(r) = &self.regex {
            if let Some(e) = too_long(r.len()) {
                return Err(e);
            }
            return Ok(Kind::Regex(r.clone()));
        }
        if let Some(c) = &self.choice {
            if c.is_empty() {
                return Err(invalid("choice must name at least one string"));
            }
            if c.len() > MAX_CHOICES {
                return Err(invalid(format!(
                    "at most {MAX_CHOICES} choices are allowed, got {}",
                    c.len()
                )));
            }
            if let Some(e) = too_long(c.iter().map(String::len).sum()) {
                return Err(e);
            }
            return Ok(Kind::Choice(c.clone()));
        }
        let g = self.grammar.clone().unwrap_or_default();
        if g.trim().is_empty() {
            return Err(invalid("the grammar is empty"));
        }
        if let Some(e) = too_long(g.len()) {
            return Err(e);
        }
        Ok(Kind::Grammar(g))
    }

    /// Checks the form (one kind, within the size limits); compiling is [`Grammars::compile`].
    pub fn validate(&self) -> Result<(), InvalidParam> {
        self.kind().map(|_| ())
    }
}

/// Why a constraint does not compile.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GrammarError {
    #[error(transparent)]
    Invalid(#[from] InvalidParam),
    /// Structured output cannot be served for this model's vocabulary.
    #[error("structured output is unavailable: {0}")]
    Unavailable(String),
}

/// A compiled constraint; cheap to clone, one [`RowMatcher`] per completion.
#[derive(Clone)]
pub struct CompiledGrammar {
    parser: TokenParser,
    /// Bits of the logits row (the model's vocabulary).
    width: usize,
}

impl std::fmt::Debug for CompiledGrammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompiledGrammar")
            .field("width", &self.width)
            .finish_non_exhaustive()
    }
}

impl CompiledGrammar {
    /// A matcher at the start of the output.
    pub fn matcher(&self) -> RowMatcher {
        RowMatcher {
            inner: Matcher::new(Ok(self.parser.clone())),
            width: self.width,
        }
    }
}

/// One completion's place in its grammar.
pub struct RowMatcher {
    inner: Matcher,
    width: usize,
}

impl RowMatcher {
    /// u32 words of a bitmask over the logits row.
    pub fn words(&self) -> usize {
        self.width.div_ceil(32)
    }

    /// The tokens allowed next as a bitmask over the logits row (bit `t % 32` of word `t / 32`).
    /// An engine error, or a state that allows nothing, allows only the end of text, so the
    /// completion ends instead of running on unconstrained.
    pub fn mask_into(&mut self, out: &mut [u32]) {
        out.fill(0);
        let mask = self
            .inner
            .compute_mask_or_eos()
            .ok()
            .filter(|m| !m.is_zero());
        match mask {
            Some(m) => {
                for (o, &w) in out.iter_mut().zip(m.as_slice()) {
                    *o = w;
                }
                // ids past the model's row are never allowed
                let tail = self.width % 32;
                if tail != 0 {
                    if let Some(last) = out.get_mut(self.width / 32) {
                        *last &= (1u32 << tail) - 1;
                    }
                }
            }
            None => {
                if let Ok(env) = self.inner.tok_env() {
                    for &t in env.tok_trie().eos_tokens() {
                        if let Some(w) = out.get_mut(t as usize / 32) {
                            *w |= 1 << (t % 32);
                        }
                    }
                }
            }
        }
    }

    /// Follows a sampled token; returns true when the grammar is complete (nothing may follow).
    /// A token the grammar refuses ends it too.
    pub fn advance(&mut self, token: u32) -> bool {
        if self.inner.consume_token(token).is_err() {
            return true;
        }
        self.inner.is_stopped()
    }

    /// Whether the output so far is a complete match.
    pub fn is_accepting(&mut self) -> bool {
        self.inner.is_accepting().unwrap_or(false)
    }
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars")
            .field("width", &self.width)
            .field("compact_default", &self.compact_default)
            .finish_non_exhaustive()
    }
}

/// Compiles constraints against one model's vocabulary and keeps the results by their text.
pub struct Grammars {
    tokenizer: Arc<Tokenizer>,
    width: usize,
    eos: Vec<u32>,
    /// Built on first use (indexing a large vocabulary takes a moment).
    factory: OnceLock<Result<ParserFactory, String>>,
    cache: Mutex<Cache>,
    /// JSON without free whitespace unless a request says otherwise.
    compact_default: bool,
}

#[derive(Default)]
struct Cache {
    map: HashMap<String, (CompiledGrammar, u64)>,
    clock: u64,
}

/// How long a compile took, and whether it came from the cache.
#[derive(Debug, Clone, Copy)]
pub struct CompileInfo {
    pub seconds: f64,
    pub cached: bool,
}

impl Grammars {
    /// `width` is the logits row (the model's vocabulary size), `eos` the ids that end a text.
    pub fn new(tokenizer: Arc<Tokenizer>, width: usize, eos: Vec<u32>) -> Self {
        Self {
            tokenizer,
            width,
            eos,
            factory: OnceLock::new(),
            cache: Mutex::new(Cache::default()),
            compact_default: true,
        }
    }

    /// Whether JSON allows free whitespace when a request does not say.
    pub fn with_any_whitespace(mut self, allowed: bool) -> Self {
        self.compact_default = !allowed;
        self
    }

    /// Indexes the vocabulary on a background thread (half a second for a 128k vocabulary), so the
    /// first constrained request does not wait for it.
    pub fn warm_up_in_background(self: &Arc<Self>) {
        let me = self.clone();
        let spawned = std::thread::Builder::new()
            .name("rserve-grammar-index".into())
            .spawn(move || {
                crate::host::lowest_priority();
                if let Err(e) = me.factory() {
                    tracing::warn!("{e}");
                }
            });
        if let Err(e) = spawned {
            tracing::warn!("indexing the vocabulary for grammars: {e}");
        }
    }

    fn factory(&self) -> Result<&ParserFactory, GrammarError> {
        self.factory
            .get_or_init(|| {
                let env: TokEnv =
                    tok_env::ModelTokEnv::build(self.tokenizer.clone(), self.width, &self.eos)?;
                let mut f = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
                f.quiet();
                *f.limits_mut() = ParserLimits {
                    verbose_errors: false,
                    ..ParserLimits::default()
                };
                Ok(f)
            })
            .as_ref()
            .map_err(|e| GrammarError::Unavailable(e.clone()))
    }

    /// The grammar of `spec`, from the cache or compiled now.
    pub fn compile(
        &self,
        spec: &StructuredOutputs,
    ) -> Result<(CompiledGrammar, CompileInfo), GrammarError> {
        let started = Instant::now();
        let kind = spec.kind()?;
        let compact = spec.disable_any_whitespace.unwrap_or(self.compact_default);
        let (key, grammar) = match kind {
            Kind::Json(mut schema) => {
                let key = format!("json:{compact}:{schema}");
                let opts = JsonCompileOptions {
                    whitespace_flexible: !compact,
                    ..JsonCompileOptions::default()
                };
                opts.apply_to(&mut schema);
                (key, TopLevelGrammar::from_json_schema(schema))
            }
            Kind::Regex(r) => (format!("regex:{r}"), TopLevelGrammar::from_regex(&r)),
            Kind::Choice(c) => {
                let alts: Vec<String> = c
                    .iter()
                    .map(|s| serde_json::to_string(s).unwrap_or_default())
                    .collect();
                let lark = format!("start: {}", alts.join(" | "));
                (format!("lark:{lark}"), TopLevelGrammar::from_lark(lark))
            }
            Kind::Grammar(g) => (format!("lark:{g}"), TopLevelGrammar::from_lark(g)),
        };
        if let Some(g) = self.cached(&key) {
            let info = CompileInfo {
                seconds: started.elapsed().as_secs_f64(),
                cached: true,
            };
            return Ok((g, info));
        }
        let factory = self.factory()?;
        let parser = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            factory.create_parser(grammar)
        }))
        .map_err(|_| invalid("the constraint could not be compiled"))?
        .map_err(|e| invalid(first_line(&e.to_string())))?;
        let compiled = CompiledGrammar {
            parser,
            width: self.width,
        };
        self.insert(key, compiled.clone());
        let info = CompileInfo {
            seconds: started.elapsed().as_secs_f64(),
            cached: false,
        };
        Ok((compiled, info))
    }

    fn cached(&self, key: &str) -> Option<CompiledGrammar> {
        let mut c = self.cache.lock().ok()?;
        c.clock += 1;
        let now = c.clock;
        c.map.get_mut(key).map(|(g, used)| {
            *used = now;
            g.clone()
        })
    }

    fn insert(&self, key: String, g: CompiledGrammar) {
        let Ok(mut c) = self.cache.lock() else {
            return;
        };
        if c.map.len() >= CACHE_ENTRIES {
            if let Some(oldest) = c
                .map
                .iter()
                .min_by_key(|(_, (_, used))| *used)
                .map(|(k, _)| k.clone())
            {
                c.map.remove(&oldest);
            }
        }
        c.clock += 1;
        let now = c.clock;
        c.map.insert(key, (g, now));
    }
}

/// The engine's message on one line, at most 400 characters.
fn first_line(msg: &str) -> String {
    let line = msg.split_whitespace().collect::<Vec<_>>().join(" ");
    let mut s: String = line.chars().take(400).collect();
    if s.is_empty() {
        s = "the constraint could not be compiled".into();
    }
    s
}

#[cfg(test)]
mod tests;
