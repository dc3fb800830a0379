-- Batch mode's database work for 100 messages, at its least: one
-- transaction, the 100 claims in one statement sent with the BEGIN (as the
-- runtime pipelines them), the 100 ledger rows in one, the COMMIT: three
-- round trips.
\set base random(1, 1000000000000)
\startpipeline
BEGIN;
INSERT INTO claims (consumer, message_id)
	SELECT 'batch', (:base::bigint * 1000 + g)::text FROM generate_series(1, 100) g
	ON CONFLICT DO NOTHING;
\endpipeline
INSERT INTO ledger (id, amount)
	SELECT (:base::bigint * 1000 + g)::text, g FROM generate_series(1, 100) g;
COMMIT;
