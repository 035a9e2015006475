-- Money, as a double-entry ledger in integer micro-dollars (1e-6 USD). Every transfer
-- moves a positive amount from one account to another, so the balances of all accounts
-- always sum to zero. Accounts: 'org:<id>' (an organization's spendable credit),
-- 'holds:<id>' (its credit reserved by requests in flight), 'revenue:<id>' (what its
-- requests cost), 'grants' (where granted and purchased credit comes from; it goes
-- negative).
-- `balance` is the running sum of an account's transfers, kept in the same transaction
-- as each transfer: the conditional update on it is what admits a request.
CREATE TABLE ledger_accounts (
    id TEXT PRIMARY KEY,
    balance BIGINT NOT NULL DEFAULT 0
);

INSERT INTO ledger_accounts (id, balance) VALUES ('grants', 0);

CREATE TABLE ledger_transfers (
    id TEXT PRIMARY KEY,
    from_account TEXT NOT NULL REFERENCES ledger_accounts (id),
    to_account TEXT NOT NULL REFERENCES ledger_accounts (id),
    amount BIGINT NOT NULL CHECK (amount > 0),
    -- grant, hold, release or charge
    kind TEXT NOT NULL,
    request_id TEXT,
    memo TEXT NOT NULL DEFAULT '',
    created_at BIGINT NOT NULL
);

CREATE INDEX ledger_transfers_by_request ON ledger_transfers (request_id);

-- A request's reservation of its worst-case cost, settled exactly once.
CREATE TABLE holds (
    request_id TEXT PRIMARY KEY,
    org_id TEXT NOT NULL REFERENCES orgs (id),
    amount BIGINT NOT NULL,
    created_at BIGINT NOT NULL,
    settled_at BIGINT
);

-- One per settled request: what it used and what it cost.
CREATE TABLE usage_records (
    request_id TEXT PRIMARY KEY REFERENCES holds (request_id),
    org_id TEXT NOT NULL REFERENCES orgs (id),
    key_id TEXT NOT NULL,
    model TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    prompt_tokens BIGINT NOT NULL,
    cached_tokens BIGINT NOT NULL,
    completion_tokens BIGINT NOT NULL,
    reasoning_tokens BIGINT NOT NULL,
    cost_micros BIGINT NOT NULL,
    -- credits (subscriptions come with their issue)
    funding TEXT NOT NULL,
    -- the supply discount's multiplier in basis points (10000 = no discount)
    multiplier_bp BIGINT NOT NULL,
    finish_reason TEXT NOT NULL,
    -- microseconds since the Unix epoch: requests settle many to a second
    created_at BIGINT NOT NULL
);

CREATE INDEX usage_records_by_org ON usage_records (org_id, created_at);
