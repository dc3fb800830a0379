package natsjs_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	natsjs "github.com/idemq/idemq/brokers/nats"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/natstest"
)

// partitionStallBound is the longest gap between two applies this test
// allows when the consumer's server is cut off: the client leaves a silent
// connection after a write times out (5 s) or two pings go unanswered
// (natsjs pings every 5 s), reconnects to another server and, if the
// cut-off server led the stream or the durable, waits for an election.
// With nats.go's defaults it took 60 s and more: its writes block for a
// minute, and its pings, every 2 minutes, wait behind them.
const partitionStallBound = 30 * time.Second

// TestClusterPartitionsTheConsumersServer: on a 3-server cluster with an
// R3 stream, the server the Source is connected to is cut off mid-stream
// (every packet dropped, in a network namespace of its own). Every message
// is applied exactly once, and the consumer moves to the other servers
// within partitionStallBound.
func TestClusterPartitionsTheConsumersServer(t *testing.T) {
	t.Parallel()
	c := natstest.StartPartitionableCluster(t, 3)
	cut := c.Node("n3")
	ctx := testCtx(t, 4*time.Minute)
	nc, err := nats.Connect(c.URLs())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	j, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	r := randomHex(4)
	stream, subject, durable := "IDEMQ_PART_"+r, "idemq-part."+r, "idemq-part-"+r
	for _, sc := range []jetstream.StreamConfig{
		{Name: stream, Subjects: []string{subject}, Replicas: 3},
		{Name: stream + natsjs.DLQStreamSuffix, Subjects: []string{subject + natsjs.DLQSuffix}, Replicas: 3},
	} {
		if _, err := j.CreateStream(ctx, sc); err != nil {
			t.Fatal(err)
		}
	}
	const total = 3000
	pub := newPublisher(t, natsjs.PublisherConfig{URL: c.URLs()})
	msgs := make([]*consumer.Message, total)
	for i := range msgs {
		msgs[i] = &consumer.Message{ID: fmt.Sprintf("p-%04d", i), Body: []byte("x")}
	}
	for i := 0; i < total; i += 500 {
		if err := pub.Publish(ctx, subject, msgs[i:i+500]...); err != nil {
			t.Fatal(err)
		}
	}

	e := newE2E(t)
	applied := pgx.Identifier{e.store.Schema(), "applied"}.Sanitize()
	if _, err := e.store.Pool().Exec(ctx, "CREATE TABLE "+applied+" (message_id text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())"); err != nil {
		t.Fatal(err)
	}
	// The Source knows the cut-off server only; the others it learns
	// from it, as a client given one URL does.
	src := newSource(t, natsjs.Config{URL: cut.URL, Stream: stream, Subject: subject, Durable: durable})
	rt, err := consumer.New(consumer.Config{Name: "partition", Source: src, Store: e.store, DeadLetterer: src.DeadLetterer(),
		Concurrency: 8, ShutdownTimeout: 10 * time.Second,
		Handler: func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			time.Sleep(10 * time.Millisecond)
			_, err := tx.Exec(ctx, "INSERT INTO "+applied+" (message_id) VALUES ($1)", m.ID)
			return err
		}})
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- rt.Run(rctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	}()

	waitFor(t, time.Minute, "a fifth applied", func() bool { return rt.Stats().Applied >= total/5 })
	if err := cut.Partition(); err != nil {
		t.Fatal(err)
	}
	t.Logf("cut off %s after %d applied", cut.Name, rt.Stats().Applied)
	waitFor(t, 3*time.Minute, "every message applied", func() bool {
		st := rt.Stats()
		return st.Applied+st.Duplicates >= total && st.InFlight == 0
	})
	var rows, distinct int
	var secs float64
	if err := e.store.Pool().QueryRow(ctx, `SELECT count(*), count(DISTINCT message_id),
		coalesce(extract(epoch FROM max(d)), 0)::float8 FROM (SELECT message_id, at - lag(at) OVER (ORDER BY at) AS d FROM `+applied+`) g`).
		Scan(&rows, &distinct, &secs); err != nil {
		t.Fatal(err)
	}
	gap := time.Duration(secs * float64(time.Second))
	t.Logf("applied %d rows, %d ids; the longest gap between applies %s; runtime %+v; source %+v", rows, distinct, gap.Round(time.Millisecond), rt.Stats(), src.Stats())
	if rows != total || distinct != total {
		t.Fatalf("%d effects of %d ids for %d messages: want each once", rows, distinct, total)
	}
	if gap > partitionStallBound {
		t.Fatalf("the consumer stalled %s, longer than %s", gap.Round(time.Millisecond), partitionStallBound)
	}
}
