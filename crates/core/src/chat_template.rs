//! Chat templates: Hugging Face `chat_template` Jinja sources rendered with minijinja.
//!
//! This module owns loading a model's template (`chat_template.jinja`, else the
//! `chat_template` field of `tokenizer_config.json`) and rendering a list of chat
//! messages into a prompt string with the semantics of transformers'
//! `apply_chat_template`: `trim_blocks` and `lstrip_blocks` on, no kept trailing
//! newline, loop controls, Python string/dict/list methods, `raise_exception`,
//! `strftime_now` and a `tojson` filter that matches `json.dumps(ensure_ascii=False)`.
//! Printed none, booleans and floats use Python's spelling (`None`, `True`, `1e-05`).
//! It does not tokenize the prompt, validate message schemas or pick between several
//! named templates beyond `default`.
//! Invariants: nothing a template, a message or a tool definition contains can panic
//! here; every failure is a [`ChatTemplateError`]. Map key order is insertion order,
//! which requires minijinja's and serde_json's `preserve_order` features.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Serde, Value, ValueKind};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, Output, State};

const TEMPLATE_NAME: &str = "chat_template";

/// Errors from loading or rendering a chat template.
#[derive(Debug, thiserror::Error)]
pub enum ChatTemplateError {
    #[error("invalid chat template: {0}")]
    Syntax(#[source] Error),
    /// The template called `raise_exception(message)`.
    #[error("chat template raised an exception: {0}")]
    Raised(String),
    #[error("failed to render chat template: {0}")]
    Render(#[source] Error),
    #[error("failed to read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("invalid {}: {reason}", path.display())]
    Config { path: PathBuf, reason: String },
}

/// Marker attached to the minijinja error produced by `raise_exception`.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Raised(String);

/// A chat template and the special tokens it may reference, from a model directory.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TemplateSource {
    pub template: Option<String>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
}

/// A compiled chat template, ready to render conversations.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    /// `bos_token`/`eos_token` context entries, for the tokens that are known.
    special_tokens: Vec<(&'static str, String)>,
    source: String,
}

impl ChatTemplate {
    /// Compiles `source`; `bos_token`/`eos_token` are exposed to the template when set.
    pub fn new(
        source: &str,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, ChatTemplateError> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .map_err(ChatTemplateError::Syntax)?;
        env.set_syntax(syntax);
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(python_formatter);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source.to_owned())
            .map_err(ChatTemplateError::Syntax)?;
        let tokens = [("bos_token", bos_token), ("eos_token", eos_token)];
        let special_tokens = tokens.into_iter().filter_map(|(n, t)| Some((n, t?)));
        Ok(Self {
            env,
            special_tokens: special_tokens.collect(),
            source: source.to_owned(),
        })
    }

    /// The template's source text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders `messages` like transformers' `apply_chat_template(tokenize=False)`.
    ///
    /// The context holds `messages`, `add_generation_prompt`, `tools` (none when not
    /// given), `documents` (none), `bos_token`/`eos_token` when known, and the `extra`
    /// keys (e.g. `enable_thinking`), which may override everything but `messages`,
    /// `add_generation_prompt` and `tools`.
    pub fn render(
        &self,
        messages: &[serde_json::Value],
        add_generation_prompt: bool,
        tools: Option<&[serde_json::Value]>,
        extra: Option<&serde_json::Map<String, serde_json::Value>>,
    ) -> Result<String, ChatTemplateError> {
        let none = Value::from(());
        let mut ctx = BTreeMap::from([("documents".to_owned(), none.clone())]);
        for (name, token) in &self.special_tokens {
            ctx.insert((*name).to_owned(), Value::from(token.as_str()));
        }
        let extra = extra.into_iter().flatten();
        ctx.extend(extra.map(|(k, v)| (k.clone(), Value::from(Serde(v)))));
        ctx.insert("messages".into(), Value::from(Serde(messages)));
        let agp = Value::from(add_generation_prompt);
        ctx.insert("add_generation_prompt".into(), agp);
        let tools = tools.map_or(none, |t| Value::from(Serde(t)));
        ctx.insert("tools".into(), tools);
        let template = self.env.get_template(TEMPLATE_NAME);
        let rendered = template.and_then(|t| t.render(Value::from_pairs(ctx)));
        rendered.map_err(render_error)
    }
}

