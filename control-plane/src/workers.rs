//! Local `tessera-worker` child processes for `tessera serve`: started with a free
//! loopback port, ready when they print their address, killed when dropped.

use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use tessera_proto::speculative::SpecConfig;
use tessera_worker::telemetry::TraceConfig;
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

/// One line of a worker's log onto ours: a JSON line as it is (prefixed, it would no
/// longer be JSON), any other with the worker's weights before it.
fn relay(json_logs: bool, weights: &str, line: &str) {
    if json_logs && line.starts_with('{') {
        eprintln!("{line}");
    } else {
        eprintln!("[worker {weights}] {line}");
    }
}

/// How to start a worker: a program and the arguments before the worker's own.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WorkerCommand {
    pub program: PathBuf,
    pub prefix: Vec<&'static str>,
    /// Workers log JSON lines, relayed as they are (each names its request), rather
    /// than text lines prefixed with the worker's weights.
    pub json_logs: bool,
    /// Where the workers' traces go (the control plane's collector).
    pub traces: TraceConfig,
    /// Each worker's `--contended-batch` (fair sharing); None: the worker's default.
    pub contended_batch: Option<usize>,
    /// Each worker's second KV tier: host bytes, and a folder (one per replica under
    /// it) with its bytes.
    pub kv_offload_bytes: Option<u64>,
    pub kv_disk: Option<(PathBuf, u64)>,
}

/// The worker: as configured, else the `tessera-worker` beside this executable, else
/// the worker built into this binary (`tessera worker`), so that `cargo run --bin
/// tessera` alone, which builds no other binary, serves.
pub fn worker_command(configured: Option<&Path>) -> Result<WorkerCommand> {
    let own = |program: PathBuf| WorkerCommand { program, ..WorkerCommand::default() };
    if let Some(p) = configured {
        return Ok(own(p.to_path_buf()));
    }
    let exe = std::env::current_exe().context("finding this executable")?;
    let sibling = exe.parent().map(|d| d.join("tessera-worker"));
    Ok(match sibling {
        Some(p) if p.is_file() => own(p),
        _ => WorkerCommand { program: exe, prefix: vec!["worker"], ..WorkerCommand::default() },
    })
}

/// One local worker's own settings.
#[derive(Debug, Clone, Default)]
pub struct Settings {
    pub kv_cache_bytes: Option<u64>,
    /// It records metrics.
    pub metrics: bool,
    pub speculative: Option<SpecConfig>,
    /// Its part in disaggregated serving.
    pub role: tessera_proto::cluster::Role,
}

/// Starts a worker serving `weights` (named `replica` in its metrics) and waits until it listens (it fetches and loads
/// the model first, which may take minutes on a first start).
pub async fn start(worker: &WorkerCommand, weights: &str, replica: &str, settings: Settings) -> Result<LocalWorker> {
    let Settings { kv_cache_bytes, metrics, speculative, role } = settings;
    let mut cmd = Command::new(&worker.program);
    cmd.env("TESSERA_LOG_FORMAT", if worker.json_logs { "json" } else { "text" });
    if let Some(endpoint) = &worker.traces.endpoint {
        cmd.env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", endpoint);
        cmd.env("TESSERA_OTLP_TRACES_SAMPLE_RATIO", worker.traces.sample_ratio.to_string());
    }
    cmd.args(&worker.prefix).args(["serve", "--model", weights, "--listen", "127.0.0.1:0", "--replica-id", replica]);
    if !metrics {
        cmd.arg("--no-metrics");
    }
    if let Some(bytes) = kv_cache_bytes {
        cmd.args(["--kv-cache-bytes", &bytes.to_string()]);
    }
    if let Some(rows) = worker.contended_batch {
        cmd.args(["--contended-batch", &rows.to_string()]);
    }
    if let Some(bytes) = worker.kv_offload_bytes {
        cmd.args(["--kv-offload-bytes", &bytes.to_string()]);
    }
    if let Some((root, bytes)) = &worker.kv_disk {
        cmd.arg("--kv-disk-path").arg(root.join(replica)).args(["--kv-disk-bytes", &bytes.to_string()]);
    }
    if !role.is_none() {
        cmd.args(["--disaggregation-mode", role.as_str()]);
    }
    if let Some(spec) = speculative {
        cmd.args(["--speculative", spec.method.as_str(), "--speculative-tokens", &spec.max_tokens.to_string()]);
        if let Some(draft) = &spec.draft {
            cmd.args(["--speculative-draft", draft]);
        }
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
        .with_context(|| format!("starting {}", worker.program.display()))?;
    let mut lines = BufReader::new(child.stderr.take().context("worker stderr")?);
    let addr = loop {
        let Some(line) = next_line(&mut lines).await else {
            let status = child.wait().await?;
            bail!("the worker for {weights} exited before listening ({status})");
        };
        relay(worker.json_logs, weights, &line);
        if let Some(addr) = line.strip_prefix("tessera-worker serving ").and_then(|l| l.rsplit(" on ").next()) {
            break addr.trim().to_string();
        }
    };
    // Keep relaying the worker's log so its pipe never fills.
    let (name, json) = (weights.to_string(), worker.json_logs);
    tokio::spawn(async move {
        while let Some(line) = next_line(&mut lines).await {
            relay(json, &name, &line);
        }
    });
    Ok(LocalWorker { weights: weights.to_string(), addr, _child: child })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_configured_worker_wins_else_the_built_in_one_runs_when_none_lies_beside() {
        let configured = worker_command(Some(Path::new("/opt/w/tessera-worker"))).unwrap();
        assert_eq!(configured, WorkerCommand { program: "/opt/w/tessera-worker".into(), ..WorkerCommand::default() });
        // A test binary has no tessera-worker beside it (target/*/deps).
        let exe = std::env::current_exe().unwrap();
        assert!(!exe.parent().unwrap().join("tessera-worker").exists());
        assert_eq!(
            worker_command(None).unwrap(),
            WorkerCommand { program: exe, prefix: vec!["worker"], ..WorkerCommand::default() }
        );
    }
}
