//! Local `tessera-worker` child processes for `tessera serve`: started with a free
//! loopback port, ready when they print their address, killed when dropped.

use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

pub struct LocalWorker {
    pub weights: String,
    pub addr: String,
    _child: Child,
}

/// The next line of a worker's log, any bytes shown lossily; None at its end.
async fn next_line(reader: &mut BufReader<tokio::process::ChildStderr>) -> Option<String> {
    let mut buf = Vec::new();
    match reader.read_until(b'\n', &mut buf).await {
        Ok(0) | Err(_) => None,
        Ok(_) => Some(String::from_utf8_lossy(&buf).trim_end().to_string()),
    }
}

/// The worker binary: as configured, else beside this executable, else on PATH.
pub fn worker_binary(configured: Option<&Path>) -> PathBuf {
    if let Some(p) = configured {
        return p.to_path_buf();
    }
    let sibling = std::env::current_exe().ok().and_then(|exe| exe.parent().map(|d| d.join("tessera-worker")));
    match sibling {
        Some(p) if p.exists() => p,
        _ => PathBuf::from("tessera-worker"),
    }
}

/// Starts a worker serving `weights` (named `replica` in its metrics) and waits until it listens (it fetches and loads
/// the model first, which may take minutes on a first start).
pub async fn start(
    binary: &Path,
    weights: &str,
    replica: &str,
    kv_cache_bytes: Option<u64>,
    metrics: bool,
) -> Result<LocalWorker> {
    let mut cmd = Command::new(binary);
    cmd.args(["serve", "--model", weights, "--listen", "127.0.0.1:0", "--replica-id", replica]);
    if !metrics {
        cmd.arg("--no-metrics");
    }
    if let Some(bytes) = kv_cache_bytes {
        cmd.args(["--kv-cache-bytes", &bytes.to_string()]);
    }
    // A worker ends with this process however it ends (even SIGKILL): an orphan would
    // hold its port, memory and GPU until someone found it. (The signal follows the
    // thread that spawned the worker: `tessera serve` starts them from its main task,
    // never from a blocking-pool thread that could exit first.)
    // SAFETY: prctl is async-signal-safe, and nothing else runs between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::inherit())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {}", binary.display()))?;
    let mut lines = BufReader::new(child.stderr.take().context("worker stderr")?);
    let addr = loop {
        let Some(line) = next_line(&mut lines).await else {
            let status = child.wait().await?;
            bail!("the worker for {weights} exited before listening ({status})");
        };
        eprintln!("[worker {weights}] {line}");
        if let Some(addr) = line.strip_prefix("tessera-worker serving ").and_then(|l| l.rsplit(" on ").next()) {
            break addr.trim().to_string();
        }
    };
    // Keep relaying the worker's log so its pipe never fills.
    let name = weights.to_string();
    tokio::spawn(async move {
        while let Some(line) = next_line(&mut lines).await {
            eprintln!("[worker {name}] {line}");
        }
    });
    Ok(LocalWorker { weights: weights.to_string(), addr, _child: child })
}
