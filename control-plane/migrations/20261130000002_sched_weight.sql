-- An organization's share of each replica's batch relative to others' (fair sharing):
-- NULL is the default weight, 1.
ALTER TABLE orgs ADD COLUMN sched_weight BIGINT;