/// Maps a render failure to [`ChatTemplateError::Raised`] when `raise_exception` caused it.
fn render_error(err: Error) -> ChatTemplateError {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(&err);
    while let Some(e) = cur {
        if let Some(raised) = e.downcast_ref::<Raised>() {
            return ChatTemplateError::Raised(raised.0.clone());
        }
        cur = e.source();
    }
    ChatTemplateError::Render(err)
}

/// Reads the chat template and BOS/EOS tokens of a model directory.
///
/// `chat_template.jinja` wins over `tokenizer_config.json`'s `chat_template`, which may
/// be a string or a list of `{name, template}` (the `default` entry is used). Returns
/// `Ok(None)` when the directory has neither file.
pub fn load_chat_template(model_dir: &Path) -> Result<Option<TemplateSource>, ChatTemplateError> {
    use serde_json::Value as Json;
    let jinja = read_optional(&model_dir.join("chat_template.jinja"))?;
    let path = model_dir.join("tokenizer_config.json");
    let invalid = |reason: String| ChatTemplateError::Config {
        path: path.clone(),
        reason,
    };
    let config: Option<Json> = match read_optional(&path)? {
        Some(text) => Some(serde_json::from_str(&text).map_err(|e| invalid(e.to_string()))?),
        None => None,
    };
    if jinja.is_none() && config.is_none() {
        return Ok(None);
    }
    let field = |name: &str| config.as_ref().and_then(|c| c.get(name));
    let template = match (jinja, field("chat_template")) {
        (Some(text), _) => Some(text),
        (None, None | Some(Json::Null)) => None,
        (None, Some(Json::String(text))) => Some(text.clone()),
        (None, Some(Json::Array(entries))) => {
            let named = |e: &&Json| e.get("name").and_then(Json::as_str) == Some("default");
            let default = entries.iter().find(named).and_then(|e| e.get("template"));
            let text = default
                .and_then(Json::as_str)
                .ok_or_else(|| invalid("chat_template list has no \"default\" template".into()))?;
            Some(text.to_owned())
        }
        (None, Some(other)) => {
            return Err(invalid(format!(
                "chat_template must be a string or a list, not {other}"
            )));
        }
    };
    // A special token is a string or an AddedToken dict `{"content": ...}`.
    let token = |name: &str| match field(name)? {
        Json::Object(map) => map.get("content")?.as_str().map(str::to_owned),
        other => other.as_str().map(str::to_owned),
    };
    Ok(Some(TemplateSource {
        template,
        bos_token: token("bos_token"),
        eos_token: token("eos_token"),
    }))
}

fn read_optional(path: &Path) -> Result<Option<String>, ChatTemplateError> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(ChatTemplateError::Io {
            path: path.to_path_buf(),
            source,
        }),
    }
}

fn raise_exception(message: Value) -> Result<Value, Error> {
    let message = message.to_string();
    Err(Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(Raised(message)))
}

/// `strftime_now(format)`: the current UTC time formatted with strftime codes.
fn strftime_now(format: String) -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(0));
    format_time(&format, now)
}

const WEEKDAYS: &str = "Sunday Monday Tuesday Wednesday Thursday Friday Saturday";
const MONTHS: &str =
    "January February March April May June July August September October November December";

fn nth_name(names: &str, n: usize, short: bool) -> String {
    let name = names.split(' ').nth(n).unwrap_or_default();
    name.get(..if short { 3 } else { name.len() })
        .unwrap_or(name)
        .to_owned()
}

