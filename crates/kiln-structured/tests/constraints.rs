//! Constraints on the SmolLM2 vocabulary driven by a random "model": at
//! every step the logits are noise (plus a pull towards closing tokens so
//! outputs end), the constraint masks them, the best allowed token is
//! taken. Whatever the noise, the output must be in the format's language.

use std::path::PathBuf;
use std::sync::Arc;

use kiln_structured::{Format, StructuredError, StructuredVocab};
use kiln_text::Tokenizer;
use serde_json::{json, Value};

fn tokenizer() -> Tokenizer {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../bench/smollm2-tokenizer");
    Tokenizer::from_hf_dir(dir).unwrap()
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 24) as f32
    }
}

const EOS: u32 = 2;

fn setup() -> (Tokenizer, Arc<StructuredVocab>) {
    let t = tokenizer();
    let v = StructuredVocab::new(&t, 49152, &[EOS, 0]).unwrap();
    (t, v)
}

/// Generate under `format` with noise seeded by `seed`; the text before EOS.
fn generate(t: &Tokenizer, v: &Arc<StructuredVocab>, format: &Format, seed: u64) -> String {
    generate_after(t, v, format, "", seed)
}

/// [`generate`] once `prefix` is written (its tokens must be allowed); the
/// text before EOS, prefix included.
fn generate_after(
    t: &Tokenizer,
    v: &Arc<StructuredVocab>,
    format: &Format,
    prefix: &str,
    seed: u64,
) -> String {
    let mut c = v.constraint(format).unwrap();
    let mut out = t.encode(prefix, false).unwrap();
    for &token in &out {
        assert!(c.allowed().unwrap().is_allowed(token), "prefix {prefix:?}");
        c.commit(token).unwrap();
    }
    let mut rng = Rng(seed | 1);
    // Tokens that close things, pulled up so random outputs end.
    let closers: Vec<u32> = (0..49152u32)
        .filter(|&id| {
            matches!(
                t.token_bytes(id).as_deref(),
                Some(b"}") | Some(b"]") | Some(b"\"") | Some(b",") | Some(b"0") | Some(b"1")
            )
        })
        .collect();
    for _ in 0..600 {
        let mut logits: Vec<f32> = (0..49152).map(|_| rng.next()).collect();
        for &id in &closers {
            logits[id as usize] += 0.6;
        }
        logits[EOS as usize] += 2.0;
        c.mask_logits(&mut logits).unwrap();
        let (best, &l) = logits
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .unwrap();
        assert!(l.is_finite(), "the mask left no token");
        c.commit(best as u32).unwrap();
        if best as u32 == EOS {
            assert!(c.is_finished());
            return t.decode(&out, false).unwrap();
        }
        out.push(best as u32);
    }
    panic!(
        "no end after 600 steps: {:?}",
        t.decode(&out, false).unwrap()
    );
}

fn check_schema(value: &Value, schema: &Value) {
    match schema["type"].as_str() {
        Some("object") => {
            let obj = value.as_object().expect("an object");
            for r in schema["required"].as_array().into_iter().flatten() {
                assert!(
                    obj.contains_key(r.as_str().unwrap()),
                    "required {r} in {value}"
                );
            }
            if schema["additionalProperties"] == json!(false) {
                let props = schema["properties"].as_object().unwrap();
                assert!(
                    obj.keys().all(|k| props.contains_key(k)),
                    "extra key in {value}"
                );
            }
            for (k, v) in obj {
                if let Some(s) = schema["properties"].get(k) {
                    check_schema(v, s);
                }
            }
        }
        Some("array") => {
            let a = value.as_array().expect("an array");
            if let Some(n) = schema["minItems"].as_u64() {
                assert!(a.len() as u64 >= n, "minItems in {value}");
            }
            if let Some(n) = schema["maxItems"].as_u64() {
                assert!(a.len() as u64 <= n, "maxItems in {value}");
            }
            for x in a {
                check_schema(x, &schema["items"]);
            }
        }
        Some("integer") => {
            // Integers past i64 (no bounds in the schema) parse as f64.
            let n = value
                .as_f64()
                .unwrap_or_else(|| panic!("an integer: {value}"));
            assert!(n.fract() == 0.0, "an integer: {value}");
            if let Some(m) = schema["minimum"].as_f64() {
                assert!(n >= m, "minimum in {value}");
            }
            if let Some(m) = schema["maximum"].as_f64() {
                assert!(n <= m, "maximum in {value}");
            }
        }
        Some("boolean") => assert!(value.is_boolean()),
        Some("string") => {
            let s = value.as_str().expect("a string");
            if let Some(n) = schema["maxLength"].as_u64() {
                assert!(s.chars().count() as u64 <= n, "maxLength in {value}");
            }
            if let Some(e) = schema["enum"].as_array() {
                assert!(e.contains(value), "enum in {value}");
            }
        }
        _ => {
            if let Some(e) = schema["enum"].as_array() {
                assert!(e.contains(value), "enum in {value}");
            }
        }
    }
}

