use super::*;

fn tools() -> Vec<Value> {
    vec![
        json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}),
        json!({"type": "function", "function": {"name": "get_time"}}),
    ]
}

#[test]
fn choices_become_modes_and_constraints() {
    let t = tools();
    let p = plan(Some(&t), None, None, Some(ToolParser::Hermes)).expect("auto");
    assert!(matches!(p.mode, ToolMode::Auto { .. }) && p.constraint.is_none());
    assert_eq!(p.template_tools.as_ref().map(Vec::len), Some(2));
    let named = json!({"type": "function", "function": {"name": "get_weather"}});
    let p = plan(Some(&t), Some(&named), None, None).expect("named");
    assert_eq!(p.mode, ToolMode::Named("get_weather".into()));
    let schema = p.constraint.and_then(|c| c.json).expect("schema");
    assert_eq!(schema["required"], json!(["city"]));
    let p = plan(Some(&t), Some(&json!("required")), Some(false), None).expect("required");
    let schema = p.constraint.and_then(|c| c.json).expect("schema");
    assert_eq!(schema["maxItems"], json!(1));
    assert_eq!(schema["items"]["anyOf"].as_array().map(Vec::len), Some(2));
    let p = plan(Some(&t), Some(&json!("none")), None, None).expect("none");
    assert_eq!(p.mode, ToolMode::Off);
    assert!(p.template_tools.is_some());
    let p = plan(None, None, None, None).expect("no tools");
    assert!(p.template_tools.is_none());
}

#[test]
fn bad_tools_and_choices_are_400s() {
    let t = tools();
    let cases: Vec<(Vec<Value>, Option<Value>)> = vec![
        (t.clone(), None), // auto without a parser
        (t.clone(), Some(json!("auto"))),
        (
            t.clone(),
            Some(json!({"type": "function", "function": {"name": "nope"}})),
        ),
        (t.clone(), Some(json!("sometimes"))),
        (t.clone(), Some(json!(3))),
        (vec![], Some(json!("required"))),
        (
            vec![json!({"type": "function", "function": {"name": "a b"}})],
            Some(json!("none")),
        ),
        (vec![json!({"type": "retrieval"})], Some(json!("none"))),
        (
            vec![json!({"type": "function", "function": {"name": "f", "parameters": 3}})],
            Some(json!("none")),
        ),
        (vec![t[0].clone(), t[0].clone()], Some(json!("none"))),
    ];
    for (tools, choice) in cases {
        let r = plan(Some(&tools), choice.as_ref(), None, None);
        assert!(r.is_err(), "{tools:?} {choice:?}");
    }
    let msg = plan(Some(&t), None, None, None)
        .expect_err("auto")
        .body()
        .to_string();
    assert!(msg.contains("--enable-auto-tool-choice"), "{msg}");
}

#[test]
fn required_replies_stream_as_they_parse() {
    let text = r#"[{"name":"get_weather","parameters":{"city":"Oslo"}},{"name":"get_time","parameters":{}}]"#;
    let whole = ToolMode::Required.reply(text);
    assert_eq!(whole.calls.len(), 2);
    assert_eq!(whole.calls[0].arguments, r#"{"city":"Oslo"}"#);
    for step in [1, 3, 7, text.len()] {
        let mut s = ToolMode::Required.streamer();
        let mut calls: Vec<(String, String)> = Vec::new();
        let chars: Vec<char> = text.chars().collect();
        let mut events = Vec::new();
        for chunk in chars.chunks(step) {
            events.extend(s.push(&chunk.iter().collect::<String>()));
        }
        events.extend(s.finish());
        for e in events {
            match e {
                StreamEvent::CallStart { name, .. } => calls.push((name, String::new())),
                StreamEvent::Arguments { text, .. } => {
                    if let Some(c) = calls.last_mut() {
                        c.1.push_str(&text);
                    }
                }
                StreamEvent::Content(c) => panic!("content {c}"),
            }
        }
        let want: Vec<(String, String)> = whole
            .calls
            .iter()
            .map(|c| (c.name.clone(), c.arguments.clone()))
            .collect();
        assert_eq!(calls, want, "chunks of {step}");
        assert!(s.called());
    }
    // a reply cut short is text
    let cut = ToolMode::Required.reply(r#"[{"name":"get_we"#);
    assert!(cut.calls.is_empty() && cut.content.is_some());
}

#[test]
fn named_replies_are_the_arguments() {
    let m = ToolMode::Named("f".into());
    let r = m.reply(r#"{"a":1}"#);
    assert_eq!(r.calls[0].arguments, r#"{"a":1}"#);
    assert!(r.content.is_none() && !m.reports_tool_calls());
    let mut s = m.streamer();
    let ev = s.push("{\"a\"");
    assert!(matches!(&ev[0], StreamEvent::CallStart { name, .. } if name == "f"));
    assert_eq!(s.push(":1}").len(), 1);
}
