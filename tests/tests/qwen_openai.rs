//! A real tool-calling model through the API: `tessera serve` with the Qwen2.5-Coder
//! 0.5B entry of `deploy/catalog-qwen.toml`, driven by the official `openai` SDK
//! (tests/python/test_qwen_api.py): a call the model chooses itself under
//! `tool_choice: auto`, its round trip, and JSON-schema output; and speculative decoding
//! (the catalog turns it on) against the same server with `--speculative off`: the same
//! answers and usage (tests/python/test_spec_api.py).

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

#[test]
fn speculation_changes_no_answer_and_no_usage() {
    let (on_dir, off_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let catalog = on_dir.path().join("catalog.toml");
    std::fs::write(&catalog, small_catalog()).unwrap();
    assert!(small_catalog().contains("speculative"), "the shipped catalog speculates");
    let catalog = catalog.to_str().unwrap();
    let on = Serve::start(on_dir.path(), &["--catalog", catalog], &[]);
    let off = Serve::start(off_dir.path(), &["--catalog", catalog, "--speculative", "off"], &[]);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/python/test_spec_api.py");
    let status = Command::new("python3")
        .arg(script)
        .env("TESSERA_BASE_URL", on.base_url())
        .env("TESSERA_API_KEY", &on.key)
        .env("TESSERA_OFF_BASE_URL", off.base_url())
        .env("TESSERA_OFF_API_KEY", &off.key)
        .status()
        .unwrap();
    assert!(status.success(), "the SDK tests failed (their output is above)");
    // The speculating worker did verify proposals, and its model accepted some.
    let counter = |serve: &Serve, name: &str| -> f64 {
        let worker =
            serve.started.iter().find_map(|l| l.contains("tessera-worker serving").then(|| l.rsplit(" on ").next())?);
        let metrics = tessera_e2e::get(&format!("http://{}/metrics", worker.expect("a worker's address"))).unwrap();
        metrics.lines().filter(|l| l.starts_with(name)).filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).sum()
    };
    assert!(counter(&on, "vllm:spec_decode_num_accepted_tokens_total") > 0.0);
    assert_eq!(counter(&off, "vllm:spec_decode_num_draft_tokens_total"), 0.0);
}
