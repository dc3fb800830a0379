package franz_test

// Issue 14, item 11: a topic written by transactional producers. Both Kafka
// Sources run the same scenarios: brokers/franz's (franz-go, read_committed)
// and brokers/kafka's (kafka-go, with its own read_committed fetch path).
// Before the fix brokers/kafka's Source read the topic as read_uncommitted,
// with control records as messages: it fails every test here on 8924c08.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	kafkago "github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemq/idemq/brokers/kafka"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/kafkatest"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

// txnSource is one of the two Sources under test, opened on e's topic and
// group.
type txnSource struct {
	name string
	open func(t *testing.T, e *env) consumer.Source
}

var txnSources = []txnSource{
	{"franz", func(t *testing.T, e *env) consumer.Source { return e.source(t) }},
	{"kafka-go", func(t *testing.T, e *env) consumer.Source {
		s, err := kafka.NewSource(kafka.Config{
			Brokers: e.c.Addrs(), Topic: e.topic, GroupID: e.group,
			CommitInterval: 50 * time.Millisecond, SessionTimeout: 3 * time.Second, HeartbeatInterval: 100 * time.Millisecond,
			RebalanceTimeout: 5 * time.Second, DrainTimeout: time.Second, JoinGroupBackoff: 100 * time.Millisecond,
			FetchMaxWait: 100 * time.Millisecond,
		})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = s.Close() })
		return s
	}},
}

// txnProducer is a franz-go transactional producer on e's topic.
type txnProducer struct {
	t  *testing.T
	cl *kgo.Client
}

func newTxnProducer(t *testing.T, e *env) *txnProducer {
	t.Helper()
	cl, err := kgo.NewClient(
		kgo.SeedBrokers(e.c.Addrs()...),
		kgo.TransactionalID(kafkatest.Name(t, "txn")),
		kgo.DefaultProduceTopic(e.topic),
	)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	return &txnProducer{t: t, cl: cl}
}

// txn produces recs in one transaction and commits or aborts it.
func (p *txnProducer) txn(ctx context.Context, commit bool, recs ...*kgo.Record) {
	p.t.Helper()
	if err := p.cl.BeginTransaction(); err != nil {
		p.t.Fatal(err)
	}
	if err := p.cl.ProduceSync(ctx, recs...).FirstErr(); err != nil {
		p.t.Fatal(err)
	}
	end := kgo.TryAbort
	if commit {
		end = kgo.TryCommit
	}
	if err := p.cl.EndTransaction(ctx, end); err != nil {
		p.t.Fatal(err)
	}
}

// txnRecords makes n records "<prefix>-<i>" keyed "key-<i>", with the id
// header "<prefix>-<i>" when withID.
func txnRecords(prefix string, from, n int, withID bool) []*kgo.Record {
	var recs []*kgo.Record
	for i := from; i < from+n; i++ {
		body := fmt.Sprintf("%s-%03d", prefix, i)
		r := &kgo.Record{Key: fmt.Appendf(nil, "key-%d", i), Value: []byte(body)}
		if withID {
			r.Headers = []kgo.RecordHeader{{Key: "idempotency-key", Value: []byte(body)}}
		}
		recs = append(recs, r)
	}
	return recs
}

// produceScenario writes the mix and returns the bodies a
// read_committed consumer must apply, each once: a plain record, a
// committed transaction, an aborted one without ids, an aborted one with
// ids, three of those aborted records re-sent in a committed transaction,
// and a last plain record.
func produceScenario(ctx context.Context, t *testing.T, e *env) []string {
	t.Helper()
	p := newTxnProducer(t, e)
	plain := func(body string) {
		if err := e.pub.Publish(ctx, e.topic, &consumer.Message{ID: body, RecordKey: []byte(body), Body: []byte(body)}); err != nil {
			t.Fatal(err)
		}
	}
	plain("plain-first")
	p.txn(ctx, true, txnRecords("committed", 0, 5, true)...)
	p.txn(ctx, false, txnRecords("aborted-noid", 0, 40, false)...)
	p.txn(ctx, false, txnRecords("aborted-id", 0, 40, true)...)
	p.txn(ctx, true, txnRecords("aborted-id", 0, 3, true)...)
	plain("plain-last")
	want := []string{"plain-first", "plain-last", "aborted-id-000", "aborted-id-001", "aborted-id-002"}
	for i := range 5 {
		want = append(want, fmt.Sprintf("committed-%03d", i))
	}
	slices.Sort(want)
	return want
}

// isMarker reports whether m looks like a transaction marker: a 4-byte key
// (version, type) and a 6-byte value (version, coordinator epoch).
func isMarker(m *consumer.Message) bool {
	return len(m.RecordKey) == 4 && len(m.Body) == 6 && bytes.Equal(m.RecordKey[:2], []byte{0, 0})
}

