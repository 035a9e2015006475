-- The id a client gave its request (X-Client-Request-Id, or vLLM's X-Request-Id), kept
-- beside ours: ours stays the key, since a client's need not be unique.
ALTER TABLE usage_records ADD COLUMN client_request_id TEXT;
