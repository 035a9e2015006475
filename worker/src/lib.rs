//! The Tessera worker: loads a model, runs its forward pass, generates text.

pub mod loader;
