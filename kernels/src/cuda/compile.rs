//! The CUDA C sources and their compilation by NVRTC for the device's architecture,
//! with the PTX cached on disk by a hash of the source and the options, so a worker
//! compiles each kernel once per machine rather than at every start.

use cudarc::nvrtc::{result, sys};
use std::ffi::{CStr, CString};
use std::path::PathBuf;

/// One `.cu` file of `kernels/cuda`.
pub struct Source {
    pub name: &'static str,
    text: &'static str,
}

/// Helpers every source uses; NVRTC cannot read include files, so it is prepended.
const COMMON: &str = include_str!("../../cuda/common.cuh");

pub const SOURCES: [Source; 5] = [
    Source { name: "elementwise.cu", text: include_str!("../../cuda/elementwise.cu") },
    Source { name: "attention.cu", text: include_str!("../../cuda/attention.cu") },
    Source { name: "prefill.cu", text: include_str!("../../cuda/prefill.cu") },
    Source { name: "sampling.cu", text: include_str!("../../cuda/sampling.cu") },
    Source { name: "quant.cu", text: include_str!("../../cuda/quant.cu") },
];

impl Source {
    /// The text NVRTC compiles: the common helpers, then the file, with `#line` so that
    /// messages point into the file itself.
    pub fn full_text(&self) -> String {
        format!("{COMMON}\n#line 1 \"{}\"\n{}", self.name, self.text)
    }
}

/// NVRTC's options for an architecture such as `sm_90`.
pub fn options(arch: &str) -> Vec<String> {
    vec![format!("--gpu-architecture={arch}"), "--std=c++17".into(), "-lineinfo".into()]
}

/// What NVRTC made of a source: its PTX and its log (warnings; empty when clean).
pub struct Compiled {
    pub ptx: String,
    pub log: String,
}

/// Whether NVRTC's library can be loaded; calling it when it cannot would panic.
pub fn nvrtc_present() -> bool {
    // SAFETY: only probes for the library with dlopen.
    unsafe { sys::is_culib_present() }
}

