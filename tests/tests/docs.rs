//! The repository stands alone: every relative link in a Markdown file, every file it
//! names in backticks, and every repository path a Rust module's `//!` comment names
//! lead to something that is in the repository (a link into a Markdown page to one of
//! its headings too), and nothing points at notes a reader does not have.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The repository's root (this crate lives in `tests/`).
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// The files git tracks, with those not yet added, minus ignored ones.
fn files() -> Vec<PathBuf> {
    let out = Command::new("git")
        .args(["ls-files", "--cached", "--others", "--exclude-standard", "-z"])
        .current_dir(root())
        .output()
        .expect("git lists the repository's files");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    out.stdout
        .split(|b| *b == 0)
        .filter(|p| !p.is_empty())
        .map(|p| PathBuf::from(String::from_utf8_lossy(p).into_owned()))
        .filter(|p| root().join(p).exists())
        .collect()
}

/// Names of notes kept outside the repository, which a reader cannot follow.
const OUTSIDE: [&str; 5] = ["SPEC.md", "API-WIRE.md", "DESIGN.md", "DESIGN notes", "STYLE.md"];

/// `[text](target)` links of a Markdown text, without code spans and blocks.
fn links(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    for line in prose(text) {
        let mut rest = line.as_str();
        while let Some(at) = rest.find("](") {
            let tail = &rest[at + 2..];
            let Some(end) = tail.find(')') else { break };
            found.push(tail[..end].trim().to_string());
            rest = &tail[end..];
        }
    }
    found
}

/// The lines of a Markdown text outside fenced code blocks.
fn unfenced(text: &str) -> Vec<&str> {
    let mut fenced = false;
    text.lines()
        .filter(|line| {
            let fence = line.trim_start().starts_with("```");
            fenced ^= fence;
            !fence && !fenced
        })
        .collect()
}

/// The lines of a Markdown text outside fenced code blocks, with code spans removed.
fn prose(text: &str) -> Vec<String> {
    unfenced(text).into_iter().map(|line| line.split('`').step_by(2).collect::<Vec<_>>().join("")).collect()
}

/// The code spans of a text (what sits between single backticks on a line).
fn spans(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in text.lines() {
        let parts: Vec<&str> = line.split('`').collect();
        // An odd number of parts: backticks paired on this line.
        if parts.len() % 2 == 1 {
            out.extend(parts.iter().skip(1).step_by(2).map(|s| s.trim().to_string()));
        }
    }
    out
}

/// Whether `span` reads as a path in this repository: made of path characters, with a
/// slash or a file extension, and not an address, a URL route or a placeholder.
fn path_like(span: &str) -> bool {
    let chars_ok = span.chars().all(|c| c.is_ascii_alphanumeric() || "/._-*".contains(c));
    let shaped = span.contains('/') || span.rsplit_once('.').is_some_and(|(stem, ext)| !stem.is_empty() && is_ext(ext));
    let hidden = span.starts_with('.') && !span.starts_with("../");
    chars_ok && shaped && !span.starts_with('/') && !hidden && !span.contains("//") && !built(span)
}

/// Build outputs the docs may name (`target/release`, the test venv): not in git.
fn built(span: &str) -> bool {
    span.starts_with("target/")
}

/// Extensions of files this repository holds.
fn is_ext(ext: &str) -> bool {
    ["md", "rs", "toml", "py", "sh", "html", "css", "js", "proto", "sql", "cu", "cpp", "yaml", "yml", "json", "txt"]
        .contains(&ext)
}

/// What git holds: every file, and every folder above one, relative to the root.
struct Tree(BTreeSet<PathBuf>);

impl Tree {
    fn new(files: &[PathBuf]) -> Self {
        let mut all = BTreeSet::new();
        for f in files {
            all.extend(f.ancestors().filter(|a| !a.as_os_str().is_empty()).map(Path::to_path_buf));
        }
        Self(all)
    }

