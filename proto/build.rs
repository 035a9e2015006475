//! Compiles worker.proto with protox (pure Rust; no system protoc needed).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/worker.proto");
    let fds = protox::compile(["proto/worker.proto"], ["proto"])?;
    tonic_prost_build::configure().compile_fds(fds)?;
    Ok(())
}
