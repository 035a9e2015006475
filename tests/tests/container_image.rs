//! The container image (`deploy/container/Containerfile`) built and run here, with
//! Debian's buildah and podman and no image registry: the runtime base is Debian
//! bookworm made with debootstrap (cached under the target folder), and the binaries
//! stage is this workspace's own binaries (`--build-arg BINARIES=…`; the builder stage,
//! a release build inside a Rust image, is the one part not run: it would rebuild the
//! workspace from nothing, and no Rust image can be pulled). In the image, as it
//! starts by default (`tessera serve`, a non-root user), the API answers a chat
//! completion through the `openai` SDK, the image's health check passes, and SIGTERM
//! stops it cleanly.
//!
//! The machines here run containers only in a reduced form, which the flags below say:
//! vfs storage, chroot isolation for `RUN`, runc with the host's network, and limits on
//! open files and processes no higher than the sandbox's own hard limits.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use tessera_e2e::{binary, free_port, get, output_text as said, python, repo_root as repo, until};

/// Storage of its own for every run (removed with the folder): nothing is left behind
/// in the machine's image store, and no earlier run's image can stand in for this one's.
struct Engine {
    dir: tempfile::TempDir,
}

impl Engine {
    fn new() -> Self {
        Self { dir: tempfile::tempdir().unwrap() }
    }

    fn command(&self, tool: &str) -> Command {
        let mut c = Command::new(tool);
        c.arg("--root")
            .arg(self.dir.path().join("storage"))
            .arg("--runroot")
            .arg(self.dir.path().join("run"))
            .args(["--storage-driver", "vfs"]);
        if tool == "podman" {
            c.args(["--runtime", "runc", "--events-backend", "none", "--cgroup-manager", "cgroupfs"]);
        }
        c
    }

    fn run(&self, tool: &str, args: &[&str]) -> String {
        let out = self.command(tool).args(args).stdin(Stdio::null()).output().unwrap();
        let said = said(&out);
        assert!(out.status.success(), "{tool} {args:?} failed:\n{said}");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }
}

/// A minimal Debian bookworm root file system as a tarball, made once with debootstrap
/// from Debian's mirror (the only source of a base image here).
fn debian_base(target: &Path) -> PathBuf {
    let tarball = target.join("container-test/debian-bookworm-minbase.tar");
    if tarball.exists() {
        return tarball;
    }
    let work = target.join("container-test/rootfs");
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).unwrap();
    let out = Command::new("debootstrap")
        .args(["--variant=minbase", "bookworm"])
        .arg(&work)
        .arg("http://deb.debian.org/debian")
        .output()
        .expect("debootstrap (Debian's debootstrap package)");
    assert!(out.status.success(), "debootstrap failed:\n{}", said(&out));
    let partial = tarball.with_extension("partial");
    let status = Command::new("tar").arg("-C").arg(&work).arg("-cf").arg(&partial).arg(".").status().unwrap();
    assert!(status.success());
    std::fs::rename(&partial, &tarball).unwrap();
    std::fs::remove_dir_all(&work).unwrap();
    tarball
}

const CHAT: &str = r#"
import os, openai
c = openai.OpenAI(base_url=os.environ["BASE"], api_key=os.environ["KEY"], max_retries=0)
r = c.chat.completions.create(model="vendor-a/model-a", max_tokens=8,
    messages=[{"role": "user", "content": "Say hello."}])
print(r.choices[0].finish_reason, r.usage.completion_tokens, repr(r.choices[0].message.content))
"#;

