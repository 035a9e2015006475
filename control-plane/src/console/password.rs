//! Passwords: the rules (ASVS V6.2: at least 8 characters, at least 64 allowed, not
//! a common one, no composition rules), and argon2id hashing with OWASP's parameters
//! (m = 19 MiB, t = 2, p = 1). Hashing takes tens of milliseconds: callers run it on
//! the blocking pool.

use argon2::password_hash::{PasswordHasher, PasswordVerifier};
use argon2::{Algorithm, Argon2, Params, Version};
use std::collections::HashSet;
use std::sync::LazyLock;

pub const MIN_CHARS: usize = 8;
/// Long passphrases are welcome; the limit only bounds the work of hashing.
pub const MAX_CHARS: usize = 128;

/// 11,611 passwords of 8 characters or more from zxcvbn's list of the 30,000 most
/// common (MIT licence, beside the file), compared in lower case.
static COMMON: LazyLock<HashSet<&'static str>> =
    LazyLock::new(|| include_str!("common-passwords.txt").lines().filter(|l| !l.is_empty()).collect());

fn argon2() -> Argon2<'static> {
    Argon2::new(Algorithm::Argon2id, Version::V0x13, Params::new(19 * 1024, 2, 1, None).expect("valid parameters"))
}

/// Why a new password is refused, in words for the form; None if it is fine.
pub fn problem(password: &str, email: &str) -> Option<String> {
    let chars = password.chars().count();
    if chars < MIN_CHARS {
        return Some(format!("Use at least {MIN_CHARS} characters."));
    }
    if chars > MAX_CHARS {
        return Some(format!("Use at most {MAX_CHARS} characters."));
    }
    let lower = password.to_lowercase();
    if COMMON.contains(lower.as_str()) {
        return Some("That is one of the most common passwords. Choose another.".into());
    }
    let name = email.split('@').next().unwrap_or_default().to_lowercase();
    if lower == email.to_lowercase() || (name.chars().count() >= MIN_CHARS && lower == name) {
        return Some("Do not use your e-mail address as your password.".into());
    }
    None
}

/// The argon2id PHC string of a password, with a fresh 128-bit salt.
pub fn hash(password: &str) -> String {
    let salt: [u8; 16] = rand::random();
    argon2().hash_password_with_salt(password.as_bytes(), &salt).expect("argon2 with valid parameters").to_string()
}

/// Whether `password` matches `phc`. Without a hash (an unknown address, or an account
/// with no password yet) a dummy hash is verified, so that the answer takes as long.
pub fn verify(password: &str, phc: Option<&str>) -> bool {
    static DUMMY: LazyLock<String> = LazyLock::new(|| hash("not anyone's password: timing only"));
    match phc {
        Some(phc) => argon2().verify_password(password.as_bytes(), phc).is_ok(),
        None => {
            let _ = argon2().verify_password(password.as_bytes(), DUMMY.as_str());
            false
        }
    }
}

/// At most one hash per core at a time (each takes 19 MiB and a core for tens of
/// milliseconds): a flood of sign-ins queues here instead of taking the memory and the
/// blocking pool from the API served beside the console.
static HASHING: LazyLock<tokio::sync::Semaphore> = LazyLock::new(|| {
    tokio::sync::Semaphore::new(std::thread::available_parallelism().map_or(2, std::num::NonZeroUsize::get))
});

async fn off_thread<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> T {
    let _permit = HASHING.acquire().await.expect("the semaphore is never closed");
    tokio::task::spawn_blocking(work).await.expect("argon2 does not panic")
}

/// `hash` on the blocking pool, one per core at a time.
pub async fn hash_off_thread(password: String) -> String {
    off_thread(move || hash(&password)).await
}

/// `verify` on the blocking pool, one per core at a time.
pub async fn verify_off_thread(password: String, phc: Option<String>) -> bool {
    off_thread(move || verify(&password, phc.as_deref())).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn length_common_passwords_and_the_address_are_checked() {
        assert!(problem("short", "a@b.co").unwrap().contains("at least 8"));
        assert!(problem("password1", "a@b.co").unwrap().contains("common"));
        assert!(problem("PassWord1", "a@b.co").unwrap().contains("common"), "case does not matter");
        assert!(problem("ada.lovelace@example.com", "ada.lovelace@example.com").unwrap().contains("e-mail"));
        assert!(problem("ada.lovelace", "ada.lovelace@example.com").unwrap().contains("e-mail"));
        assert_eq!(problem("correct horse battery staple", "a@b.co"), None);
        // 64 characters (and up to 128) are allowed; unicode counts as characters.
        assert_eq!(problem(&"ž".repeat(64), "a@b.co"), None);
        assert_eq!(problem(&"x7".repeat(64), "a@b.co"), None);
        assert!(problem(&"x".repeat(129), "a@b.co").unwrap().contains("at most"));
        assert!(COMMON.len() >= 3000, "{}", COMMON.len());
        assert!(COMMON.iter().all(|p| p.chars().count() >= MIN_CHARS));
    }

    #[test]
    fn hashes_are_argon2id_with_the_chosen_cost_and_verify() {
        let h = hash("correct horse battery staple");
        assert!(h.starts_with("$argon2id$v=19$m=19456,t=2,p=1$"), "{h}");
        assert_ne!(h, hash("correct horse battery staple"), "salted");
        assert!(verify("correct horse battery staple", Some(&h)));
        assert!(!verify("correct horse battery stapler", Some(&h)));
        assert!(!verify("anything", None));
        assert!(!verify("anything", Some("not a hash")));
    }
}
