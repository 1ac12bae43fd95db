//! The Hermes format (NousResearch Hermes 2/3, Qwen2.5, Qwen3): each call is a JSON object
//! `{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`, usually on lines of
//! their own; several in a row are parallel calls. Text outside the tags is content. The closing
//! tag may be missing (the model stopped, or went straight on): a complete object is a call anyway.
//! "parameters" is read as a synonym of "arguments".

use super::stream::{Core, Lit};

const START: &str = "<tool_call>";
const END: &str = "</tool_call>";

#[derive(Debug, Clone, Copy, Default)]
pub(super) enum State {
    /// Outside calls, looking for `<tool_call>`.
    #[default]
    Content,
    /// After `<tool_call>`: the call's JSON object.
    Open,
    /// After a call's object: `</tool_call>`, if it comes.
    After,
}

pub(super) fn step(state: &mut State, core: &mut Core, eof: bool) {
    while !core.verbatim() {
        match state {
            State::Content => {
                if !core.scan_for(START, eof) {
                    return;
                }
                *state = State::Open;
            }
            State::Open => {
                if !core.take_call(None, eof) {
                    return;
                }
                *state = State::After;
            }
            State::After => {
                core.skip_ws();
                match core.starts(END, eof) {
                    Lit::More => return,
                    Lit::Yes => {
                        core.take(END.len());
                        core.settle();
                    }
                    Lit::No => {}
                }
                *state = State::Content;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testutil::{falls_back, golden};
    use super::super::ToolParser;

    const P: ToolParser = ToolParser::Hermes;
    const KNOWN: &[&str] = &["get_weather", "search", "noop"];

    #[test]
    fn single_call() {
        let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"c\"}}\n</tool_call>";
        golden(
            P,
            text,
            KNOWN,
            None,
            &[("get_weather", r#"{"city":"Paris","unit":"c"}"#)],
        );
    }

    #[test]
    fn parallel_calls() {
        let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"search\", \"parameters\": {\"q\": \"rust\", \"n\": 3}}\n</tool_call>\n<tool_call>\n{\"name\": \"noop\"}\n</tool_call>\n";
        golden(
            P,
            text,
            KNOWN,
            None,
            &[
                ("get_weather", r#"{"city":"Paris"}"#),
                ("search", r#"{"q":"rust","n":3}"#),
                ("noop", "{}"),
            ],
        );
    }

    #[test]
    fn text_before_the_call_is_content() {
        let text = "Let me check the weather.\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>";
        golden(
            P,
            text,
            KNOWN,
            Some("Let me check the weather.\n\n"),
            &[("get_weather", r#"{"city":"Oslo"}"#)],
        );
    }

    #[test]
    fn text_after_a_call_is_content() {
        let text = "<tool_call>{\"name\": \"noop\", \"arguments\": {}}</tool_call>\nDone < soon.";
        golden(P, text, KNOWN, Some("\nDone < soon."), &[("noop", "{}")]);
    }

    #[test]
    fn missing_closing_tag() {
        let text =
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n";
        golden(
            P,
            text,
            KNOWN,
            None,
            &[("get_weather", r#"{"city":"Rome"}"#)],
        );
        let text = "<tool_call>\n{\"name\": \"noop\", \"arguments\": {}}\n<tool_call>\n{\"name\": \"search\", \"arguments\": {\"q\": \"x\"}}";
        golden(
            P,
            text,
            KNOWN,
            None,
            &[("noop", "{}"), ("search", r#"{"q":"x"}"#)],
        );
    }

    #[test]
    fn nested_arguments_with_escapes_and_unicode() {
        let text = concat!(
            "<tool_call>\n",
            r#"{"name": "search", "arguments": {"q": "a {b} [c] \"d\" \\ e\n", "#,
            r#""filters": [{"lang": "日本語 \u00e9 😀"}, [1, 2.5, -3e2, true, null]], "#,
            r#""path": "C:\\dir\\}", "nested": {"deep": {"x": "</tool_call>"}}}}"#,
            "\n</tool_call>"
        );
        let arguments = concat!(
            r#"{"q":"a {b} [c] \"d\" \\ e\n","#,
            r#""filters":[{"lang":"日本語 é 😀"},[1,2.5,-300.0,true,null]],"#,
            r#""path":"C:\\dir\\}","nested":{"deep":{"x":"</tool_call>"}}}"#
        );
        golden(P, text, KNOWN, None, &[("search", arguments)]);
    }

    #[test]
    fn string_arguments_are_read_as_json() {
        let text = r#"<tool_call>{"name": "search", "arguments": "{\"q\": \"x\"}"}</tool_call>"#;
        golden(P, text, KNOWN, None, &[("search", r#"{"q":"x"}"#)]);
    }

    #[test]
    fn plain_text() {
        golden(
            P,
            "日本語 <tool_cal… é",
            KNOWN,
            Some("日本語 <tool_cal… é"),
            &[],
        );
        golden(
            P,
            "The answer is 42. <b>bold</b> <tool",
            KNOWN,
            Some("The answer is 42. <b>bold</b> <tool"),
            &[],
        );
        golden(P, "  \n hi\n", KNOWN, Some("  \n hi\n"), &[]);
        golden(P, " \n\t", KNOWN, None, &[]);
        golden(P, "", KNOWN, None, &[]);
    }

    #[test]
    fn malformed_json_falls_back() {
        falls_back(
            P,
            "<tool_call>\n{\"name\": \"search\", \"arguments\": {\"q\": }}\n</tool_call>",
            KNOWN,
        );
        falls_back(
            P,
            "Sure.\n<tool_call>\n{\"name\": \"search\", \"arguments\": {\"q\": \"x\"}\n",
            KNOWN,
        );
        falls_back(P, "<tool_call>\nsearch(q=\"x\")\n</tool_call>", KNOWN);
        falls_back(P, "\n<tool_call>\n", KNOWN);
        falls_back(
            P,
            "<tool_call>\n{\"name\": \"search\", \"arguments\": [1]}</tool_call>",
            KNOWN,
        );
    }

    #[test]
    fn unknown_function_falls_back() {
        falls_back(
            P,
            "<tool_call>\n{\"name\": \"delete_all\", \"arguments\": {}}\n</tool_call>",
            KNOWN,
        );
        falls_back(
            P,
            "<tool_call>{\"name\": \"noop\", \"arguments\": {}}</tool_call>",
            &[],
        );
    }

    #[test]
    fn a_bad_call_after_a_good_one_falls_back() {
        let text = "<tool_call>{\"name\": \"noop\"}</tool_call>\n<tool_call>{\"name\": \"nope\"}</tool_call>";
        let parsed = P.parse(text, KNOWN);
        assert_eq!(parsed.content.as_deref(), Some(text));
        assert!(parsed.calls.is_empty());
        super::super::testutil::stream_sends_no_call_after(P, text, KNOWN, 1);
    }

    #[test]
    fn sends_content_and_calls_as_soon_as_they_are_known() {
        use super::super::StreamEvent::{Arguments, CallStart, Content};
        let mut stream = P.streamer(vec!["noop".into()]);
        assert_eq!(stream.push("Hi <tool"), [Content("Hi ".into())]);
        assert_eq!(stream.push("_call>\n{\"name\": \"noop\", "), []);
        assert!(!stream.called());
        let call = [
            CallStart {
                index: 0,
                name: "noop".into(),
            },
            Arguments {
                index: 0,
                text: "{}".into(),
            },
        ];
        assert_eq!(stream.push("\"arguments\": {}}"), call);
        assert_eq!(stream.push("\n</tool_call>\n"), []);
        assert!(stream.called());
        assert_eq!(stream.finish(), []);
    }
}
