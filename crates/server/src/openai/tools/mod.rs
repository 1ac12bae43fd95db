//! Tool calls in model output: the formats chat models write calls in (`hermes`, `llama3_json`,
//! `mistral`), turned back into OpenAI `tool_calls`, for a whole output and for a stream of deltas.
//! This module only reads text; choosing a parser (`--tool-call-parser`), minting call ids and
//! shaping the response belong to the HTTP layer.
//!
//! One state machine per format does both jobs: [`ToolParser::parse`] feeds the whole text to the
//! same streamer a stream uses, so the two agree by construction on every well-formed output,
//! whatever the chunking. A call is emitted once its JSON is complete and names a known function
//! (in a Mistral array or a Llama 3 list, once the `,`, `]`, `;` or end after it confirms it);
//! its `arguments` are that JSON's arguments object re-serialized compactly by `serde_json`. A
//! malformed call or an unknown name turns the whole output back into plain content (a stream, which
//! cannot take back what it sent, turns the rest into content). Text between calls that is only
//! whitespace is dropped; other text outside calls is content, verbatim.

mod hermes;
mod llama3_json;
mod mistral;
mod stream;
#[cfg(test)]
mod testutil;

use serde_json::Value;
use stream::Core;

/// A parsed call: the function's name and its arguments as JSON text (an object, compact, exactly
/// the model's JSON re-serialized with `serde_json::to_string` of the parsed value).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: String,
}

/// What a finished output holds: text meant for the user (`None` when empty or whitespace only)
/// and the calls.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Parsed {
    pub content: Option<String>,
    pub calls: Vec<ToolCall>,
}

/// The tool-call formats this server reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolParser {
    /// Hermes / Qwen2.5: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated.
    Hermes,
    /// Llama 3.1/3.2: `[<|python_tag|>]{"name": ..., "parameters": {...}}`, `;`-separated.
    Llama3Json,
    /// Mistral: `[TOOL_CALLS][{...}, ...]` or `[TOOL_CALLS]name[ARGS]{...}`, repeated.
    Mistral,
}

impl ToolParser {
    /// Names accepted by `--tool-call-parser`.
    pub const NAMES: &'static [&'static str] = &["hermes", "llama3_json", "mistral"];

    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "hermes" => Some(Self::Hermes),
            "llama3_json" => Some(Self::Llama3Json),
            "mistral" => Some(Self::Mistral),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Hermes => "hermes",
            Self::Llama3Json => "llama3_json",
            Self::Mistral => "mistral",
        }
    }

    /// Parses a whole output. `known` are the request's tool names: a call naming a function not
    /// in `known`, or whose JSON is malformed, makes the whole output fall back to plain content
    /// (content = the full text, calls empty).
    pub fn parse(self, text: &str, known: &[&str]) -> Parsed {
        let mut stream = self.streamer(known.iter().map(|k| (*k).to_owned()).collect());
        let mut events = stream.push(text);
        events.extend(stream.finish());
        if stream.core.fell_back() {
            return Parsed {
                content: non_blank(text.to_owned()),
                calls: Vec::new(),
            };
        }
        collect(events)
    }

    /// A streaming parser for one completion.
    pub fn streamer(self, known: Vec<String>) -> ToolStream {
        let machine = match self {
            Self::Hermes => Machine::Hermes(hermes::State::default()),
            Self::Llama3Json => Machine::Llama3Json(llama3_json::State::default()),
            Self::Mistral => Machine::Mistral(mistral::State::default()),
        };
        ToolStream {
            core: Core::new(known),
            machine,
        }
    }
}

/// One piece of a streamed reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamEvent {
    Content(String),
    /// The start of call `index` (0-based within this completion): its name. The HTTP layer mints
    /// the id.
    CallStart {
        index: usize,
        name: String,
    },
    /// More of call `index`'s arguments JSON text.
    Arguments {
        index: usize,
        text: String,
    },
}

/// The streaming parser of one completion: text deltas in, [`StreamEvent`]s out. It holds back
/// what could still turn out to be part of a call (a marker's first bytes, a call's JSON until it
/// is complete, whitespace that may only separate calls). Call [`ToolStream::finish`] once, last.
#[derive(Debug)]
pub struct ToolStream {
    core: Core,
    machine: Machine,
}

#[derive(Debug)]
enum Machine {
    Hermes(hermes::State),
    Llama3Json(llama3_json::State),
    Mistral(mistral::State),
}

impl ToolStream {
    /// Feed the next text delta; returns what can be sent now.
    pub fn push(&mut self, delta: &str) -> Vec<StreamEvent> {
        self.core.feed(delta);
        self.run(false);
        self.core.drain()
    }

