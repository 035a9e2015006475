//! Accounts in SQL through sqlx's `Any` driver: the same queries on SQLite (the
//! default, one file) and PostgreSQL (several control planes). `crate::db` opens the
//! database.

use super::keys;
use serde::Serialize;
use sqlx::{AnyPool, Row};
use std::str::FromStr;
use std::time::{SystemTime, UNIX_EPOCH};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database: {0}")]
    Db(#[from] sqlx::Error),
    #[error("organization {0:?} not found")]
    NoOrg(String),
    #[error("user {0:?} not found")]
    NoUser(String),
    #[error("API key {0:?} not found")]
    NoKey(String),
    #[error("{0}")]
    Invalid(String),
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Org {
    pub id: String,
    pub name: String,
    pub created_at: i64,
}

/// A person, with a personal organization of their own.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct User {
    pub id: String,
    pub email: String,
    pub org_id: String,
    pub created_at: i64,
}

/// How a key's usage is paid for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum BillingMode {
    Credits,
    Subscription,
}

impl BillingMode {
    fn as_str(self) -> &'static str {
        match self {
            Self::Credits => "credits",
            Self::Subscription => "subscription",
        }
    }
}

impl FromStr for BillingMode {
    type Err = StoreError;
    fn from_str(s: &str) -> Result<Self, StoreError> {
        match s {
            "credits" => Ok(Self::Credits),
            "subscription" => Ok(Self::Subscription),
            other => Err(StoreError::Invalid(format!("unknown billing mode {other:?} in the database"))),
        }
    }
}

/// A key's record; never its secret.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ApiKey {
    pub id: String,
    pub org_id: String,
    pub name: String,
    pub billing_mode: BillingMode,
    pub fallback_to_credits: bool,
    pub created_at: i64,
    pub revoked_at: Option<i64>,
    /// The secret's first characters (not enough to use it); None for keys made
    /// before the console.
    pub prefix: Option<String>,
    /// The user who made it in the console; None: the operator's CLI.
    pub created_by: Option<String>,
    pub last_used_at: Option<i64>,
}

/// What to create a key with.
#[derive(Debug, Clone)]
pub struct NewKey<'a> {
    pub org_id: &'a str,
    pub name: &'a str,
    pub billing_mode: BillingMode,
    pub fallback_to_credits: bool,
    /// The console user making it (None: the CLI).
    pub created_by: Option<&'a str>,
}

#[derive(Clone)]
pub struct Store {
    pub(super) pool: AnyPool,
}

/// The columns `key_from_row` reads; a macro so queries stay static strings.
macro_rules! key_columns {
    () => {
        "id, org_id, name, billing_mode, fallback_to_credits, created_at, revoked_at, prefix, created_by, last_used_at"
    };
}

impl Store {
    /// The accounts kept in `db` (`Db::accounts`).
    pub(crate) fn new(pool: AnyPool) -> Self {
        Self { pool }
    }

    pub async fn create_org(&self, name: &str) -> Result<Org, StoreError> {
        if name.trim().is_empty() {
            return Err(StoreError::Invalid("an organization needs a name".into()));
        }
        let org = Org { id: keys::random_id("org_"), name: name.to_string(), created_at: now() };
        insert_org(&mut *self.pool.acquire().await?, &org).await?;
        Ok(org)
    }

    /// An organization by id, or by name when exactly one has it.
    pub async fn find_org(&self, id_or_name: &str) -> Result<Org, StoreError> {
        let rows = sqlx::query("SELECT id, name, created_at FROM orgs WHERE id = $1 OR name = $2 ORDER BY created_at")
            .bind(id_or_name)
            .bind(id_or_name)
            .fetch_all(&self.pool)
            .await?;
        let orgs: Vec<Org> = rows
            .iter()
            .map(|r| Ok(Org { id: r.try_get("id")?, name: r.try_get("name")?, created_at: r.try_get("created_at")? }))
            .collect::<Result<_, sqlx::Error>>()?;
        if let Some(by_id) = orgs.iter().find(|o| o.id == id_or_name) {
            return Ok(by_id.clone());
        }
        match orgs.len() {
            1 => Ok(orgs.into_iter().next().expect("one")),
            0 => Err(StoreError::NoOrg(id_or_name.to_string())),
            n => Err(StoreError::Invalid(format!("{n} organizations are named {id_or_name:?}: use the id"))),
        }
    }

    pub async fn count_orgs(&self) -> Result<i64, StoreError> {
        Ok(sqlx::query("SELECT COUNT(*) AS n FROM orgs").fetch_one(&self.pool).await?.try_get("n")?)
    }

