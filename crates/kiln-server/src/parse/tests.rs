//! Recorded outputs of every syntax, parsed whole and streamed split at
//! every character boundary (and one character at a time): the same
//! reasoning, text and calls either way.

use serde_json::{json, Value};

use super::*;

fn syntax(tools: ToolSyntax, think: bool) -> OutputSyntax {
    OutputSyntax {
        think: think.then(|| (ThinkSyntax::detect("<think>").unwrap(), false)),
        tools: Some((tools, vec!["get_weather".into(), "search".into()])),
        forced_call: false,
        harmony: false,
    }
}

/// Parses `text` whole, then streamed split at every boundary and char by
/// char; every way must agree. Returns the whole parse.
fn check(text: &str, syntax: &OutputSyntax) -> Parsed {
    let whole = parse(text, syntax);
    let bounds: Vec<usize> = (0..=text.len())
        .filter(|&i| text.is_char_boundary(i))
        .collect();
    for &i in &bounds {
        let mut p = OutputParser::new(syntax);
        let mut pieces = p.push(&text[..i]);
        pieces.extend(p.push(&text[i..]));
        pieces.extend(p.finish());
        assert_eq!(
            Parsed::from_pieces(pieces),
            whole,
            "split at {i} of {text:?}"
        );
    }
    let mut p = OutputParser::new(syntax);
    let mut pieces = Vec::new();
    for w in bounds.windows(2) {
        pieces.extend(p.push(&text[w[0]..w[1]]));
    }
    pieces.extend(p.finish());
    assert_eq!(Parsed::from_pieces(pieces), whole, "char by char: {text:?}");
    whole
}

fn args(call: &ToolCall) -> Value {
    serde_json::from_str(&call.arguments).expect("arguments are JSON")
}

#[test]
fn hermes_calls_and_text() {
    let s = syntax(ToolSyntax::Hermes, false);
    let p = check(
        "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"search\", \"arguments\": \"{\\\"q\\\": \\\"é\\\"}\"}\n</tool_call>",
        &s,
    );
    assert_eq!(p.content.as_deref(), Some("Let me check."));
    assert_eq!(p.calls.len(), 2);
    assert_eq!(
        (p.calls[0].name.as_str(), args(&p.calls[0])),
        ("get_weather", json!({"city": "Paris"}))
    );
    assert_eq!(args(&p.calls[1]), json!({"q": "é"}));
    // A bare call naming a declared tool; an undeclared one stays text.
    let p = check(
        "  {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n",
        &s,
    );
    assert_eq!((p.content, p.calls.len()), (None, 1));
    let p = check("{\"name\": \"other\", \"arguments\": {}}", &s);
    assert_eq!(
        (p.content.as_deref(), p.calls.len()),
        (Some("{\"name\": \"other\", \"arguments\": {}}"), 0)
    );
}

#[test]
fn malformed_and_partial_calls_stay_text() {
    let s = syntax(ToolSyntax::Hermes, false);
    for text in [
        "x <tool_call>{not json}</tool_call> y",
        "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Par",
        "{\"name\": \"get_weather\", \"arguments\": {\"city\"",
        "a <tool_ca",
        "<tool_call>[1, 2]</tool_call>",
        "{\"name\": \"get_weather\", \"arguments\": [1]}",
        "",
        "   ",
    ] {
        let p = check(text, &s);
        assert!(p.calls.is_empty(), "{text:?}");
        assert_eq!(p.content.as_deref().unwrap_or(""), text, "{text:?}");
    }
    // Text between and after calls is kept; blanks around calls are not.
    let p = check(
        "A <tool_call>{\"name\":\"search\",\"arguments\":{}}</tool_call>\n\nB  <tool_call>{bad}</tool_call>",
        &s,
    );
    assert_eq!(
        p.content.as_deref(),
        Some("AB  <tool_call>{bad}</tool_call>")
    );
    assert_eq!(p.calls.len(), 1);
}

#[test]
fn llama3_json_calls() {
    let s = syntax(ToolSyntax::Llama3, false);
    let p = check(
        "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Rome\"}}",
        &s,
    );
    assert_eq!(
        (p.calls.len(), args(&p.calls[0])),
        (1, json!({"city": "Rome"}))
    );
    assert_eq!(p.content, None);
    let p = check(
        "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Rome\"}}; {\"name\": \"search\", \"parameters\": {\"q\": \"x;y\"}}",
        &s,
    );
    assert_eq!(
        p.calls.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(),
        ["get_weather", "search"]
    );
    assert_eq!(args(&p.calls[1]), json!({"q": "x;y"}));
    // Built-in tool code after the tag is not a JSON call: text.
    let p = check("<|python_tag|>brave_search.call(query=\"x\")", &s);
    assert_eq!(p.calls.len(), 0);
    assert_eq!(
        p.content.as_deref(),
        Some("<|python_tag|>brave_search.call(query=\"x\")")
    );
}

