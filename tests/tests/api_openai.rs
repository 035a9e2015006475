//! `tessera serve` as a user runs it — the real binaries, the real model, a fresh data
//! folder — driven by the official `openai` Python SDK (tests/python/test_openai_api.py),
//! then stopped with SIGTERM.

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use tessera_e2e::binary;
use tessera_proto::worker::worker_client::WorkerClient;
use tessera_proto::worker::{self as pb};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

struct Serve(Option<Child>);

impl Drop for Serve {
    fn drop(&mut self) {
        if let Some(child) = &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A streamed greedy completion of up to `max_tokens`, read until its first event.
async fn open_stream(port: u16, key: &str, max_tokens: u32) -> tokio::net::TcpStream {
    let body = format!(
        r#"{{"model":"vendor-a/model-a","prompt":"Once upon a time","max_tokens":{max_tokens},"stream":true,"temperature":0}}"#
    );
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut socket = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    socket.write_all(request.as_bytes()).await.unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("data: {") {
        let head = String::from_utf8_lossy(&seen);
        assert!(!head.starts_with("HTTP/1.1 4") && !head.starts_with("HTTP/1.1 5"), "refused: {head}");
        let n = socket.read(&mut buf).await.unwrap();
        assert!(n > 0, "the stream ended early: {}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..n]);
    }
    socket
}

/// The rest of a stream, up to `[DONE]` or the connection's end.
async fn read_to_end(socket: &mut tokio::net::TcpStream) -> String {
    let mut rest = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = socket.read(&mut buf).await.unwrap();
        rest.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&rest);
        if n == 0 || text.contains("data: [DONE]") {
            return text.into_owned();
        }
    }
}

/// A client that disconnects mid-stream: the worker's sequence stops at once, seen
/// through the worker's own load reports.
async fn a_dropped_stream_aborts_the_sequence(port: u16, key: &str, worker_addr: &str) {
    let mut worker = WorkerClient::connect(format!("http://{worker_addr}")).await.unwrap();
    let mut load = worker.watch_load(pb::WatchLoadRequest { interval_ms: 100 }).await.unwrap().into_inner();
    // Long enough to outlast the test, within the 2,912 tokens a 128 MiB cache holds.
    let socket = open_stream(port, key, 2800).await;
    let within = Duration::from_secs(30);
    let wait_for = async |load: &mut tonic::Streaming<pb::LoadReport>, want_running: bool| {
        tokio::time::timeout(within, async {
            loop {
                let r = load.message().await.unwrap().expect("load reports");
                if !r.snapshot && (r.running + r.waiting > 0) == want_running {
                    return r;
                }
            }
        })
        .await
    };
    wait_for(&mut load, true).await.expect("the streamed request runs on the worker");
    drop(socket);
    let idle = wait_for(&mut load, false).await.expect("the worker still runs the sequence of a client that left");
    assert_eq!((idle.running, idle.waiting), (0, 0));
}

fn python_has_openai() -> bool {
    Command::new("python3").args(["-c", "import openai"]).status().is_ok_and(|s| s.success())
}

#[test]
fn the_openai_sdk_works_against_tessera_serve() {
    assert!(python_has_openai(), "this test drives the API with the official SDK: pip install openai (`.ci/run` does)");
    // The worker is started from beside `tessera`, so build both.
    binary("tessera-worker", "tessera-worker");
    let tessera = binary("tessera-control-plane", "tessera");
    let data = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut child = Command::new(&tessera)
        .args(["serve", "--listen", &format!("127.0.0.1:{port}"), "--kv-cache-bytes", "134217728"])
        .arg("--data-dir")
        .arg(data.path())
        .args(["--shutdown-grace-secs", "5"])
        // The suite's own bursts stay clear of the default limit; the rate-limit test
        // gives its organization a limit of its own.
        .args(["--rate-limit-rpm", "100000"])
        // Supply states every two seconds rather than ten minutes, for the suite to see.
        .args(["--supply-refresh-secs", "2"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = BufReader::new(child.stderr.take().unwrap());
    let stdout = child.stdout.take().unwrap();
    let mut serve = Serve(Some(child));
    let mut listening = false;
    let mut log = Vec::new();
    let mut worker_addr = None;
    let mut lines = stderr.lines();
    for line in lines.by_ref() {
        let line = line.unwrap();
        log.push(line.clone());
        if line.contains("tessera-worker serving") {
            worker_addr = line.rsplit(" on ").next().map(str::to_string);
        }
        if line.starts_with("tessera listening on") {
            listening = true;
            break;
        }
    }
    assert!(listening, "tessera serve exited before listening:\n{}", log.join("\n"));
    // Keep draining the log so the server never blocks on a full pipe.
    std::thread::spawn(move || lines.for_each(drop));

    // First start: a bootstrap key, printed once and saved with mode 0600.
    let key_file = data.path().join("bootstrap.key");
    let key = std::fs::read_to_string(&key_file).unwrap().trim().to_string();
    assert!(key.starts_with("tsk_"), "{key}");
    assert_eq!(std::fs::metadata(&key_file).unwrap().permissions().mode() & 0o777, 0o600);
    let printed: Vec<String> = BufReader::new(stdout).lines().take(2).map(Result::unwrap).collect();
    assert_eq!(printed[1], key, "the key is printed once on first start");

    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/python/test_openai_api.py");
    let status = Command::new("python3")
        .arg(script)
        .env("TESSERA_BASE_URL", format!("http://127.0.0.1:{port}/v1"))
        .env("TESSERA_API_KEY", &key)
        .env("TESSERA_BIN", &tessera)
        .env("TESSERA_DATA_DIR", data.path())
        .status()
        .unwrap();
    assert!(status.success(), "the SDK tests failed (their output is above)");

    let worker_addr = worker_addr.expect("the worker's address in the log");
    tokio::runtime::Runtime::new().unwrap().block_on(a_dropped_stream_aborts_the_sequence(port, &key, &worker_addr));

    // SIGTERM with a stream in flight: the stream still runs to its end, then the
    // server exits cleanly.
    let mut child = serve.0.take().unwrap();
    let pid = child.id().to_string();
    let rest = tokio::runtime::Runtime::new().unwrap().block_on(async {
        let mut socket = open_stream(port, &key, 48).await;
        assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
        read_to_end(&mut socket).await
    });
    assert!(rest.contains("\"finish_reason\":\"length\"") && rest.contains("data: [DONE]"), "{rest}");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(child.wait()));
    let status = rx.recv_timeout(Duration::from_secs(20)).expect("tessera serve did not stop on SIGTERM").unwrap();
    assert!(status.success(), "tessera serve exited with {status}");
}
