-- The commit guard of migration 0004 checks the COMMIT itself, so that the
-- runtime's commit needs no query of its own before it. BeginClaim's
-- transaction declares the cursor idemq_claim, and the runtime's commit is
-- the one simple-protocol query
--
--     /* idemq-commit <token> */ CLOSE idemq_claim; COMMIT
--
-- whose text, at COMMIT, the deferred trigger finds with current_query():
-- a COMMIT (or END, or PREPARE TRANSACTION) that a handler runs itself
-- carries no token, and fails, rolling the transaction back. The CLOSE
-- fails when the transaction open then is not the one BeginClaim began (a
-- handler ended it with SQL and began another): nothing is committed.
-- The trigger also raises the transaction's synchronous_commit again, as
-- the claim did, before the commit is written (a handler's SET LOCAL
-- synchronous_commit = off must not make the ack rest on an asynchronous
-- commit).
--
-- A commit by a process of an earlier version, which runs {{commit_check}}
-- (token) before COMMIT, sets idemq.commit to the token and still passes.
CREATE OR REPLACE FUNCTION {{schema}}.{{commit_guard}}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('idemq.commit', true) IS DISTINCT FROM current_setting('idemq.tx', true)
       AND coalesce(strpos(current_query(), '/* idemq-commit ' || current_setting('idemq.tx', true) || ' */'), 0) = 0 THEN
        RAISE EXCEPTION 'idemq: a handler ran COMMIT, END or PREPARE TRANSACTION on the runtime''s transaction; only the runtime commits it, so the transaction is rolled back'
            USING ERRCODE = '25000',
                  HINT = 'Return nil from the handler to commit, an error to roll back. With SET CONSTRAINTS, name your constraints rather than ALL.';
    END IF;
    IF current_setting('synchronous_commit') IN ('off', 'local') THEN
        PERFORM set_config('synchronous_commit', 'on', true);
    END IF;
    RETURN NULL;
END
$$;