#[test]
fn the_image_builds_and_serves_a_chat_completion_as_a_non_root_user() {
    let tessera = binary("tessera-control-plane", "tessera");
    let worker = binary("tessera-worker", "tessera-worker");
    let target = tessera.parent().unwrap().parent().unwrap().to_path_buf();
    let engine = Engine::new();

    // The base, imported as a local image.
    let base = debian_base(&target);
    engine.run("podman", &["import", base.to_str().unwrap(), "localhost/tessera-test/debian:bookworm"]);

    // The workspace's binaries as the image the binaries stage names.
    let bins = engine.dir.path().join("binaries");
    std::fs::create_dir_all(&bins).unwrap();
    for bin in [&tessera, &worker] {
        // Without debug sections the vfs driver copies a fraction of the bytes.
        let to = bins.join(bin.file_name().unwrap());
        let out = Command::new("objcopy").arg("--strip-debug").arg(bin).arg(&to).output().unwrap();
        assert!(out.status.success(), "objcopy: {}", said(&out));
    }
    std::fs::write(bins.join("Containerfile"), "FROM scratch\nCOPY tessera tessera-worker /out/bin/\n").unwrap();
    let ctx = bins.to_str().unwrap();
    engine.run("buildah", &["bud", "--isolation", "chroot", "-q", "-t", "localhost/tessera-test/binaries", ctx]);

    // The project's Containerfile, from the repository root as its README says.
    let repo = repo();
    let out = engine
        .command("buildah")
        .current_dir(&repo)
        .args(["bud", "--isolation", "chroot", "--format", "docker", "--ulimit", "nofile=4096:4096"])
        .args(["--ulimit", "nproc=4096:4096"])
        .args(["--build-arg", "BINARIES=localhost/tessera-test/binaries"])
        .args(["--build-arg", "RUNTIME_BASE=localhost/tessera-test/debian:bookworm"])
        .args(["-f", "deploy/container/Containerfile", "-t", "localhost/tessera-test/tessera", "."])
        .output()
        .unwrap();
    assert!(out.status.success(), "buildah bud deploy/container/Containerfile failed:\n{}", said(&out));

    // What the image says of itself.
    let config: serde_json::Value = serde_json::from_str(
        &engine.run("podman", &["image", "inspect", "--format", "{{json .Config}}", "localhost/tessera-test/tessera"]),
    )
    .unwrap();
    assert_eq!(config["User"], "10001:10001", "{config}");
    assert_eq!(config["Entrypoint"], serde_json::json!(["tessera"]), "{config}");
    assert_eq!(config["Cmd"], serde_json::json!(["serve"]), "{config}");
    for volume in ["/var/lib/tessera", "/var/cache/tessera"] {
        assert!(config["Volumes"].get(volume).is_some(), "no volume {volume}: {config}");
    }
    let health = engine
        .run("podman", &["image", "inspect", "--format", "{{json .HealthCheck}}", "localhost/tessera-test/tessera"]);
    assert!(health.contains("tessera-healthcheck"), "{health}");

    // Run as it starts by default, on the host's network (this sandbox has no bridge),
    // the model cache mounted read-only, the data folder a fresh one the user can write.
    let data = engine.dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    let status = Command::new("chown").args(["10001:10001"]).arg(&data).status().unwrap();
    assert!(status.success());
    let port = free_port();
    let name = format!("tessera-test-{port}");
    // The cache the test command filled (`scripts/test` fetches the models first).
    let models = tessera_worker::model_cache::cache_dir();
    assert!(models.is_dir(), "no model cache at {models:?}: scripts/test fetches the models first");
    engine.run(
        "podman",
        &[
            "run",
            "-d",
            "--name",
            &name,
            "--network",
            "host",
            "--ulimit",
            "nofile=4096:4096",
            "--ulimit",
            "nproc=4096:4096",
            "-e",
            &format!("TESSERA_LISTEN=127.0.0.1:{port}"),
            "-e",
            "RUST_LOG=warn",
            "-v",
            &format!("{}:/var/cache/tessera/models:ro", models.display()),
            "-v",
            &format!("{}:/var/lib/tessera", data.display()),
            "localhost/tessera-test/tessera",
        ],
    );
    // Whatever happens below, the container goes (podman's storage goes with the folder).
    struct Remove<'a>(&'a Engine, String);
    impl Drop for Remove<'_> {
        fn drop(&mut self) {
            let _ = self.0.command("podman").args(["rm", "-f", "-t", "0", &self.1]).output();
        }
    }
    let _remove = Remove(&engine, name.clone());

    let logs = || engine.run("podman", &["logs", &name]);
    until(300, "the container's tessera serve answers /health", || {
        let state = engine.run("podman", &["inspect", "--format", "{{.State.Status}}", &name]);
        assert_eq!(state, "running", "the container stopped:\n{}", logs());
        get(&format!("http://127.0.0.1:{port}/health"))
    });
    let uid = engine.run("podman", &["exec", &name, "id", "-u"]);
    assert_eq!(uid, "10001");
    // The bootstrap key, written by the container's user into the mounted data folder.
    let key = std::fs::read_to_string(data.join("bootstrap.key")).expect("the bootstrap key");
    let base_url = format!("http://127.0.0.1:{port}/v1");
    let out = until(300, "a chat completion from the container", || {
        let out = python(CHAT, &base_url, key.trim(), &[]).output().unwrap();
        out.status.success().then_some(out)
    });
    let answer = String::from_utf8_lossy(&out.stdout);
    let fields: Vec<&str> = answer.trim().splitn(3, ' ').collect();
    assert!(matches!(fields[0], "stop" | "length"), "{answer}");
    assert!(fields[1].parse::<u32>().unwrap() > 0, "{answer}");

    // The image's own health check, as docker would run it.
    let out = engine.command("podman").args(["healthcheck", "run", &name]).output().unwrap();
    assert!(out.status.success(), "the image's health check failed:\n{}", said(&out));

    // SIGTERM (podman stop) ends it cleanly, well within the time given.
    engine.run("podman", &["stop", "-t", "60", &name]);
    let code = engine.run("podman", &["inspect", "--format", "{{.State.ExitCode}}", &name]);
    assert_eq!(code, "0", "tessera serve's exit after SIGTERM:\n{}", logs());
}
