//! The Llama 3.1/3.2 JSON format: the whole output is calls, `{"name": ..., "parameters": {...}}`
//! ("arguments" is read as a synonym), optionally after `<|python_tag|>`, several separated by `;`.
//! It is recognised only when the output, past leading whitespace, starts with `{` or
//! `<|python_tag|>`; otherwise the output is plain content. Once recognised, anything that is not a
//! call, a `;` or whitespace makes it content again (a JSON answer that is not a call included).

use super::stream::{Core, Lit};

const TAG: &str = "<|python_tag|>";

#[derive(Debug, Clone, Copy, Default)]
pub(super) enum State {
    /// Nothing but whitespace yet.
    #[default]
    Start,
    /// A call's JSON object is next.
    Call,
    /// After a call, which `;` or the end confirms.
    After,
    /// After `;`: another call or the end.
    Separated,
}

pub(super) fn step(state: &mut State, core: &mut Core, eof: bool) {
    while !core.verbatim() {
        match state {
            State::Start => {
                core.skip_ws();
                match core.peek() {
                    None => return,
                    Some('{') => *state = State::Call,
                    Some(_) => match core.starts(TAG, eof) {
                        Lit::Yes => {
                            core.take(TAG.len());
                            *state = State::Call;
                        }
                        Lit::More => return,
                        Lit::No => {
                            core.plain();
                            return;
                        }
                    },
                }
            }
            State::Call => {
                if !core.read_call(None, eof) {
                    return;
                }
                *state = State::After;
            }
            State::After => {
                core.skip_ws();
                match core.peek() {
                    None => {
                        if eof {
                            core.send_pending();
                        }
                        return;
                    }
                    Some(';') => {
                        core.take(1);
                        core.send_pending();
                        *state = State::Separated;
                    }
                    Some(_) => {
                        core.fall_back();
                        return;
                    }
                }
            }
            State::Separated => {
                core.skip_ws();
                match core.peek() {
                    None => return,
                    Some('{') => *state = State::Call,
                    Some(_) => {
                        core.fall_back();
                        return;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testutil::{falls_back, golden, stream_sends_no_call_after};
    use super::super::ToolParser;

    const P: ToolParser = ToolParser::Llama3Json;
    const KNOWN: &[&str] = &["get_weather", "search", "noop"];

    #[test]
    fn single_call() {
        let text = r#"{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}"#;
        golden(
            P,
            text,
            KNOWN,
            None,
            &[("get_weather", r#"{"city":"Paris","unit":"c"}"#)],
        );
        let text = "\n <|python_tag|>{\"name\": \"search\", \"arguments\": {\"q\": \"x\"}}\n";
        golden(P, text, KNOWN, None, &[("search", r#"{"q":"x"}"#)]);
    }

    #[test]
    fn parallel_calls() {
        let text = concat!(
            r#"<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; "#,
            r#"{"name": "search", "parameters": {"q": "rust"}};"#,
            "\n",
            r#"{"name": "noop", "parameters": {}};"#
        );
        golden(
            P,
            text,
            KNOWN,
            None,
            &[
                ("get_weather", r#"{"city":"Paris"}"#),
                ("search", r#"{"q":"rust"}"#),
                ("noop", "{}"),
            ],
        );
    }

    #[test]
    fn text_before_the_call_is_plain_content() {
        let text = r#"Here you go: {"name": "search", "parameters": {"q": "x"}}"#;
        golden(P, text, KNOWN, Some(text), &[]);
        let text = " \nI think <|python_tag|> is a token.";
        golden(P, text, KNOWN, Some(text), &[]);
    }

    #[test]
    fn nested_arguments_with_escapes_and_unicode() {
        let text = concat!(
            r#"{"name": "search", "parameters": {"q": "a {b} [c] \"d\" \\ e\t;", "#,
            r#""filters": [{"lang": "日本語 \u00e9 \ud83d\ude00"}, [1, 2.50, {}]], "#,
            r#""s": "\/;{", "nested": {"deep": {"x": ["}", "]"]}}}}"#
        );
        let arguments = concat!(
            r#"{"q":"a {b} [c] \"d\" \\ e\t;","#,
            r#""filters":[{"lang":"日本語 é 😀"},[1,2.5,{}]],"#,
            r#""s":"/;{","nested":{"deep":{"x":["}","]"]}}}"#
        );
        golden(P, text, KNOWN, None, &[("search", arguments)]);
    }

    #[test]
    fn plain_text() {
        golden(
            P,
            "Paris is sunny today.",
            KNOWN,
            Some("Paris is sunny today."),
            &[],
        );
        golden(P, "<b>hi</b>", KNOWN, Some("<b>hi</b>"), &[]);
        golden(P, "\n\n", KNOWN, None, &[]);
        golden(P, "", KNOWN, None, &[]);
    }

    #[test]
    fn malformed_json_falls_back() {
        falls_back(P, r#"{"name": "search", "parameters": {"q": "x"}"#, KNOWN);
        falls_back(P, r#"{"name": "search", "parameters": {"q": x}}"#, KNOWN);
        falls_back(P, r#"{"answer": 42}"#, KNOWN);
        falls_back(P, "<|python_tag|>print(\"hi\")", KNOWN);
        falls_back(P, "<|python_tag|>", KNOWN);
        falls_back(P, r#"{"name": "search", "parameters": "q"}"#, KNOWN);
    }

    #[test]
    fn unknown_function_falls_back() {
        falls_back(P, r#"{"name": "delete_all", "parameters": {}}"#, KNOWN);
        falls_back(P, r#"{"name": "Search", "parameters": {}}"#, KNOWN);
    }

    #[test]
    fn bad_text_after_a_call_falls_back() {
        falls_back(
            P,
            r#"{"name": "noop", "parameters": {}} and then some"#,
            KNOWN,
        );
        falls_back(
            P,
            r#"{"name": "noop", "parameters": {}} {"name": "noop"}"#,
            KNOWN,
        );
        let text = r#"{"name": "noop", "parameters": {}}; {"name": "nope", "parameters": {}}"#;
        assert!(P.parse(text, KNOWN).calls.is_empty());
        stream_sends_no_call_after(P, text, KNOWN, 1);
    }

    #[test]
    fn a_call_is_sent_once_a_separator_or_the_end_confirms_it() {
        let call = super::super::testutil::noop_call;
        let mut stream = P.streamer(vec!["noop".into()]);
        assert_eq!(stream.push(" {\"name\": \"noop\", \"parameters\": {}}"), []);
        assert_eq!(stream.push(";"), call(0));
        assert_eq!(stream.push(" {\"name\": \"noop\"}\n"), []);
        assert_eq!(stream.finish(), call(1));
    }
}
