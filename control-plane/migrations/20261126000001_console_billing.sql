-- The console's billing pages: a plan cancelled at the end of its period, and
-- requests for dedicated capacity.

-- When the plan ends instead of renewing (the end of the period it was cancelled in);
-- NULL: it renews.
ALTER TABLE subscriptions ADD COLUMN cancel_at BIGINT;

-- The console's usage sums read only these indexes, never the records' rows: one for a
-- range of time (replacing the narrower index on organization and time), one for a key.
DROP INDEX usage_records_by_org;
CREATE INDEX usage_records_by_org ON usage_records (org_id, created_at, model, key_id, funding, prompt_tokens,
    cached_tokens, completion_tokens, reasoning_tokens, cost_micros);
CREATE INDEX usage_records_by_key ON usage_records (org_id, key_id, created_at);

-- A request for dedicated GPU capacity, sourced by hand (SPEC.md item 7). Times in µs.
CREATE TABLE capacity_requests (
    id TEXT PRIMARY KEY,
    org_id TEXT NOT NULL REFERENCES orgs (id),
    requested_by TEXT NOT NULL REFERENCES users (id),
    gpu_type TEXT NOT NULL,
    -- vm, bare_metal or cluster
    topology TEXT NOT NULL,
    gpus BIGINT NOT NULL,
    nodes BIGINT NOT NULL,
    region TEXT NOT NULL,
    -- the first day wanted, YYYY-MM-DD
    start_date TEXT NOT NULL,
    term_months BIGINT NOT NULL,
    contact_name TEXT NOT NULL,
    contact_email TEXT NOT NULL,
    notes TEXT NOT NULL,
    -- received, in_review, quoted or closed
    status TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    updated_at BIGINT NOT NULL
);

CREATE INDEX capacity_requests_by_org ON capacity_requests (org_id, created_at);
