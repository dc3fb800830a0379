-- Earlier versions made the table range-partitioned, from Go code outside
-- these migrations, when Config.Partitioned was set. The partitioned layout
-- is now the generations of the gen migrations, which start from a plain
-- table: a table of the earlier layout is made plain again here, with its
-- rows (one pass over them) and its grants. Any other table is left as it
-- is.
DO $$
DECLARE
    g record;
BEGIN
    IF (SELECT relkind FROM pg_class WHERE oid = to_regclass('{{table}}')) IS DISTINCT FROM 'p' THEN
        RETURN;
    END IF;
    ALTER TABLE {{table}} RENAME TO {{old_partitioned}};
    CREATE TABLE {{table}} (LIKE {{schema}}.{{old_partitioned}} INCLUDING DEFAULTS INCLUDING CONSTRAINTS,
        PRIMARY KEY (consumer, message_id));
    -- The earlier layout's defects could leave one id in two partitions:
    -- its first claim's row stays.
    INSERT INTO {{table}}
        SELECT DISTINCT ON (consumer, message_id) * FROM {{schema}}.{{old_partitioned}}
        ORDER BY consumer, message_id, processed_at;
    FOR g IN
        SELECT a.privilege_type AS priv,
               CASE a.grantee WHEN 0 THEN 'PUBLIC' ELSE quote_ident(pg_get_userbyid(a.grantee)) END AS who
        FROM pg_class c, aclexplode(c.relacl) a
        WHERE c.oid = to_regclass('{{schema}}.{{old_partitioned}}') AND a.grantee <> c.relowner
    LOOP
        EXECUTE format('GRANT %s ON {{table}} TO %s', g.priv, g.who);
    END LOOP;
    DROP TABLE {{schema}}.{{old_partitioned}} CASCADE;
    DROP TABLE IF EXISTS {{schema}}.{{old_sealed}}, {{schema}}.{{old_filter}};
END
$$;
