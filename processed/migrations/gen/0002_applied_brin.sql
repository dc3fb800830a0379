-- A BRIN index on processed_at in each generation, for counting a
-- consumer's applied messages by time (the console's applied chart)
-- without reading a generation whole. A generation is only ever appended
-- to and then emptied whole (TRUNCATE), so its rows lie in the order they
-- were claimed, and processed_at (the claim transaction's start) rises
-- with it: a block range's summary is narrow. A claim pays almost nothing
-- for it: the index holds one summary per 128 pages, and the ranges being
-- filled are not summarized until the next one begins (autosummarize),
-- so an insert there writes nothing to the index. A scan reads the
-- unsummarized ranges, the newest, always.
--
-- The indexes keep their names when the janitor rotates the generations,
-- so a name need not say which generation its table is now: nothing reads
-- them by name.
CREATE INDEX {{brin0}} ON {{schema}}.{{g0}} USING brin (processed_at) WITH (autosummarize = on);
CREATE INDEX {{brin1}} ON {{schema}}.{{g1}} USING brin (processed_at) WITH (autosummarize = on);
CREATE INDEX {{brin2}} ON {{schema}}.{{g2}} USING brin (processed_at) WITH (autosummarize = on);
CREATE INDEX {{brin3}} ON {{schema}}.{{g3}} USING brin (processed_at) WITH (autosummarize = on);
