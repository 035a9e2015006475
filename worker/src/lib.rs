//! The Tessera worker: loads a model, runs its forward pass, generates text.

pub mod chat_template;
pub mod engine;
pub mod generate;
pub mod load;
pub mod loader;
pub mod model;
pub mod model_cache;
pub mod tokenizer;
