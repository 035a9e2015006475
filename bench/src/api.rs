//! The HTTP API as the load generators meet it: a throwaway `tessera serve` (its own
//! data folder, a free port, the bootstrap key it writes), and one streamed request over
//! a fresh or a kept-alive HTTP/1.1 connection, each server-sent event timed as it
//! arrives.

use anyhow::{Context, Result, bail};
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A running `tessera serve`, killed (and its data folder removed) when dropped.
pub struct Server {
    child: Child,
    binary: PathBuf,
    data: PathBuf,
    pub port: u16,
    /// The bootstrap organization's API key.
    pub key: String,
    /// The gRPC addresses of its workers, from its log.
    pub workers: Vec<String>,
    /// The first worker's device, as its log names it (`cpu (2 threads)`, `cuda (NVIDIA H100 …)`).
    pub device: Option<String>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.data);
    }
}

/// The `tessera` binary: as given, else beside this one.
pub fn tessera_binary(given: Option<PathBuf>) -> Result<PathBuf> {
    match given {
        Some(p) => Ok(p),
        None => Ok(std::env::current_exe()?.parent().context("bench directory")?.join("tessera")),
    }
}

impl Server {
    /// Starts `tessera serve ARGS` with rate limits out of the way, and waits until it
    /// listens.
    pub fn start(tessera: &Path, args: &[String]) -> Result<Self> {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let data = std::env::temp_dir().join(format!("tessera-bench-{}-{n}", std::process::id()));
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let mut child = Command::new(tessera)
            .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
            .args(["--rate-limit-rpm", "1000000", "--rate-limit-burst", "100000"])
            .args(args)
            .arg("--data-dir")
            .arg(&data)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| {
                format!(
                    "starting {} (build it with `cargo build --release -p tessera-control-plane -p tessera-worker`)",
                    tessera.display()
                )
            })?;
        let stderr = child.stderr.take().context("stderr")?;
        let mut server = Self {
            child,
            binary: tessera.to_path_buf(),
            data,
            port,
            key: String::new(),
            workers: Vec::new(),
            device: None,
        };
        let mut lines = BufReader::new(stderr).lines();
        loop {
            let Some(line) = lines.next() else { bail!("tessera serve exited before listening") };
            let line = line?;
            if line.contains("tessera-worker serving")
                && let Some(addr) = line.rsplit(" on ").next()
            {
                server.workers.push(addr.to_string());
            }
            if let Some((_, device)) = line.split_once("tessera-worker device: ")
                && server.device.is_none()
            {
                server.device = Some(device.to_string());
            }
            if line.starts_with("tessera listening on") {
                break;
            }
        }
        std::thread::spawn(move || lines.for_each(drop));
        server.key = std::fs::read_to_string(server.data.join("bootstrap.key"))?.trim().to_string();
        Ok(server)
    }

    /// Runs an operator command (`tessera orgs create NAME`, …) against this server's
    /// database, and returns what it printed with `--json`.
    pub fn operator(&self, args: &[&str]) -> Result<Value> {
        let out = Command::new(&self.binary).args(args).arg("--json").arg("--data-dir").arg(&self.data).output()?;
        if !out.status.success() {
            bail!("tessera {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
        }
        serde_json::from_slice(&out.stdout).context("an operator command's JSON")
    }
}

/// One `data:` event of a stream and when it arrived (from the request's start).
pub struct Event {
    pub at: Duration,
    pub data: Value,
}

/// What a stream's token arrival times say: time to the first, the gaps after it, and
/// the mean time per token after the first (None for a single token).
pub struct Timing {
    pub ttft: Duration,
    pub itl: Vec<Duration>,
    pub tpot: Option<Duration>,
}

/// `times` of the events that carried tokens, `completion_tokens` in all.
pub fn timing(times: &[Duration], completion_tokens: u64) -> Result<Timing> {
    let ttft = *times.first().context("no token arrived")?;
    let last = *times.last().unwrap_or(&ttft);
    Ok(Timing {
        ttft,
        itl: times.windows(2).map(|w| w[1] - w[0]).collect(),
        tpot: (completion_tokens > 1).then(|| (last - ttft) / (completion_tokens - 1) as u32),
    })
}

/// Time to first token, time per output token and inter-token gaps over `timings`, p50
/// and p99 in milliseconds, as every serving benchmark line reports them.
pub fn latency<'a>(timings: impl Iterator<Item = &'a Timing> + Clone) -> serde_json::Map<String, Value> {
    use crate::{percentile, round};
    let ms = |d: &Duration| d.as_secs_f64() * 1e3;
    let ttft: Vec<f64> = timings.clone().map(|t| ms(&t.ttft)).collect();
    let tpot: Vec<f64> = timings.clone().filter_map(|t| t.tpot.as_ref().map(ms)).collect();
    let itl: Vec<f64> = timings.flat_map(|t| t.itl.iter().map(ms)).collect();
    let mut out = serde_json::Map::new();
    for (name, values) in [("ttft", &ttft), ("tpot", &tpot), ("itl", &itl)] {
        out.insert(format!("{name}_p50_ms"), round(percentile(values, 0.5)).into());
        out.insert(format!("{name}_p99_ms"), round(percentile(values, 0.99)).into());
    }
    out
}

/// The longest silence a stream may have.
const READ_TIMEOUT: Duration = Duration::from_secs(300);

/// POSTs `body` to `path` on a fresh connection and reads its event stream to `[DONE]`.
pub async fn stream(port: u16, key: &str, path: &str, body: &Value) -> Result<Vec<Event>> {
    let start = Instant::now();
    let mut socket = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    socket.set_nodelay(true)?;
    exchange(&mut socket, start, key, path, body, false).await
}

