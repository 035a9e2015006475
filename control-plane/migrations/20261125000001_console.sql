-- The web console: passwords, organization membership with roles, browser sessions,
-- e-mailed invites, one-time account links and sign-in throttling. Every secret here
-- (session token, invite code, link token, device token) is stored as its SHA-256
-- only; passwords as argon2id PHC strings. Times are Unix seconds.

-- NULL until the person sets one (accounts made by `tessera users create`).
ALTER TABLE users ADD COLUMN password_hash TEXT;

-- The first characters of the secret, shown in lists (NULL for keys made before).
ALTER TABLE api_keys ADD COLUMN prefix TEXT;
-- The user who created the key in the console (NULL: the operator's CLI).
ALTER TABLE api_keys ADD COLUMN created_by TEXT;
-- Updated at most once a minute per key.
ALTER TABLE api_keys ADD COLUMN last_used_at BIGINT;

-- role: owner or member. Every organization keeps at least one owner once it has one.
CREATE TABLE memberships (
    org_id TEXT NOT NULL REFERENCES orgs (id),
    user_id TEXT NOT NULL REFERENCES users (id),
    role TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    PRIMARY KEY (org_id, user_id)
);
CREATE INDEX memberships_by_user ON memberships (user_id);
-- Everyone owns their personal organization.
INSERT INTO memberships (org_id, user_id, role, created_at) SELECT org_id, id, 'owner', created_at FROM users;

CREATE TABLE sessions (
    token_hash TEXT PRIMARY KEY,
    user_id TEXT NOT NULL REFERENCES users (id),
    created_at BIGINT NOT NULL,
    last_seen_at BIGINT NOT NULL
);
CREATE INDEX sessions_by_user ON sessions (user_id);

CREATE TABLE invites (
    id TEXT PRIMARY KEY,
    org_id TEXT NOT NULL REFERENCES orgs (id),
    -- lower case; only this address may accept
    email TEXT NOT NULL,
    role TEXT NOT NULL,
    code_hash TEXT NOT NULL UNIQUE,
    invited_by TEXT NOT NULL REFERENCES users (id),
    created_at BIGINT NOT NULL,
    sent_at BIGINT NOT NULL,
    expires_at BIGINT NOT NULL,
    accepted_at BIGINT,
    accepted_by TEXT,
    cancelled_at BIGINT
);
CREATE INDEX invites_by_org ON invites (org_id);

-- One-time links printed by the server: `owner` makes the first owner of `org_id`,
-- `password` sets the password of `user_id`.
CREATE TABLE account_links (
    token_hash TEXT PRIMARY KEY,
    purpose TEXT NOT NULL,
    user_id TEXT,
    org_id TEXT,
    created_at BIGINT NOT NULL,
    expires_at BIGINT NOT NULL,
    used_at BIGINT
);

-- Failed sign-ins, per scope (`account:<e-mail>` or `address:<client address>`).
CREATE TABLE sign_in_failures (
    scope TEXT NOT NULL,
    at BIGINT NOT NULL
);
CREATE INDEX sign_in_failures_by_scope ON sign_in_failures (scope, at);

-- Browsers that have signed in to an account: the per-account throttle spares them,
-- so that failures an attacker causes never lock the owner out.
CREATE TABLE known_devices (
    token_hash TEXT PRIMARY KEY,
    user_id TEXT NOT NULL REFERENCES users (id),
    created_at BIGINT NOT NULL
);

-- Facts about this installation: `bootstrap_org` is the organization made on first
-- start, whose first owner the printed one-time link creates.
CREATE TABLE settings (
    name TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
INSERT INTO settings (name, value)
    SELECT 'bootstrap_org', id FROM orgs WHERE name = 'default' ORDER BY created_at, id LIMIT 1;
