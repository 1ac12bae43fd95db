//! The Mistral format: `[TOOL_CALLS]` followed by a JSON array of `{"name": ..., "arguments": {...}}`
//! objects (tokenizers up to v3), or by `name[ARGS]{...}` (v11 and later; one `[TOOL_CALLS]` per
//! call), or by a single call object. Text before and after the calls is content. `[TOOL_CALLS]` is
//! a special token: the output must be detokenized with special tokens kept.
//!
//! In the `name[ARGS]` form the name is checked as it arrives: text that cannot become a known
//! name followed by `[ARGS]` turns to content at once instead of waiting for the end.

use super::partial_suffix;
use super::stream::Core;

const MARK: &str = "[TOOL_CALLS]";
const ARGS: &str = "[ARGS]";

#[derive(Debug, Clone, Default)]
pub(super) enum State {
    /// Outside calls, looking for `[TOOL_CALLS]`.
    #[default]
    Content,
    /// After `[TOOL_CALLS]`: an array, an object or a name.
    Open,
    /// In an array: a call object is next.
    Element,
    /// In an array after a call, which `,` or `]` confirms.
    Next,
    /// A function name, up to `[ARGS]`.
    Name,
    /// After `name[ARGS]`: the arguments object.
    Args(String),
}

pub(super) fn step(state: &mut State, core: &mut Core, eof: bool) {
    while !core.verbatim() {
        match state {
            State::Content => {
                if !core.scan_for(MARK, eof) {
                    return;
                }
                *state = State::Open;
            }
            State::Open => match core.next_or_fall_back(eof) {
                None => return,
                Some('[') => {
                    core.take(1);
                    *state = State::Element;
                }
                Some('{') => {
                    if !core.take_call(None, eof) {
                        return;
                    }
                    *state = State::Content;
                }
                Some(_) => *state = State::Name,
            },
            State::Element => {
                if !core.read_call(None, eof) {
                    return;
                }
                *state = State::Next;
            }
            State::Next => match core.next_or_fall_back(eof) {
                None => return,
                Some(',') => {
                    core.take(1);
                    core.send_pending();
                    *state = State::Element;
                }
                Some(']') => {
                    core.take(1);
                    core.send_pending();
                    *state = State::Content;
                }
                Some(_) => {
                    core.fall_back();
                    return;
                }
            },
            State::Name => {
                let held = core.unread();
                if let Some(at) = held.find(ARGS) {
                    let name = held[..at].trim().to_owned();
                    core.take(at + ARGS.len());
                    if !core.known().contains(&name) {
                        core.fall_back();
                        return;
                    }
                    *state = State::Args(name);
                } else {
                    if eof || !name_may_continue(held, core.known()) {
                        core.fall_back();
                    }
                    return;
                }
            }
            State::Args(name) => {
                if !core.take_call(Some(name.as_str()), eof) {
                    return;
                }
                *state = State::Content;
            }
        }
    }
}

/// Whether `held` (with no `[ARGS]` in it) may still grow into whitespace, a known name,
/// whitespace and `[ARGS]`.
fn name_may_continue(held: &str, known: &[String]) -> bool {
    let name = held.trim_start();
    let partial = partial_suffix(name, ARGS);
    let (name, partial) = name.split_at(name.len() - partial);
    if partial.is_empty() && known.iter().any(|k| k.starts_with(name)) {
        return true;
    }
    let trimmed = name.trim_end();
    (!partial.is_empty() || trimmed.len() < name.len()) && known.iter().any(|k| k == trimmed)
}

#[cfg(test)]
mod tests {
    use super::super::testutil::{falls_back, golden, stream_sends_no_call_after};
    use super::super::ToolParser;
    use super::name_may_continue;

    const P: ToolParser = ToolParser::Mistral;
    const KNOWN: &[&str] = &["get_weather", "search", "noop"];