/// Formats a Unix timestamp (UTC) with the common glibc strftime codes, including the
/// `-` no-padding flag (`%-d`). Unknown codes are copied through like glibc does.
fn format_time(format: &str, unix_secs: i64) -> String {
    let days = unix_secs.div_euclid(86_400);
    let secs = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (secs / 3600, secs / 60 % 60, secs % 60);
    let weekday = (days + 4).rem_euclid(7) as usize; // 1970-01-01 was a Thursday.
    let leap = year % 4 == 0 && (year % 100 != 0 || year % 400 == 0);
    const CUMULATIVE: [i64; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let month_idx = (month - 1).clamp(0, 11) as usize;
    let yday = CUMULATIVE[month_idx] + day + i64::from(leap && month > 2);
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };
    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut spec = chars.next();
        let no_pad = spec == Some('-');
        if no_pad {
            spec = chars.next();
        }
        let num =
            |v: i64, width: usize| format!("{v:0width$}", width = width * usize::from(!no_pad));
        let piece = match spec {
            Some('Y') => year.to_string(),
            Some('y') => num(year.rem_euclid(100), 2),
            Some('m') => num(month, 2),
            Some('d') => num(day, 2),
            Some('e') if no_pad => day.to_string(),
            Some('e') => format!("{day:2}"),
            Some('H') => num(hour, 2),
            Some('I') => num(hour12, 2),
            Some('M') => num(minute, 2),
            Some('S') => num(second, 2),
            Some('j') => num(yday, 3),
            Some('p') => (if hour < 12 { "AM" } else { "PM" }).to_owned(),
            Some('A') => nth_name(WEEKDAYS, weekday, false),
            Some('a') => nth_name(WEEKDAYS, weekday, true),
            Some('B') => nth_name(MONTHS, month_idx, false),
            Some('b' | 'h') => nth_name(MONTHS, month_idx, true),
            Some('u') => (if weekday == 0 { 7 } else { weekday }).to_string(),
            Some('w') => weekday.to_string(),
            Some('F') => format!("{year}-{month:02}-{day:02}"),
            Some('T') => format!("{hour:02}:{minute:02}:{second:02}"),
            Some('Z') => "UTC".to_owned(),
            Some('z') => "+0000".to_owned(),
            Some('%') => "%".to_owned(),
            Some(other) => format!("%{}{other}", if no_pad { "-" } else { "" }),
            None => format!("%{}", if no_pad { "-" } else { "" }),
        };
        out.push_str(&piece);
    }
    out
}

/// Days since 1970-01-01 to (year, month 1..=12, day 1..=31), proleptic Gregorian.
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// Output formatter: Python's spelling of none, booleans and floats (`None`, `True`, `1e-05`).
fn python_formatter(out: &mut Output, state: &mut State, value: &Value) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None => Ok(out.write_str("None")?),
        ValueKind::Bool => Ok(out.write_str(if value.is_true() { "True" } else { "False" })?),
        ValueKind::Number if !value.is_integer() => {
            Ok(out.write_str(&py_float(f64::try_from(value.clone())?, false))?)
        }
        _ => minijinja::escape_formatter(out, state, value),
    }
}

/// Python's `repr(float)` (shortest round-trip digits, exponent outside 1e-4..1e16);
/// `json` picks the spelling of non-finite values (`NaN`/`Infinity` vs `nan`/`inf`).
fn py_float(f: f64, json: bool) -> String {
    let sign = if f.is_sign_negative() { "-" } else { "" };
    if !f.is_finite() {
        let name = match (f.is_nan(), json) {
            (true, true) => return "NaN".into(),
            (true, false) => return "nan".into(),
            (false, true) => "Infinity",
            (false, false) => "inf",
        };
        return format!("{sign}{name}");
    }
    let sci = format!("{:e}", f.abs());
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    if !(-4..16).contains(&exp) {
        let (first, rest) = digits.split_at(1.min(digits.len()));
        let dot = if rest.is_empty() { "" } else { "." };
        let exp_sign = if exp < 0 { '-' } else { '+' };
        return format!("{sign}{first}{dot}{rest}e{exp_sign}{:02}", exp.abs());
    }
    if exp < 0 {
        let zeros = "0".repeat(exp.unsigned_abs() as usize - 1);
        return format!("{sign}0.{zeros}{digits}");
    }
    let int_len = exp as usize + 1;
    let padded = format!("{digits:0<int_len$}");
    let (int, frac) = padded.split_at(int_len);
    format!("{sign}{int}.{}", if frac.is_empty() { "0" } else { frac })
}

