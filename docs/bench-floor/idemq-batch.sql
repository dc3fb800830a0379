-- batch.sql with idemq's own claim, as the runtime sends it for a batch of
-- 100 on a plain table (processed/store.go: claimOnce, newStatements and
-- txOptions): BEGIN, the claim cursor and the claim pipelined in one round
-- trip, the claim writing every column and passing the commit guard's
-- token; the ledger rows in one statement; CLOSE and COMMIT in one. The
-- table is the one `idemq migrate` makes, with the purge's index and the
-- commit guard's trigger.
\set base random(1, 1000000000000)
\startpipeline
BEGIN ISOLATION LEVEL READ COMMITTED;
DECLARE idemq_claim CURSOR FOR SELECT;
INSERT INTO processed_messages (consumer, message_id, fingerprint, source, partition, "offset", shard_key)
	SELECT 'batch', (:base::bigint * 1000 + g)::text,
		'\x0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef'::bytea, 'floor', NULL, NULL, NULL
	FROM generate_series(1, 100) g
	WHERE set_config('synchronous_commit', CASE WHEN current_setting('synchronous_commit') IN ('off', 'local') THEN 'on'
		ELSE current_setting('synchronous_commit') END, true) IS NOT NULL
		AND set_config('idemq.tx', 'floor', true) IS NOT NULL
	ON CONFLICT (consumer, message_id) DO NOTHING
	RETURNING message_id;
\endpipeline
INSERT INTO ledger (id, amount)
	SELECT (:base::bigint * 1000 + g)::text, g FROM generate_series(1, 100) g;
\startpipeline
CLOSE idemq_claim;
/* idemq-commit floor */ COMMIT;
\endpipeline