#[test]
fn json_schema_outputs_parse_and_validate_whatever_the_noise() {
    let (t, v) = setup();
    let schemas = [
        json!({"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
               "age": {"type": "integer", "minimum": 0, "maximum": 150}},
               "required": ["name", "age"], "additionalProperties": false}),
        json!({"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 5},
               "minItems": 1, "maxItems": 3}, "ok": {"type": "boolean"}},
               "required": ["tags", "ok"], "additionalProperties": false}),
        json!({"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]},
               "point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                         "required": ["x", "y"], "additionalProperties": false}},
               "required": ["color", "point"], "additionalProperties": false}),
        json!({"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 2, "maxItems": 4}),
    ];
    for (i, schema) in schemas.iter().enumerate() {
        for seed in 1..=4u64 {
            let text = generate(
                &t,
                &v,
                &Format::JsonSchema(schema.clone()),
                seed * 7919 + i as u64,
            );
            let value: Value = serde_json::from_str(&text)
                .unwrap_or_else(|e| panic!("schema {i} seed {seed}: {e}: {text:?}"));
            check_schema(&value, schema);
        }
    }
}

#[test]
fn json_object_regex_choice_and_grammar_hold() {
    let (t, v) = setup();
    for seed in 1..=3u64 {
        let text = generate(&t, &v, &Format::JsonObject, seed);
        assert!(
            serde_json::from_str::<Value>(&text).unwrap().is_object(),
            "{text:?}"
        );

        let text = generate(&t, &v, &Format::Regex(r"[0-9]{3}-[a-z]{2,4}".into()), seed);
        let (digits, letters) = text.split_once('-').unwrap_or_else(|| panic!("{text:?}"));
        assert!(
            digits.len() == 3 && digits.bytes().all(|b| b.is_ascii_digit()),
            "{text:?}"
        );
        assert!(
            (2..=4).contains(&letters.len()) && letters.bytes().all(|b| b.is_ascii_lowercase()),
            "{text:?}"
        );

        let options = vec![
            "yes".to_string(),
            "no".to_string(),
            "maybe later".to_string(),
        ];
        let text = generate(&t, &v, &Format::Choice(options.clone()), seed);
        assert!(options.contains(&text), "{text:?}");

        let lark = r#"start: expr
expr: NUMBER | expr "+" NUMBER
NUMBER: /[0-9]{1,3}/"#;
        let text = generate(&t, &v, &Format::Lark(lark.into()), seed);
        assert!(
            text.split('+')
                .all(|n| (1..=3).contains(&n.len()) && n.bytes().all(|b| b.is_ascii_digit())),
            "{text:?}"
        );
    }
}

