//! Tools on chat completions: the request's `tools` and `tool_choice` checked, what the chat
//! template sees, the constraint a `required` or named choice imposes (so the model can write
//! nothing else), and the reply turned back into `tool_calls`, whole or streamed.
//!
//! `auto` parses what the model wrote with the server's `--tool-call-parser`. A named function
//! constrains the output to that function's parameters schema: the output is the arguments. A
//! `required` choice constrains it to a JSON array of `{"name", "parameters"}` objects, one per
//! call (one at most without `parallel_tool_calls`), as vLLM does; either works with any model.

use super::error::ApiError;
use super::tools::{json_value_end, StreamEvent, ToolCall, ToolParser, ToolStream};
use rserve_core::structured::StructuredOutputs;
use serde_json::{json, Value};

/// Most tools one request may declare.
pub const MAX_TOOLS: usize = 512;

/// How a request's reply relates to its tools.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolMode {
    /// No tools, or `tool_choice: "none"`: the reply is text.
    Off,
    /// The model may call tools, written in `parser`'s format.
    Auto {
        parser: ToolParser,
        names: Vec<String>,
    },
    /// The reply is the arguments of this function.
    Named(String),
    /// The reply is a list of calls.
    Required,
}

/// What a chat request's tools mean for its handling.
#[derive(Debug, Clone)]
pub struct ToolPlan {
    /// The tools as the chat template receives them (OpenAI's form).
    pub template_tools: Option<Vec<Value>>,
    pub mode: ToolMode,
    /// The output constraint of a named or `required` choice.
    pub constraint: Option<StructuredOutputs>,
}

fn bad(field: &str, msg: impl Into<String>) -> ApiError {
    ApiError::bad_request(msg.into()).with_param(field)
}

/// A declared function: its name and parameters schema.
fn function_of(i: usize, tool: &Value) -> Result<(String, Value), ApiError> {
    if tool.get("type").and_then(Value::as_str) != Some("function") {
        return Err(bad("tools", format!("tools[{i}].type must be `function`")));
    }
    let f = tool
        .get("function")
        .filter(|f| f.is_object())
        .ok_or_else(|| bad("tools", format!("tools[{i}].function must be an object")))?;
    let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
    let valid = !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.');
    if !valid {
        return Err(bad(
            "tools",
            format!("tools[{i}].function.name must be 1 to 64 letters, digits, `_`, `-` or `.`"),
        ));
    }
    let params = match f.get("parameters") {
        None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(_) => {
            return Err(bad(
                "tools",
                format!("tools[{i}].function.parameters must be a JSON schema object"),
            ))
        }
    };
    Ok((name.to_owned(), params))
}

