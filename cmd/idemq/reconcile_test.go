package main

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/cmd/idemq/internal/reconcile"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/keys"
	"github.com/idemq/idemq/outbox"
	"github.com/idemq/idemq/processed"
)

const reconcileStep = "ledger-entry-recorded/v1"

// reconcileChain makes the schemas of examples/chain (payments, ledger,
// notify) with n keys through the whole chain an hour ago, and returns
// the schemas and the reconcile arguments that check them.
func reconcileChain(t *testing.T, n int) (map[string]string, []string) {
	t.Helper()
	ctx := context.Background()
	pool := testdb.Pool(t)
	schemas := map[string]string{}
	for _, s := range []string{"payments", "ledger", "notify"} {
		schemas[s] = testdb.Schema(t)
		ob, err := outbox.New(pool, outbox.Config{Schema: schemas[s]})
		if err != nil {
			t.Fatal(err)
		}
		st, err := processed.New(pool, processed.Config{Schema: schemas[s]})
		if err != nil {
			t.Fatal(err)
		}
		if err := ob.Migrate(ctx); err != nil {
			t.Fatal(err)
		}
		if err := st.Migrate(ctx); err != nil {
			t.Fatal(err)
		}
	}
	at := time.Now().Add(-time.Hour)
	exec := func(sql string, args ...any) {
		t.Helper()
		if _, err := pool.Exec(ctx, sql, args...); err != nil {
			t.Fatal(err)
		}
	}
	tbl := func(s, name string) string { return pgx.Identifier{schemas[s], name}.Sanitize() }
	for i := range n {
		id := "charge-" + string(rune('a'+i%26)) + string(rune('a'+i/26))
		child := keys.ChildKey(id, reconcileStep)
		exec(`INSERT INTO `+tbl("payments", "outbox")+` (destination, message_id, body, sent_at) VALUES ('chain.charges', $1, '', $2)`, id, at)
		// Each step ten minutes after the one before: more than the grace
		// after the oldest row of the outbox it comes from.
		exec(`INSERT INTO `+tbl("ledger", "processed_messages")+` (consumer, message_id, fingerprint, processed_at) VALUES ('ledger', $1, $2, $3)`, id, make([]byte, 32), at.Add(10*time.Minute))
		exec(`INSERT INTO `+tbl("ledger", "outbox")+` (destination, message_id, body, sent_at) VALUES ('chain.ledger', $1, '', $2)`, child, at.Add(10*time.Minute))
		exec(`INSERT INTO `+tbl("notify", "processed_messages")+` (consumer, message_id, fingerprint, processed_at) VALUES ('notify', $1, $2, $3)`, child, make([]byte, 32), at.Add(20*time.Minute))
	}
	args := []string{"reconcile", "--database-url", testdb.URL(), "--db", "payments", "--db", "ledger", "--db", "notify=" + testdb.URL(),
		"--schema", "payments=" + schemas["payments"], "--schema", "ledger=" + schemas["ledger"], "--schema", "notify=" + schemas["notify"],
		"--flow", "payments:chain.charges->ledger:ledger",
		"--flow", "ledger:ledger=>ledger:chain.ledger@" + reconcileStep,
		"--flow", "ledger:chain.ledger->notify:notify", "--since", "3h"}
	return schemas, args
}