    /// Creates a user and their personal organization (named after the address).
    pub async fn create_user(&self, email: &str) -> Result<User, StoreError> {
        self.create_user_with_password(email, None).await
    }

    /// Creates a user (with an argon2id PHC string, or none yet) and their personal
    /// organization, which they own. Addresses are kept in lower case.
    pub async fn create_user_with_password(
        &self,
        email: &str,
        password_hash: Option<&str>,
    ) -> Result<User, StoreError> {
        let email = normalize_email(email);
        let email = email.as_str();
        if !well_formed_email(email) {
            return Err(StoreError::Invalid(format!("{email:?} is not an e-mail address")));
        }
        let taken = sqlx::query("SELECT id FROM users WHERE email = $1").bind(email).fetch_optional(&self.pool).await?;
        if taken.is_some() {
            return Err(StoreError::Invalid(format!("a user with the address {email} exists")));
        }
        let org = Org { id: keys::random_id("org_"), name: email.to_string(), created_at: now() };
        let user =
            User { id: keys::random_id("user_"), email: email.to_string(), org_id: org.id.clone(), created_at: now() };
        let mut tx = self.pool.begin().await?;
        insert_org(&mut tx, &org).await?;
        sqlx::query("INSERT INTO users (id, email, org_id, created_at, password_hash) VALUES ($1, $2, $3, $4, $5)")
            .bind(&user.id)
            .bind(&user.email)
            .bind(&user.org_id)
            .bind(user.created_at)
            .bind(password_hash)
            .execute(&mut *tx)
            .await?;
        insert_membership(&mut tx, &user.org_id, &user.id, super::Role::Owner, user.created_at).await?;
        tx.commit().await?;
        Ok(user)
    }

    /// A user by id or e-mail address.
    pub async fn find_user(&self, id_or_email: &str) -> Result<User, StoreError> {
        let row = sqlx::query("SELECT id, email, org_id, created_at FROM users WHERE id = $1 OR email = $2")
            .bind(id_or_email)
            .bind(normalize_email(id_or_email))
            .fetch_optional(&self.pool)
            .await?
            .ok_or_else(|| StoreError::NoUser(id_or_email.to_string()))?;
        Ok(User {
            id: row.try_get("id")?,
            email: row.try_get("email")?,
            org_id: row.try_get("org_id")?,
            created_at: row.try_get("created_at")?,
        })
    }

    /// Creates a key and returns it with its secret, which is not kept.
    pub async fn create_key(&self, new: NewKey<'_>) -> Result<(ApiKey, String), StoreError> {
        if new.name.trim().is_empty() {
            return Err(StoreError::Invalid("a key needs a name".into()));
        }
        let org = self.find_org(new.org_id).await?;
        if new.billing_mode == BillingMode::Subscription {
            let personal =
                sqlx::query("SELECT id FROM users WHERE org_id = $1").bind(&org.id).fetch_optional(&self.pool).await?;
            if personal.is_none() {
                return Err(StoreError::Invalid(format!(
                    "subscription billing is for personal accounts; {} is an organization and pays with credits",
                    org.id
                )));
            }
        }
        if new.fallback_to_credits && new.billing_mode != BillingMode::Subscription {
            return Err(StoreError::Invalid("credit fallback is for subscription keys".into()));
        }
        let secret = keys::generate();
        let key = ApiKey {
            id: keys::random_id("key_"),
            org_id: org.id,
            name: new.name.trim().to_string(),
            billing_mode: new.billing_mode,
            fallback_to_credits: new.fallback_to_credits,
            created_at: now(),
            revoked_at: None,
            prefix: Some(keys::prefix(&secret.secret).to_string()),
            created_by: new.created_by.map(str::to_string),
            last_used_at: None,
        };
        sqlx::query(
            "INSERT INTO api_keys (id, org_id, name, secret_hash, billing_mode, fallback_to_credits, created_at, \
             prefix, created_by) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
        )
        .bind(&key.id)
        .bind(&key.org_id)
        .bind(&key.name)
        .bind(&secret.hash)
        .bind(key.billing_mode.as_str())
        .bind(key.fallback_to_credits as i64)
        .bind(key.created_at)
        .bind(&key.prefix)
        .bind(&key.created_by)
        .execute(&self.pool)
        .await?;
        Ok((key, secret.secret))
    }

