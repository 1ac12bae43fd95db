//! Test harness shared by the formats' tests: a golden output is checked through `parse` and then
//! streamed under many chunkings (whole, one char per delta, cut in two at every char boundary,
//! and seeded random chunkings), each of which must add up to exactly the parsed result.

use super::{Parsed, StreamEvent, ToolCall, ToolParser};

/// `text` parses to `content` and `calls`, and streams to the same under every chunking.
pub(super) fn golden(
    parser: ToolParser,
    text: &str,
    known: &[&str],
    content: Option<&str>,
    calls: &[(&str, &str)],
) {
    let expected = Parsed {
        content: content.map(str::to_owned),
        calls: calls
            .iter()
            .map(|(name, arguments)| ToolCall {
                name: (*name).to_owned(),
                arguments: (*arguments).to_owned(),
            })
            .collect(),
    };
    assert_eq!(parser.parse(text, known), expected, "parse of {text:?}");
    let content = expected.content.unwrap_or_default();
    for chunks in chunkings(text) {
        let (streamed, calls) = replay(parser, known, &chunks);
        assert_eq!(streamed, content, "content streamed as {chunks:?}");
        assert_eq!(calls, expected.calls, "calls streamed as {chunks:?}");
    }
}

/// `text` is not (only) well-formed calls: `parse` gives it back whole as content, and a stream
/// sends no call and all of the text as content.
pub(super) fn falls_back(parser: ToolParser, text: &str, known: &[&str]) {
    let expected = Parsed {
        content: Some(text.to_owned()),
        calls: Vec::new(),
    };
    assert_eq!(parser.parse(text, known), expected, "parse of {text:?}");
    for chunks in chunkings(text) {
        let (streamed, calls) = replay(parser, known, &chunks);
        assert_eq!(calls, [], "calls streamed as {chunks:?}");
        assert_eq!(streamed, text, "content streamed as {chunks:?}");
    }
}

/// A stream of `text` sends `good` calls and then, in place of the bad one, text as content that
/// ends the output.
pub(super) fn stream_sends_no_call_after(
    parser: ToolParser,
    text: &str,
    known: &[&str],
    good: usize,
) {
    for chunks in chunkings(text) {
        let (streamed, calls) = replay(parser, known, &chunks);
        assert_eq!(calls.len(), good, "calls streamed as {chunks:?}");
        assert!(
            !streamed.trim().is_empty(),
            "content streamed as {chunks:?}"
        );
        assert!(text.ends_with(&streamed), "content streamed as {chunks:?}");
    }
}

/// Streams `chunks`, checks the event order, and adds the events up.
fn replay(parser: ToolParser, known: &[&str], chunks: &[&str]) -> (String, Vec<ToolCall>) {
    let mut stream = parser.streamer(known.iter().map(|k| (*k).to_owned()).collect());
    let mut events = Vec::new();
    for chunk in chunks {
        events.extend(stream.push(chunk));
    }
    events.extend(stream.finish());
    let mut content = String::new();
    let mut calls: Vec<ToolCall> = Vec::new();
    for event in events {
        match event {
            StreamEvent::Content(text) => {
                assert!(!text.is_empty(), "empty content event");
                content.push_str(&text);
            }
            StreamEvent::CallStart { index, name } => {
                assert_eq!(index, calls.len(), "calls start in order");
                calls.push(ToolCall {
                    name,
                    arguments: String::new(),
                });
            }
            StreamEvent::Arguments { index, text } => {
                assert_eq!(
                    index + 1,
                    calls.len(),
                    "arguments follow their call's start"
                );
                calls[index].arguments.push_str(&text);
            }
        }
    }
    assert_eq!(stream.called(), !calls.is_empty());
    (content, calls)
}