/// Checks `tools` and `tool_choice` and decides the reply's mode. `auto_parser` is the server's
/// parser when `--enable-auto-tool-choice` is on.
pub fn plan(
    tools: Option<&[Value]>,
    tool_choice: Option<&Value>,
    parallel_tool_calls: Option<bool>,
    auto_parser: Option<ToolParser>,
) -> Result<ToolPlan, ApiError> {
    let tools = tools.unwrap_or_default();
    if tools.len() > MAX_TOOLS {
        return Err(bad(
            "tools",
            format!("at most {MAX_TOOLS} tools are allowed, got {}", tools.len()),
        ));
    }
    let mut funcs: Vec<(String, Value)> = Vec::with_capacity(tools.len());
    for (i, t) in tools.iter().enumerate() {
        let f = function_of(i, t)?;
        if funcs.iter().any(|(n, _)| *n == f.0) {
            return Err(bad(
                "tools",
                format!("the function `{}` is declared twice", f.0),
            ));
        }
        funcs.push(f);
    }
    let choice = tool_choice.filter(|c| !c.is_null());
    let off = ToolPlan {
        template_tools: (!tools.is_empty()).then(|| tools.to_vec()),
        mode: ToolMode::Off,
        constraint: None,
    };
    let choice = match choice {
        None if funcs.is_empty() => return Ok(off),
        None => "auto",
        Some(Value::String(s)) => s.as_str(),
        Some(obj @ Value::Object(_)) => {
            let name = obj
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|_| obj.get("type").and_then(Value::as_str) == Some("function"))
                .ok_or_else(|| {
                    bad(
                        "tool_choice",
                        "tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    )
                })?;
            let Some((_, params)) = funcs.iter().find(|(n, _)| n == name) else {
                return Err(bad(
                    "tool_choice",
                    format!("tool_choice names the function `{name}`, which is not in tools"),
                ));
            };
            return Ok(ToolPlan {
                mode: ToolMode::Named(name.to_owned()),
                constraint: Some(StructuredOutputs {
                    json: Some(params.clone()),
                    ..StructuredOutputs::default()
                }),
                ..off
            });
        }
        Some(_) => {
            return Err(bad(
                "tool_choice",
                "tool_choice must be a string or a function object",
            ))
        }
    };
    if choice != "none" && funcs.is_empty() {
        return Err(bad(
            "tool_choice",
            "When using `tool_choice`, `tools` must be set.",
        ));
    }
    match choice {
        "none" => Ok(off),
        "auto" => match auto_parser {
            Some(parser) => Ok(ToolPlan {
                mode: ToolMode::Auto {
                    parser,
                    names: funcs.into_iter().map(|(n, _)| n).collect(),
                },
                ..off
            }),
            None => Err(bad(
                "tool_choice",
                "\"auto\" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set",
            )),
        },
        "required" => {
            let items: Vec<Value> = funcs
                .iter()
                .map(|(name, params)| {
                    json!({
                        "type": "object",
                        "properties": {"name": {"const": name}, "parameters": params},
                        "required": ["name", "parameters"],
                        "additionalProperties": false,
                    })
                })
                .collect();
            let mut schema = json!({"type": "array", "minItems": 1, "items": {"anyOf": items}});
            if parallel_tool_calls == Some(false) {
                schema["maxItems"] = json!(1);
            }
            Ok(ToolPlan {
                mode: ToolMode::Required,
                constraint: Some(StructuredOutputs {
                    json: Some(schema),
                    ..StructuredOutputs::default()
                }),
                ..off
            })
        }
        other => Err(bad(
            "tool_choice",
            format!("tool_choice `{other}` is not one of none, auto, required"),
        )),
    }
}

/// A reply read back: text for the user and the calls.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Reply {
    pub content: Option<String>,
    pub calls: Vec<ToolCall>,
}

/// One `{"name", "parameters"}` element of a `required` reply as a call.
fn listed_call(v: &Value) -> Option<ToolCall> {
    let name = v.get("name")?.as_str()?.to_owned();
    let args = v.get("parameters").cloned().unwrap_or_else(|| json!({}));
    Some(ToolCall {
        name,
        arguments: serde_json::to_string(&args).ok()?,
    })
}

impl ToolMode {
    /// A whole reply read back.
    pub fn reply(&self, text: &str) -> Reply {
        let as_text = || Reply {
            content: Some(text.to_owned()),
            calls: Vec::new(),
        };
        match self {
            ToolMode::Off => as_text(),
            ToolMode::Named(name) => Reply {
                content: None,
                calls: vec![ToolCall {
                    name: name.clone(),
                    arguments: text.to_owned(),
                }],
            },
            ToolMode::Required => {
                let calls: Option<Vec<ToolCall>> = serde_json::from_str::<Vec<Value>>(text)
                    .ok()
                    .and_then(|list| list.iter().map(listed_call).collect());
                match calls {
                    Some(calls) if !calls.is_empty() => Reply {
                        content: None,
                        calls,
                    },
                    _ => as_text(),
                }
            }
            ToolMode::Auto { parser, names } => {
                let known: Vec<&str> = names.iter().map(String::as_str).collect();
                let p = parser.parse(text, &known);
                Reply {
                    content: p.content,
                    calls: p.calls,
                }
            }
        }
    }

