//! Helpers for end-to-end tests: the workspace's real binaries, built if needed.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Path of binary `bin` of workspace package `package`, rebuilt first (a no-op when
/// fresh) so a test never runs a stale one, in the profile the tests were built in.
///
/// It builds what `cargo test --workspace` builds (every package, dev-dependencies
/// included), which already made the binaries: a build of one package alone would
/// resolve its dependencies' features differently and compile most of the tree again.
pub fn binary(package: &str, bin: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // Test executables live in target/<profile>/deps; binaries one level up.
    let profile_dir = exe.parent().and_then(|deps| deps.parent()).expect("target directory").to_path_buf();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut build = Command::new(cargo);
    build.args(["build", "--quiet", "--workspace", "--tests"]);
    if profile_dir.ends_with("release") {
        build.arg("--release");
    }
    let status = build.status().expect("running cargo build");
    assert!(status.success(), "cargo build of the workspace (for {package}'s {bin}) failed");
    profile_dir.join(bin)
}

/// `tessera-worker serve` of the real model on a free loopback port with a 64 MiB KV
/// cache, and the address it printed once listening.
pub fn serve_worker() -> (Process, String) {
    let mut child = Command::new(binary("tessera-worker", "tessera-worker"))
        .args(["serve", "--model", "smollm2-135m-instruct", "--listen", "127.0.0.1:0", "--kv-cache-bytes", "67108864"])
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting tessera-worker");
    let stderr = BufReader::new(child.stderr.take().expect("piped stderr"));
    let worker = Process(child);
    let mut lines = stderr.lines();
    while let Some(line) = lines.next() {
        let line = line.expect("reading the worker's output");
        if let Some(addr) = line.strip_prefix("tessera-worker serving ").and_then(|l| l.split(" on ").nth(1)) {
            // The worker logs each request: its log is read to the end, so that the pipe
            // never fills.
            std::thread::spawn(move || lines.for_each(drop));
            return (worker, addr.to_string());
        }
    }
    panic!("the worker exited before listening");
}

/// A child process, killed (SIGKILL) when dropped.
pub struct Process(pub Child);

impl Process {
    /// Sends SIGTERM and waits up to `secs` for the process to end; its exit status.
    pub fn terminate(&mut self, secs: u64) -> std::process::ExitStatus {
        let pid = self.0.id().to_string();
        assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success(), "kill -TERM {pid}");
        until(secs, "the process to end after SIGTERM", || self.0.try_wait().unwrap())
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The repository's root folder (the workspace, with `deploy/`).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ sits in the workspace").to_path_buf()
}

/// A finished command's standard output and error together, for assertion messages.
pub fn output_text(out: &std::process::Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// GET `url` (through Python's standard library), as text; None unless it answers 200.
pub fn get(url: &str) -> Option<String> {
    let script = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())";
    let out = Command::new("python3").args(["-c", script, url]).stderr(Stdio::null()).output().unwrap();
    out.status.success().then(|| String::from_utf8(out.stdout).unwrap())
}

/// Waits (up to `secs`) for `f`: for what converges on its own schedule (leases,
/// watches, scrapes, background refreshes).
pub fn until<T>(secs: u64, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "never: {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Python run with the SDK client's settings in its environment (`BASE`, `KEY`, and
/// `env`), its output piped.
pub fn python(script: &str, base: &str, key: &str, env: &[(&str, String)]) -> Command {
    let mut command = Command::new("python3");
    command.args(["-c", script]).env("BASE", base).env("KEY", key).stdout(Stdio::piped()).stderr(Stdio::piped());
    for (k, v) in env {
        command.env(k, v);
    }
    command
}

/// `tessera serve` on a free loopback port over a data directory, once listening.
pub struct Serve {
    pub port: u16,
    /// The bootstrap organization's key.
    pub key: String,
    /// What it wrote to stderr before it listened.
    pub started: Vec<String>,
    /// Every line it writes to stderr after.
    pub lines: mpsc::Receiver<String>,
    pub process: Process,
}

impl Serve {
    /// `tessera serve --listen … --data-dir DATA_DIR ARGS` with a 64 MiB KV cache per
    /// worker unless ARGS size it; `env_remove` names variables it must not inherit.
    pub fn start(data_dir: &Path, args: &[&str], env_remove: &[&str]) -> Self {
        binary("tessera-worker", "tessera-worker");
        let port = free_port();
        let mut command = Command::new(binary("tessera-control-plane", "tessera"));
        command.args(["serve", "--listen", &format!("127.0.0.1:{port}")]);
        if !args.contains(&"--kv-cache-bytes") {
            command.args(["--kv-cache-bytes", "67108864"]);
        }
        command.arg("--data-dir").arg(data_dir).args(args).stdout(Stdio::null()).stderr(Stdio::piped());
        for name in env_remove {
            command.env_remove(name);
        }
        let mut child = command.spawn().expect("starting tessera serve");
        let stderr = BufReader::new(child.stderr.take().expect("piped stderr"));
        let process = Process(child);
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in stderr.lines() {
                let Ok(line) = line else { return };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let mut started = Vec::new();
        loop {
            let line = lines.recv_timeout(Duration::from_secs(300)).expect("tessera serve exited or went quiet");
            if line.contains("tessera listening on") {
                break;
            }
            started.push(line);
        }
        let key = std::fs::read_to_string(data_dir.join("bootstrap.key")).expect("the bootstrap key");
        Self { port, key: key.trim().to_string(), started, lines, process }
    }

    pub fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}/v1", self.port)
    }

    /// GET `path` (from the root, not /v1), as text; None unless it answers 200.
    pub fn get(&self, path: &str) -> Option<String> {
        get(&format!("http://127.0.0.1:{}{path}", self.port))
    }
}
