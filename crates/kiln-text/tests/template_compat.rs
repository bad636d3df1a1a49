//! Jinja2 compatibility: small feature probes and two real templates shipped with
//! transformers (Llama 4, SmolVLM), rendered here and by transformers + Jinja2
//! (`tests/data/template_compat.json`), compared byte for byte.

mod common;

use common::{test_data, text};
use kiln_text::{ChatContext, ChatTemplate};

#[test]
fn templates_render_like_jinja2() {
    let data = test_data("template_compat.json");
    let mut failures = Vec::new();
    for case in data["cases"].as_array().expect("cases") {
        let name = text(&case["template"]);
        let source = text(&data["templates"][name]);
        let template = ChatTemplate::with_name(name, source).expect("compiles");
        let mut ctx = ChatContext::new(case["messages"].clone());
        ctx.add_generation_prompt = case["add_generation_prompt"].as_bool().expect("bool");
        ctx.tools = Some(case["tools"].clone()).filter(|t| !t.is_null());
        for (key, value) in case["kwargs"].as_object().expect("kwargs") {
            ctx.extra.insert(key.clone(), value.clone());
        }
        match template.render(&ctx) {
            Ok(out) if out == text(&case["rendered"]) => {}
            Ok(out) => failures.push(format!(
                "{}:\n  got  {out:?}\n  want {:?}",
                case["name"], case["rendered"]
            )),
            Err(e) => failures.push(format!("{}: error {e}", case["name"])),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
