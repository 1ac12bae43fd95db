use super::*;
use crate::sampler::SeqRng;
use serde_json::json;

const EOS: [u32; 2] = [1, 6];

fn grammars() -> Grammars {
    let tok = Tokenizer::from_bytes(include_bytes!("../../assets/tokenizer.json")).expect("tok");
    let width = tok.vocab_size() + 24; // a padded logits row, as many models have
    Grammars::new(Arc::new(tok), width, EOS.to_vec())
}

fn spec(f: impl FnOnce(&mut StructuredOutputs)) -> StructuredOutputs {
    let mut s = StructuredOutputs::default();
    f(&mut s);
    s
}

fn allowed(mask: &[u32]) -> Vec<u32> {
    (0..mask.len() as u32 * 32)
        .filter(|&t| mask[t as usize / 32] >> (t % 32) & 1 == 1)
        .collect()
}

/// Samples uniformly among the allowed tokens (ending when the grammar allows it with
/// probability `p_end`) until the grammar completes, EOS is drawn or `max` tokens; returns the text
/// and whether it ended by the grammar or EOS.
fn walk(g: &Grammars, s: &StructuredOutputs, seed: u64, max: usize) -> (String, bool) {
    let (compiled, _) = g.compile(s).expect("compiles");
    let mut m = compiled.matcher();
    let mut rng = SeqRng::new(seed);
    let mut mask = vec![0u32; m.words()];
    let mut ids = Vec::new();
    for _ in 0..max {
        m.mask_into(&mut mask);
        let ok = allowed(&mask);
        assert!(!ok.is_empty(), "a row always has a token");
        assert!(ok.iter().all(|&t| (t as usize) < g.width), "inside the row");
        let text: Vec<u32> = ok.iter().copied().filter(|t| !EOS.contains(t)).collect();
        let end = ok.iter().any(|t| EOS.contains(t)) && (text.is_empty() || rng.next_f32() < 0.3);
        if end {
            return (decode(g, &ids), true);
        }
        let t = text[(rng.next_u64() % text.len() as u64) as usize];
        ids.push(t);
        if m.advance(t) {
            return (decode(g, &ids), true);
        }
    }
    (decode(g, &ids), false)
}

fn decode(g: &Grammars, ids: &[u32]) -> String {
    g.tokenizer.decode(ids, false).expect("decode")
}

#[test]
fn json_schema_outputs_parse_and_match() {
    let g = grammars();
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
            "age": {"type": "integer", "minimum": 0, "maximum": 99},
            "kind": {"enum": ["cat", "dog"]},
            "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
            "owner": {"type": "object", "properties": {"id": {"type": "integer", "minimum": -5, "maximum": 1000}}, "required": ["id"], "additionalProperties": false}
        },
        "required": ["name", "age", "kind"],
        "additionalProperties": false
    });
    let s = spec(|s| s.json = Some(schema));
    let mut done = 0;
    for seed in 0..40 {
        let (text, ended) = walk(&g, &s, seed, 200);
        if !ended {
            continue;
        }
        done += 1;
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
        let name = v["name"].as_str().expect("name");
        assert!((1..=6).contains(&name.len()) && name.chars().all(|c| c.is_ascii_lowercase()));
        assert!((0..=99).contains(&v["age"].as_i64().expect("age")));
        assert!(["cat", "dog"].contains(&v["kind"].as_str().expect("kind")));
        if let Some(t) = v.get("tags") {
            assert!(t.as_array().expect("array").len() <= 3);
        }
        if let Some(o) = v.get("owner") {
            assert!(o["id"].is_i64());
        }
        // compact by default: the text is its own compact serialization
        assert_eq!(serde_json::to_string(&v).expect("json"), text);
    }
    assert!(done >= 30, "{done} of 40 walks completed");
}

#[test]
fn regex_choice_and_grammar_outputs_match() {
    let g = grammars();
    let rx = spec(|s| s.regex = Some("[a-c]{2,4}-[0-9]{1,3}".into()));
    let choices = vec!["yes".to_string(), "no".into(), "maybe \"so\"".into()];
    let ch = spec(|s| s.choice = Some(choices.clone()));
    let lark = spec(|s| {
        s.grammar = Some("start: expr\nexpr: NUM | expr \"+\" NUM\nNUM: /[0-9]{1,2}/".into())
    });
    for seed in 0..20 {
        let (t, ended) = walk(&g, &rx, seed, 50);
        assert!(ended);
        let (head, tail) = t.split_once('-').expect("dash");
        assert!((2..=4).contains(&head.len()) && head.chars().all(|c| ('a'..='c').contains(&c)));
        assert!((1..=3).contains(&tail.len()) && tail.chars().all(|c| c.is_ascii_digit()));
        let (t, ended) = walk(&g, &ch, seed, 50);
        assert!(ended && choices.contains(&t), "{t}");
        let (t, ended) = walk(&g, &lark, seed, 60);
        if ended {
            assert!(t.split('+').all(|n| (1..=2).contains(&n.len())), "{t}");
        }
    }
}