#[test]
fn mistral_calls() {
    let s = syntax(ToolSyntax::Mistral, false);
    let p = check(
        "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Lima\"}}, {\"name\": \"search\", \"arguments\": {\"q\": \"[x]\"}}]",
        &s,
    );
    assert_eq!(p.calls.len(), 2);
    assert_eq!(args(&p.calls[1]), json!({"q": "[x]"}));
    let p = check(
        "Sure.[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Lima\", \"name\": \"x\"}[TOOL_CALLS]search[CALL_ID]a1b2c3d4e[ARGS]{\"q\": \"z\"}",
        &s,
    );
    assert_eq!(p.content.as_deref(), Some("Sure."));
    assert_eq!(p.calls[0].name, "get_weather");
    assert_eq!(args(&p.calls[0]), json!({"city": "Lima", "name": "x"}));
    assert_eq!(
        (p.calls[1].name.as_str(), args(&p.calls[1])),
        ("search", json!({"q": "z"}))
    );
    let p = check("[TOOL_CALLS] not a call", &s);
    assert_eq!(
        (p.calls.len(), p.content.as_deref()),
        (0, Some("[TOOL_CALLS] not a call"))
    );
}

#[test]
fn glm45_calls_with_typed_and_string_arguments() {
    let s = syntax(ToolSyntax::Glm45, true);
    let p = check(
        "<think>Weather first.</think>Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call><tool_call>search\n<arg_key>q</arg_key>\n<arg_value>{\"a\": [1, 2]}</arg_value>\n</tool_call>",
        &s,
    );
    assert_eq!(p.reasoning.as_deref(), Some("Weather first."));
    assert_eq!(p.content.as_deref(), Some("Checking."));
    assert_eq!(p.calls.len(), 2);
    // A value that parses as JSON is JSON; any other is a string.
    assert_eq!(
        (p.calls[0].name.as_str(), args(&p.calls[0])),
        ("get_weather", json!({"city": "Paris", "days": 3}))
    );
    assert_eq!(args(&p.calls[1]), json!({"q": {"a": [1, 2]}}));
    // A call without arguments; a body that is not one stays text.
    let p = check("<tool_call>search</tool_call>", &s);
    assert_eq!(
        (p.calls[0].name.as_str(), args(&p.calls[0])),
        ("search", json!({}))
    );
    let p = check("<tool_call>get weather now</tool_call>", &s);
    assert_eq!(
        (p.calls.len(), p.content.as_deref()),
        (0, Some("<tool_call>get weather now</tool_call>"))
    );
}

