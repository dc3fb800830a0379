package chaos

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/kafkatest"
)

// TestTxnProducerCommitsAndAborts: the transactional workload producer's
// committed transactions reach a read_committed consumer and its aborted
// ones never do, which is what the checker's Aborted set relies on.
func TestTxnProducerCommitsAndAborts(t *testing.T) {
	c := kafkatest.Start(t)
	topic := kafkatest.Name(t, "txn")
	c.CreateTopic(t, topic, 2)
	p := &txnProducer{brokers: c.Addrs(), topic: topic, txnID: kafkatest.Name(t, "txn-id")}
	defer p.close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for i, unit := range []struct {
		ids   []string
		abort bool
	}{{[]string{"c1", "c2"}, false}, {[]string{"a1", "a2"}, true}, {[]string{"c3"}, false}, {[]string{"a3"}, true}} {
		msgs := make([]*consumer.Message, len(unit.ids))
		for j, id := range unit.ids {
			msgs[j] = &consumer.Message{ID: id, Body: []byte(id), Headers: map[string]string{HeaderCopy: id}}
		}
		want := txnCommitted
		if unit.abort {
			want = txnAborted
		}
		if got, err := p.publish(ctx, msgs, unit.abort); got != want || err != nil {
			t.Fatalf("unit %d: outcome %d, %v; want %d", i, got, err, want)
		}
	}

	cl, err := kgo.NewClient(kgo.SeedBrokers(c.Addrs()...), kgo.ConsumeTopics(topic),
		kgo.FetchIsolationLevel(kgo.ReadCommitted()), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	var got []string
	for len(got) < 3 && ctx.Err() == nil {
		fs := cl.PollFetches(ctx)
		fs.EachRecord(func(r *kgo.Record) {
			got = append(got, string(r.Value))
			if len(r.Headers) == 0 || r.Headers[0].Key != "idempotency-key" || string(r.Headers[0].Value) != string(r.Value) {
				t.Errorf("record %s: headers %v, want the id header first", r.Value, r.Headers)
			}
		})
	}
	// Anything aborted would have come before c3 on its partition or
	// around it: poll once more to be sure nothing else arrives.
	pctx, pcancel := context.WithTimeout(ctx, 500*time.Millisecond)
	cl.PollFetches(pctx).EachRecord(func(r *kgo.Record) { got = append(got, string(r.Value)) })
	pcancel()
	slices.Sort(got)
	if !slices.Equal(got, []string{"c1", "c2", "c3"}) {
		t.Fatalf("read_committed consumer got %v, want exactly the committed c1 c2 c3", got)
	}
}

// TestIsCommit: the proxy finds a COMMIT alone and at the end of a query
// that checks the transaction first, as processed commits (and did before
// migration 0009).
func TestIsCommit(t *testing.T) {
	for q, want := range map[string]bool{
		"commit\x00": true, " COMMIT; \x00": true, "end\x00": true,
		`SELECT "s"."processed_messages_commit_check"('k.1'); COMMIT` + "\x00": true,
		"/* idemq-commit k.1 */ CLOSE idemq_claim; COMMIT\x00":                 true,
		"SELECT 1\x00": false, "commit and chain\x00": false, "BEGIN; SELECT 1\x00": false,
	} {
		if got := isCommit([]byte(q)); got != want {
			t.Errorf("isCommit(%q) = %v, want %v", q, got, want)
		}
	}
}