fn chunkings(text: &str) -> Vec<Vec<&str>> {
    let bounds: Vec<usize> = text
        .char_indices()
        .map(|(i, _)| i)
        .chain([text.len()])
        .collect();
    let mut all = vec![vec![text]];
    all.push(bounds.windows(2).map(|w| &text[w[0]..w[1]]).collect());
    for &cut in &bounds {
        all.push(vec![&text[..cut], &text[cut..]]);
    }
    let mut seed = 0x9e37_79b9_7f4a_7c15_u64 ^ text.len() as u64;
    for _ in 0..32 {
        let mut chunks = Vec::new();
        let mut at = 0;
        while at + 1 < bounds.len() {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let next = (at + 1 + (seed % 8) as usize).min(bounds.len() - 1);
            chunks.push(&text[bounds[at]..bounds[next]]);
            at = next;
        }
        all.push(chunks);
    }
    all
}

/// Random texts built from each format's pieces (markers whole and cut, calls good and bad, text,
/// whitespace): nothing panics, and whenever `parse` keeps the calls, every chunking streams the
/// same result.
#[test]
fn random_texts_stream_like_parse() {
    const CALL: &str = r#"{"name": "f", "arguments": {"a": "}{\" 日"}}"#;
    const COMMON: &[&str] = &[
        CALL,
        r#"{"name": "g", "arguments": {}}"#,
        r#"{"name": "f", "parameters": [1]}"#,
        "{",
        "}",
        "\"",
        "[",
        "]",
        ",",
        ";",
        " ",
        "\n",
        "text",
        "é日😀",
        "f",
    ];
    let formats = [
        (
            ToolParser::Hermes,
            vec![
                "<tool_call>".to_owned(),
                "</tool_call>".to_owned(),
                "<tool".to_owned(),
                format!("<tool_call>\n{CALL}\n</tool_call>"),
                format!("\n<tool_call>{CALL}"),
            ],
        ),
        (
            ToolParser::Llama3Json,
            vec![
                "<|python_tag|>".to_owned(),
                "<|python".to_owned(),
                format!("{CALL}; "),
                format!("{CALL}\n"),
                format!("<|python_tag|>{CALL}"),
            ],
        ),
        (
            ToolParser::Mistral,
            vec![
                "[TOOL_CALLS]".to_owned(),
                "[ARGS]".to_owned(),
                "[TOOL".to_owned(),
                "[TOOL_CALLS]f[ARGS]{\"b\": [1, \"]\"]}".to_owned(),
                format!("[TOOL_CALLS][{CALL}, {CALL}]"),
                format!("[TOOL_CALLS] {CALL}"),
            ],
        ),
    ];
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    let mut next = |bound: usize| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed % bound as u64) as usize
    };
    let (mut kept, mut fell_back) = (0, 0);
    for (parser, own) in &formats {
        let parser = *parser;
        for _ in 0..1500 {
            let mut text = String::new();
            for _ in 0..1 + next(10) {
                // own pieces are drawn at least as often as all common ones together
                let own_share = if parser == ToolParser::Llama3Json {
                    4
                } else {
                    2
                };
                let piece = if next(own_share) != 0 {
                    own[next(own.len())].as_str()
                } else {
                    COMMON[next(COMMON.len())]
                };
                text.push_str(piece);
            }
            let parsed = parser.parse(&text, &["f"]);
            let mut whole = parser.streamer(vec!["f".to_owned()]);
            whole.push(&text);
            whole.finish();
            if whole.core.fell_back() {
                fell_back += 1;
                assert_eq!(parsed.content.as_deref(), Some(text.as_str()));
                continue;
            }
            kept += 1;
            let content = parsed.content.unwrap_or_default();
            for chunks in chunkings(&text).into_iter().step_by(7) {
                let (streamed, calls) = replay(parser, &["f"], &chunks);
                assert_eq!(
                    (streamed, calls),
                    (content.clone(), parsed.calls.clone()),
                    "{chunks:?}"
                );
            }
        }
    }
    assert!(
        kept > 500 && fell_back > 500,
        "{kept} kept, {fell_back} fell back"
    );
}

/// The events of call `index` to `noop` with no arguments.
pub fn noop_call(index: usize) -> [StreamEvent; 2] {
    [
        StreamEvent::CallStart {
            index,
            name: "noop".into(),
        },
        StreamEvent::Arguments {
            index,
            text: "{}".into(),
        },
    ]
}