    /// `base/path` with `.` and `..` resolved, if it stays inside the repository.
    fn inside(base: &Path, path: &str) -> Option<PathBuf> {
        let mut out = PathBuf::new();
        for part in base.join(path).components() {
            match part {
                std::path::Component::ParentDir if !out.pop() => return None,
                std::path::Component::Normal(p) => out.push(p),
                _ => {}
            }
        }
        Some(out)
    }

    fn has(&self, base: &Path, path: &str) -> bool {
        Self::inside(base, path).is_some_and(|p| p.as_os_str().is_empty() || self.0.contains(&p))
    }

    /// Whether `path` (maybe with `*` in its last part) is in git under some base (a
    /// glob: some file of its folder matches its start and end).
    fn resolves(&self, bases: &[PathBuf], path: &str) -> bool {
        let path = path.trim_end_matches('/');
        bases.iter().any(|base| match path.rsplit_once('/') {
            Some((dir, last)) if last.contains('*') => self.matches(base, dir, last),
            _ if path.contains('*') => self.matches(base, "", path),
            _ => self.has(base, path),
        })
    }

    fn matches(&self, base: &Path, dir: &str, glob: &str) -> bool {
        let (start, end) = glob.split_once('*').unwrap_or((glob, ""));
        let Some(dir) = Self::inside(base, dir) else { return false };
        self.0.iter().any(|p| {
            p.parent() == Some(dir.as_path())
                && p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(start) && n.ends_with(end))
        })
    }

    /// Whether the first part of `path` names something in git under some base: only
    /// such spans are held to resolve (`vendor-a/model-a` or `text/event-stream` are
    /// not paths here), and every `../` path is.
    fn rooted(&self, bases: &[PathBuf], path: &str) -> bool {
        let first = path.split('/').next().unwrap_or("");
        path.starts_with("../") || (path.contains('/') && bases.iter().any(|b| self.has(b, first)))
    }
}

/// GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

fn anchors(text: &str) -> BTreeSet<String> {
    unfenced(text).into_iter().filter(|l| l.starts_with('#')).map(|l| anchor(l.trim_start_matches('#'))).collect()
}

/// The bases (relative to the root) a path named in `file` may be relative to: the
/// repository, the file's own folder, and its crate's folder and `src/`.
fn bases(tree: &Tree, file: &Path) -> Vec<PathBuf> {
    let dir = file.parent().unwrap_or(Path::new("")).to_path_buf();
    let mut bases = vec![PathBuf::new(), dir.clone()];
    if let Some(krate) = dir.ancestors().find(|d| tree.0.contains(&d.join("Cargo.toml"))) {
        bases.push(krate.to_path_buf());
        bases.push(krate.join("src"));
    }
    bases
}

#[test]
fn every_link_and_named_file_in_the_docs_resolves() {
    let root = root();
    let files = files();
    let tree = Tree::new(&files);
    let mut broken = Vec::new();
    for file in files.iter().filter(|f| f.extension().is_some_and(|e| e == "md")) {
        let text = std::fs::read_to_string(root.join(file)).unwrap();
        let bases = bases(&tree, file);
        let dir = file.parent().unwrap_or(Path::new(""));
        for link in links(&text) {
            if link.contains("://") || link.starts_with("mailto:") {
                continue;
            }
            let (target, fragment) = link.split_once('#').unwrap_or((&link, ""));
            let page = if target.is_empty() { Some(file.clone()) } else { Tree::inside(dir, target) };
            let Some(page) = page.filter(|p| tree.has(Path::new(""), &p.to_string_lossy())) else {
                broken.push(format!("{}: link to {link}", file.display()));
                continue;
            };
            if !fragment.is_empty() && page.extension().is_some_and(|e| e == "md") {
                let text = std::fs::read_to_string(root.join(&page)).unwrap();
                if !anchors(&text).contains(fragment) {
                    broken.push(format!("{}: link to {link}: no such heading", file.display()));
                }
            }
        }
        for span in spans(&text) {
            if path_like(&span) && (tree.rooted(&bases, &span) || !span.contains('/')) && !tree.resolves(&bases, &span)
            {
                // A bare file name (`Cargo.toml`) may be any crate's; only `.md` names
                // must be found beside the page or at the root.
                if span.contains('/') || span.ends_with(".md") {
                    broken.push(format!("{}: `{span}`", file.display()));
                }
            }
        }
        for name in OUTSIDE {
            if text.contains(name) {
                broken.push(format!("{}: names {name}, which is not in the repository", file.display()));
            }
        }
    }
    assert!(broken.is_empty(), "references that lead nowhere:\n{}", broken.join("\n"));
}