#[test]
fn deepseek_v3_calls_in_both_spellings() {
    let s = syntax(ToolSyntax::DeepSeekV3, false);
    // V3 / R1: `function<sep>NAME` and a fenced JSON block.
    let p = check(
        "Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Oslo\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n{\"q\": \"fjord\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        &s,
    );
    assert_eq!(p.content.as_deref(), Some("Let me look."));
    assert_eq!(p.calls.len(), 2);
    assert_eq!(
        (p.calls[0].name.as_str(), args(&p.calls[0])),
        ("get_weather", json!({"city": "Oslo"}))
    );
    assert_eq!(args(&p.calls[1]), json!({"q": "fjord"}));
    // V3.1: `NAME<sep>{…}`.
    let p = check(
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>{\"q\": \"é\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        &s,
    );
    assert_eq!(
        (p.calls[0].name.as_str(), args(&p.calls[0])),
        ("search", json!({"q": "é"}))
    );
    // Arguments that are not an object: text, as written.
    let text = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>[1]<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
    let p = check(text, &s);
    assert_eq!((p.calls.len(), p.content.as_deref()), (0, Some(text)));
}

#[test]
fn kimi_k2_calls() {
    let s = syntax(ToolSyntax::KimiK2, false);
    let p = check(
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Kyoto\"}<|tool_call_end|><|tool_call_begin|>functions.search:1<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>",
        &s,
    );
    assert_eq!(p.content, None);
    assert_eq!(
        (p.calls[0].name.as_str(), args(&p.calls[0])),
        ("get_weather", json!({"city": "Kyoto"}))
    );
    assert_eq!(
        (p.calls[1].name.as_str(), args(&p.calls[1])),
        ("search", json!({}))
    );
}

#[test]
fn gemma_calls() {
    let s = syntax(ToolSyntax::Gemma, false);
    let p = check(
        "<start_function_call>call:get_weather{city:<escape>São Paulo<escape>,days:2}<end_function_call>",
        &s,
    );
    assert_eq!(args(&p.calls[0]), json!({"city": "São Paulo", "days": 2}));
    let p = check(
        "I'll look.\n```tool_code\nget_weather(city=\"Kyiv\")\nsearch(q='a')\n```\nDone.",
        &s,
    );
    assert_eq!(p.calls.len(), 2);
    assert_eq!(p.content.as_deref(), Some("I'll look.Done."));
    let p = check("```tool_code\nx = 1\n```", &s);
    assert_eq!(
        (p.calls.len(), p.content.as_deref()),
        (0, Some("```tool_code\nx = 1\n```"))
    );
}

#[test]
fn reasoning_is_split_from_the_answer() {
    let s = syntax(ToolSyntax::Hermes, true);
    let p = check(
        "<think>\nThe user wants weather.\n\nCall the tool.\n</think>\n\nOK.<tool_call>{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}</tool_call>",
        &s,
    );
    assert_eq!(
        p.reasoning.as_deref(),
        Some("The user wants weather.\n\nCall the tool.")
    );
    assert_eq!(p.content.as_deref(), Some("OK."));
    assert_eq!(p.calls.len(), 1);
    assert!(matches!(
        p.pieces.as_slice(),
        [Piece::Reasoning(_), Piece::Text(_), Piece::Call(_)]
    ));
    // An empty think block gives no reasoning; no block gives no reasoning.
    let p = check("<think>\n\n</think>\n\nHi", &s);
    assert_eq!((p.reasoning, p.content.as_deref()), (None, Some("Hi")));
    let p = check("Hi <think>x</think>", &s);
    assert_eq!(
        (p.reasoning, p.content.as_deref()),
        (None, Some("Hi <think>x</think>"))
    );
    // Cut short inside the block: all of it is reasoning.
    let p = check("<think>still going", &s);
    assert_eq!(
        (p.reasoning.as_deref(), p.content),
        (Some("still going"), None)
    );
    // Opened by the template in the prompt.
    let opened = OutputSyntax {
        think: Some((ThinkSyntax::detect("</think>").unwrap(), true)),
        tools: None,
        forced_call: false,
        harmony: false,
    };
    let p = check("plan </thin", &opened);
    assert_eq!(p.reasoning.as_deref(), Some("plan </thin"));
    let p = check("plan\n</think>\n\n42", &opened);
    assert_eq!(
        (p.reasoning.as_deref(), p.content.as_deref()),
        (Some("plan"), Some("42"))
    );
}

#[test]
fn syntax_detection() {
    assert_eq!(
        ToolSyntax::detect("{{ '<tool_call>' }}"),
        ToolSyntax::Hermes
    );
    assert_eq!(
        ToolSyntax::detect("<|start_header_id|>ipython<|eom_id|>"),
        ToolSyntax::Llama3
    );
    assert_eq!(ToolSyntax::detect("[TOOL_CALLS]"), ToolSyntax::Mistral);
    assert_eq!(
        ToolSyntax::detect("<start_of_turn>model"),
        ToolSyntax::Gemma
    );
    assert_eq!(ToolSyntax::detect("<|im_start|>"), ToolSyntax::Hermes);
    // GLM-4.5's template teaches `<tool_call>` too; its `<arg_key>` decides.
    assert_eq!(
        ToolSyntax::detect("<tool_call>{{ name }}<arg_key>{{ k }}</arg_key>"),
        ToolSyntax::Glm45
    );
    assert_eq!(
        ToolSyntax::detect("{{'<｜tool▁calls▁begin｜>'}}"),
        ToolSyntax::DeepSeekV3
    );
    assert_eq!(
        ToolSyntax::detect("<|tool_calls_section_begin|>"),
        ToolSyntax::KimiK2
    );
    assert_eq!(ToolSyntax::from_name("glm45"), Some(ToolSyntax::Glm45));
    assert_eq!(
        ToolSyntax::from_name("deepseek_v31"),
        Some(ToolSyntax::DeepSeekV3)
    );
    assert!(ThinkSyntax::detect("<|im_start|>").is_none());
}

#[test]
fn a_forced_call_is_one_call_whole_streamed_or_cut() {
    let mut s = syntax(ToolSyntax::Hermes, true);
    s.forced_call = true;
    let p = check(
        "<think>the user wants weather</think>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Pa}ris\"}}",
        &s,
    );
    assert_eq!(p.reasoning.as_deref(), Some("the user wants weather"));
    assert_eq!(p.content, None);
    assert_eq!(p.calls.len(), 1);
    assert_eq!(
        (p.calls[0].name.as_str(), args(&p.calls[0])),
        ("get_weather", json!({"city": "Pa}ris"}))
    );
    assert_eq!(p.pieces.len(), 2, "{:?}", p.pieces);
    let cut = check("{\"name\": \"search\", \"arguments\": {\"q\": \"ab", &s);
    assert_eq!(cut.calls[0].name, "search");
    assert_eq!(cut.calls[0].arguments, "{\"q\": \"ab");
}
