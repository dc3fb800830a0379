-- The partitioned layout (Config.Partitioned): the rows live in
-- generations, the tables {{table}}_g0, _g1 and _g2, each with its own
-- primary key. g0 is the current generation: every claim inserts into it,
-- after finding its id in neither g1 nor g2 (see generations.go). The
-- janitor rotates the four tables by renaming them, under one lock: g2
-- becomes g3, the retired generation, which it then empties (TRUNCATE),
-- and g3 the new g0. The view {{table}} shows the four, for operators.
-- {{generations_table}} numbers the generations and says when each became
-- current: the one in g0 is the highest, g1 holds the one before it, g2
-- the one before that.
--
-- The plain table, with its rows, becomes g1: the generation before the
-- first, which ended now.
ALTER TABLE {{table}} RENAME TO {{g1}};
DROP INDEX {{schema}}.{{consumer_processed_at_index}};
CREATE TABLE {{schema}}.{{g0}} (LIKE {{schema}}.{{g1}} INCLUDING ALL);
CREATE TABLE {{schema}}.{{g2}} (LIKE {{schema}}.{{g1}} INCLUDING ALL);
CREATE TABLE {{schema}}.{{g3}} (LIKE {{schema}}.{{g1}} INCLUDING ALL);
-- g1 keeps the commit guard of migration 0004; the others get their own.
CREATE CONSTRAINT TRIGGER {{commit_guard}} AFTER INSERT ON {{schema}}.{{g0}}
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
    WHEN (current_setting('idemq.tx', true) <> '')
    EXECUTE FUNCTION {{schema}}.{{commit_guard}}();
CREATE CONSTRAINT TRIGGER {{commit_guard}} AFTER INSERT ON {{schema}}.{{g2}}
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
    WHEN (current_setting('idemq.tx', true) <> '')
    EXECUTE FUNCTION {{schema}}.{{commit_guard}}();
CREATE CONSTRAINT TRIGGER {{commit_guard}} AFTER INSERT ON {{schema}}.{{g3}}
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
    WHEN (current_setting('idemq.tx', true) <> '')
    EXECUTE FUNCTION {{schema}}.{{commit_guard}}();

CREATE TABLE {{schema}}.{{generations_table}} (
    generation bigint      PRIMARY KEY,
    began_at   timestamptz NOT NULL
);
INSERT INTO {{schema}}.{{generations_table}} VALUES (0, '-infinity'), (1, '-infinity'), (2, clock_timestamp());

CREATE VIEW {{table}} AS
    SELECT * FROM {{schema}}.{{g0}}
    UNION ALL SELECT * FROM {{schema}}.{{g1}}
    UNION ALL SELECT * FROM {{schema}}.{{g2}}
    UNION ALL SELECT * FROM {{schema}}.{{g3}};

-- The plain table's grants go to every generation (they take turns) and
-- to the view.
DO $$
DECLARE
    g record;
BEGIN
    FOR g IN
        SELECT a.privilege_type AS priv,
               CASE a.grantee WHEN 0 THEN 'PUBLIC' ELSE quote_ident(pg_get_userbyid(a.grantee)) END AS who
        FROM pg_class c, aclexplode(c.relacl) a
        WHERE c.oid = to_regclass('{{schema}}.{{g1}}') AND a.grantee <> c.relowner
    LOOP
        EXECUTE format('GRANT %s ON {{schema}}.{{g0}}, {{schema}}.{{g2}}, {{schema}}.{{g3}}, {{table}} TO %s', g.priv, g.who);
    END LOOP;
END
$$;