    /// A reader of this reply's stream, for one choice.
    pub fn streamer(&self) -> ReplyStream {
        match self {
            ToolMode::Off => ReplyStream::Text,
            ToolMode::Named(name) => ReplyStream::Named {
                name: name.clone(),
                started: false,
            },
            ToolMode::Required => ReplyStream::Listed {
                buf: String::new(),
                pos: 0,
                sent: 0,
            },
            ToolMode::Auto { parser, names } => ReplyStream::Auto(parser.streamer(names.clone())),
        }
    }

    /// Whether a reply with calls ends with `finish_reason: "tool_calls"` (a named choice ends with
    /// `stop`, as OpenAI's does).
    pub fn reports_tool_calls(&self) -> bool {
        matches!(self, ToolMode::Auto { .. } | ToolMode::Required)
    }
}

/// One choice's streamed reply as events.
#[derive(Debug)]
pub enum ReplyStream {
    Text,
    Named {
        name: String,
        started: bool,
    },
    Listed {
        buf: String,
        pos: usize,
        sent: usize,
    },
    Auto(ToolStream),
}

impl ReplyStream {
    /// The events of the next text delta.
    pub fn push(&mut self, delta: &str) -> Vec<StreamEvent> {
        match self {
            ReplyStream::Text => vec![StreamEvent::Content(delta.to_owned())],
            ReplyStream::Named { name, started } => {
                let mut ev = Vec::new();
                if !*started {
                    *started = true;
                    ev.push(StreamEvent::CallStart {
                        index: 0,
                        name: name.clone(),
                    });
                }
                if !delta.is_empty() {
                    ev.push(StreamEvent::Arguments {
                        index: 0,
                        text: delta.to_owned(),
                    });
                }
                ev
            }
            ReplyStream::Listed { buf, pos, sent } => {
                buf.push_str(delta);
                let mut ev = Vec::new();
                loop {
                    let rest = &buf[*pos..];
                    let skip = rest
                        .find(|c: char| !(c.is_whitespace() || c == ',' || c == '['))
                        .unwrap_or(rest.len());
                    let start = *pos + skip;
                    if !buf[start..].starts_with('{') {
                        break;
                    }
                    let Some(end) = json_value_end(buf, start) else {
                        break;
                    };
                    *pos = end;
                    let call = serde_json::from_str::<Value>(&buf[start..end])
                        .ok()
                        .as_ref()
                        .and_then(listed_call);
                    if let Some(c) = call {
                        ev.push(StreamEvent::CallStart {
                            index: *sent,
                            name: c.name,
                        });
                        ev.push(StreamEvent::Arguments {
                            index: *sent,
                            text: c.arguments,
                        });
                        *sent += 1;
                    }
                }
                ev
            }
            ReplyStream::Auto(s) => s.push(delta),
        }
    }

    /// The events held back until the end.
    pub fn finish(&mut self) -> Vec<StreamEvent> {
        match self {
            ReplyStream::Auto(s) => s.finish(),
            ReplyStream::Listed { buf, sent, .. } if *sent == 0 && !buf.is_empty() => {
                vec![StreamEvent::Content(std::mem::take(buf))]
            }
            _ => Vec::new(),
        }
    }

    /// Whether a call was sent.
    pub fn called(&self) -> bool {
        match self {
            ReplyStream::Text => false,
            ReplyStream::Named { started, .. } => *started,
            ReplyStream::Listed { sent, .. } => *sent > 0,
            ReplyStream::Auto(s) => s.called(),
        }
    }
}

/// A fresh call id, as OpenAI shapes them.
pub fn call_id() -> String {
    format!("chatcmpl-tool-{}", crate::routes::misc::random_id())
}

#[cfg(test)]
mod tests;
