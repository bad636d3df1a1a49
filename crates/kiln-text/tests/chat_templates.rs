//! Chat templates against transformers: the goldens' conversations rendered with the
//! GGUF's `tokenizer.chat_template`, a Qwen tool-calling render, and the template
//! environment's features (`raise_exception`, `tojson`, `strftime_now`, kwargs).

mod common;

use common::{gguf_tokenizer, golden, ids, test_data, text, Model};
use kiln_text::{ChatContext, ChatTemplate, TextError};
use serde_json::json;

/// Renders every golden conversation with and without the generation prompt and
/// compares text and ids.
fn check_chat_cases(model: Model) {
    let tok = gguf_tokenizer(model);
    let cases = golden(model, "chat_template_cases.json");
    let source = tok.chat_template().expect("the GGUF has a chat template");
    assert_eq!(
        source,
        text(&cases["chat_template"]),
        "{model:?} template text"
    );
    let template = ChatTemplate::new(source).expect("template compiles");
    for case in cases["cases"].as_array().expect("cases") {
        for (add_generation_prompt, rendered_key, ids_key) in [
            (true, "rendered", "ids"),
            (
                false,
                "rendered_no_generation_prompt",
                "ids_no_generation_prompt",
            ),
        ] {
            let mut ctx = tok.chat_context(case["messages"].clone());
            ctx.add_generation_prompt = add_generation_prompt;
            let rendered = template.render(&ctx).expect("renders");
            assert_eq!(
                rendered,
                text(&case[rendered_key]),
                "{model:?} {rendered_key}"
            );
            let got = tok.encode(&rendered, false).expect("encode");
            assert_eq!(got, ids(&case[ids_key]), "{model:?} {ids_key}");
        }
    }
}

#[test]
fn smollm2_chat_template_matches_goldens() {
    check_chat_cases(Model::SmolLm2);
}

#[test]
fn qwen_chat_template_matches_goldens() {
    check_chat_cases(Model::Qwen);
}

#[test]
fn qwen_tools_render_matches_transformers() {
    let tok = gguf_tokenizer(Model::Qwen);
    let case = test_data("qwen_tools_case.json");
    let template = ChatTemplate::new(tok.chat_template().expect("template")).expect("compiles");
    let mut ctx = tok.chat_context(case["messages"].clone());
    ctx.tools = Some(case["tools"].clone());
    ctx.add_generation_prompt = true;
    let rendered = template.render(&ctx).expect("renders");
    let weather_tool = "{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Get the current weather in a city.\", \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\", \"description\": \"City name, e.g. Zürich\"}";
    assert!(rendered.contains(weather_tool), "{rendered}");
    assert!(rendered.contains("{\"name\": \"add\", \"arguments\": {\"a\": 1.5, \"b\": 2}}"));
    assert_eq!(rendered, text(&case["rendered"]));
    assert_eq!(
        tok.encode(&rendered, false).expect("encode"),
        ids(&case["ids"])
    );
}

#[test]
fn template_features_match_transformers() {
    let data = test_data("template_features.json");
    for case in data["cases"].as_array().expect("cases") {
        let template = ChatTemplate::new(text(&case["template"])).expect("compiles");
        let mut ctx = ChatContext::new(json!([{"role": "user", "content": "hi"}]));
        if case["name"] == "kwargs" {
            ctx.bos_token = Some("<s>".to_string());
            ctx.extra.insert("custom".to_string(), json!({"x": [1]}));
            ctx.enable_thinking = Some(false);
        }
        let rendered = template.render(&ctx).expect("renders");
        assert_eq!(rendered, text(&case["rendered"]), "{}", case["name"]);
    }
}

#[test]
fn raise_exception_is_an_error_with_its_message() {
    let src = "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}ok";
    let template = ChatTemplate::new(src).expect("compiles");
    let ctx = ChatContext::new(json!([{"role": "assistant", "content": "x"}]));
    match template.render(&ctx) {
        Err(TextError::TemplateRaised { name, message }) => {
            assert_eq!(name, "default");
            let want = "Conversation roles must alternate user/assistant/user/assistant/...";
            assert_eq!(message, want);
        }
        other => panic!("expected TemplateRaised, got {other:?}"),
    }
    let ok = ChatContext::new(json!([{"role": "user", "content": "x"}]));
    assert_eq!(template.render(&ok).expect("renders"), "ok");
}

#[test]
fn template_errors_are_errors_not_panics() {
    let err = ChatTemplate::new("{% for x in %}").expect_err("syntax error");
    assert!(matches!(err, TextError::TemplateSyntax { .. }), "{err}");
    let err = ChatTemplate::new("{{ messages | no_such_filter }}")
        .expect("unknown filters are found when rendering")
        .render(&ChatContext::new(json!([])))
        .expect_err("unknown filter");
    assert!(matches!(err, TextError::TemplateRender { .. }), "{err}");
    let template = ChatTemplate::new("{{ messages[0].content.nope.deeper }}").expect("compiles");
    let err = template
        .render(&ChatContext::new(json!([{"role": "user"}])))
        .expect_err("undefined attribute");
    assert!(matches!(err, TextError::TemplateRender { .. }), "{err}");
    let err = ChatTemplate::new("{{ x | tojson }}")
        .expect("compiles")
        .render(&ChatContext::new(json!([])))
        .expect_err("undefined is not JSON");
    assert!(matches!(err, TextError::TemplateRender { .. }), "{err}");
}

/// Today's UTC date from the system clock (days-to-civil, Howard Hinnant's algorithm).
fn utc_date() -> (i64, u32, u32) {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock after 1970")
        .as_secs() as i64;
    let z = secs.div_euclid(86_400) + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[test]
fn strftime_now_formats_the_current_date() {
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    let template =
        ChatTemplate::new("{{ strftime_now('%Y-%m-%d') }}|{{ strftime_now('%d %b %Y') }}")
            .expect("compiles");
    let before = utc_date();
    let rendered = template
        .render(&ChatContext::new(json!([])))
        .expect("renders");
    let after = utc_date();
    let expect = |(y, m, d): (i64, u32, u32)| {
        format!(
            "{y:04}-{m:02}-{d:02}|{d:02} {} {y:04}",
            MONTHS[m as usize - 1]
        )
    };
    assert!(
        rendered == expect(before) || rendered == expect(after),
        "{rendered} vs {}",
        expect(before)
    );
    let bad = ChatTemplate::new("{{ strftime_now('%') }}").expect("compiles");
    let err = bad
        .render(&ChatContext::new(json!([])))
        .expect_err("bad format");
    assert!(matches!(err, TextError::TemplateRender { .. }), "{err}");
}

#[test]
fn chat_template_kwargs_pass_through() {
    let src = "{{ bos_token }}|{{ flag }}|{{ nested.list | tojson }}|{{ enable_thinking }}|{{ tools }}|{{ add_generation_prompt }}";
    let template = ChatTemplate::new(src).expect("compiles");
    let mut ctx = ChatContext::new(json!([]));
    ctx.bos_token = Some("<bos>".to_string());
    ctx.extra.insert("flag".to_string(), json!("on"));
    ctx.extra
        .insert("nested".to_string(), json!({"list": [1, "a"]}));
    // Explicit fields win over `extra`; `extra` wins over the special tokens.
    ctx.extra
        .insert("enable_thinking".to_string(), json!("from-extra"));
    ctx.extra
        .insert("bos_token".to_string(), json!("<override>"));
    ctx.enable_thinking = Some(true);
    let rendered = template.render(&ctx).expect("renders");
    assert_eq!(rendered, "<override>|on|[1, \"a\"]|True|None|False");
}