#[test]
fn whitespace_may_be_allowed() {
    let g = grammars();
    let schema =
        json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]});
    let (c, _) = g
        .compile(&spec(|s| {
            s.json = Some(schema.clone());
            s.disable_any_whitespace = Some(false);
        }))
        .expect("compiles");
    let mut m = c.matcher();
    let mut mask = vec![0u32; m.words()];
    m.mask_into(&mut mask);
    let space = g.tokenizer.encode(" ", false).expect("enc");
    let brace = g.tokenizer.encode("{", false).expect("enc");
    assert!(!m.advance(brace[0]));
    m.mask_into(&mut mask);
    assert!(
        allowed(&mask).contains(&space[0]),
        "free whitespace allowed"
    );
    let (c, _) = g
        .compile(&spec(|s| s.json = Some(schema)))
        .expect("compiles");
    let mut m = c.matcher();
    assert!(!m.advance(brace[0]));
    m.mask_into(&mut mask);
    assert!(!allowed(&mask).contains(&space[0]), "compact by default");
}

#[test]
fn bad_constraints_are_refused_with_the_reason() {
    let g = grammars();
    let cases = [
        spec(|_| {}),
        spec(|s| {
            s.regex = Some("a".into());
            s.choice = Some(vec!["a".into()]);
        }),
        spec(|s| s.choice = Some(vec![])),
        spec(|s| s.grammar = Some("  ".into())),
        spec(|s| s.json = Some(json!("not json {"))),
        spec(|s| s.json = Some(json!(3))),
        spec(|s| s.regex = Some("x".repeat(MAX_GRAMMAR_BYTES + 1))),
    ];
    for c in &cases {
        assert!(c.validate().is_err(), "{c:?}");
        assert!(matches!(g.compile(c), Err(GrammarError::Invalid(_))));
    }
    let compile_errors = [
        spec(|s| s.regex = Some("(unclosed".into())),
        spec(|s| s.grammar = Some("start: undefined_rule".into())),
        spec(|s| {
            s.json = Some(json!({"type": "object", "properties": {"a": {"type": "nonsense"}}}))
        }),
    ];
    for c in &compile_errors {
        assert!(c.validate().is_ok());
        match g.compile(c) {
            Err(GrammarError::Invalid(e)) => {
                assert_eq!(e.field, "structured_outputs");
                assert!(!e.message.is_empty() && !e.message.contains('\n'));
                assert!(e.message.chars().count() <= 400);
            }
            other => panic!("{c:?}: {:?}", other.map(|_| ())),
        }
    }
}

#[test]
fn compiled_grammars_are_cached_by_text() {
    let g = grammars();
    let s = spec(|s| s.json_object = Some(true));
    let (_, first) = g.compile(&s).expect("compiles");
    let (_, second) = g.compile(&s).expect("compiles");
    assert!(!first.cached && second.cached);
    // the whitespace option is part of the key
    let loose = spec(|s| {
        s.json_object = Some(true);
        s.disable_any_whitespace = Some(false);
    });
    assert!(!g.compile(&loose).expect("compiles").1.cached);
}

#[test]
fn a_finished_grammar_allows_only_the_end() {
    let g = grammars();
    let (c, _) = g
        .compile(&spec(|s| s.choice = Some(vec!["ab".into(), "abc".into()])))
        .expect("compiles");
    let mut m = c.matcher();
    let ids = g.tokenizer.encode("ab", false).expect("enc");
    for &t in &ids {
        assert!(!m.advance(t), "abc may still follow");
    }
    assert!(m.is_accepting());
    let mut mask = vec![0u32; m.words()];
    m.mask_into(&mut mask);
    let ok = allowed(&mask);
    assert!(EOS.iter().all(|e| ok.contains(e)), "the end is allowed");
    // a token the grammar refuses ends it
    let z = g.tokenizer.encode("z", false).expect("enc");
    assert!(m.advance(z[0]));
}