// TestEdgeKafkaTransactionalAbortedNeverApplied: through the real runtime
// and a Postgres dedup store, exactly the committed records are applied,
// each once; no aborted record and no transaction marker reaches the
// handler, and the records re-sent after an abort are applied once.
func TestEdgeKafkaTransactionalAbortedNeverApplied(t *testing.T) {
	for _, ts := range txnSources {
		t.Run(ts.name, func(t *testing.T) {
			ctx := testCtx(t, 90*time.Second)
			e := newEnv(t, 2)
			want := produceScenario(ctx, t, e)

			pool := testdb.Pool(t)
			schema := testdb.Schema(t)
			store, err := processed.New(pool, processed.Config{Schema: schema})
			if err != nil {
				t.Fatal(err)
			}
			if err := store.Migrate(ctx); err != nil {
				t.Fatal(err)
			}
			effects := pgx.Identifier{schema, "effects"}.Sanitize()
			if _, err := pool.Exec(ctx, "CREATE TABLE "+effects+" (body text NOT NULL)"); err != nil {
				t.Fatal(err)
			}
			var (
				mu   sync.Mutex
				seen []string
			)
			rt, err := consumer.New(consumer.Config{
				Name: "txn", Source: ts.open(t, e), Store: store, Concurrency: 4,
				ShutdownTimeout: 5 * time.Second,
				Handler: func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
					mu.Lock()
					seen = append(seen, string(m.Body))
					mu.Unlock()
					if isMarker(m) {
						t.Errorf("a transaction marker reached the handler: key %x body %x at %s/%d@%d", m.RecordKey, m.Body, m.Source, m.Partition, m.Offset)
					}
					_, err := tx.Exec(ctx, "INSERT INTO "+effects+" (body) VALUES ($1)", string(m.Body))
					return err
				},
				DeadLetterer: consumer.DeadLettererFunc(func(_ context.Context, m *consumer.Message, f consumer.Failure) error {
					t.Errorf("dead-lettered %q: %v", m.Body, f.Err)
					return nil
				}),
			})
			if err != nil {
				t.Fatal(err)
			}
			rctx, stop := context.WithCancel(ctx)
			errc := make(chan error, 1)
			go func() { errc <- rt.Run(rctx) }()
			waitFor(t, 60*time.Second, "the committed records to be applied", func() bool {
				s := rt.Stats()
				return s.Applied >= int64(len(want)) && s.InFlight == 0
			})
			time.Sleep(1500 * time.Millisecond) // anything more would arrive now
			stop()
			if err := <-errc; err != nil && !errors.Is(err, context.Canceled) {
				t.Fatal(err)
			}

			rows, err := pool.Query(ctx, "SELECT body FROM "+effects+" ORDER BY body")
			if err != nil {
				t.Fatal(err)
			}
			applied, err := pgx.CollectRows(rows, pgx.RowTo[string])
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(applied, want) {
				t.Errorf("applied %d effects %q,\nwant exactly the %d committed records %q", len(applied), trim(applied), len(want), want)
			}
			mu.Lock()
			defer mu.Unlock()
			for _, b := range seen {
				if _, ok := slices.BinarySearch(want, b); !ok {
					t.Errorf("the handler saw %q, which no committed record holds", b)
					break
				}
			}
			if s := rt.Stats(); s.Applied != int64(len(want)) {
				t.Errorf("stats: %d applied, want %d (%+v)", s.Applied, len(want), s)
			}
		})
	}
}

// TestEdgeKafkaControlRecordsNeverDelivered: read directly from each
// Source, a transactional topic yields exactly its committed records, never
// a transaction marker, and acking them commits the group up to the end of
// every partition, past the markers (no lag is left behind).
func TestEdgeKafkaControlRecordsNeverDelivered(t *testing.T) {
	for _, ts := range txnSources {
		t.Run(ts.name, func(t *testing.T) {
			ctx := testCtx(t, 60*time.Second)
			e := newEnv(t, 2)
			want := produceScenario(ctx, t, e)
			src := ts.open(t, e)
			var got []string
			for range want {
				d, err := src.Receive(ctx)
				if err != nil {
					t.Fatalf("receive after %q: %v", got, err)
				}
				m := d.Message()
				if isMarker(m) {
					t.Errorf("received a transaction marker: key %x body %x at %d@%d", m.RecordKey, m.Body, m.Partition, m.Offset)
				}
				got = append(got, string(m.Body))
				if err := d.Ack(ctx); err != nil {
					t.Fatal(err)
				}
			}
			rctx, cancel := context.WithTimeout(ctx, 1500*time.Millisecond)
			defer cancel()
			if d, err := src.Receive(rctx); err == nil {
				t.Errorf("received %q (offset %d) after every committed record", d.Message().Body, d.Message().Offset)
			}
			slices.Sort(got)
			if !slices.Equal(got, want) {
				t.Errorf("received %q,\nwant %q", trim(got), want)
			}
			high := txnHighWatermarks(ctx, t, e)
			waitFor(t, 10*time.Second, fmt.Sprintf("the group to commit up to the high watermarks %v", high), func() bool {
				c := txnCommitted(ctx, t, e)
				for p, hw := range high {
					if c[p] != hw {
						return false
					}
				}
				return true
			})
		})
	}
}