/// Why a source did not become PTX.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CompileError {
    #[error("{name}: NUL byte in the source")]
    Nul { name: &'static str },
    /// NVRTC itself failed (creating the program, handing back its PTX).
    #[error("{name}: {step}: {detail}")]
    Nvrtc { name: &'static str, step: &'static str, detail: String },
    /// The source does not compile; `log` is NVRTC's.
    #[error("{name} does not compile for {arch} ({detail}):\n{log}")]
    Refused { name: &'static str, arch: String, detail: String, log: String },
}

/// Compiles one source for `arch`. An error carries NVRTC's log.
pub fn compile(source: &Source, arch: &str) -> Result<Compiled, CompileError> {
    let name = source.name;
    let text = CString::new(source.full_text()).map_err(|_| CompileError::Nul { name })?;
    let c_name = CString::new(name).expect("source names have no NUL");
    let prog = result::create_program(&text, Some(c_name.as_c_str())).map_err(|e| CompileError::Nvrtc {
        name,
        step: "creating the program",
        detail: format!("{e:?}"),
    })?;
    // SAFETY: `prog` is a live program, destroyed once below whatever happens.
    unsafe {
        let compiled = result::compile_program(prog, &options(arch));
        let log = result::get_program_log(prog).map(|raw| c_chars(&raw)).unwrap_or_default();
        let out = match compiled {
            Ok(()) => result::get_ptx(prog)
                .map(|raw| Compiled { ptx: c_chars(&raw), log: log.clone() })
                .map_err(|e| CompileError::Nvrtc { name, step: "reading PTX", detail: format!("{e:?}") }),
            Err(e) => Err(CompileError::Refused { name, arch: arch.to_string(), detail: format!("{e:?}"), log }),
        };
        let _ = result::destroy_program(prog);
        out
    }
}

fn c_chars(raw: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = raw.iter().map(|&c| c as u8).collect();
    CStr::from_bytes_until_nul(&bytes)
        .map(|s| s.to_string_lossy().trim().to_owned())
        .unwrap_or_else(|_| String::from_utf8_lossy(&bytes).trim().to_owned())
}

/// The PTX of `source` for `arch`, from the disk cache when an earlier start compiled
/// the same text with the same options. A cache that cannot be read or written only
/// costs a compile.
pub fn ptx_cached(source: &Source, arch: &str) -> Result<String, CompileError> {
    let key = fnv1a(&[source.full_text().as_bytes(), options(arch).join(" ").as_bytes()]);
    let path = cache_dir().map(|d| d.join(format!("{}-{arch}-{key:016x}.ptx", source.name.trim_end_matches(".cu"))));
    if let Some(ptx) = path.as_ref().and_then(|p| std::fs::read_to_string(p).ok()) {
        return Ok(ptx);
    }
    let ptx = compile(source, arch)?.ptx;
    if let Some(path) = path {
        // Written aside then renamed, so a concurrent start never reads half a file.
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        if path.parent().is_some_and(|d| std::fs::create_dir_all(d).is_ok()) && std::fs::write(&tmp, &ptx).is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
    }
    Ok(ptx)
}

/// `$TESSERA_CUDA_CACHE`, else `$XDG_CACHE_HOME/tessera/cuda`, else `~/.cache/tessera/cuda`.
fn cache_dir() -> Option<PathBuf> {
    let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    env("TESSERA_CUDA_CACHE")
        .or_else(|| env("XDG_CACHE_HOME").map(|d| d.join("tessera/cuda")))
        .or_else(|| env("HOME").map(|d| d.join(".cache/tessera/cuda")))
}

/// FNV-1a, 64-bit: stable across Rust releases, unlike `DefaultHasher`.
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &b in part.iter().chain(&[0xff]) {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CI's check of every kernel source without a GPU: each must compile for Ampere
    /// and Hopper with an empty log (no warnings). Where NVRTC cannot be loaded the
    /// test says so and passes, unless `TESSERA_REQUIRE_NVRTC=1` (set by `.ci/run`,
    /// which installs NVRTC from PyPI) makes that a failure. NVRTC passes inline PTX
    /// through unread, so where `TESSERA_PTXAS` names a `ptxas` (`.ci/run` installs
    /// PyPI's) the PTX is also assembled for its architecture, as the driver would.
    #[test]
    fn every_cuda_source_compiles_cleanly_for_sm80_and_sm90() {
        if !nvrtc_present() {
            let required = std::env::var("TESSERA_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
            assert!(!required, "TESSERA_REQUIRE_NVRTC=1 but libnvrtc cannot be loaded (LD_LIBRARY_PATH?)");
            eprintln!("skipped: NVRTC is not installed");
            return;
        }
        let mut entries = String::new();
        for arch in ["sm_80", "sm_90"] {
            for source in &SOURCES {
                let compiled = compile(source, arch).unwrap_or_else(|e| panic!("{e}"));
                entries.push_str(&compiled.ptx);
                assert!(compiled.log.is_empty(), "{} for {arch} warns:\n{}", source.name, compiled.log);
                assert!(compiled.ptx.contains(".entry"), "{} for {arch}: no kernel in the PTX", source.name);
                if let Ok(ptxas) = std::env::var("TESSERA_PTXAS") {
                    assemble(&ptxas, source.name, arch, &compiled.ptx);
                }
            }
        }
        // Every kernel the backend looks up is an entry point: a misspelt name would
        // otherwise surface only on a GPU, as the backend failing to start.
        for name in kernel_names() {
            assert!(
                entries.contains(&format!(".entry {name}(")),
                "the backend looks up {name}, which no source defines"
            );
        }
    }

    /// The kernels `CudaBackend::new` finds: the literal names in the backend's sources,
    /// and those it builds from formats, head sizes and logit types.
    fn kernel_names() -> Vec<String> {
        let rust = [include_str!("mod.rs"), include_str!("sampling.rs"), include_str!("packed.rs")].concat();
        let mut names: Vec<String> =
            rust.split("find(\"").skip(1).filter_map(|r| r.split('"').next()).map(String::from).collect();
        assert!(names.len() > 20, "the backend's lookups moved: {names:?}");
        for format in ["q4_0", "q4_1", "q5_0", "q8_0", "q4_k", "q5_k", "q6_k", "fp8", "int4"] {
            names.extend(["gemv", "gemm", "embedding"].map(|k| format!("{k}_{format}")));
        }
        for logits in ["f32", "bf16"] {
            names.extend(["best", "radix", "count", "find"].map(|k| format!("pick_{k}_{logits}")));
        }
        for hd in [64, 128, 256] {
            names.extend([1, 2, 4, 8].map(|g| format!("paged_attention_hd{hd}_g{g}")));
        }
        names.extend([64, 128].map(|hd| format!("prefill_attention_hd{hd}")));
        names
    }

    fn assemble(ptxas: &str, name: &str, arch: &str, ptx: &str) {
        let dir = std::env::temp_dir().join(format!("tessera-ptxas-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let input = dir.join(format!("{name}.{arch}.ptx"));
        std::fs::write(&input, ptx).unwrap();
        let out = std::process::Command::new(ptxas)
            .arg(format!("-arch={arch}"))
            .arg("-o")
            .arg(dir.join(format!("{name}.{arch}.cubin")))
            .arg(&input)
            .output()
            .unwrap_or_else(|e| panic!("TESSERA_PTXAS={ptxas}: {e}"));
        let _ = std::fs::remove_dir_all(&dir);
        assert!(out.status.success(), "ptxas {name} for {arch}:\n{}", String::from_utf8_lossy(&out.stderr));
    }

    #[test]
    fn cache_key_changes_with_any_byte() {
        assert_ne!(fnv1a(&[b"ab", b"c"]), fnv1a(&[b"a", b"bc"]));
        assert_ne!(fnv1a(&[b"sm_80"]), fnv1a(&[b"sm_90"]));
        assert_eq!(fnv1a(&[b"x"]), fnv1a(&[b"x"]));
    }
}
