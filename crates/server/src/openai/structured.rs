//! The request forms of structured output -> the engine's one [`StructuredOutputs`]:
//! `response_format` (`json_object`, `json_schema`), vLLM's `structured_outputs` object and its
//! older top-level `guided_json`, `guided_regex`, `guided_choice` and `guided_grammar`. A request
//! names at most one constraint; the grammar itself is compiled (and its errors reported) at
//! submit.

use super::error::ApiError;
use super::types::CommonFields;
use rserve_core::structured::StructuredOutputs;
use serde_json::Value;

fn bad(field: &str, msg: impl Into<String>) -> ApiError {
    ApiError::bad_request(msg.into()).with_param(field)
}

/// The constraint of `response_format` (`None` for `text`).
pub fn from_response_format(rf: Option<&Value>) -> Result<Option<StructuredOutputs>, ApiError> {
    let Some(rf) = rf.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let kind = rf.get("type").and_then(Value::as_str).ok_or_else(|| {
        bad(
            "response_format",
            "response_format.type must be one of text, json_object, json_schema",
        )
    })?;
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some(StructuredOutputs {
            json_object: Some(true),
            ..StructuredOutputs::default()
        })),
        "json_schema" => {
            let js = rf
                .get("json_schema")
                .filter(|v| v.is_object())
                .ok_or_else(|| {
                    bad(
                        "response_format",
                        "response_format.json_schema must be an object with a `schema`",
                    )
                })?;
            // OpenAI's `schema` is optional: without one any JSON object will do
            let s = match js.get("schema").filter(|v| !v.is_null()) {
                Some(schema) => StructuredOutputs {
                    json: Some(schema.clone()),
                    ..StructuredOutputs::default()
                },
                None => StructuredOutputs {
                    json_object: Some(true),
                    ..StructuredOutputs::default()
                },
            };
            Ok(Some(s))
        }
        other => Err(bad(
            "response_format",
            format!("response_format.type `{other}` is not one of text, json_object, json_schema"),
        )),
    }
}

/// The field a request's constraint came from (for the `param` of its errors).
pub fn field_of(c: &CommonFields, response_format: Option<&Value>) -> &'static str {
    let rf = response_format
        .and_then(|r| r.get("type"))
        .and_then(Value::as_str);
    if matches!(rf, Some("json_object" | "json_schema")) {
        "response_format"
    } else if c.guided_json.is_some() {
        "guided_json"
    } else if c.guided_regex.is_some() {
        "guided_regex"
    } else if c.guided_choice.is_some() {
        "guided_choice"
    } else if c.guided_grammar.is_some() {
        "guided_grammar"
    } else {
        "structured_outputs"
    }
}

/// The request's one constraint from any of its forms; two forms at once are a 400.
pub fn constraint(
    c: &CommonFields,
    response_format: Option<&Value>,
) -> Result<Option<StructuredOutputs>, ApiError> {
    let mut found: Vec<(&str, StructuredOutputs)> = Vec::new();
    if let Some(s) = from_response_format(response_format)? {
        found.push(("response_format", s));
    }
    if let Some(s) = &c.structured_outputs {
        found.push(("structured_outputs", s.clone()));
    }
    let blank = StructuredOutputs::default;
    if let Some(j) = c.guided_json.as_ref().filter(|v| !v.is_null()) {
        let s = StructuredOutputs {
            json: Some(j.clone()),
            ..blank()
        };
        found.push(("guided_json", s));
    }
    if let Some(r) = &c.guided_regex {
        let s = StructuredOutputs {
            regex: Some(r.clone()),
            ..blank()
        };
        found.push(("guided_regex", s));
    }
    if let Some(ch) = &c.guided_choice {
        let s = StructuredOutputs {
            choice: Some(ch.clone()),
            ..blank()
        };
        found.push(("guided_choice", s));
    }
    if let Some(g) = &c.guided_grammar {
        let s = StructuredOutputs {
            grammar: Some(g.clone()),
            ..blank()
        };
        found.push(("guided_grammar", s));
    }
    if found.len() > 1 {
        let names: Vec<&str> = found.iter().map(|(n, _)| *n).collect();
        return Err(bad(
            names[1],
            format!(
                "only one structured output constraint may be given, got {}",
                names.join(" and ")
            ),
        ));
    }
    let Some((field, s)) = found.pop() else {
        return Ok(None);
    };
    s.validate().map_err(|e| bad(field, e.message))?;
    Ok(Some(s))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn common(v: Value) -> CommonFields {
        serde_json::from_value(v).expect("fields")
    }

    #[test]
    fn every_form_becomes_one_constraint() {
        let schema = json!({"type": "object"});
        let rf = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}});
        let s = constraint(&common(json!({})), Some(&rf))
            .expect("ok")
            .expect("some");
        assert_eq!(s.json, Some(schema.clone()));
        let s = constraint(&common(json!({})), Some(&json!({"type": "json_object"})))
            .expect("ok")
            .expect("some");
        assert_eq!(s.json_object, Some(true));
        assert!(
            constraint(&common(json!({})), Some(&json!({"type": "text"})))
                .expect("ok")
                .is_none()
        );
        let c = common(json!({"guided_choice": ["a", "b"]}));
        assert_eq!(
            constraint(&c, None).expect("ok").expect("some").choice,
            Some(vec!["a".into(), "b".into()])
        );
        let c =
            common(json!({"structured_outputs": {"regex": "a+", "disable_any_whitespace": false}}));
        let s = constraint(&c, None).expect("ok").expect("some");
        assert_eq!(s.regex.as_deref(), Some("a+"));
        assert_eq!(s.disable_any_whitespace, Some(false));
    }

    #[test]
    fn two_forms_or_bad_shapes_are_400s() {
        let c = common(json!({"guided_regex": "a", "guided_choice": ["b"]}));
        assert!(constraint(&c, None).is_err());
        let c = common(json!({"guided_regex": "a"}));
        assert!(constraint(&c, Some(&json!({"type": "json_object"}))).is_err());
        for rf in [
            json!({"type": "xml"}),
            json!({}),
            json!({"type": "json_schema"}),
        ] {
            assert!(constraint(&common(json!({})), Some(&rf)).is_err(), "{rf}");
        }
        assert!(constraint(&common(json!({"guided_choice": []})), None).is_err());
    }
}