func TestReconcileCleanAndBroken(t *testing.T) {
	t.Parallel()
	schemas, args := reconcileChain(t, 20)
	out := filepath.Join(t.TempDir(), "last.json")
	r := idemq(t, append(args, "--out", out)...)
	want(t, r, exitOK, "CLEAN", "")
	want(t, r, exitOK, "scanned         40 sent outbox rows, 40 dedup rows, 0 pending outbox rows", "")
	var rep reconcile.Report
	b, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &rep); err != nil || !rep.Clean {
		t.Fatalf("--out: %v, %s", err, b)
	}
	if tmp, _ := filepath.Glob(filepath.Join(filepath.Dir(out), ".*")); len(tmp) > 0 {
		t.Errorf("temporary files left: %v", tmp)
	}

	// Break it: notify loses a dedup row (never applied), the ledger an
	// outbox row (not forwarded, and notify's row has no origin).
	ctx := context.Background()
	pool := testdb.Pool(t)
	if _, err := pool.Exec(ctx, `DELETE FROM `+pgx.Identifier{schemas["notify"], "processed_messages"}.Sanitize()+` WHERE message_id = $1`, keys.ChildKey("charge-aa", reconcileStep)); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `DELETE FROM `+pgx.Identifier{schemas["ledger"], "outbox"}.Sanitize()+` WHERE message_id = $1`, keys.ChildKey("charge-ba", reconcileStep)); err != nil {
		t.Fatal(err)
	}
	r = idemq(t, append(args, "--json", "--out", out)...)
	want(t, r, exitFail, "", "idemq reconcile: 3 discrepancies found")
	rep = reconcile.Report{}
	if err := json.Unmarshal([]byte(r.stdout), &rep); err != nil {
		t.Fatalf("--json: %v\n%s", err, r.stdout)
	}
	if rep.NeverApplied.Count != 1 || rep.NeverApplied.Samples[0].MessageID != keys.ChildKey("charge-aa", reconcileStep) ||
		rep.NotForwarded.Count != 1 || rep.NotForwarded.Samples[0].MessageID != "charge-ba" ||
		rep.UnknownOrigin.Count != 1 || rep.UnknownOrigin.Samples[0].MessageID != keys.ChildKey("charge-ba", reconcileStep) || rep.Clean {
		t.Errorf("report %+v", rep)
	}
	if b, _ := os.ReadFile(out); !strings.Contains(string(b), `"clean": false`) {
		t.Errorf("--out not rewritten: %s", b)
	}

	// The text form names each and says where dead letters count.
	r = idemq(t, args...)
	want(t, r, exitFail, "3 DISCREPANCIES", "")
	want(t, r, exitFail, "charge-ba  consumer ledger  destination chain.ledger  in ledger", "")
	want(t, r, exitFail, "idemq dlq inspect", "")

	// Paged 7 at a time, the same findings.
	r = idemq(t, append(args, "--json", "--page", "7")...)
	var paged reconcile.Report
	if err := json.Unmarshal([]byte(r.stdout), &paged); err != nil || paged.Discrepancies != 3 || paged.Scanned != rep.Scanned {
		t.Errorf("paged: %v %+v", err, paged)
	}
}

func TestReconcileUsage(t *testing.T) {
	t.Parallel()
	_, args := reconcileChain(t, 1)
	for _, tc := range []struct {
		args []string
		err  string
	}{
		{[]string{"reconcile", "--flow", "a:q->b:c"}, "--db is required"},
		{[]string{"reconcile", "--db", "a"}, "--flow is required"},
		{[]string{"reconcile", "--db", "a", "--db", "a", "--flow", "a:q->a:c"}, "--db a given twice"},
		{[]string{"reconcile", "--db", "a", "--flow", "a:q-b:c"}, "want PRODUCER:DESTINATION->DATABASE:CONSUMER"},
		{[]string{"reconcile", "--db", "a", "--flow", "a,b:q->a:c"}, "one producer database"},
		{[]string{"reconcile", "--db", "a", "--flow", "a:c=>a:q"}, "want DESTINATION@STEP"},
		{[]string{"reconcile", "--db", "a", "--flow", "a:q->z:c"}, "Flows[0].ConsumerDatabases: no database named \"z\""},
		{[]string{"reconcile", "--db", "a", "--schema", "b=x", "--flow", "a:q->a:c"}, "--schema b: no --db b"},
		{[]string{"reconcile", "--db", "a", "--flow", "a:q->a:c", "--since", "yesterday"}, "--since \"yesterday\""},
		{[]string{"reconcile", "--db", "a", "--flow", "a:q->a:c", "--since", "1m"}, "nothing in the window is old enough"},
		{[]string{"reconcile", "--db", "a", "--flow", "a:q->a:c", "--page", "0"}, "--page 0"},
		{[]string{"reconcile", "--db", "a", "--flow", "a:q->a:c", "--grace", "0s"}, "--grace 0s"},
		{[]string{"reconcile", "--db", "a", "--flow", "a:q->a:c", "--dlq", "c=sqs:q"}, "broker \"sqs\""},
		{[]string{"reconcile", "--db", "a", "--flow", "a:q->a:c", "--outbox-table", "a=x.y.z"}, `"y.z" is not a plain identifier`},
	} {
		r := idemq(t, tc.args...)
		want(t, r, exitUsage, "", tc.err)
	}
	// A database that cannot be reached, its password never shown: exit 2.
	r := idemq(t, "reconcile", "--db", "a=postgres://u:s3cr3t-pw@127.0.0.1:1/x?connect_timeout=2", "--flow", "a:q->a:c")
	want(t, r, exitUsage, "", "cannot connect to Postgres at postgres://u:xxxxx@127.0.0.1:1/x")
	if strings.Contains(r.stderr, "s3cr3t-pw") {
		t.Errorf("the password is shown: %s", r.stderr)
	}
	if strings.Contains(r.stderr, "--help") {
		t.Errorf("a check that could not run is not a usage mistake: %s", r.stderr)
	}
	// A table that does not exist: exit 2, naming it.
	r = idemq(t, append(args, "--outbox-table", "payments=nope")...)
	want(t, r, exitUsage, "", "cannot reconcile: reconcile: database payments: the outbox table ")
	// --help.
	r = idemq(t, "reconcile", "--help")
	want(t, r, exitOK, "PRODUCER:DESTINATION->CONSUMERDB", "")
}

