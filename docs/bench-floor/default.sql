-- The default's database work for a group of 32 messages (its largest
-- group), at its least: one transaction, the 32 claims in one statement
-- sent with the BEGIN (as the runtime pipelines them), then a per-message
-- handler's one ledger row each, a round trip each, and the COMMIT.
\set base random(1, 1000000000000)
\startpipeline
BEGIN;
INSERT INTO claims (consumer, message_id)
	SELECT 'default', (:base::bigint * 1000 + g)::text FROM generate_series(1, 32) g
	ON CONFLICT DO NOTHING;
\endpipeline
INSERT INTO ledger (id, amount) VALUES ((:base::bigint * 1000 + 1)::text, 1);
INSERT INTO ledger (id, amount) VALUES ((:base::bigint * 1000 + 2)::text, 2);
INSERT INTO ledger (id, amount) VALUES ((:base::bigint * 1000 + 3)::text, 3);
INSERT INTO ledger (id, amount) VALUES ((:base::bigint * 1000 + 4)::text, 4);
INSERT INTO ledger (id, amount) VALUES ((:base::bigint * 1000 + 5)::text, 5);
INSERT INTO ledger (id, amount) VALUES ((:base::bigint * 1000 + 6)::text, 6);
INSERT INTO ledger (id, amount) VALUES ((:base::bigint * 1000 + 7)::text, 7);
INSERT INTO ledger (id, amount) VALUES ((:base::bigint * 1000 + 8)::text, 8);
INSERT INTO ledger (id, amount) VALUES ((:base::bigint * 1000 + 9)::text, 9);
INSERT INTO ledger (id, amount) VALUES ((:base::bigint * 1000 + 10)::text, 10);
INSERT INTO ledger (id, amount) VALUES ((:base::bigint * 1000 + 11)::text, 11);
INSERT INTO ledger (id, amount) VALUES ((:base::bigint * 1000 + 12)::text, 12);
INSERT INTO ledger (id, amount) VALUES ((:base::bigint * 1000 + 13)::text, 13);
INSERT INTO ledger (id, amount) VALUES ((:base::bigint * 1000 + 14)::text, 14);
INSERT INTO ledger (id, amount) VALUES ((:base::bigint * 1000 + 15)::text, 15);
INSERT INTO ledger (id, amount) VALUES ((:base::bigint * 1000 + 16)::text, 16);
INSERT INTO ledger (id, amount) VALUES ((:base::bigint * 1000 + 17)::text, 17);
INSERT INTO ledger (id, amount) VALUES ((:base::bigint * 1000 + 18)::text, 18);
INSERT INTO ledger (id, amount) VALUES ((:base::bigint * 1000 + 19)::text, 19);
INSERT INTO ledger (id, amount) VALUES ((:base::bigint * 1000 + 20)::text, 20);
INSERT INTO ledger (id, amount) VALUES ((:base::bigint * 1000 + 21)::text, 21);
INSERT INTO ledger (id, amount) VALUES ((:base::bigint * 1000 + 22)::text, 22);
INSERT INTO ledger (id, amount) VALUES ((:base::bigint * 1000 + 23)::text, 23);
INSERT INTO ledger (id, amount) VALUES ((:base::bigint * 1000 + 24)::text, 24);
INSERT INTO ledger (id, amount) VALUES ((:base::bigint * 1000 + 25)::text, 25);
INSERT INTO ledger (id, amount) VALUES ((:base::bigint * 1000 + 26)::text, 26);
INSERT INTO ledger (id, amount) VALUES ((:base::bigint * 1000 + 27)::text, 27);
INSERT INTO ledger (id, amount) VALUES ((:base::bigint * 1000 + 28)::text, 28);
INSERT INTO ledger (id, amount) VALUES ((:base::bigint * 1000 + 29)::text, 29);
INSERT INTO ledger (id, amount) VALUES ((:base::bigint * 1000 + 30)::text, 30);
INSERT INTO ledger (id, amount) VALUES ((:base::bigint * 1000 + 31)::text, 31);
INSERT INTO ledger (id, amount) VALUES ((:base::bigint * 1000 + 32)::text, 32);
COMMIT;
