-- Personal accounts and their subscription plans, payments, and the supply state that
-- sets each model's subscription discount. Times here are microseconds since the Unix
-- epoch; money is micro-dollars.

-- A person. Each has a personal organization of their own (`org_id`): its keys may be
-- billed to the person's plan, which organizations shared by several people cannot.
CREATE TABLE users (
    id TEXT PRIMARY KEY,
    email TEXT NOT NULL UNIQUE,
    org_id TEXT NOT NULL UNIQUE REFERENCES orgs (id),
    created_at BIGINT NOT NULL
);

-- One plan per user. The billing period is month `period` counted from `started_at`
-- (its bounds kept in `period_start`/`period_end`). Included usage is tracked here,
-- apart from the credit ledger: `included_micros` for the period (plan multiplier ×
-- `paid_micros`), `spent_micros` of it settled, `held_micros` reserved by requests in
-- flight (`in_flight` of them, bounded by the plan's concurrency). The 5-hour and 7-day
-- windows start with the first request after they lapse (NULL: not running).
CREATE TABLE subscriptions (
    user_id TEXT PRIMARY KEY REFERENCES users (id),
    -- new each time a plan is started: names its charges (idempotency keys)
    id TEXT NOT NULL UNIQUE,
    plan TEXT NOT NULL,
    -- a downgrade, taking effect when the period renews
    pending_plan TEXT,
    -- active or past_due (the renewal payment failed)
    status TEXT NOT NULL,
    payment_method TEXT NOT NULL,
    started_at BIGINT NOT NULL,
    period BIGINT NOT NULL,
    period_start BIGINT NOT NULL,
    period_end BIGINT NOT NULL,
    paid_micros BIGINT NOT NULL,
    included_micros BIGINT NOT NULL,
    spent_micros BIGINT NOT NULL DEFAULT 0,
    held_micros BIGINT NOT NULL DEFAULT 0,
    in_flight BIGINT NOT NULL DEFAULT 0,
    window_5h_start BIGINT,
    window_5h_spent BIGINT NOT NULL DEFAULT 0,
    window_7d_start BIGINT,
    window_7d_spent BIGINT NOT NULL DEFAULT 0
);

CREATE INDEX subscriptions_by_period_end ON subscriptions (period_end);

-- Money taken through the payment processor; the id is the charge's idempotency key,
-- so a charge retried or raced by another control plane is recorded once.
CREATE TABLE payments (
    id TEXT PRIMARY KEY,
    -- the user (plans) or organization (credits) who paid
    payer TEXT NOT NULL,
    -- plan, upgrade, renewal or credits
    purpose TEXT NOT NULL,
    amount_micros BIGINT NOT NULL,
    payment_method TEXT NOT NULL,
    processor_ref TEXT NOT NULL,
    created_at BIGINT NOT NULL
);

-- A hold is paid from credits (`org_id`'s balance) or from `user_id`'s included usage,
-- and is owned by the control-plane process that took it (`owner`).
ALTER TABLE holds ADD COLUMN funding TEXT NOT NULL DEFAULT 'credits';
ALTER TABLE holds ADD COLUMN user_id TEXT;
ALTER TABLE holds ADD COLUMN owner TEXT;

-- Control-plane processes alive, by heartbeat (µs): the holds of one that stops beating
-- are released, so that a crash frees a plan's concurrency within a minute, not a day.
CREATE TABLE control_planes (
    id TEXT PRIMARY KEY,
    heartbeat_at BIGINT NOT NULL
);

-- Each model's supply state per refresh slot (slot = start time / refresh interval),
-- written once by whichever control plane computes it first: every control plane reads
-- the same state back. The rows are the history /status shows.
CREATE TABLE supply_states (
    model TEXT NOT NULL,
    slot BIGINT NOT NULL,
    -- low, medium, high or surplus
    state TEXT NOT NULL,
    -- mean load over the slot, in basis points of capacity
    load_bp BIGINT NOT NULL,
    samples BIGINT NOT NULL,
    updated_at BIGINT NOT NULL,
    PRIMARY KEY (model, slot)
);
