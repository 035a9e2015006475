//! API key secrets: `tsk_` + 40 random base62 characters + a 6-character checksum of
//! them. The checksum lets a mistyped or truncated key be refused without a database
//! lookup; only the SHA-256 of a secret is ever stored.

use rand::Rng;
use sha2::{Digest, Sha256};

pub const PREFIX: &str = "tsk_";
const BODY: usize = 40;
const CHECK: usize = 6;
const ALPHABET: &[u8; 62] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";

/// A freshly generated secret, shown once, and what is stored of it.
pub struct NewSecret {
    pub secret: String,
    pub hash: String,
}

pub fn generate() -> NewSecret {
    let body = base62(BODY);
    let secret = format!("{PREFIX}{body}{}", checksum(&body));
    NewSecret { hash: hash(&secret), secret }
}

/// Whether `secret` has the shape of a key this service issued (prefix, length,
/// alphabet, checksum).
pub fn well_formed(secret: &str) -> bool {
    let Some(rest) = secret.strip_prefix(PREFIX) else { return false };
    if rest.len() != BODY + CHECK || !rest.bytes().all(|b| b.is_ascii_alphanumeric()) {
        return false;
    }
    let (body, check) = rest.split_at(BODY);
    checksum(body) == check
}

/// What lists show of a key: the prefix and four characters of its 238 random bits,
/// enough to tell keys apart and nothing to guess the rest with.
pub fn prefix(secret: &str) -> &str {
    secret.get(..PREFIX.len() + 4).unwrap_or(secret)
}

/// A fresh random token of 256 bits (43 base62 characters) for sessions, invites and
/// one-time links; only its `hash` is stored.
pub fn token() -> String {
    base62(43)
}

/// The stored form of a secret.
pub fn hash(secret: &str) -> String {
    hex(&Sha256::digest(secret.as_bytes()))
}

/// A secret with all but its first and last four characters hidden, for error messages.
pub fn mask(secret: &str) -> String {
    let chars: Vec<char> = secret.chars().collect();
    if chars.len() <= 12 {
        return "*".repeat(chars.len());
    }
    let head: String = chars[..8].iter().collect();
    let tail: String = chars[chars.len() - 4..].iter().collect();
    format!("{head}***{tail}")
}

fn checksum(body: &str) -> String {
    let digest = Sha256::digest(body.as_bytes());
    let mut v = u64::from_be_bytes(digest[..8].try_into().expect("8 bytes"));
    (0..CHECK)
        .map(|_| {
            let c = ALPHABET[(v % 62) as usize] as char;
            v /= 62;
            c
        })
        .collect()
}

/// `n` random base62 characters.
pub fn base62(n: usize) -> String {
    let mut rng = rand::rng();
    (0..n).map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char).collect()
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A random identifier with a type prefix, e.g. `org_3f9a…`.
pub fn random_id(prefix: &str) -> String {
    let bytes: [u8; 12] = rand::rng().random();
    format!("{prefix}{}", hex(&bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_secrets_are_well_formed_and_hash_stably() {
        let k = generate();
        assert!(k.secret.starts_with(PREFIX) && k.secret.len() == PREFIX.len() + BODY + CHECK);
        assert!(well_formed(&k.secret));
        assert_eq!(k.hash, hash(&k.secret));
        assert_ne!(k.hash, k.secret, "the stored form is not the secret");
        assert_ne!(generate().secret, k.secret);
    }

    #[test]
    fn malformed_secrets_are_refused_without_a_lookup() {
        let k = generate().secret;
        // One character changed in the body breaks the checksum.
        let mut typo: Vec<char> = k.chars().collect();
        typo[10] = if typo[10] == 'a' { 'b' } else { 'a' };
        let typo: String = typo.into_iter().collect();
        for bad in [&typo[..], &k[..k.len() - 1], "sk-abc", "", &k.replace(PREFIX, "tsx_"), &format!("{k}x")] {
            assert!(!well_formed(bad), "{bad:?} accepted");
        }
    }

    #[test]
    fn masks_hide_the_middle() {
        let k = generate().secret;
        let m = mask(&k);
        assert!(m.starts_with(&k[..8]) && m.ends_with(&k[k.len() - 4..]) && m.contains("***"));
        assert!(!m.contains(&k[8..k.len() - 4]));
        assert_eq!(mask("short"), "*****");
    }
}