#[test]
fn end_of_sequence_only_where_the_grammar_accepts() {
    let (_, v) = setup();
    let mut c = v
        .constraint(&Format::JsonSchema(
            json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
        ))
        .unwrap();
    let mut logits = vec![0f32; 49152];
    c.mask_logits(&mut logits).unwrap();
    assert_eq!(
        logits[EOS as usize],
        f32::NEG_INFINITY,
        "nothing generated yet"
    );
    assert_eq!(logits[0], f32::NEG_INFINITY, "every stop id follows EOS");
    let allowed = logits.iter().filter(|l| l.is_finite()).count();
    assert!(
        allowed > 0 && allowed < 49152 / 2,
        "{allowed} tokens allowed at the start"
    );
}

#[test]
fn bad_formats_are_errors_with_the_reason() {
    let (_, v) = setup();
    let bad = [
        Format::Regex("[unclosed".into()),
        Format::Lark("start: undefined_rule".into()),
        Format::JsonSchema(json!("not a schema")),
        Format::Choice(vec![]),
    ];
    for f in bad {
        match v.constraint(&f) {
            Err(StructuredError::Invalid { reason, .. }) => assert!(!reason.is_empty()),
            Err(e) => panic!("{f:?}: wrong error {e}"),
            Ok(_) => panic!("{f:?} compiled"),
        }
    }
}

#[test]
fn a_token_the_grammar_forbids_is_refused() {
    let (t, v) = setup();
    let mut c = v.constraint(&Format::Regex("[0-9]+".into())).unwrap();
    let letter = t.encode("x", false).unwrap()[0];
    assert!(c.commit(letter).is_err());
}

#[test]
fn masks_match_the_matcher_token_by_token() {
    // `apply` works a mask word (32 ids) at a time: every id must still get
    // exactly what the mask says, stop ids what end of sequence gets.
    let (t, v) = setup();
    let mut c = v
        .constraint(&Format::JsonSchema(json!({"type": "object",
            "properties": {"name": {"type": "string"}}, "required": ["name"]})))
        .unwrap();
    for token in t.encode("{\"name\": \"Ada\"}", false).unwrap() {
        let mask = c.allowed().unwrap();
        let mut logits: Vec<f32> = (0..49152).map(|i| (i % 7) as f32).collect();
        c.apply(&mask, &mut logits);
        let eos_ok = mask.is_allowed(EOS);
        for (id, &l) in logits.iter().enumerate() {
            let want = if [EOS, 0].contains(&(id as u32)) {
                eos_ok
            } else {
                mask.is_allowed(id as u32)
            };
            assert_eq!(l.is_finite(), want, "id {id}");
            if want {
                assert_eq!(l, (id % 7) as f32);
            }
        }
        c.commit(token).unwrap();
    }
    assert!(c.is_finished() || c.allowed().unwrap().is_allowed(EOS));
}

#[test]
fn a_format_seen_before_gives_an_independent_constraint() {
    // The second constraint comes from the compiled-grammar cache: it must
    // start where a fresh one starts and not share the first one's state.
    let (t, v) = setup();
    let f = Format::JsonSchema(json!({"type": "object",
        "properties": {"n": {"type": "integer"}}, "required": ["n"]}));
    let mut first = v.constraint(&f).unwrap();
    let start = first.allowed().unwrap().as_slice().to_vec();
    for token in t.encode("{\"n\": 4", false).unwrap() {
        first.commit(token).unwrap();
    }
    let mut second = v.constraint(&f).unwrap();
    assert_eq!(second.allowed().unwrap().as_slice(), &start[..]);
    assert_ne!(first.allowed().unwrap().as_slice(), &start[..]);
}

/// Whether `format` admits exactly `text` (its tokens, then end of sequence).
fn admits(t: &Tokenizer, v: &Arc<StructuredVocab>, format: &Format, text: &str) -> bool {
    let mut c = v.constraint(format).unwrap();
    for token in t.encode(text, false).unwrap() {
        if !c.allowed().unwrap().is_allowed(token) || c.commit(token).is_err() {
            return false;
        }
    }
    c.allowed().unwrap().is_allowed(EOS)
}

