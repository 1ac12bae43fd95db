//! JSON bodies -> typed requests, with errors a client can act on: a wrong type names the field in
//! `param` and says what was expected ("`temperature` must be a number"), never serde's internals.

use super::error::ApiError;
use super::types::CommonFields;
use serde::de::DeserializeOwned;
use serde_json::Value;

/// Parses `bytes` into `T`. Malformed JSON and wrong types are 400s.
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let value: Value = serde_json::from_slice(bytes)
        .map_err(|e| ApiError::bad_request(format!("Invalid JSON: {e}")))?;
    if !value.is_object() {
        return parse_value(value);
    }
    // by value, so strings move into `T` instead of being copied (an image's base64 runs to
    // megabytes); an error is worded from a second parse, which keeps the value for its search
    match serde_path_to_error::deserialize::<_, T>(value) {
        Ok(v) => Ok(v),
        Err(_) => parse_value(
            serde_json::from_slice(bytes)
                .map_err(|e| ApiError::bad_request(format!("Invalid JSON: {e}")))?,
        ),
    }
}

/// [`parse_json`] from an already parsed value.
pub fn parse_value<T: DeserializeOwned>(value: Value) -> Result<T, ApiError> {
    if !value.is_object() {
        return Err(ApiError::bad_request(format!(
            "the request body must be a JSON object, got {}",
            json_kind(&value)
        )));
    }
    match serde_path_to_error::deserialize::<_, T>(&value) {
        Ok(v) => Ok(v),
        Err(e) => {
            let mut path = e.path().to_string();
            let mut msg = e.inner().to_string();
            if path == "." {
                // a flattened field loses its path: find it in the shared fields
                if let Err(e2) = serde_path_to_error::deserialize::<_, CommonFields>(&value) {
                    path = e2.path().to_string();
                    msg = e2.inner().to_string();
                }
            }
            Err(field_error(&path, &msg))
        }
    }
}

/// The JSON type of `v` in words.
pub fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(n) if n.is_f64() => "a number",
        Value::Number(_) => "an integer",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// A type name from serde's messages in words.
fn expected(exp: &str) -> String {
    match exp {
        "f64" | "f32" => "a number".into(),
        "i8" | "i16" | "i32" | "i64" | "u8" | "u16" | "u32" | "u64" | "usize" | "isize" => {
            "an integer".into()
        }
        "a sequence" => "a list".into(),
        "a map" => "an object".into(),
        s if s.starts_with("struct ") => "an object".into(),
        s => s.to_string(),
    }
}

/// serde's description of an unexpected value in words.
fn got(what: &str) -> String {
    let w = what
        .replace("unit value", "null")
        .replace("floating point", "number")
        .replace("sequence", "a list")
        .replace("map", "an object");
    w.replace('`', "")
}

/// One deserialization error as a 400 naming the field.
fn field_error(path: &str, msg: &str) -> ApiError {
    let root = path.is_empty() || path == ".";
    let field = if root { "" } else { path };
    if let Some(name) = msg
        .strip_prefix("missing field `")
        .and_then(|r| r.strip_suffix('`'))
    {
        let full = if root {
            name.to_string()
        } else {
            format!("{field}.{name}")
        };
        return ApiError::bad_request(format!("`{full}` is required")).with_param(full);
    }
    let described = ["invalid type: ", "invalid value: "]
        .iter()
        .find_map(|p| msg.strip_prefix(p))
        .and_then(|rest| rest.rsplit_once(", expected "))
        .map(|(what, exp)| format!("must be {}, got {}", expected(exp), got(what)))
        .or_else(|| {
            (msg.starts_with("a ") || msg.starts_with("an ")).then(|| format!("must be {msg}"))
        });
    let text = match described {
        Some(d) if !root => format!("`{field}` {d}"),
        Some(d) => format!("the request {d}"),
        None if !root => format!("`{field}`: {msg}"),
        None => format!("Invalid request: {msg}"),
    };
    let e = ApiError::bad_request(text);
    if root {
        e
    } else {
        e.with_param(field)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::types::{ChatCompletionRequest, CompletionRequest};
    use serde_json::json;

    fn err<T: DeserializeOwned + std::fmt::Debug>(v: Value) -> (Option<String>, String) {
        let e = parse_value::<T>(v).expect_err("should fail");
        (e.param, e.message)
    }

    #[test]
    fn type_errors_name_the_field() {
        let m = json!([{"role": "user", "content": "hi"}]);
        let (p, msg) = err::<ChatCompletionRequest>(json!({"messages": m, "temperature": "hot"}));
        assert_eq!(p.as_deref(), Some("temperature"));
        assert!(msg.contains("`temperature` must be a number"), "{msg}");
        let (p, msg) = err::<ChatCompletionRequest>(json!({"messages": m, "stop": 5}));
        assert_eq!(p.as_deref(), Some("stop"));
        assert!(msg.contains("a string or a list of strings"), "{msg}");
        let (p, msg) = err::<ChatCompletionRequest>(json!({"messages": m, "max_tokens": 1.5}));
        assert_eq!(p.as_deref(), Some("max_tokens"));
        assert!(msg.contains("must be an integer"), "{msg}");
        let (p, _) = err::<ChatCompletionRequest>(json!({"messages": [{"role": 5}]}));
        assert_eq!(p.as_deref(), Some("messages[0].role"));
        let (p, msg) = err::<ChatCompletionRequest>(json!({"model": "m"}));
        assert_eq!(p.as_deref(), Some("messages"));
        assert!(msg.contains("required"), "{msg}");
        let (p, msg) = err::<CompletionRequest>(json!({"prompt": {"a": 1}}));
        assert_eq!(p.as_deref(), Some("prompt"));
        for bad in ["untagged", "variant", "f64", "i64", "line 1"] {
            assert!(!msg.contains(bad), "{msg}");
        }
        let (p, msg) = err::<CompletionRequest>(json!([1]));
        assert_eq!(p, None);
        assert!(msg.contains("must be a JSON object"), "{msg}");
    }
}