/// One kept-alive HTTP/1.1 connection, as the SDKs' pooled clients keep them: requests
/// on it one after another, each read to the end of its response.
pub struct Conn {
    socket: tokio::net::TcpStream,
}

impl Conn {
    pub async fn open(port: u16) -> Result<Self> {
        let socket = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        socket.set_nodelay(true)?;
        Ok(Self { socket })
    }

    /// POSTs `body` to `path` and reads its event stream to `[DONE]` and the response's end.
    pub async fn stream(&mut self, key: &str, path: &str, body: &Value) -> Result<Vec<Event>> {
        exchange(&mut self.socket, Instant::now(), key, path, body, true).await
    }
}

/// Sends one request on `socket` and reads its events, timed from `start`; with
/// `keep_alive`, also the rest of the response, so that the connection can carry the next.
async fn exchange(
    socket: &mut tokio::net::TcpStream,
    start: Instant,
    key: &str,
    path: &str,
    body: &Value,
    keep_alive: bool,
) -> Result<Vec<Event>> {
    let body = body.to_string();
    let connection = if keep_alive { "keep-alive" } else { "close" };
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\nContent-Type: application/json\r\n\
         Connection: {connection}\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    socket.write_all(request.as_bytes()).await?;
    let mut reader = Body::default();
    let mut buf = [0u8; 16384];
    let mut events = Vec::new();
    let mut done = false;
    loop {
        // A server that stalls fails the run rather than hanging it.
        let n = tokio::time::timeout(READ_TIMEOUT, socket.read(&mut buf))
            .await
            .map_err(|_| anyhow::anyhow!("no byte from the API in {READ_TIMEOUT:?}"))??;
        if n == 0 {
            bail!("the connection closed before [DONE]: {}", String::from_utf8_lossy(&reader.raw));
        }
        reader.push(&buf[..n])?;
        if keep_alive && reader.head_done && !reader.chunked {
            bail!("a response without chunks cannot be read to its end on a kept-alive connection");
        }
        let at = start.elapsed();
        while let Some(event) = reader.next_event() {
            let Some(data) = event.lines().find_map(|l| l.strip_prefix("data: ")) else { continue };
            if data == "[DONE]" {
                done = true;
                break;
            }
            events.push(Event { at, data: serde_json::from_str(data).context("an event's JSON")? });
        }
        if done && (!keep_alive || reader.ended) {
            return Ok(events);
        }
    }
}

/// A response read as it arrives: the head checked, chunked framing undone, and the
/// text split into events at blank lines.
#[derive(Default)]
struct Body {
    raw: Vec<u8>,
    head_done: bool,
    chunked: bool,
    /// Undone bytes not yet split into events (a character may span two chunks).
    text: Vec<u8>,
    /// The last chunk (size 0) has arrived.
    ended: bool,
}

impl Body {
    fn push(&mut self, bytes: &[u8]) -> Result<()> {
        self.raw.extend_from_slice(bytes);
        if !self.head_done {
            let Some(end) = self.raw.windows(4).position(|w| w == b"\r\n\r\n") else { return Ok(()) };
            let head = String::from_utf8_lossy(&self.raw[..end]).to_ascii_lowercase();
            if !head.starts_with("http/1.1 200") {
                bail!("the API answered {}", String::from_utf8_lossy(&self.raw));
            }
            self.chunked = head.contains("transfer-encoding: chunked");
            self.head_done = true;
            self.raw.drain(..end + 4);
        }
        if !self.chunked {
            self.text.append(&mut self.raw);
            return Ok(());
        }
        // Whole chunks only: `<hex size>\r\n<bytes>\r\n`.
        while let Some(line_end) = self.raw.windows(2).position(|w| w == b"\r\n") {
            let size = usize::from_str_radix(String::from_utf8_lossy(&self.raw[..line_end]).trim(), 16)
                .context("a chunk size")?;
            if self.raw.len() < line_end + 2 + size + 2 {
                break;
            }
            self.ended |= size == 0;
            self.text.extend_from_slice(&self.raw[line_end + 2..line_end + 2 + size]);
            self.raw.drain(..line_end + 2 + size + 2);
        }
        Ok(())
    }

    /// The next complete event's text, if one has arrived.
    fn next_event(&mut self) -> Option<String> {
        let end = self.text.windows(2).position(|w| w == b"\n\n")?;
        let event = String::from_utf8_lossy(&self.text[..end]).into_owned();
        self.text.drain(..end + 2);
        Some(event)
    }
}

#[cfg(test)]
mod tests {
    use super::Body;

    #[test]
    fn a_chunked_stream_is_read_to_its_last_chunk_across_reads() {
        let response = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n\
            f\r\ndata: {\"a\":1}\n\n\r\ne\r\ndata: [DONE]\n\n\r\n0\r\n\r\n";
        let mut body = Body::default();
        let mut events = Vec::new();
        // Split at every 7 bytes: heads, sizes and events across reads.
        for piece in response.chunks(7) {
            assert!(!body.ended, "ended before its last chunk");
            body.push(piece).unwrap();
            events.extend(std::iter::from_fn(|| body.next_event()));
        }
        assert_eq!(events, ["data: {\"a\":1}", "data: [DONE]"]);
        assert!(body.ended, "the last chunk was read");
    }

    #[test]
    fn an_answer_other_than_200_fails_the_run() {
        let mut body = Body::default();
        assert!(body.push(b"HTTP/1.1 429 Too Many Requests\r\ncontent-length: 0\r\n\r\n").is_err());
    }
}
