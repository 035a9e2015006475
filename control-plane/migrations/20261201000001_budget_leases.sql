-- Budget leases: a control plane's slice of an organization's credit, taken in one
-- transaction ('org:<id>' → 'leases:<id>') and spent in memory by its requests; their
-- settlements charge the lease ('leases:<id>' → 'revenue:<id>') in batches. The
-- remainder (granted − charged − returned) goes back to the organization when the
-- lease idles, when its control plane shuts down, or when that control plane stops
-- beating its heart (`control_planes`) and another one expires the lease.
CREATE TABLE budget_leases (
    id TEXT PRIMARY KEY,
    org_id TEXT NOT NULL REFERENCES orgs (id),
    -- the control-plane process spending it
    owner TEXT NOT NULL,
    granted BIGINT NOT NULL DEFAULT 0,
    charged BIGINT NOT NULL DEFAULT 0,
    returned BIGINT NOT NULL DEFAULT 0,
    renewals BIGINT NOT NULL DEFAULT 0,
    -- microseconds since the Unix epoch
    created_at BIGINT NOT NULL,
    closed_at BIGINT
);

CREATE INDEX budget_leases_open ON budget_leases (owner) WHERE closed_at IS NULL;

-- A request paid from a lease is written settled, with its lease: the holds table
-- still names every billed request once.
ALTER TABLE holds ADD COLUMN lease_id TEXT;
