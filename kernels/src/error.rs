//! Errors an op can raise: a caller's shape mistake, or a device failure.

#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("{op}: {detail}")]
    Shape { op: &'static str, detail: String },
    #[error("device error in {op}: {detail}")]
    Device { op: &'static str, detail: String },
}

impl KernelError {
    pub(crate) fn shape(op: &'static str, detail: impl Into<String>) -> Self {
        Self::Shape { op, detail: detail.into() }
    }
}

/// Fails with a shape error unless `len` equals `want`.
pub(crate) fn expect_len(op: &'static str, what: &str, len: usize, want: usize) -> crate::Result<()> {
    if len == want {
        Ok(())
    } else {
        Err(KernelError::shape(op, format!("{what} has {len} elements, expected {want}")))
    }
}
