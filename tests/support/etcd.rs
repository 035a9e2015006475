//! A throwaway etcd server for tests: Debian's `etcd` (package etcd-server) in a
//! temporary folder on free loopback ports, killed when dropped. `stop` and `start`
//! take it away and bring it back on the same ports and data, for outage tests.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Etcd {
    pub endpoint: String,
    dir: tempfile::TempDir,
    client_port: u16,
    peer_port: u16,
    child: Option<Child>,
}

impl Etcd {
    pub fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let (client_port, peer_port) = (free_port(), free_port());
        let mut etcd =
            Self { endpoint: format!("http://127.0.0.1:{client_port}"), dir, client_port, peer_port, child: None };
        etcd.resume();
        etcd
    }

    /// Starts the server again (after `stop`), on the same ports and data.
    pub fn resume(&mut self) {
        let bin = which("etcd").expect(
            "etcd is needed for this test: install it (Debian: apt-get install etcd-server) or put `etcd` on PATH",
        );
        let client = format!("http://127.0.0.1:{}", self.client_port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let child = Command::new(bin)
            .args(["--name", "test", "--data-dir"])
            .arg(self.dir.path().join("data"))
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("test={peer}")])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(self.dir.path().join("etcd.log")).unwrap())
            .spawn()
            .expect("starting etcd");
        self.child = Some(child);
        // Ready when it answers its health check: its port accepts connections a moment
        // before it serves them, and a request in that moment is reset.
        let deadline = Instant::now() + Duration::from_secs(30);
        while !healthy(self.client_port) {
            assert!(
                Instant::now() < deadline,
                "etcd did not start: see {}",
                self.dir.path().join("etcd.log").display()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Kills the server (its data stays, for `resume`).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Whether the etcd on `port` reports itself healthy (`GET /health`: `"health":"true"`).
fn healthy(port: u16) -> bool {
    use std::io::{Read, Write};
    let Ok(mut stream) = std::net::TcpStream::connect(("127.0.0.1", port)) else { return false };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    if stream.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").is_err() {
        return false;
    }
    let mut reply = String::new();
    let _ = stream.read_to_string(&mut reply);
    reply.contains("\"health\":\"true\"")
}

fn which(name: &str) -> Option<std::path::PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join(name)).find(|p| p.exists())
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}