    /// The output ended: flush what is held back.
    pub fn finish(&mut self) -> Vec<StreamEvent> {
        self.run(true);
        self.core.close();
        self.core.drain()
    }

    /// Whether any call was emitted (the finish reason becomes "tool_calls").
    pub fn called(&self) -> bool {
        self.core.calls() > 0
    }

    fn run(&mut self, eof: bool) {
        match &mut self.machine {
            Machine::Hermes(state) => hermes::step(state, &mut self.core, eof),
            Machine::Llama3Json(state) => llama3_json::step(state, &mut self.core, eof),
            Machine::Mistral(state) => mistral::step(state, &mut self.core, eof),
        }
    }
}

/// Where the JSON value that starts at byte `start` of `text` ends: the offset just past it, or
/// `None` while the text could still continue it (an open string, object or array, or a number or
/// literal running to the end of `text`). The scan is structural, not a validation: strings and
/// escapes are skipped, brackets must nest; a closing bracket that does not match ends the value
/// there, and a byte that cannot start a value is a one-byte "value", so parsing the span reports
/// the error. Only ASCII bytes are structural, so every offset returned is a char boundary.
pub fn json_value_end(text: &str, start: usize) -> Option<usize> {
    let bytes = text.as_bytes();
    match *bytes.get(start)? {
        b'{' | b'[' => container_end(bytes, start),
        b'"' => string_end(bytes, start + 1),
        _ => scalar_end(bytes, start),
    }
}

/// Past the closing quote of a string whose body starts at `from`.
fn string_end(bytes: &[u8], from: usize) -> Option<usize> {
    let mut i = from;
    while let Some(&b) = bytes.get(i) {
        match b {
            b'\\' => i += 2,
            b'"' => return Some(i + 1),
            _ => i += 1,
        }
    }
    None
}

fn container_end(bytes: &[u8], start: usize) -> Option<usize> {
    let mut closers = Vec::new();
    let mut i = start;
    while let Some(&b) = bytes.get(i) {
        match b {
            b'"' => {
                i = string_end(bytes, i + 1)?;
                continue;
            }
            b'{' => closers.push(b'}'),
            b'[' => closers.push(b']'),
            b'}' | b']' => {
                let matched = closers.pop() == Some(b);
                if !matched || closers.is_empty() {
                    return Some(i + 1);
                }
            }
            _ => {}
        }
        i += 1;
    }
    None
}

fn scalar_end(bytes: &[u8], start: usize) -> Option<usize> {
    let is_delimiter = |b: &u8| b.is_ascii_whitespace() || b"{}[]\",:;".contains(b);
    let len = bytes.get(start..)?.iter().position(is_delimiter)?;
    Some(start + len.max(1))
}

/// The length of the longest proper prefix of `marker` that `text` ends with: bytes to hold back
/// because the next delta may complete the marker.
fn partial_suffix(text: &str, marker: &str) -> usize {
    let longest = marker.len().saturating_sub(1).min(text.len());
    (1..=longest)
        .rev()
        .find(|&k| marker.get(..k).is_some_and(|head| text.ends_with(head)))
        .unwrap_or(0)
}

/// A call from a `{"name": ..., "arguments": {...}}` object ("parameters" is read as a synonym).
fn call_from_object(value: &Value, known: &[String]) -> Option<ToolCall> {
    let object = value.as_object()?;
    let name = object.get("name")?.as_str()?;
    let arguments = object.get("arguments").or_else(|| object.get("parameters"));
    call_from_parts(name, arguments, known)
}

/// A call from a name and its arguments: an object, a string holding a JSON object, or absent or
/// `null` for none. Anything else, or a name not in `known`, is no call.
fn call_from_parts(name: &str, arguments: Option<&Value>, known: &[String]) -> Option<ToolCall> {
    if !known.iter().any(|k| k == name) {
        return None;
    }
    let arguments = match arguments {
        None | Some(Value::Null) => "{}".to_owned(),
        Some(object @ Value::Object(_)) => serde_json::to_string(object).ok()?,
        Some(Value::String(text)) => match serde_json::from_str::<Value>(text) {
            Ok(object @ Value::Object(_)) => serde_json::to_string(&object).ok()?,
            _ => return None,
        },
        Some(_) => return None,
    };
    Some(ToolCall {
        name: name.to_owned(),
        arguments,
    })
}

fn non_blank(text: String) -> Option<String> {
    (!text.trim().is_empty()).then_some(text)
}

