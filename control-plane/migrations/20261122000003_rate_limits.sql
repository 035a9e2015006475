-- Request rate limits per organization (GCRA). `rate_limit_rpm` overrides the server's
-- default; `tat_us` is the theoretical arrival time of the next request, in
-- microseconds since the Unix epoch, advanced by one conditional update per request.
ALTER TABLE orgs ADD COLUMN rate_limit_rpm BIGINT;

CREATE TABLE rate_limit_state (
    org_id TEXT PRIMARY KEY REFERENCES orgs (id),
    tat_us BIGINT NOT NULL
);
