//! The database, through sqlx's `Any` driver: a SQLite file (the default; or memory),
//! or PostgreSQL shared by several control planes. It is opened and migrated here,
//! once, and every service that keeps its state in it is built from it.

use crate::billing::payments::PaymentProcessor;
use sqlx::AnyPool;
use sqlx::any::AnyPoolOptions;
use std::sync::Arc;

/// The schema, embedded: applied in order on open, each migration once.
static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("unsupported database URL {0:?}: use sqlite://PATH or postgres://…")]
    Url(String),
    #[error("database: {0}")]
    Connect(#[from] sqlx::Error),
    #[error("database migrations: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
}

/// An open, migrated database: a pool of connections, cheap to clone.
#[derive(Clone)]
pub struct Db {
    pool: AnyPool,
}

impl Db {
    /// Connects (creating a SQLite file if missing) and applies pending migrations.
    pub async fn open(url: &str) -> Result<Self, DbError> {
        sqlx::any::install_default_drivers();
        let (url, connections) = if let Some(rest) = url.strip_prefix("sqlite:") {
            // One connection for an in-memory database, which each connection would
            // otherwise get a fresh copy of.
            let memory = rest.contains(":memory:");
            let url = if memory || rest.contains("mode=") {
                url.to_string()
            } else {
                format!("{url}{}mode=rwc", if rest.contains('?') { "&" } else { "?" })
            };
            (url, if memory { 1 } else { 4 })
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            (url.to_string(), 8)
        } else {
            return Err(DbError::Url(url.to_string()));
        };
        let sqlite = url.starts_with("sqlite:");
        let pool = AnyPoolOptions::new()
            .max_connections(connections)
            .after_connect(move |conn, _| {
                Box::pin(async move {
                    if sqlite {
                        // Write-ahead logging: readers never wait for the writer, and a
                        // commit is one append rather than a journal rewrite (an
                        // application crash loses nothing; a power cut may lose the
                        // last commits whole, never half of one). Writers queue for
                        // up to 5 s.
                        for pragma in
                            ["PRAGMA journal_mode = WAL", "PRAGMA synchronous = NORMAL", "PRAGMA busy_timeout = 5000"]
                        {
                            sqlx::query(pragma).execute(&mut *conn).await?;
                        }
                    }
                    Ok(())
                })
            })
            .connect(&url)
            .await?;
        MIGRATOR.run(&pool).await?;
        Ok(Self { pool })
    }

    /// Organizations, people, members, keys, invites, settings.
    pub fn accounts(&self) -> crate::accounts::Store {
        crate::accounts::Store::new(self.pool.clone())
    }

    /// The credit ledger and usage records.
    pub fn ledger(&self) -> crate::billing::Ledger {
        crate::billing::Ledger::new(self.pool.clone())
    }

    /// Personal plans, paid through `processor`.
    pub fn subscriptions(&self, processor: Arc<dyn PaymentProcessor>) -> crate::billing::subscriptions::Subscriptions {
        crate::billing::subscriptions::Subscriptions::new(self.pool.clone(), processor)
    }

    /// Each model's supply state.
    pub fn supply(&self) -> crate::billing::supply::Supply {
        crate::billing::supply::Supply::new(self.pool.clone())
    }

    /// Billing: credits, plans paid through `processor`, supply.
    pub fn billing(&self, processor: Arc<dyn PaymentProcessor>) -> crate::billing::Billing {
        crate::billing::Billing::new(self.ledger(), self.subscriptions(processor), self.supply())
    }

    /// Requests for dedicated capacity.
    pub fn capacity_requests(&self) -> crate::capacity::CapacityRequests {
        crate::capacity::CapacityRequests::new(self.pool.clone())
    }

    /// Request rate limits, shared by every control plane on the database.
    /// Organizations' scheduling weights (fair sharing), cached per process.
    pub fn weights(&self) -> crate::weights::Weights {
        crate::weights::Weights::new(self.pool.clone())
    }

    pub fn rate_limiter(&self, config: crate::limits::RateConfig) -> crate::limits::RateLimiter {
        crate::limits::RateLimiter::new(self.pool.clone(), config)
    }

    /// GET /status's per-minute aggregates.
    pub fn status_minutes(&self) -> crate::status::Minutes {
        crate::status::Minutes::new(self.pool.clone())
    }

    /// Closes the connections: later queries fail (tests of a database going away).
    pub async fn close(&self) {
        self.pool.close().await;
    }
}
