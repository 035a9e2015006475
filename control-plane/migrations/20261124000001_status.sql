-- What GET /status reports, per model and per minute (`minute`: minutes since the Unix
-- epoch). Control planes add their counts to the same row, so the sums are the whole
-- service's. `updated_at` (µs since the epoch) is the latest write, which says whether
-- the aggregates are current. Rows older than 31 days are deleted.
CREATE TABLE status_minutes (
    minute BIGINT NOT NULL,
    model TEXT NOT NULL,
    -- generations that ran or failed on our side (client errors are not counted)
    requests BIGINT NOT NULL DEFAULT 0,
    failures BIGINT NOT NULL DEFAULT 0,
    -- time to first token: how many were measured, and their sum
    ttfb_samples BIGINT NOT NULL DEFAULT 0,
    ttfb_us BIGINT NOT NULL DEFAULT 0,
    -- decoding speed: tokens after the first, and the time they took
    tps_samples BIGINT NOT NULL DEFAULT 0,
    decode_tokens BIGINT NOT NULL DEFAULT 0,
    decode_us BIGINT NOT NULL DEFAULT 0,
    updated_at BIGINT NOT NULL,
    PRIMARY KEY (minute, model)
);
