//! The sign-in throttle: per client address and per account, counted in the database
//! so that every control plane sees the same numbers.
//!
//! A limit that anyone could trip would let an attacker lock the owner out; so both
//! limits spare browsers that have signed in to that account before (they carry a
//! device cookie): an attacker's failures, from one address or from many, slow down
//! only browsers the account has never used. Unknown addresses are counted exactly like
//! real ones. Behind a reverse proxy, every client has the proxy's address unless
//! `--trust-forwarded-for` is given (then the last `X-Forwarded-For` entry counts).

use crate::accounts::{Store, StoreError};

/// Failures allowed in a sliding window.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub per_address: i64,
    pub per_account: i64,
    /// Seconds.
    pub window: i64,
}

impl Default for Limits {
    fn default() -> Self {
        Self { per_address: 20, per_account: 10, window: 15 * 60 }
    }
}

fn scopes(email: &str, address: &str) -> [String; 2] {
    [format!("account:{}", crate::accounts::store::normalize_email(email)), format!("address:{address}")]
}

/// None if this attempt may go ahead; else the seconds to wait.
pub async fn check(
    store: &Store,
    limits: Limits,
    email: &str,
    address: &str,
    known_device: bool,
) -> Result<Option<i64>, StoreError> {
    if known_device {
        return Ok(None);
    }
    let since = crate::accounts::store::now() - limits.window;
    let [account, address] = scopes(email, address);
    if store.sign_in_failures(&address, since).await? >= limits.per_address
        || store.sign_in_failures(&account, since).await? >= limits.per_account
    {
        return Ok(Some(limits.window));
    }
    Ok(None)
}

/// Sign-ups and password checks of a signed-in user are counted per address too (each
/// costs an argon2 hash): None if this one may go ahead, else the seconds to wait.
pub async fn check_address(
    store: &Store,
    limits: Limits,
    scope: &str,
    address: &str,
) -> Result<Option<i64>, StoreError> {
    let since = crate::accounts::store::now() - limits.window;
    let scope = format!("{scope}:{address}");
    if store.sign_in_failures(&scope, since).await? >= limits.per_address {
        return Ok(Some(limits.window));
    }
    store.record_sign_in_failure(&[scope], since).await?;
    Ok(None)
}

pub async fn failed(store: &Store, limits: Limits, email: &str, address: &str) -> Result<(), StoreError> {
    let forget_before = crate::accounts::store::now() - limits.window;
    store.record_sign_in_failure(&scopes(email, address), forget_before).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn failures_throttle_unknown_browsers_but_not_the_owners_own() {
        let store = crate::db::Db::open("sqlite::memory:").await.unwrap().accounts();
        let limits = Limits { per_address: 5, per_account: 3, window: 900 };
        let ada = "ada@example.com";
        for _ in 0..3 {
            assert_eq!(check(&store, limits, ada, "10.0.0.9", false).await.unwrap(), None);
            failed(&store, limits, "ADA@example.com", "10.0.0.9").await.unwrap();
        }
        // The attacker's address is not yet over its limit, but the account is.
        assert_eq!(check(&store, limits, ada, "10.0.0.7", false).await.unwrap(), Some(900), "another address");
        // Ada's browser, which signed in before, still gets through.
        assert_eq!(check(&store, limits, ada, "10.0.0.1", true).await.unwrap(), None);
        // Other accounts from a fresh address are not affected; unknown addresses count alike.
        assert_eq!(check(&store, limits, "nobody@example.com", "10.0.0.8", false).await.unwrap(), None);
        for _ in 0..2 {
            failed(&store, limits, "nobody@example.com", "10.0.0.9").await.unwrap();
        }
        // Five failures from one address stop it, whatever account it tries, except in a
        // browser that account has signed in from.
        assert_eq!(check(&store, limits, "carol@example.com", "10.0.0.9", false).await.unwrap(), Some(900));
        assert_eq!(check(&store, limits, "carol@example.com", "10.0.0.9", true).await.unwrap(), None);
        assert_eq!(check(&store, limits, "carol@example.com", "10.0.0.2", false).await.unwrap(), None);
    }
}
