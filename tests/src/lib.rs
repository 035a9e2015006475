//! Helpers for end-to-end tests: the workspace's real binaries, built if needed.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

/// Path of binary `bin` of workspace package `package`, rebuilt first (a no-op when
/// fresh) so a test never runs a stale one, in the profile the tests were built in.
pub fn binary(package: &str, bin: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // Test executables live in target/<profile>/deps; binaries one level up.
    let profile_dir = exe.parent().and_then(|deps| deps.parent()).expect("target directory").to_path_buf();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut build = Command::new(cargo);
    build.args(["build", "--quiet", "-p", package, "--bin", bin]);
    if profile_dir.ends_with("release") {
        build.arg("--release");
    }
    let status = build.status().expect("running cargo build");
    assert!(status.success(), "cargo build -p {package} --bin {bin} failed");
    profile_dir.join(bin)
}

/// A `tessera-worker serve` process, killed when dropped.
pub struct Worker(Child);

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `tessera-worker serve` of the real model on a free loopback port with a 64 MiB KV
/// cache, and the address it printed once listening.
pub fn serve_worker() -> (Worker, String) {
    let mut child = Command::new(binary("tessera-worker", "tessera-worker"))
        .args(["serve", "--model", "smollm2-135m-instruct", "--listen", "127.0.0.1:0", "--kv-cache-bytes", "67108864"])
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting tessera-worker");
    let stderr = BufReader::new(child.stderr.take().expect("piped stderr"));
    let worker = Worker(child);
    for line in stderr.lines() {
        let line = line.expect("reading the worker's output");
        if let Some(addr) = line.strip_prefix("tessera-worker serving ").and_then(|l| l.split(" on ").nth(1)) {
            return (worker, addr.to_string());
        }
    }
    panic!("the worker exited before listening");
}
