//! Every GGUF tensor type we read, decoded by us and by the `gguf` Python package
//! (fixtures written by scripts/fixtures/dequant.py).

use std::path::Path;
use tessera_worker::loader::TensorSource;
use tessera_worker::loader::gguf::GgufFile;

#[test]
fn every_type_matches_the_gguf_python_decoder() {
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data");
    let quant = GgufFile::open(&data.join("dequant.gguf")).unwrap();
    let expected = GgufFile::open(&data.join("dequant_expected.gguf")).unwrap();
    let names = ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F32", "F16", "BF16"];
    assert_eq!(quant.tensors.len(), names.len());
    for name in names {
        let got = quant.load(name).unwrap();
        let want = expected.load(name).unwrap();
        assert_eq!(got.shape, want.shape, "{name}");
        for (i, (g, w)) in got.data.iter().zip(&want.data).enumerate() {
            // gguf-py multiplies in a different order (d·(sc·q) vs (d·sc)·q): allow the
            // last bit of an f32.
            let tol = w.abs() * 2e-7;
            assert!((g - w).abs() <= tol, "{name}[{i}]: got {g}, gguf-py {w}");
        }
    }
}