// TestReconcileDeadLetteredFromTheQueue: a message published and never
// applied whose id is in the consumer's dead-letter queue, read with
// --dlq as 'idemq dlq inspect' reads it, counts as dead-lettered, not as
// a discrepancy; a dead letter of another consumer does not.
func TestReconcileDeadLetteredFromTheQueue(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	schemas, args := reconcileChain(t, 20)
	lostID := keys.ChildKey("charge-aa", reconcileStep)
	if _, err := testdb.Pool(t).Exec(ctx, `DELETE FROM `+pgx.Identifier{schemas["notify"], "processed_messages"}.Sanitize()+` WHERE message_id = $1`, lostID); err != nil {
		t.Fatal(err)
	}
	// The id dead-lettered by notify in one queue, by another consumer in
	// another.
	at := time.Now().Add(-time.Minute)
	deadLetter := func(consumerName string) string {
		work, dead := rmqQueues(t)
		f := consumer.Failure{Consumer: consumerName, MessageID: lostID, Class: consumer.ClassPermanent, Attempts: 1,
			FirstFailure: at, LastFailure: at, Err: consumer.Permanent(errors.New("no address"))}
		if err := rmqDeadLetterer(ctx, t, dead, dlq.Options{}).DeadLetter(ctx, &consumer.Message{ID: lostID, Body: []byte("{}"), Source: work, Partition: -1, Offset: -1}, f); err != nil {
			t.Fatal(err)
		}
		return dead
	}
	dead, others := deadLetter("notify"), deadLetter("billing")
	r := idemq(t, append(args, "--json", "--dlq", "notify=rabbitmq:"+others)...)
	want(t, r, exitFail, lostID, "")
	// Without --dlq it is never applied.
	r = idemq(t, append(args, "--json")...)
	want(t, r, exitFail, lostID, "")
	// With it, dead-lettered, and the run is clean.
	r = idemq(t, append(args, "--json", "--dlq", "notify=rabbitmq:"+dead)...)
	want(t, r, exitOK, "", "")
	var rep reconcile.Report
	if err := json.Unmarshal([]byte(r.stdout), &rep); err != nil {
		t.Fatalf("--json: %v\n%s", err, r.stdout)
	}
	if rep.NeverApplied.Count != 0 || rep.DeadLettered.Count != 1 || rep.DeadLettered.Samples[0].MessageID != lostID || !rep.Clean {
		t.Errorf("report %+v", rep)
	}
	if n := rmqDepth(t, dead); n != 1 {
		t.Errorf("the dead-letter queue holds %d after reconcile read it, want 1: it must consume nothing", n)
	}
}
