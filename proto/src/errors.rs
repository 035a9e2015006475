//! A worker's errors over gRPC: the status code, for transports and retries, and the
//! kind (`ErrorKind`) as the reason of a standard `google.rpc.ErrorInfo` in the status's
//! details, which the control plane answers by — never by the message, which is for
//! people and may change.

use crate::worker::ErrorKind;
use std::collections::HashMap;
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

/// The domain of the worker's error reasons.
const DOMAIN: &str = "worker.tessera";

/// A status of `code` saying `message`, of `kind`.
pub fn status(code: Code, kind: ErrorKind, message: impl Into<String>) -> Status {
    let details = ErrorDetails::with_error_info(kind.as_str_name(), DOMAIN, HashMap::new());
    Status::with_error_details(code, message, details)
}

/// The kind `status` carries: unspecified for one without (a transport's own).
pub fn kind(status: &Status) -> ErrorKind {
    status
        .get_error_details()
        .error_info()
        .filter(|info| info.domain == DOMAIN)
        .and_then(|info| ErrorKind::from_str_name(&info.reason))
        .unwrap_or(ErrorKind::Unspecified)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kind_travels_beside_the_message() {
        let s = status(Code::InvalidArgument, ErrorKind::GrammarRefused, "unknown type 'frob'");
        assert_eq!(
            (kind(&s), s.code(), s.message()),
            (ErrorKind::GrammarRefused, Code::InvalidArgument, "unknown type 'frob'")
        );
        assert_eq!(kind(&Status::unavailable("gone")), ErrorKind::Unspecified);
    }
}