#[test]
fn strict_schemas_close_objects_and_bound_numbers() {
    let (t, v) = setup();
    let schema = json!({"type": "object", "properties": {
        "n": {"type": "integer"}, "x": {"type": "number"},
        "inner": {"type": "object", "properties": {"a": {"type": "boolean"}}}}});
    let strict = Format::StrictJsonSchema(schema.clone());
    let plain = Format::JsonSchema(schema);
    let fits = r#"{"n": -9007199254740991, "x": 3.141593, "inner": {"a": true}}"#;
    for (text, plain_admits) in [
        (r#"{"n": 1, "extra": 2}"#, true),
        (r#"{"inner": {"a": true, "b": 1}}"#, true),
        (r#"{"n": 99999999999999999999}"#, true),
        (r#"{"n": 9007199254740992}"#, true),
        (r#"{"x": 3.1415926}"#, true),
        (r#"{"x": 1e300}"#, true),
        (r#"{"x": 10000000000000000}"#, true),
    ] {
        assert!(!admits(&t, &v, &strict, text), "strict admits {text}");
        assert_eq!(admits(&t, &v, &plain, text), plain_admits, "{text}");
    }
    assert!(admits(&t, &v, &strict, fits));
    assert!(admits(
        &t,
        &v,
        &strict,
        r#"{"n": 9007199254740991, "x": -0.5}"#
    ));
}

#[test]
fn strict_random_outputs_end_with_only_declared_keys() {
    // Unbounded numbers and open objects: under strict semantics every
    // noisy output still ends, inside the bounds, with no other key.
    let (t, v) = setup();
    let schema = json!({"type": "object", "properties": {
        "id": {"type": "integer"}, "score": {"type": "number"},
        "child": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}}}});
    for seed in 1..=6u64 {
        let text = generate(&t, &v, &Format::StrictJsonSchema(schema.clone()), seed * 31);
        let value: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        let o = value.as_object().unwrap();
        assert!(
            o.keys()
                .all(|k| ["id", "score", "child"].contains(&k.as_str())),
            "{text}"
        );
        if let Some(c) = o.get("child") {
            assert!(c.as_object().unwrap().keys().all(|k| k == "name"), "{text}");
        }
        if let Some(id) = o.get("id") {
            assert!(id.as_i64().is_some_and(|n| n.abs() < 1 << 53), "{text}");
        }
        if let Some(x) = o.get("score") {
            assert!(x.as_f64().unwrap().abs() <= 1e15, "{text}");
        }
    }
}

#[test]
fn choices_over_the_limits_are_refused_before_compiling() {
    let (_, v) = setup();
    let many = Format::Choice((0..2000).map(|i| format!("option {i}")).collect());
    let long = Format::Choice(vec!["x".repeat(kiln_structured::MAX_CHOICE_BYTES + 1)]);
    for f in [many, long] {
        match v.constraint(&f) {
            Err(StructuredError::Invalid { reason, .. }) => {
                assert!(reason.contains("at most"), "{reason}")
            }
            Err(e) => panic!("wrong error {e}"),
            Ok(_) => panic!("compiled"),
        }
    }
    let at_limit = Format::Choice(
        (0..kiln_structured::MAX_CHOICES)
            .map(|i| format!("o{i}"))
            .collect(),
    );
    assert!(v.constraint(&at_limit).is_ok());
}

#[test]
fn schemas_the_compiler_refuses_have_a_short_readable_reason() {
    let (_, v) = setup();
    let recursive = json!({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"});
    for f in [
        Format::JsonSchema(recursive.clone()),
        Format::StrictJsonSchema(recursive),
    ] {
        match v.constraint(&f) {
            Err(StructuredError::Invalid { reason, .. }) => {
                eprintln!("{reason}");
                assert!(
                    !reason.is_empty() && reason.len() < 400 && !reason.contains('\n'),
                    "{reason}"
                );
                assert!(!reason.contains("backtrace"), "{reason}");
            }
            Err(e) => panic!("wrong error {e}"),
            Ok(_) => panic!("{f:?} compiled"),
        }
    }
}

/// Hermes-style tool calls under `tool_choice: auto`: one weather tool.
fn weather_calls(begin: &str, end: &str, many: bool) -> Format {
    let call = json!({"type": "object", "properties": {
        "name": {"const": "get_weather"},
        "arguments": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}}}},
        "required": ["name", "arguments"]});
    Format::TaggedJson(kiln_structured::TaggedJson {
        begin: begin.into(),
        schema: call,
        end: end.into(),
        many,
    })
}

#[test]
fn tagged_json_leaves_text_free_and_holds_what_a_marker_opens() {
    let (t, v) = setup();
    let one = weather_calls("<tool_call>", "</tool_call>", false);
    let many = weather_calls("<tool_call>", "</tool_call>", true);
    assert!(!v.is_special_token("<tool_call>"));
    let call = r#"{"name": "get_weather", "arguments": {"city": "Paris"}}"#;
    let tagged = format!("<tool_call>\n{call}\n</tool_call>");
    for text in [
        "It is sunny in Paris today.",
        "",
        "x < y, <b>bold</b> and <tool_call without its bracket",
        &format!("Let me look that up.\n{tagged}"),
        &tagged,
        &format!("{tagged}\nDone."),
    ] {
        assert!(admits(&t, &v, &one, text), "{text:?}");
        assert!(admits(&t, &v, &many, text), "{text:?}");
    }
    let two = format!("{tagged}\n{tagged}");
    assert!(admits(&t, &v, &many, &two));
    assert!(!admits(&t, &v, &one, &two), "one call at most");
    for bad in [
        // Undeclared keys, tools and values, an unbounded integer, an
        // unclosed call, and prose where the call should be.
        r#"{"name": "get_weather", "arguments": {"city": "Paris", "mood": 1}}"#,
        r#"{"name": "get_time", "arguments": {}}"#,
        r#"{"name": "get_weather", "arguments": {"city": 7}}"#,
        r#"{"name": "get_weather", "arguments": {"days": 99999999999999999999}}"#,
        r#"{"name": "get_weather", "arguments": {"city": "Paris"}"#,
        "I would call get_weather now.",
    ] {
        let text = format!("Sure.<tool_call>\n{bad}\n</tool_call>");
        assert!(!admits(&t, &v, &many, &text), "{text:?}");
    }
    // A call that is opened must be closed before the output ends.
    assert!(!admits(&t, &v, &many, &format!("<tool_call>\n{call}")));
}

#[test]
fn tagged_json_opened_by_a_special_token() {
    let (t, v) = setup();
    assert!(v.is_special_token("<|im_start|>"));
    let f = weather_calls("<|im_start|>", "", true);
    let call = r#"{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}"#;
    assert!(admits(&t, &v, &f, "Just text."));
    assert!(admits(&t, &v, &f, &format!("Checking.<|im_start|>{call}")));
    assert!(admits(
        &t,
        &v,
        &f,
        &format!("<|im_start|>{call}<|im_start|>{call}")
    ));
    let bad = r#"{"name": "get_weather", "arguments": {"town": "Oslo"}}"#;
    assert!(!admits(&t, &v, &f, &format!("Checking.<|im_start|>{bad}")));
}

#[test]
fn tagged_json_random_calls_validate() {
    // Once the marker is written, whatever the noise, the call ends valid.
    let (t, v) = setup();
    let f = weather_calls("<tool_call>", "</tool_call>", false);
    for seed in 1..=4u64 {
        let text = generate_after(&t, &v, &f, "Checking.<tool_call>\n", seed * 7919);
        let body = text
            .split_once("<tool_call>")
            .and_then(|(_, rest)| rest.split_once("</tool_call>"))
            .unwrap_or_else(|| panic!("no closed call: {text:?}"))
            .0;
        let call: Value =
            serde_json::from_str(body.trim()).unwrap_or_else(|e| panic!("{e}: {text:?}"));
        assert_eq!(call["name"], "get_weather", "{text:?}");
        let args = call["arguments"].as_object().unwrap();
        assert!(args.keys().all(|k| k == "city" || k == "days"), "{text:?}");
    }
}
