-- Leases. A relay claims due rows in a short transaction: it writes a fresh
-- lease_token and its lease_owner, and moves next_attempt_at to the end of
-- the lease, then commits and publishes with no transaction open. It records
-- each row's outcome only WHERE lease_token is still its token (a fencing
-- token): a relay whose lease expired and whose rows another relay claimed
-- since cannot overwrite that relay's result. Recording an outcome clears
-- both columns. While a relay holds a row, next_attempt_at is when its lease
-- expires, so a row whose relay died is due again then, and the relay poll
-- keeps using the pending index. Rows of a version 1 table have no lease and
-- are claimable as they were.
ALTER TABLE {{table}}
    ADD COLUMN IF NOT EXISTS lease_token uuid,
    ADD COLUMN IF NOT EXISTS lease_owner text;
