//! The Tessera worker: loads a model, runs its forward pass, and serves many requests
//! at once through its engine, over gRPC.

pub mod agent;
pub mod cli;
pub mod device;
pub mod engine;
pub mod generate;
pub mod grpc;
pub mod load;
pub mod loader;
pub mod metrics;
pub mod model;
pub mod model_cache;
pub mod pypi;
pub mod serve;
pub mod telemetry;
pub mod tokenizer;
pub mod vision;
