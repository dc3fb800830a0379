-- Only the runtime commits a claim's transaction. BeginClaim sets the
-- setting idemq.tx to a token of its own in the transaction it begins, and
-- the transaction's COMMIT is preceded by {{commit_check}}(token), which
-- fails unless that transaction is still the one open, then sets
-- idemq.commit to the token. A COMMIT (or END, or PREPARE TRANSACTION) that
-- a handler runs itself finds idemq.commit unset, and the deferred trigger
-- below makes it fail: the transaction rolls back, claims and effects
-- together. Rows inserted outside BeginClaim's transactions (idemq.tx
-- unset) queue no trigger event.
CREATE OR REPLACE FUNCTION {{schema}}.{{commit_check}}(token text) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('idemq.tx', true) IS DISTINCT FROM token THEN
        RAISE EXCEPTION 'idemq: the transaction open at commit is not the one the runtime began: a handler ended it with SQL and began another; nothing is committed'
            USING ERRCODE = '25000';
    END IF;
    PERFORM set_config('idemq.commit', token, true);
END
$$;

CREATE OR REPLACE FUNCTION {{schema}}.{{commit_guard}}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('idemq.commit', true) IS DISTINCT FROM current_setting('idemq.tx', true) THEN
        RAISE EXCEPTION 'idemq: a handler ran COMMIT, END or PREPARE TRANSACTION on the runtime''s transaction; only the runtime commits it, so the transaction is rolled back'
            USING ERRCODE = '25000',
                  HINT = 'Return nil from the handler to commit, an error to roll back. With SET CONSTRAINTS, name your constraints rather than ALL.';
    END IF;
    RETURN NULL;
END
$$;

CREATE CONSTRAINT TRIGGER {{commit_guard}} AFTER INSERT ON {{table}}
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
    WHEN (current_setting('idemq.tx', true) <> '')
    EXECUTE FUNCTION {{schema}}.{{commit_guard}}();