/// `json.dumps` options as transformers' `tojson` filter exposes them.
#[derive(Default)]
struct JsonStyle {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

/// `value | tojson(indent=None, separators=None, sort_keys=False, ensure_ascii=False)`.
fn tojson(value: Value, kwargs: Kwargs) -> Result<String, Error> {
    let invalid = |msg: &str| Error::new(ErrorKind::InvalidOperation, msg.to_owned());
    let indent = match kwargs.get::<Option<Value>>("indent")? {
        Some(v) if v.is_integer() => Some(" ".repeat(usize::try_from(v).unwrap_or(0))),
        Some(v) if !v.is_none() => {
            let indent = v
                .as_str()
                .ok_or_else(|| invalid("indent must be an int or a str"));
            Some(indent?.to_owned())
        }
        _ => None,
    };
    let (item_sep, key_sep) = match kwargs.get::<Option<Vec<String>>>("separators")?.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => return Err(invalid("separators must be a pair of strings")),
        None => (
            if indent.is_some() { "," } else { ", " }.to_owned(),
            ": ".to_owned(),
        ),
    };
    let style = JsonStyle {
        indent,
        item_sep,
        key_sep,
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(&mut out, &value, &style, 0)?;
    Ok(out)
}

fn write_json(
    out: &mut String,
    value: &Value,
    style: &JsonStyle,
    depth: usize,
) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number if value.is_integer() => out.push_str(&value.to_string()),
        ValueKind::Number => out.push_str(&py_float(f64::try_from(value.clone())?, true)),
        ValueKind::String => write_json_str(out, value.as_str().unwrap_or_default(), style),
        ValueKind::Seq | ValueKind::Iterable | ValueKind::Map => {
            let is_map = value.kind() == ValueKind::Map;
            let mut items = Vec::new();
            for item in value.try_iter()? {
                items.push(match is_map {
                    true => (Some(json_key(&item)?), value.get_item(&item)?),
                    false => (None, item),
                });
            }
            if style.sort_keys {
                items.sort_by(|a, b| a.0.cmp(&b.0));
            }
            let newline = |level: usize| match &style.indent {
                Some(indent) => format!("\n{}", indent.repeat(level)),
                None => String::new(),
            };
            out.push(if is_map { '{' } else { '[' });
            for (i, (key, item)) in items.iter().enumerate() {
                out.push_str(if i > 0 { &style.item_sep } else { "" });
                out.push_str(&newline(depth + 1));
                if let Some(key) = key {
                    write_json_str(out, key, style);
                    out.push_str(&style.key_sep);
                }
                write_json(out, item, style, depth + 1)?;
            }
            if !items.is_empty() {
                out.push_str(&newline(depth));
            }
            out.push(if is_map { '}' } else { ']' });
        }
        kind => {
            let msg = format!("object of kind {kind} is not JSON serializable");
            return Err(Error::new(ErrorKind::InvalidOperation, msg));
        }
    }
    Ok(())
}

/// Python's `json.dumps` turns str/int/float/bool/None keys into strings.
fn json_key(key: &Value) -> Result<String, Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_owned()),
        ValueKind::None | ValueKind::Bool | ValueKind::Number => {
            let mut out = String::new();
            write_json(&mut out, key, &JsonStyle::default(), 0)?;
            Ok(out)
        }
        kind => {
            let msg = format!("keys must be str, int, float, bool or None, not {kind}");
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        }
    }
}