/// The [`Parsed`] that a sequence of events adds up to.
fn collect(events: Vec<StreamEvent>) -> Parsed {
    let mut content = String::new();
    let mut calls: Vec<ToolCall> = Vec::new();
    for event in events {
        match event {
            StreamEvent::Content(text) => content.push_str(&text),
            StreamEvent::CallStart { name, .. } => calls.push(ToolCall {
                name,
                arguments: String::new(),
            }),
            StreamEvent::Arguments { index, text } => {
                if let Some(call) = calls.get_mut(index) {
                    call.arguments.push_str(&text);
                }
            }
        }
    }
    Parsed {
        content: non_blank(content),
        calls,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn end(text: &str) -> Option<usize> {
        json_value_end(text, 0)
    }

    #[test]
    fn scanner_finds_the_end_of_objects_and_arrays() {
        assert_eq!(end("{}"), Some(2));
        assert_eq!(end("{} tail"), Some(2));
        assert_eq!(end(r#"{"a": [1, {"b": null}], "c": {}}x"#), Some(32));
        assert_eq!(end("[1, [2, [3]]]]"), Some(13));
        assert_eq!(json_value_end(r#"xx{"a":1}yy"#, 2), Some(9));
    }

    #[test]
    fn scanner_skips_strings_and_escapes() {
        let text = r#"{"s": "} ] { [ \" \\", "t": "\\\"}"}"#;
        assert_eq!(end(text), Some(text.len()));
        assert_eq!(end(r#""a\"b" rest"#), Some(6));
        let unicode = "{\"é\": \"日本 \\u00e9 }\"}";
        assert_eq!(end(unicode), Some(unicode.len()));
    }

    #[test]
    fn scanner_waits_on_every_incomplete_prefix() {
        let text = r#"{"a": "}\\\"", "b": [1, {"c": "]"}], "d": "日本"}"#;
        for (i, _) in text.char_indices() {
            assert_eq!(end(&text[..i]), None, "prefix {:?}", &text[..i]);
        }
        assert_eq!(end(text), Some(text.len()));
        assert_eq!(end(r#""abc\"#), None);
        assert_eq!(end(""), None);
        assert_eq!(json_value_end("{}", 5), None);
    }

    #[test]
    fn scanner_ends_at_a_mismatched_bracket() {
        assert_eq!(end("{]"), Some(2));
        assert_eq!(end("[{]}"), Some(3));
        assert!(serde_json::from_str::<Value>("{]").is_err());
    }

    #[test]
    fn scanner_reads_scalars_up_to_a_delimiter() {
        assert_eq!(end("123, 4"), Some(3));
        assert_eq!(end("true}"), Some(4));
        assert_eq!(end("12"), None);
        assert_eq!(end("}"), Some(1));
        assert_eq!(end(" 1"), Some(1));
    }

    #[test]
    fn partial_suffix_holds_back_a_marker_prefix() {
        assert_eq!(partial_suffix("text <tool", "<tool_call>"), 5);
        assert_eq!(partial_suffix("text <tool_call", "<tool_call>"), 10);
        assert_eq!(partial_suffix("text", "<tool_call>"), 0);
        assert_eq!(partial_suffix("<", "<tool_call>"), 1);
        assert_eq!(partial_suffix("日本[", "[TOOL_CALLS]"), 1);
    }

    #[test]
    fn calls_need_a_known_name_and_object_arguments() {
        let known = vec!["f".to_owned()];
        let call = |text: &str| {
            let value: Value = serde_json::from_str(text).unwrap();
            call_from_object(&value, &known)
        };
        let f = |arguments: &str| {
            Some(ToolCall {
                name: "f".into(),
                arguments: arguments.into(),
            })
        };
        assert_eq!(
            call(r#"{"name": "f", "arguments": {"a": 1}}"#),
            f(r#"{"a":1}"#)
        );
        assert_eq!(
            call(r#"{"name": "f", "parameters": {"a": 1}}"#),
            f(r#"{"a":1}"#)
        );
        assert_eq!(
            call(r#"{"name": "f", "arguments": "{\"a\": 1}"}"#),
            f(r#"{"a":1}"#)
        );
        assert_eq!(call(r#"{"name": "f"}"#), f("{}"));
        assert_eq!(call(r#"{"name": "g", "arguments": {}}"#), None);
        assert_eq!(call(r#"{"name": "f", "arguments": [1]}"#), None);
        assert_eq!(call(r#"{"name": "f", "arguments": "oops"}"#), None);
        assert_eq!(call(r#"{"arguments": {}}"#), None);
        assert_eq!(call("[1]"), None);
    }

    #[test]
    fn names_round_trip() {
        for name in ToolParser::NAMES {
            assert_eq!(
                ToolParser::from_name(name).map(ToolParser::name),
                Some(*name)
            );
        }
        assert_eq!(ToolParser::from_name("qwen"), None);
    }
}
