-- Organizations and their API keys. Portable SQL: the same file runs on SQLite and
-- PostgreSQL (integers are BIGINT, booleans 0/1, times Unix seconds).
CREATE TABLE orgs (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    created_at BIGINT NOT NULL
);

CREATE TABLE api_keys (
    id TEXT PRIMARY KEY,
    org_id TEXT NOT NULL REFERENCES orgs (id),
    name TEXT NOT NULL,
    -- SHA-256 of the secret, hex; the secret itself is never stored.
    secret_hash TEXT NOT NULL UNIQUE,
    billing_mode TEXT NOT NULL,
    fallback_to_credits BIGINT NOT NULL DEFAULT 0,
    created_at BIGINT NOT NULL,
    revoked_at BIGINT
);

CREATE INDEX api_keys_by_org ON api_keys (org_id);
