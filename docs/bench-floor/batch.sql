-- Batch mode's database work for 100 messages, at its least: one
-- transaction, the 100 claims in one statement, the 100 ledger rows in one.
\set base random(1, 1000000000000)
BEGIN;
INSERT INTO claims (consumer, message_id)
	SELECT 'batch', (:base::bigint * 1000 + g)::text FROM generate_series(1, 100) g
	ON CONFLICT DO NOTHING;
INSERT INTO ledger (id, amount)
	SELECT (:base::bigint * 1000 + g)::text, g FROM generate_series(1, 100) g;
COMMIT;