#[test]
fn every_path_a_module_comment_names_resolves() {
    let root = root();
    let files = files();
    let tree = Tree::new(&files);
    let mut broken = Vec::new();
    for file in &files {
        // Sources, and scripts without an extension.
        let ext = file.extension().and_then(|e| e.to_str()).unwrap_or("");
        if !["", "rs", "py", "sh", "toml", "sql", "proto", "html", "js", "css"].contains(&ext) {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(root.join(file)) else { continue };
        let bases = bases(&tree, file);
        let docs: String = text
            .lines()
            .filter(|l| l.trim_start().starts_with("//!"))
            .map(|l| format!("{}\n", l.trim_start().trim_start_matches("//!")))
            .collect();
        for span in spans(&docs) {
            if path_like(&span) && tree.rooted(&bases, &span) && !tree.resolves(&bases, &span) {
                broken.push(format!("{}: `{span}`", file.display()));
            }
        }
        // Comments anywhere: no pointer to notes the repository does not hold. (Not in
        // migrations: an applied one is checksummed, and editing it would stop every
        // existing database from starting.)
        let frozen = file.starts_with("control-plane/migrations") || file == Path::new("tests/tests/docs.rs");
        for name in OUTSIDE {
            if text.contains(name) && !frozen {
                broken.push(format!("{}: names {name}, which is not in the repository", file.display()));
            }
        }
    }
    assert!(broken.is_empty(), "references that lead nowhere:\n{}", broken.join("\n"));
}

#[test]
fn the_checks_catch_what_they_look_for() {
    let tree = Tree::new(&files());
    let bases = vec![PathBuf::new()];
    assert!(tree.resolves(&bases, "docs/api.md") && !tree.resolves(&bases, "docs/apii.md"));
    assert!(tree.resolves(&bases, "kernels/cuda/emulation/*_check.cpp"));
    assert!(!tree.resolves(&bases, "kernels/cuda/emulation/*_nothing.cpp"));
    assert!(!tree.resolves(&[PathBuf::from("docs")], "../../outside/x.md"), "nothing outside the repository");
    assert!(tree.resolves(&[PathBuf::from("docs")], "../README.md"));
    assert!(path_like("bench/results/") && path_like("README.md") && !path_like("/v1/models"));
    assert!(!path_like("https://x.test/a") && !path_like("{org}/keys") && path_like("../shared/notes.md"));
    assert!(!path_like("target/release/tessera"), "a build output");
    assert!(tree.rooted(&bases, "worker/src/nothing.rs") && !tree.rooted(&bases, "vendor-a/model-a"));
    assert!(tree.rooted(&bases, "../shared/x.sh"));
    assert_eq!(links("see [api](docs/api.md#endpoints) and `[not](a link)`"), ["docs/api.md#endpoints"]);
    assert_eq!(anchor(" `tessera-bench spec`"), "tessera-bench-spec");
    assert_eq!(anchor(" Structured output and tool calling"), "structured-output-and-tool-calling");
    assert_eq!(spans("a `x/y.rs` b `c`"), ["x/y.rs", "c"]);
}
