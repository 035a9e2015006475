//! Browser sessions, known devices, failed sign-ins and one-time account links. Each
//! token is 256 random bits handed to the browser or printed once; only its SHA-256 is
//! stored, so a copy of the database signs no one in.

use super::keys;
use super::store::{Store, StoreError, User, now};
use sqlx::Row;

/// How long sessions live, in seconds: ended after `idle` without a request, and
/// `absolute` after sign-in whatever happens.
#[derive(Debug, Clone, Copy)]
pub struct Lifetimes {
    pub idle: i64,
    pub absolute: i64,
}

/// A signed-in browser: who, and when its session began.
#[derive(Debug, Clone, PartialEq)]
pub struct Session {
    pub user: User,
    pub token_hash: String,
    pub created_at: i64,
}

/// What a one-time link is for.
#[derive(Debug, Clone, PartialEq)]
pub enum LinkPurpose {
    /// Creates the first owner of this organization.
    Owner { org_id: String },
    /// Sets this user's password.
    Password { user_id: String },
}

impl Store {
    /// Starts a session for `user_id`; returns the token for the cookie.
    pub async fn start_session(&self, user_id: &str) -> Result<String, StoreError> {
        let token = keys::token();
        let now = now();
        sqlx::query("INSERT INTO sessions (token_hash, user_id, created_at, last_seen_at) VALUES ($1, $2, $3, $3)")
            .bind(keys::hash(&token))
            .bind(user_id)
            .bind(now)
            .execute(&self.pool)
            .await?;
        Ok(token)
    }

    /// The live session this token names, if any: an idle or too old one is ended
    /// here. Seen at most once a minute, to keep page views from being writes.
    pub async fn session(&self, token: &str, lifetimes: Lifetimes) -> Result<Option<Session>, StoreError> {
        let hash = keys::hash(token);
        let row = sqlx::query(
            "SELECT s.created_at AS began, s.last_seen_at, u.id, u.email, u.org_id, u.created_at \
             FROM sessions s JOIN users u ON u.id = s.user_id WHERE s.token_hash = $1",
        )
        .bind(&hash)
        .fetch_optional(&self.pool)
        .await?;
        let Some(r) = row else { return Ok(None) };
        let (began, seen): (i64, i64) = (r.try_get("began")?, r.try_get("last_seen_at")?);
        let now = now();
        if now - seen > lifetimes.idle || now - began > lifetimes.absolute {
            self.end_session(token).await?;
            return Ok(None);
        }
        if now - seen >= 60 {
            sqlx::query("UPDATE sessions SET last_seen_at = $1 WHERE token_hash = $2")
                .bind(now)
                .bind(&hash)
                .execute(&self.pool)
                .await?;
        }
        let user = User {
            id: r.try_get("id")?,
            email: r.try_get("email")?,
            org_id: r.try_get("org_id")?,
            created_at: r.try_get("created_at")?,
        };
        Ok(Some(Session { user, token_hash: hash, created_at: began }))
    }

    pub async fn end_session(&self, token: &str) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM sessions WHERE token_hash = $1").bind(keys::hash(token)).execute(&self.pool).await?;
        Ok(())
    }

    /// Remembers a browser that signed in to `user_id`; returns its cookie's token.
    pub async fn remember_device(&self, user_id: &str) -> Result<String, StoreError> {
        let token = keys::token();
        sqlx::query("INSERT INTO known_devices (token_hash, user_id, created_at) VALUES ($1, $2, $3)")
            .bind(keys::hash(&token))
            .bind(user_id)
            .bind(now())
            .execute(&self.pool)
            .await?;
        Ok(token)
    }

    /// Whether this device token belongs to a browser that signed in as `email`.
    pub async fn known_device(&self, token: &str, email: &str) -> Result<bool, StoreError> {
        let row = sqlx::query(
            "SELECT d.user_id FROM known_devices d JOIN users u ON u.id = d.user_id \
             WHERE d.token_hash = $1 AND u.email = $2",
        )
        .bind(keys::hash(token))
        .bind(super::store::normalize_email(email))
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.is_some())
    }

    /// Counts failed sign-ins in `scope` since `since`.
    pub async fn sign_in_failures(&self, scope: &str, since: i64) -> Result<i64, StoreError> {
        Ok(sqlx::query("SELECT COUNT(*) AS n FROM sign_in_failures WHERE scope = $1 AND at >= $2")
            .bind(scope)
            .bind(since)
            .fetch_one(&self.pool)
            .await?
            .try_get("n")?)
    }

    /// Records a failed sign-in in each scope, forgetting those older than `forget_before`.
    pub async fn record_sign_in_failure(&self, scopes: &[String], forget_before: i64) -> Result<(), StoreError> {
        let now = now();
        for scope in scopes {
            sqlx::query("INSERT INTO sign_in_failures (scope, at) VALUES ($1, $2)")
                .bind(scope)
                .bind(now)
                .execute(&self.pool)
                .await?;
        }
        sqlx::query("DELETE FROM sign_in_failures WHERE at < $1").bind(forget_before).execute(&self.pool).await?;
        Ok(())
    }

    /// Makes a one-time link token valid for `ttl` seconds. A new owner link replaces
    /// older unused ones for the same organization.
    pub async fn create_link(&self, purpose: &LinkPurpose, ttl: i64) -> Result<String, StoreError> {
        let token = keys::token();
        let now = now();
        let (kind, user, org) = match purpose {
            LinkPurpose::Owner { org_id } => ("owner", None, Some(org_id.as_str())),
            LinkPurpose::Password { user_id } => ("password", Some(user_id.as_str()), None),
        };
        let mut tx = self.pool.begin().await?;
        sqlx::query(
            "UPDATE account_links SET used_at = $1 WHERE used_at IS NULL AND purpose = $2 \
             AND (org_id = $3 OR user_id = $4)",
        )
        .bind(now)
        .bind(kind)
        .bind(org)
        .bind(user)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "INSERT INTO account_links (token_hash, purpose, user_id, org_id, created_at, expires_at) \
             VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(keys::hash(&token))
        .bind(kind)
        .bind(user)
        .bind(org)
        .bind(now)
        .bind(now + ttl)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(token)
    }

    /// What a link token is for, while it is unused and unexpired.
    pub async fn link(&self, token: &str) -> Result<Option<LinkPurpose>, StoreError> {
        let row = sqlx::query(
            "SELECT purpose, user_id, org_id FROM account_links \
             WHERE token_hash = $1 AND used_at IS NULL AND expires_at > $2",
        )
        .bind(keys::hash(token))
        .bind(now())
        .fetch_optional(&self.pool)
        .await?;
        let Some(r) = row else { return Ok(None) };
        let purpose: String = r.try_get("purpose")?;
        Ok(match purpose.as_str() {
            "owner" => r.try_get::<Option<String>, _>("org_id")?.map(|org_id| LinkPurpose::Owner { org_id }),
            "password" => r.try_get::<Option<String>, _>("user_id")?.map(|user_id| LinkPurpose::Password { user_id }),
            _ => None,
        })
    }

    /// Uses a link: true for exactly one caller, while it was unused and unexpired.
    pub async fn use_link(&self, token: &str) -> Result<bool, StoreError> {
        let now = now();
        let done = sqlx::query(
            "UPDATE account_links SET used_at = $1 WHERE token_hash = $2 AND used_at IS NULL AND expires_at > $3",
        )
        .bind(now)
        .bind(keys::hash(token))
        .bind(now)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }
}