fn write_json_str(out: &mut String, s: &str, style: &JsonStyle) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if c < ' ' || (style.ensure_ascii && !c.is_ascii()) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value as Json};

    fn template(src: &str) -> ChatTemplate {
        ChatTemplate::new(src, Some("<s>".into()), Some("</s>".into())).expect("template compiles")
    }

    fn render(src: &str, messages: Json) -> Result<String, ChatTemplateError> {
        let messages = messages.as_array().cloned().unwrap_or_default();
        template(src).render(&messages, false, None, None)
    }

    fn ok(src: &str, messages: Json) -> String {
        render(src, messages).expect("template renders")
    }

    #[test]
    fn chatml_with_generation_prompt_and_special_tokens() {
        let src = "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}{{ eos_token }}";
        let msgs = [json!({"role": "user", "content": "Hi"})];
        let render = |t: ChatTemplate, agp| t.render(&msgs, agp, None, None).expect("renders");
        let expected = "<s><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n</s>";
        assert_eq!(render(template(src), true), expected);
        let no_tokens = ChatTemplate::new("[{{ bos_token }}]", None, None).expect("compiles");
        assert_eq!(render(no_tokens, false), "[]");
    }

    #[test]
    fn renders_like_transformers() {
        let cases = [
            // trim_blocks + lstrip_blocks, trailing newline dropped
            (
                "{% for m in messages %}\n    {% if m.role == 'user' %}\n  U:{{ m.content }}\n    {% endif %}\n{% endfor %}\n",
                json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]),
                "  U:hi\n",
            ),
            // loop controls
            (
                "{% for m in messages %}{% if loop.index0 == 1 %}{% continue %}{% endif %}{% if loop.index0 == 3 %}{% break %}{% endif %}{{ m.content }}{% endfor %}",
                json!([{"content": "a"}, {"content": "b"}, {"content": "c"}, {"content": "d"}]),
                "ac",
            ),
            // Python methods, dict key order, Python spelling of booleans
            (
                "{{ messages[0].content.strip().upper() }}|{{ messages[0].content.split()|join(',') }}|{{ messages[0].content.startswith(' x') }}|{% for k, v in messages[0].items() %}{{ k }}={{ v|length }};{% endfor %}|{{ messages[0].get('missing', 'dflt') }}",
                json!([{"z": "1", "role": "user", "content": " x y "}]),
                "X Y|x,y|True|z=1;role=4;content=5;|dflt",
            ),
            (
                "{{ none }} {{ false }} {{ 1.5e-7 }} {{ 2.0 }} {{ messages[0] }}",
                json!([1e16]),
                "None False 1.5e-07 2.0 1e+16",
            ),
        ];
        for (src, messages, expected) in cases {
            assert_eq!(ok(src, messages), expected, "template {src:?}");
        }
    }

    #[test]
    fn context_holds_tools_documents_and_extra() {
        let src = "{{ tools is none }}|{{ tools|length if tools else 0 }}|{{ documents is none }}|{{ enable_thinking }}|{{ messages|length }}";
        let extra = json!({"enable_thinking": true, "messages": "ignored"});
        let tpl = template(src);
        let tools = [json!({"type": "function"})];
        let with = tpl.render(&[json!({})], false, Some(&tools), extra.as_object());
        assert_eq!(with.expect("renders"), "False|1|True|True|1");
        let without = tpl.render(&[], false, None, None).expect("renders");
        assert_eq!(without, "True|0|True||0");
    }

    #[test]
    fn raise_exception_is_an_error_not_a_panic() {
        let src = "{% if messages[0].role != 'user' %}{{ raise_exception('bad role: ' ~ messages[0].role) }}{% endif %}ok";
        match render(src, json!([{"role": "tool"}])) {
            Err(ChatTemplateError::Raised(msg)) => assert_eq!(msg, "bad role: tool"),
            other => panic!("expected Raised, got {other:?}"),
        }
        assert_eq!(ok(src, json!([{"role": "user"}])), "ok");
        assert!(matches!(
            render("{{ messages[0].x.y }}", json!([{}])),
            Err(ChatTemplateError::Render(_))
        ));
        let err = ChatTemplate::new("{% for m in messages %}", None, None);
        assert!(matches!(err, Err(ChatTemplateError::Syntax(_))), "{err:?}");
    }

    #[test]
    fn strftime_codes() {
        let fmt = "%Y-%m-%d %H:%M:%S|%A %a %B %b|%-d %-m %j %y %I%p %e|%F %T %u %w %%";
        let cases = [
            (1_709_622_489, "2024-03-05 07:08:09|Tuesday Tue March Mar|5 3 065 24 07AM  5|2024-03-05 07:08:09 2 2 %"),
            (951_868_741, "2000-02-29 23:59:01|Tuesday Tue February Feb|29 2 060 00 11PM 29|2000-02-29 23:59:01 2 2 %"),
            (-43_200, "1969-12-31 12:00:00|Wednesday Wed December Dec|31 12 365 69 12PM 31|1969-12-31 12:00:00 3 3 %"),
        ];
        for (ts, expected) in cases {
            assert_eq!(format_time(fmt, ts), expected);
        }
        assert_eq!(format_time("%Q %-", 0), "%Q %-");
        let year = ok("{{ strftime_now('%Y') }}", json!([]));
        assert!(year.len() == 4 && year.parse::<u32>().is_ok(), "{year}");
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let msgs = json!([{"b": 1, "a": [1, 2.5, null, true, 1e16, 1e-5, 0.1, 100.0],
            "s": "<é>&'\"\n\t🙂", "e": {}, "l": []}]);
        let compact = r#"{"b": 1, "a": [1, 2.5, null, true, 1e+16, 1e-05, 0.1, 100.0], "s": "<é>&'\"\n\t🙂", "e": {}, "l": []}"#;
        let dumps = |filter: &str| ok(&format!("{{{{ {filter} }}}}"), msgs.clone());
        assert_eq!(dumps("messages[0] | tojson"), compact);
        let pretty = "{\n  \"b\": 1,\n  \"a\": [\n    1,\n    2.5,\n    null,\n    true,\n    1e+16,\n    1e-05,\n    0.1,\n    100.0\n  ],\n  \"s\": \"<é>&'\\\"\\n\\t🙂\",\n  \"e\": {},\n  \"l\": []\n}";
        assert_eq!(dumps("messages[0] | tojson(indent=2)"), pretty);
        let sorted = r#"{"a":[1,2.5,null,true,1e+16,1e-05,0.1,100.0],"b":1,"e":{},"l":[],"s":"<é>&'\"\n\t🙂"}"#;
        assert_eq!(
            dumps("messages[0] | tojson(sort_keys=true, separators=(',', ':'))"),
            sorted
        );
        let ascii = r#""<\u00e9>&'\"\n\t\ud83d\ude42""#;
        assert_eq!(dumps("messages[0].s | tojson(ensure_ascii=true)"), ascii);
        assert!(render("{{ messages | tojson(bogus=1) }}", msgs).is_err());
    }

    fn scratch_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("rserve-ct-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create temp dir");
        dir
    }

    #[test]
    fn loads_template_sources() {
        let dir = scratch_dir("load");
        let write = |name: &str, text: &str| std::fs::write(dir.join(name), text).expect("write");
        let load = || load_chat_template(&dir);
        assert_eq!(load().expect("loads"), None);
        let config = json!({"chat_template": [{"name": "tool_use", "template": "T"},
            {"name": "default", "template": "D"}], "bos_token": {"content": "<s>", "lstrip": false},
            "eos_token": "</s>"});
        write("tokenizer_config.json", &config.to_string());
        let expected = |t: &str| TemplateSource {
            template: Some(t.into()),
            bos_token: Some("<s>".into()),
            eos_token: Some("</s>".into()),
        };
        assert_eq!(load().expect("loads"), Some(expected("D")));
        write("chat_template.jinja", "J");
        assert_eq!(load().expect("loads"), Some(expected("J")));
        std::fs::remove_file(dir.join("chat_template.jinja")).expect("remove");
        let bad = json!({"chat_template": [{"name": "tool_use", "template": "T"}]});
        for text in [bad.to_string(), "{not json".to_owned()] {
            write("tokenizer_config.json", &text);
            assert!(matches!(load(), Err(ChatTemplateError::Config { .. })));
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn transformers_goldens() {
        let root = std::env::var("RSERVE_REPO")
            .unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/../..").to_owned());
        let path = Path::new(&root).join("tests/fixtures/chat_goldens.json");
        let text = std::fs::read_to_string(&path);
        let text = text.unwrap_or_else(|e| panic!("{} ({e}); set RSERVE_REPO", path.display()));
        let goldens: Json = serde_json::from_str(&text).expect("valid golden JSON");
        let token = |k: &str| goldens[k].as_str().map(str::to_owned);
        let cases = goldens["cases"].as_array().expect("cases");
        assert!(!cases.is_empty());
        for case in cases {
            let name = case["name"].as_str().unwrap_or("?");
            let source = goldens["templates"][case["template"].as_str().unwrap_or("")].as_str();
            let tpl =
                ChatTemplate::new(source.unwrap_or(""), token("bos_token"), token("eos_token"));
            let tpl = tpl.unwrap_or_else(|e| panic!("{name}: {e}"));
            let messages = case["messages"].as_array().expect("messages");
            let tools = case["tools"].as_array().map(Vec::as_slice);
            let agp = case["add_generation_prompt"].as_bool().unwrap_or(false);
            let out = tpl.render(messages, agp, tools, None);
            if case["error"].as_bool().unwrap_or(false) {
                let raised = matches!(out, Err(ChatTemplateError::Raised(_)));
                assert!(raised, "{name}: expected an error, got {out:?}");
            } else {
                let expected = case["expected"].as_str();
                let out = out.unwrap_or_else(|e| panic!("{name}: {e}"));
                assert_eq!(Some(out.as_str()), expected, "case {name}");
            }
        }
    }
}