// TestEdgeKafkaBrowserSkipsTransactionMarkers: brokers/kafka's Browser
// (dlq inspect, replay and requeue) reads a transactional topic as a
// read_committed consumer does, and ends at the high watermark even when
// the last offsets are transaction markers.
func TestEdgeKafkaBrowserSkipsTransactionMarkers(t *testing.T) {
	ctx := testCtx(t, 60*time.Second)
	e := newEnv(t, 2)
	want := produceScenario(ctx, t, e)
	p := newTxnProducer(t, e)
	p.txn(ctx, false, txnRecords("aborted-last", 0, 4, true)...) // the partitions end with aborts
	b, err := kafka.NewBrowser(ctx, kafka.BrowserConfig{Brokers: e.c.Addrs(), Topic: e.topic, FetchMaxWait: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = b.Close() }()
	var got []string
	nctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	for {
		d, err := b.Next(nctx)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("next after %q: %v", got, err)
		}
		if isMarker(d.Message()) {
			t.Errorf("browsed a transaction marker at %d@%d", d.Message().Partition, d.Message().Offset)
		}
		got = append(got, string(d.Message().Body))
	}
	slices.Sort(got)
	if !slices.Equal(got, want) {
		t.Errorf("browsed %q,\nwant %q", trim(got), want)
	}
}

// trim shortens a long list of bodies for an error message.
func trim(s []string) []string {
	if len(s) > 20 {
		return append(slices.Clip(s[:20]), fmt.Sprintf("… %d more", len(s)-20))
	}
	return s
}

// txnClient returns a kafka-go client of e's cluster.
func txnClient(t *testing.T, e *env) *kafkago.Client {
	t.Helper()
	transport := &kafkago.Transport{}
	t.Cleanup(transport.CloseIdleConnections)
	return &kafkago.Client{Addr: kafkago.TCP(e.c.Addrs()...), Transport: transport}
}

// txnPartitions returns the ids of e.topic's partitions.
func txnPartitions(ctx context.Context, t *testing.T, e *env) []int {
	t.Helper()
	md, err := txnClient(t, e).Metadata(ctx, &kafkago.MetadataRequest{Topics: []string{e.topic}})
	if err != nil {
		t.Fatal(err)
	}
	var ids []int
	for _, tp := range md.Topics {
		for _, p := range tp.Partitions {
			ids = append(ids, p.ID)
		}
	}
	return ids
}

// txnHighWatermarks returns the next offset of each partition of e.topic.
func txnHighWatermarks(ctx context.Context, t *testing.T, e *env) map[int]int64 {
	t.Helper()
	var reqs []kafkago.OffsetRequest
	for _, p := range txnPartitions(ctx, t, e) {
		reqs = append(reqs, kafkago.LastOffsetOf(p))
	}
	resp, err := txnClient(t, e).ListOffsets(ctx, &kafkago.ListOffsetsRequest{Topics: map[string][]kafkago.OffsetRequest{e.topic: reqs}})
	if err != nil {
		t.Fatal(err)
	}
	out := map[int]int64{}
	for _, p := range resp.Topics[e.topic] {
		if p.Error != nil {
			t.Fatal(p.Error)
		}
		out[p.Partition] = p.LastOffset
	}
	return out
}

// txnCommitted returns e.group's committed offset of each partition of e.topic,
// -1 where it has none.
func txnCommitted(ctx context.Context, t *testing.T, e *env) map[int]int64 {
	t.Helper()
	resp, err := txnClient(t, e).OffsetFetch(ctx, &kafkago.OffsetFetchRequest{GroupID: e.group, Topics: map[string][]int{e.topic: txnPartitions(ctx, t, e)}})
	if err != nil {
		t.Fatal(err)
	}
	out := map[int]int64{}
	for _, p := range resp.Topics[e.topic] {
		out[p.Partition] = p.CommittedOffset
	}
	return out
}