    /// Revokes a key; true if it was active. The next request with it is refused.
    pub async fn revoke_key(&self, id: &str) -> Result<bool, StoreError> {
        let done = sqlx::query("UPDATE api_keys SET revoked_at = $1 WHERE id = $2 AND revoked_at IS NULL")
            .bind(now())
            .bind(id)
            .execute(&self.pool)
            .await?;
        if done.rows_affected() == 0 && self.key(id).await?.is_none() {
            return Err(StoreError::NoKey(id.to_string()));
        }
        Ok(done.rows_affected() > 0)
    }

    pub async fn key(&self, id: &str) -> Result<Option<ApiKey>, StoreError> {
        let row = sqlx::query(concat!("SELECT ", key_columns!(), " FROM api_keys WHERE id = $1"))
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(key_from_row).transpose()
    }

    pub async fn list_keys(&self, org: &str) -> Result<Vec<ApiKey>, StoreError> {
        let org = self.find_org(org).await?;
        let rows =
            sqlx::query(concat!("SELECT ", key_columns!(), " FROM api_keys WHERE org_id = $1 ORDER BY created_at, id"))
                .bind(&org.id)
                .fetch_all(&self.pool)
                .await?;
        rows.iter().map(key_from_row).collect()
    }

    /// The active key whose secret this is, if any. Malformed secrets never reach the
    /// database.
    pub async fn authenticate(&self, secret: &str) -> Result<Option<ApiKey>, StoreError> {
        if !keys::well_formed(secret) {
            return Ok(None);
        }
        let row = sqlx::query(concat!(
            "SELECT ",
            key_columns!(),
            " FROM api_keys WHERE secret_hash = $1 AND revoked_at IS NULL"
        ))
        .bind(keys::hash(secret))
        .fetch_optional(&self.pool)
        .await?;
        let key = row.as_ref().map(key_from_row).transpose()?;
        if let Some(key) = &key {
            self.touch_key(key).await?;
        }
        Ok(key)
    }

    /// Records that a key was used: at most one write a minute per key, so that the
    /// API's hot path is not a write per request.
    async fn touch_key(&self, key: &ApiKey) -> Result<(), StoreError> {
        let now = now();
        if key.last_used_at.is_some_and(|at| at > now - 60) {
            return Ok(());
        }
        sqlx::query(
            "UPDATE api_keys SET last_used_at = $1 WHERE id = $2 AND (last_used_at IS NULL OR last_used_at < $3)",
        )
        .bind(now)
        .bind(&key.id)
        .bind(now - 60)
        .execute(&self.pool)
        .await?;
        Ok(())
    }
}

pub(super) async fn insert_org(conn: &mut sqlx::AnyConnection, org: &Org) -> Result<(), StoreError> {
    sqlx::query("INSERT INTO orgs (id, name, created_at) VALUES ($1, $2, $3)")
        .bind(&org.id)
        .bind(&org.name)
        .bind(org.created_at)
        .execute(conn)
        .await?;
    Ok(())
}

/// Adds a member; one who is already in the organization keeps their role.
pub(super) async fn insert_membership(
    conn: &mut sqlx::AnyConnection,
    org_id: &str,
    user_id: &str,
    role: super::Role,
    at: i64,
) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO memberships (org_id, user_id, role, created_at) VALUES ($1, $2, $3, $4) \
         ON CONFLICT (org_id, user_id) DO NOTHING",
    )
    .bind(org_id)
    .bind(user_id)
    .bind(role.as_str())
    .bind(at)
    .execute(conn)
    .await?;
    Ok(())
}

/// An address with a name, an `@` and a dotted host, no spaces, at most 254 characters.
pub fn well_formed_email(email: &str) -> bool {
    email.len() <= 254
        && !email.chars().any(|c| c.is_whitespace() || c.is_control())
        && email
            .split_once('@')
            .is_some_and(|(name, host)| !name.is_empty() && host.contains('.') && !host.contains('@'))
}

/// E-mail addresses are compared and kept in lower case.
pub fn normalize_email(email: &str) -> String {
    email.trim().to_lowercase()
}

fn key_from_row(r: &sqlx::any::AnyRow) -> Result<ApiKey, StoreError> {
    Ok(ApiKey {
        id: r.try_get("id")?,
        org_id: r.try_get("org_id")?,
        name: r.try_get("name")?,
        billing_mode: r.try_get::<String, _>("billing_mode")?.parse()?,
        fallback_to_credits: r.try_get::<i64, _>("fallback_to_credits")? != 0,
        created_at: r.try_get("created_at")?,
        revoked_at: r.try_get("revoked_at")?,
        prefix: r.try_get("prefix")?,
        created_by: r.try_get("created_by")?,
        last_used_at: r.try_get("last_used_at")?,
    })
}

pub fn now() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64)
}
