//! A vision model through the API: `tessera serve` with a catalog that serves the
//! worker's tiny SmolVLM fixture (a Hugging Face directory, images and video), driven by
//! the official `openai` SDK (tests/python/test_vision_api.py).

use std::path::PathBuf;
use std::process::Command;
use tessera_e2e::Serve;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../worker/tests/data/vision/models")
}

/// The directory under two ids: the model's context, and one of 170 tokens that four
/// frames do not fit.
fn vision_catalog() -> String {
    let weights = fixtures().join("smolvlm").canonicalize().unwrap();
    let entry = |id: &str, context: u32| {
        format!(
            "[[models]]\nid = \"{id}\"\nname = \"Tiny SmolVLM\"\ncontext_length = {context}\nquantization = \"BF16\"\n\
             weights = \"{}\"\nprices = {{ input = 1_000_000, cache_read = 100_000, output = 2_000_000 }}\n\
             capabilities = {{ image_input = true, video_input = true, tool_calling = false, structured_output = false }}\n\
             reasoning = {{ default = \"off\", control = \"none\" }}\n\n",
            weights.display()
        )
    };
    entry("tiny/smolvlm", 1024) + &entry("tiny/smolvlm-short", 170)
}

#[test]
fn the_sdk_sends_images_and_video_to_a_vision_model() {
    let data = tempfile::tempdir().unwrap();
    let catalog = data.path().join("catalog.toml");
    std::fs::write(&catalog, vision_catalog()).unwrap();
    let serve = Serve::start(data.path(), &["--catalog", catalog.to_str().unwrap()], &[]);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/python/test_vision_api.py");
    let status = Command::new("python3")
        .arg(script)
        .env("TESSERA_BASE_URL", format!("http://127.0.0.1:{}/v1", serve.port))
        .env("TESSERA_API_KEY", &serve.key)
        .env("TESSERA_VISION_IMAGES", fixtures().join("images"))
        .status()
        .unwrap();
    assert!(status.success(), "the SDK tests failed (their output is above)");
}
