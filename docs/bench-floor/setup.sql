-- The smallest tables a consumer's database work needs: a dedup table with
-- its primary key, and a ledger shaped as the bench's (no index). Run in
-- a scratch schema (floor.sh sets search_path).
CREATE TABLE claims (
	consumer     text        NOT NULL,
	message_id   text        NOT NULL,
	processed_at timestamptz NOT NULL DEFAULT now(),
	PRIMARY KEY (consumer, message_id));
CREATE TABLE ledger (
	id     text        NOT NULL,
	amount bigint      NOT NULL,
	at     timestamptz NOT NULL DEFAULT now());
