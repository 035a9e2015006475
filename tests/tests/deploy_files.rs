//! The deployment files (`deploy/`) against their real validators, through `deploy/check`:
//! hadolint and BuildKit's parser on the Containerfile, the compose specification and
//! `docker-compose config` on the compose files, `kubectl kustomize` and the Kubernetes
//! API schemas on the manifests, `systemd-analyze verify` on the units, promtool and
//! HAProxy on their configurations, and the flags and variables they pass against the
//! built binaries. Then the same checker on copies of the files each broken in one way,
//! which it must refuse naming what broke (a checker that passes anything fails here).

use std::path::Path;
use std::process::{Command, Output};
use tessera_e2e::{binary, output_text as text, repo_root as repo};

/// Runs `deploy/check` of the tree at `root` against freshly built binaries.
fn check(root: &Path) -> Output {
    let tessera = binary("tessera-control-plane", "tessera");
    binary("tessera-worker", "tessera-worker");
    Command::new(root.join("deploy/check"))
        .env("TESSERA_BIN_DIR", tessera.parent().unwrap())
        .output()
        .expect("running deploy/check")
}

#[test]
fn every_deployment_file_passes_its_validators() {
    let out = check(&repo());
    let said = text(&out);
    assert!(out.status.success(), "deploy/check failed:\n{said}");
    // Each kind of file was checked by its own validator, not skipped.
    for line in [
        "ok    container: hadolint deploy/container/Containerfile",
        "ok    compose: docker-compose config resolves compose.yaml + compose.gpu.yaml",
        "ok    kubernetes: kubectl kustomize deploy/kubernetes/overlays/gpu",
        "ok    kubernetes: kubernetes-validate --strict (Kubernetes 1.32.0) cpu-demo",
        "ok    systemd: systemd-analyze verify deploy/systemd/tessera-control-plane.service",
        "ok    systemd: systemd-analyze verify deploy/systemd/tessera-worker-agent.service",
    ] {
        assert!(said.lines().any(|l| l.starts_with(line)), "no {line:?} in:\n{said}");
    }
    let last = said.lines().last().unwrap_or_default();
    let checks: u32 = last
        .strip_prefix("deploy/check: all ")
        .and_then(|l| l.strip_suffix(" checks passed"))
        .unwrap_or_else(|| panic!("no closing line: {last:?}"))
        .parse()
        .unwrap();
    assert!(checks >= 25, "{checks} checks");
}

/// A copy of the repository whose `deploy/` can be edited: `deploy/` copied, the rest
/// (the workspace's manifests and sources the checker reads) linked.
fn scratch_tree() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let status = Command::new("cp").arg("-a").arg(repo().join("deploy")).arg(dir.path()).status().unwrap();
    assert!(status.success());
    for entry in std::fs::read_dir(repo()).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name();
        if name == "deploy" || name == "target" || name == ".git" {
            continue;
        }
        std::os::unix::fs::symlink(entry.path(), dir.path().join(&name)).unwrap();
    }
    dir
}

fn edit(root: &Path, file: &str, from: &str, to: &str) {
    let path = root.join(file);
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains(from), "{file} has no {from:?}");
    std::fs::write(&path, text.replacen(from, to, 1)).unwrap();
}

#[test]
fn broken_deployment_files_are_refused_naming_what_broke() {
    // (file, text, replacement, what the failure line must name)
    let breaks = [
        // The runtime stage running as root (hadolint's DL3002 says so first).
        ("deploy/container/Containerfile", "USER ${TESSERA_UID}:${TESSERA_GID}", "USER 0:0", "container: hadolint"),
        // A misspelt field: Kubernetes' schema has no such key.
        (
            "deploy/kubernetes/base/control-plane.yaml",
            "readinessProbe:",
            "readinesProbe:",
            "kubernetes: kubernetes-validate --strict",
        ),
        // systemd killing the agent before its drain can finish.
        (
            "deploy/systemd/tessera-worker-agent.service",
            "TimeoutStopSec=11min",
            "TimeoutStopSec=30s",
            "systemd: stop and sandbox policy",
        ),
        // A flag the agent does not have.
        ("deploy/compose/compose.yaml", "--label runtime=compose", "--labels runtime=compose", "flags"),
    ];
    for (file, from, to, named) in breaks {
        let tree = scratch_tree();
        edit(tree.path(), file, from, to);
        let out = check(tree.path());
        let said = text(&out);
        assert_eq!(out.status.code(), Some(1), "{file} with {to:?} passed:\n{said}");
        let fail = said.lines().find(|l| l.starts_with("FAIL")).unwrap_or_else(|| panic!("no FAIL line:\n{said}"));
        assert!(fail.contains(named), "{file} with {to:?}: {fail:?}, not {named:?}:\n{said}");
    }
}