    #[test]
    fn single_call() {
        let text =
            r#"[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}]"#;
        golden(
            P,
            text,
            KNOWN,
            None,
            &[("get_weather", r#"{"city":"Paris","unit":"c"}"#)],
        );
        let text = r#"[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "c"}"#;
        golden(
            P,
            text,
            KNOWN,
            None,
            &[("get_weather", r#"{"city":"Paris","unit":"c"}"#)],
        );
        let text = r#"[TOOL_CALLS] {"name": "search", "arguments": {"q": "x"}}"#;
        golden(P, text, KNOWN, None, &[("search", r#"{"q":"x"}"#)]);
    }

    #[test]
    fn parallel_calls() {
        let expected = [
            ("get_weather", r#"{"city":"Paris"}"#),
            ("search", r#"{"q":"rust"}"#),
        ];
        let text = concat!(
            r#"[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}},"#,
            "\n ",
            r#"{"name": "search", "arguments": {"q": "rust"}}]"#
        );
        golden(P, text, KNOWN, None, &expected);
        let text = concat!(
            r#"[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}"#,
            r#"[TOOL_CALLS]search[ARGS]{"q": "rust"}"#,
            "\n"
        );
        golden(P, text, KNOWN, None, &expected);
        let text = concat!(
            r#"[TOOL_CALLS][{"name": "noop", "arguments": {}}] "#,
            r#"[TOOL_CALLS]noop [ARGS] {}"#
        );
        golden(P, text, KNOWN, None, &[("noop", "{}"), ("noop", "{}")]);
    }

    #[test]
    fn text_before_the_call_is_content() {
        let text = r#"I'll look that up [now].[TOOL_CALLS]search[ARGS]{"q": "x"}"#;
        golden(
            P,
            text,
            KNOWN,
            Some("I'll look that up [now]."),
            &[("search", r#"{"q":"x"}"#)],
        );
        let text = concat!(
            "Checking.\n",
            r#"[TOOL_CALLS][{"name": "search", "arguments": {"q": "x"}}]"#,
            " Back soon."
        );
        golden(
            P,
            text,
            KNOWN,
            Some("Checking.\n Back soon."),
            &[("search", r#"{"q":"x"}"#)],
        );
    }

    #[test]
    fn nested_arguments_with_escapes_and_unicode() {
        let text = concat!(
            r#"[TOOL_CALLS]search[ARGS]{"q": "[ARGS] {b} [c] \"d\" \\ e\n", "#,
            r#""filters": [{"lang": "日本語 \u00e9 😀"}, [1, 2.0, -0.5, false]], "#,
            r#""nested": {"deep": {"x": "[TOOL_CALLS]", "y": ["}", "]"]}}}"#
        );
        let arguments = concat!(
            r#"{"q":"[ARGS] {b} [c] \"d\" \\ e\n","#,
            r#""filters":[{"lang":"日本語 é 😀"},[1,2.0,-0.5,false]],"#,
            r#""nested":{"deep":{"x":"[TOOL_CALLS]","y":["}","]"]}}}"#
        );
        golden(P, text, KNOWN, None, &[("search", arguments)]);
        let array = format!(
            "[TOOL_CALLS][{{\"name\": \"search\", \"arguments\": {}}}]",
            &text["[TOOL_CALLS]search[ARGS]".len()..]
        );
        golden(P, &array, KNOWN, None, &[("search", arguments)]);
    }

    #[test]
    fn plain_text() {
        golden(
            P,
            "Nothing to call [TOOL] here.",
            KNOWN,
            Some("Nothing to call [TOOL] here."),
            &[],
        );
        golden(
            P,
            "ends with [TOOL_CALL",
            KNOWN,
            Some("ends with [TOOL_CALL"),
            &[],
        );
        golden(P, " \n", KNOWN, None, &[]);
    }

    #[test]
    fn malformed_json_falls_back() {
        falls_back(
            P,
            r#"[TOOL_CALLS][{"name": "search", "arguments": {"q": "x"}}"#,
            KNOWN,
        );
        falls_back(
            P,
            r#"[TOOL_CALLS][{"name": "search", "arguments": {"q": }}]"#,
            KNOWN,
        );
        falls_back(P, r#"[TOOL_CALLS]search[ARGS]{"q": "x""#, KNOWN);
        falls_back(P, r#"[TOOL_CALLS]search[ARGS]["x"]"#, KNOWN);
        falls_back(P, r#"[TOOL_CALLS]search{"q": "x"}"#, KNOWN);
        falls_back(P, "Sure. [TOOL_CALLS]", KNOWN);
        falls_back(P, "[TOOL_CALLS][]", KNOWN);
    }

    #[test]
    fn unknown_function_falls_back() {
        falls_back(
            P,
            r#"[TOOL_CALLS][{"name": "delete_all", "arguments": {}}]"#,
            KNOWN,
        );
        falls_back(P, r#"[TOOL_CALLS]delete_all[ARGS]{}"#, KNOWN);
        falls_back(P, r#"[TOOL_CALLS]search_more[ARGS]{}"#, KNOWN);
    }

    #[test]
    fn a_bad_call_after_a_good_one_falls_back() {
        let text =
            r#"[TOOL_CALLS][{"name": "noop", "arguments": {}}, {"name": "nope", "arguments": {}}]"#;
        assert!(P.parse(text, KNOWN).calls.is_empty());
        stream_sends_no_call_after(P, text, KNOWN, 1);
        let text = r#"[TOOL_CALLS]noop[ARGS]{}[TOOL_CALLS]nope[ARGS]{}"#;
        assert!(P.parse(text, KNOWN).calls.is_empty());
        stream_sends_no_call_after(P, text, KNOWN, 1);
    }

    #[test]
    fn names_are_checked_as_they_arrive() {
        let known = ["search".to_owned(), "noop".to_owned()];
        for held in [
            "",
            " ",
            "se",
            "search",
            "search ",
            "search [AR",
            "search[",
            " noop\n[ARGS",
        ] {
            assert!(name_may_continue(held, &known), "{held:?}");
        }
        for held in ["x", "sea rch", "search_", "search [x", "se[", "sea\n"] {
            assert!(!name_may_continue(held, &known), "{held:?}");
        }
    }

    #[test]
    fn calls_are_sent_as_soon_as_they_are_known() {
        use super::super::StreamEvent::Content;
        let call = super::super::testutil::noop_call;
        let mut stream = P.streamer(vec!["noop".into()]);
        assert_eq!(stream.push("Ok [TOOL"), [Content("Ok ".into())]);
        assert_eq!(
            stream.push("_CALLS][{\"name\": \"noop\", \"arguments\": {}}"),
            []
        );
        assert_eq!(stream.push(", "), call(0));
        assert_eq!(stream.push("{\"name\": \"noop\"}]"), call(1));
        assert_eq!(stream.push("[TOOL_CALLS]noop[ARGS]{}"), call(2));
        assert_eq!(stream.finish(), []);
        let mut stream = P.streamer(vec!["noop".into()]);
        assert_eq!(stream.push("[TOOL_CALLS]no"), []);
        assert_eq!(stream.push("t"), [Content("[TOOL_CALLS]not".into())]);
    }
}
