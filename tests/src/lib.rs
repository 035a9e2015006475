//! Helpers for end-to-end tests: the workspace's real binaries, built if needed.

use std::path::PathBuf;
use std::process::Command;

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
