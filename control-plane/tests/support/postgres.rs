//! A PostgreSQL server for tests: TESSERA_TEST_POSTGRES_URL when set (a fresh, empty
//! database), else a throwaway cluster started from the local installation's `initdb`
//! and `pg_ctl` in a temporary folder, stopped when dropped. As root, the cluster runs
//! as the `postgres` user, since PostgreSQL refuses to run as root.

use std::path::PathBuf;
use std::process::Command;

pub struct Server {
    pub url: String,
    cluster: Option<(PathBuf, tempfile::TempDir)>,
}

impl Server {
    pub fn start() -> Self {
        if let Ok(url) = std::env::var("TESSERA_TEST_POSTGRES_URL") {
            return Self { url, cluster: None };
        }
        let bin = pg_bin().expect(
            "PostgreSQL is needed for this test: install it (Debian: apt-get install postgresql) or set \
             TESSERA_TEST_POSTGRES_URL to an empty database",
        );
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let root = is_root();
        if root {
            chown_postgres(dir.path());
        }
        run(&bin.join("initdb"), &["-D", data.to_str().unwrap(), "-U", "tessera", "--auth=trust", "-E", "UTF8"], root);
        let port = free_port();
        let opts = format!("-p {port} -k {} -c listen_addresses=127.0.0.1 -c fsync=off", dir.path().display());
        let log = dir.path().join("log");
        run(
            &bin.join("pg_ctl"),
            &["-D", data.to_str().unwrap(), "-o", &opts, "-l", log.to_str().unwrap(), "-w", "start"],
            root,
        );
        Self { url: format!("postgres://tessera@127.0.0.1:{port}/postgres"), cluster: Some((bin, dir)) }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some((bin, dir)) = &self.cluster {
            let data = dir.path().join("data");
            let mut cmd = command(&bin.join("pg_ctl"), is_root());
            let _ = cmd.args(["-D", data.to_str().unwrap(), "-m", "immediate", "stop"]).output();
        }
    }
}

fn pg_bin() -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH").and_then(|p| std::env::split_paths(&p).find(|d| d.join("initdb").exists()));
    on_path.or_else(|| {
        let mut versions: Vec<PathBuf> =
            std::fs::read_dir("/usr/lib/postgresql").ok()?.flatten().map(|e| e.path().join("bin")).collect();
        versions.sort();
        versions.into_iter().rev().find(|d| d.join("initdb").exists())
    })
}

fn is_root() -> bool {
    Command::new("id").arg("-u").output().is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

fn chown_postgres(dir: &std::path::Path) {
    let ok = Command::new("chown").args(["-R", "postgres", dir.to_str().unwrap()]).status().is_ok_and(|s| s.success());
    assert!(ok, "running as root needs a `postgres` user to run PostgreSQL as");
}

fn command(bin: &std::path::Path, as_postgres: bool) -> Command {
    if as_postgres {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(bin);
        c
    } else {
        Command::new(bin)
    }
}

fn run(bin: &std::path::Path, args: &[&str], as_postgres: bool) {
    let out = command(bin, as_postgres).args(args).output().unwrap();
    assert!(out.status.success(), "{} failed: {}", bin.display(), String::from_utf8_lossy(&out.stderr));
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}
