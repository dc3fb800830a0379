package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/brokers/rabbitmq"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/dedup"
	"github.com/idemq/idemq/dlq"
)

// rmqQueues declares a fresh work queue and DLQ, deleted at cleanup.
func rmqQueues(t *testing.T) (work, dead string) {
	t.Helper()
	var b [4]byte
	_, _ = rand.Read(b[:])
	work = "idemq-cli-test-" + hex.EncodeToString(b[:])
	dead = work + ".dlq"
	conn, err := amqp.Dial(rabbitmq.DefaultURL)
	if err != nil {
		t.Fatalf("RabbitMQ at %s: %v", rabbitmq.DefaultURL, err)
	}
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{work, dead} {
		if _, err := ch.QueueDeclare(q, true, false, false, false, nil); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		for _, q := range []string{work, dead} {
			_, _ = ch.QueueDelete(q, false, false, false)
		}
		_ = conn.Close()
	})
	return work, dead
}

func rmqDepth(t *testing.T, q string) int {
	t.Helper()
	conn, err := amqp.Dial(rabbitmq.DefaultURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	st, err := ch.QueueDeclarePassive(q, true, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	return st.Messages
}

// rmqDeadLetterer returns a dead-letterer publishing, confirmed, to the
// RabbitMQ queue dead; its publisher closes at cleanup.
func rmqDeadLetterer(ctx context.Context, t *testing.T, dead string, opts dlq.Options) consumer.DeadLetterer {
	t.Helper()
	pub, err := rabbitmq.NewPublisher(ctx, rabbitmq.PublisherConfig{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	dl, err := dlq.NewDeadLetterer(func(ctx context.Context, m *consumer.Message) error {
		return pub.Publish(ctx, "", dead, m)
	}, opts)
	if err != nil {
		t.Fatal(err)
	}
	return dl
}

func TestDLQInspectAndReplayRabbitMQ(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	store, dbArgs := migrated(t)
	work, dead := rmqQueues(t)

	dl := rmqDeadLetterer(ctx, t, dead, dlq.Options{})
	// Five dead letters: three permanent, one timeout, and one whose id
	// was in fact applied.
	for i := 0; i < 5; i++ {
		id := fmt.Sprintf("m-%d", i)
		class, reason := consumer.ClassPermanent, "unknown account"
		if i == 3 {
			class, reason = consumer.ClassTimeout, "handler timed out"
		}
		body := []byte(fmt.Sprintf(`{"n":%d}`, i))
		err := dl.DeadLetter(ctx, &consumer.Message{ID: id, Body: body, Source: work, Partition: -1, Offset: -1},
			consumer.Failure{Consumer: "billing", MessageID: id, Class: class, Err: errors.New(reason), Attempts: 1,
				FirstFailure: time.Now(), LastFailure: time.Now()})
		if err != nil {
			t.Fatal(err)
		}
	}
	fp := (&consumer.Message{Body: []byte(`{"n":4}`)}).Fingerprint()
	claim(t, store, dedup.Claim{Consumer: "billing", MessageID: "m-4", Fingerprint: fp, Partition: -1, Offset: -1})

	r := idemq(t, "dlq", "inspect", "--queue", dead)
	want(t, r, 0, "5 dead-lettered messages in 2 groups", "")
	want(t, r, 0, "unknown account", "")
	r = idemq(t, "dlq", "inspect", "--queue", dead, "--json", "--class", "timeout")
	var rep dlq.Report
	if err := json.Unmarshal([]byte(r.stdout), &rep); err != nil || rep.Total != 1 || rep.Groups[0].Class != consumer.ClassTimeout {
		t.Fatalf("inspect --json: %v %+v\n%s", err, rep, r.stdout)
	}
	if n := rmqDepth(t, dead); n != 5 {
		t.Fatalf("inspect consumed messages: DLQ depth %d", n)
	}

	r = idemq(t, append([]string{"dlq", "replay", "--queue", dead, "--dry-run", "--retention", "72h"}, dbArgs...)...)
	want(t, r, 0, "4 will apply, 1 already applied, 0 fingerprint mismatch", "")
	if n := rmqDepth(t, dead); n != 5 {
		t.Fatalf("dry run consumed messages: DLQ depth %d", n)
	}

	r = idemq(t, append([]string{"dlq", "replay", "--queue", dead, "--class", "permanent", "--retention", "72h"}, dbArgs...)...)
	want(t, r, 0, "republished 3", "")
	want(t, r, 0, "skipped 1 already applied", "")
	if w, d := rmqDepth(t, work), rmqDepth(t, dead); w != 3 || d != 1 {
		t.Fatalf("after replay: work queue %d (want 3), DLQ %d (want the timeout one)", w, d)
	}

	want(t, idemq(t, "dlq", "replay", "--queue", dead, "--class", "bogus"), 2, "", "not an error class")
	want(t, idemq(t, "dlq", "inspect"), 2, "", "--queue is required")
	want(t, idemq(t, "dlq", "inspect", "--broker", "sqs", "--queue", "x"), 2, "", "want rabbitmq, kafka, nats or redis")
}

// TestDLQReplayVerifyKeyFile: with --verify-key-file, the CLI republishes
// only signed dead letters, and a forged one naming another queue stays in
// the DLQ.
func TestDLQReplayVerifyKeyFile(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	_, dbArgs := migrated(t)
	work, dead := rmqQueues(t)
	target, _ := rmqQueues(t) // what the forged envelope names as its source

	dir := t.TempDir()
	keyFile, oldFile, shortFile := dir+"/dlq.key", dir+"/old.key", dir+"/short.key"
	key := []byte("6f2d0c3e8a1b4f5d9e7c2a0b1d3f5e7a")
	for f, k := range map[string]string{keyFile: string(key) + "\n", oldFile: "an old key, rotated out, 32 byte", shortFile: "short"} {
		if err := os.WriteFile(f, []byte(k), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	signed, unsigned := rmqDeadLetterer(ctx, t, dead, dlq.Options{SigningKey: key}), rmqDeadLetterer(ctx, t, dead, dlq.Options{})
	deadLetter := func(id, source string, dl consumer.DeadLetterer) {
		t.Helper()
		err := dl.DeadLetter(ctx, &consumer.Message{ID: id, Body: []byte(`{}`), Source: source, Partition: -1, Offset: -1},
			consumer.Failure{Consumer: "billing", MessageID: id, Class: consumer.ClassPermanent, Err: errors.New("bug"), Attempts: 1,
				FirstFailure: time.Now(), LastFailure: time.Now()})
		if err != nil {
			t.Fatal(err)
		}
	}
	deadLetter("signed-1", work, signed)
	deadLetter("signed-2", work, signed)
	deadLetter("forged", target, unsigned)

	r := idemq(t, "dlq", "inspect", "--queue", dead, "--verify-key-file", keyFile)
	// The forged one names another source, so it is a group of its own.
	want(t, r, 0, "3 dead-lettered messages in 2 groups; 1 unverified", "")
	base := append([]string{"dlq", "replay", "--queue", dead, "--retention", "72h"}, dbArgs...)
	want(t, idemq(t, append(base, "--verify-key-file", shortFile)...), 2, "", "at least 16")
	want(t, idemq(t, append(base, "--verify-key-file", dir+"/missing.key")...), 2, "", "read key file")
	r = idemq(t, append(base, "--dry-run", "--verify-key-file", keyFile)...)
	want(t, r, 0, "2 will apply", "")
	want(t, r, 0, "1 unverified", "")
	r = idemq(t, append(base, "--verify-key-file", oldFile+","+keyFile)...)
	want(t, r, 0, "republished 2", "")
	want(t, r, 0, "1 unverified", "")
	if w, tg, d := rmqDepth(t, work), rmqDepth(t, target), rmqDepth(t, dead); w != 2 || tg != 0 || d != 1 {
		t.Fatalf("after replay: work queue %d (want 2), forged target %d (want 0), DLQ %d (want the forged one)", w, tg, d)
	}
}

// deadLetters12 dead-letters twelve messages from four causes to the
// RabbitMQ queue dead, each with its own id, times and values in its error
// text, the way the runtime and handlers write them.
func deadLetters12(ctx context.Context, t *testing.T, work, dead string) {
	t.Helper()
	dl := rmqDeadLetterer(ctx, t, dead, dlq.Options{})
	base := time.Date(2026, 12, 1, 9, 0, 0, 0, time.UTC)
	for i := 0; i < 12; i++ {
		id := fmt.Sprintf("order-%04d", 17*i+3)
		at := base.Add(time.Duration(i) * 7 * time.Minute)
		f := consumer.Failure{Consumer: "billing", MessageID: id, Attempts: 1, FirstFailure: at, LastFailure: at}
		body := []byte(fmt.Sprintf(`{"n":%d}`, i))
		switch i % 4 {
		case 0: // the runtime's mismatch text
			f.Class, f.ProcessedAt = consumer.ClassFingerprintMismatch, at.Add(-time.Hour)
			f.Err = fmt.Errorf("message id %q was applied at %s with a different payload", id, f.ProcessedAt.Format(time.RFC3339Nano))
		case 1: // a handler's permanent error naming a value
			f.Class = consumer.ClassPermanent
			f.Err = consumer.Permanent(fmt.Errorf("unknown account %q for order %s (received %s)", fmt.Sprintf("acct-%d", 100+i), id, at.Format(time.RFC3339)))
		case 2: // a panic
			f.Class = consumer.ClassPanic
			f.Err = &consumer.PanicError{Value: fmt.Errorf("runtime error: index out of range [%d] with length %d", i, i/2)}
		case 3: // a Postgres error, retried until the budget ran out
			f.Class, f.Attempts = consumer.ClassRetryableExhausted, 5
			f.Err = fmt.Errorf("insert ledger row for %s: %w", id,
				errors.New(`ERROR: insert or update on table "ledger" violates foreign key constraint "ledger_account_fkey" (SQLSTATE 23503)`))
		}
		if err := dl.DeadLetter(ctx, &consumer.Message{ID: id, Body: body, Source: work, Partition: -1, Offset: -1}, f); err != nil {
			t.Fatal(err)
		}
	}
}

// TestDLQInspectGroupsByFingerprint: twelve dead letters from four causes,
// each error text with its own id and times, come out as four groups.
func TestDLQInspectGroupsByFingerprint(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	work, dead := rmqQueues(t)
	deadLetters12(ctx, t, work, dead)

	r := idemq(t, "dlq", "inspect", "--queue", dead)
	t.Logf("idemq dlq inspect:\n%s", r.stdout)
	want(t, r, 0, "12 dead-lettered messages in 4 groups", "")
	for _, s := range []string{
		`message id "<id>" was applied at <time> with a different payload`,
		`e.g. message id "order-0003" was applied at 2026-12-01T08:00:00Z with a different payload`,
		`permanent: unknown account "<q>" for order <id> (received <time>)`,
		`handler panic: runtime error: index out of range [<n>] with length <n>`,
		`violates foreign key constraint "ledger_account_fkey" (SQLSTATE 23503)`,
	} {
		want(t, r, 0, s, "")
	}

	r = idemq(t, "dlq", "inspect", "--queue", dead, "--json")
	var rep dlq.Report
	if err := json.Unmarshal([]byte(r.stdout), &rep); err != nil || rep.Total != 12 || len(rep.Groups) != 4 {
		t.Fatalf("inspect --json: %v %+v\n%s", err, rep, r.stdout)
	}
	if !strings.Contains(r.stdout, `"pattern": "message id \"<id>\" was applied at <time> with a different payload"`) {
		t.Errorf("inspect --json escapes the placeholders:\n%s", r.stdout)
	}
	for _, g := range rep.Groups {
		if g.Count != 3 || g.Fingerprint == "" || g.Pattern == "" || g.Error == "" || !slices.Equal(g.Consumers, []string{"billing"}) || !slices.Equal(g.Sources, []string{work}) ||
			len(g.Sample) != 3 || !g.FirstSeen.Before(g.LastSeen) {
			t.Errorf("group %+v", g)
		}
	}
	if n := rmqDepth(t, dead); n != 12 {
		t.Fatalf("inspect consumed messages: DLQ depth %d", n)
	}
}

// TestDLQDryRunHorizonReason: the dry run says why each message beyond the
// replay horizon is, in its table and in --json.
func TestDLQDryRunHorizonReason(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	_, dbArgs := migrated(t)
	work, dead := rmqQueues(t)
	dl := rmqDeadLetterer(ctx, t, dead, dlq.Options{})
	now := time.Now()
	for _, f := range []consumer.Failure{
		{MessageID: "old", Class: consumer.ClassPermanent, Err: errors.New("bug"), FirstFailure: now.Add(-2 * time.Hour), LastFailure: now},
		// Its original was applied ten minutes ago, but its dedup row is
		// gone: replaying it would apply the id a second time.
		{MessageID: "gone", Class: consumer.ClassFingerprintMismatch, Err: errors.New("message id \"gone\" was applied with a different payload"),
			FirstFailure: now, LastFailure: now, ProcessedAt: now.Add(-10 * time.Minute)},
		{MessageID: "fresh", Class: consumer.ClassPermanent, Err: errors.New("bug"), FirstFailure: now, LastFailure: now},
	} {
		f.Consumer, f.Attempts = "billing", 1
		if err := dl.DeadLetter(ctx, &consumer.Message{ID: f.MessageID, Body: []byte(`{}`), Source: work, Partition: -1, Offset: -1}, f); err != nil {
			t.Fatal(err)
		}
	}
	base := append([]string{"dlq", "replay", "--queue", dead, "--dry-run", "--retention", "1h"}, dbArgs...)
	r := idemq(t, base...)
	t.Logf("dry run:\n%s", r.stdout)
	want(t, r, 0, "2 beyond the retention horizon", "")
	lines := map[string]string{}
	for _, l := range strings.Split(r.stdout, "\n") {
		if f := strings.Fields(l); len(f) > 0 {
			lines[f[0]] = l
		}
	}
	for id, reason := range map[string]string{
		"old":   "yes: first failed 2h0m",
		"gone":  "yes: fingerprint mismatch whose original's dedup row is gone",
		"fresh": "will-apply",
	} {
		if !strings.Contains(lines[id], reason) {
			t.Errorf("row of %s lacks %q: %q", id, reason, lines[id])
		}
	}
	if !strings.Contains(lines["old"], "longer ago than the retention of 1h0m0s") || !strings.HasSuffix(strings.TrimSpace(lines["fresh"]), " -") {
		t.Errorf("rows:\n%s\n%s", lines["old"], lines["fresh"])
	}

	r = idemq(t, append(base, "--json")...)
	var cl dlq.Classification
	if err := json.Unmarshal([]byte(r.stdout), &cl); err != nil || len(cl.Items) != 3 || cl.BeyondHorizon != 2 {
		t.Fatalf("dry run --json: %v %+v\n%s", err, cl, r.stdout)
	}
	for _, it := range cl.Items {
		if got := it.BeyondHorizon && it.HorizonReason != ""; got != (it.Record.MessageID != "fresh") {
			t.Errorf("%s: beyond the horizon %v, reason %q", it.Record.MessageID, it.BeyondHorizon, it.HorizonReason)
		}
	}
	if !strings.Contains(r.stdout, `"horizon_reason": "first failed 2h0m`) {
		t.Errorf("--json lacks horizon_reason:\n%s", r.stdout)
	}
	if n := rmqDepth(t, dead); n != 3 {
		t.Fatalf("dry run consumed messages: DLQ depth %d", n)
	}
}

func TestDLQOneLine(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		in   string
		n    int
		want string
	}{
		{"short\n\ttext", 20, "short text"},
		{"0123456789abcdefghij", 10, "012345…hij"},
		{"ééééééééé (SQLSTATE 23505)", 20, "éééééé…23505)"},
	} {
		if got := oneLine(tc.in, tc.n); got != tc.want {
			t.Errorf("oneLine(%q, %d) = %q, want %q", tc.in, tc.n, got, tc.want)
		}
	}
}
