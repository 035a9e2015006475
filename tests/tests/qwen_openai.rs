//! A real tool-calling model through the API: `tessera serve` with the Qwen2.5-Coder
//! 0.5B entry of `deploy/catalog-qwen.toml`, driven by the official `openai` SDK
//! (tests/python/test_qwen_api.py): a call the model chooses itself under
//! `tool_choice: auto`, its round trip, and JSON-schema output.

use std::process::Command;
use tessera_e2e::Serve;

/// The shipped catalog's entry for the 0.5B model, alone (the 1.5B one would start a
/// second worker and fetch another 1.1 GB).
fn small_catalog() -> String {
    let shipped = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/catalog-qwen.toml")).unwrap();
    let entry = shipped
        .split("[[models]]")
        .find(|m| m.contains("weights = \"qwen2.5-coder-0.5b-instruct\""))
        .expect("the catalog serves the 0.5B model");
    format!("[[models]]{entry}")
}

#[test]
fn the_sdk_calls_tools_and_gets_json_from_qwen() {
    let data = tempfile::tempdir().unwrap();
    let catalog = data.path().join("catalog.toml");
    std::fs::write(&catalog, small_catalog()).unwrap();
    let serve = Serve::start(data.path(), &["--catalog", catalog.to_str().unwrap()], &[]);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/python/test_qwen_api.py");
    let status = Command::new("python3")
        .arg(script)
        .env("TESSERA_BASE_URL", format!("http://127.0.0.1:{}/v1", serve.port))
        .env("TESSERA_API_KEY", &serve.key)
        .status()
        .unwrap();
    assert!(status.success(), "the SDK tests failed (their output is above)");
}
