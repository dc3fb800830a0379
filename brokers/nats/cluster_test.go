package natsjs_test

import (
	"context"
	"fmt"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	natsjs "github.com/idemq/idemq/brokers/nats"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/natstest"
	"github.com/idemq/idemq/internal/testlog"
)

// clusterStallBound is the longest gap between two applies
// TestClusterLosesTheConsumerLeader allows while a JetStream server is
// lost, when the durable consumer's new leader is elected in a few
// seconds: an ack that got no answer is sent again within 2 s. Without the
// ack retry, the acks lost with the leader held MaxAckPending until
// AckWait, 30 s.
const clusterStallBound = 12 * time.Second

// clusterResumeSlack is how long after the durable's new leader is elected
// the Source may take to apply again: a consumer request of its own that
// hung in the election times out (apiAttemptTimeout, 5 s), a pull sent to
// the lost leader expires (pullExpiry, 2 s), and a retry waits at most
// retryMax (1 s). An election slower than clusterStallBound less this
// slack (seen at 17 s under the whole suite's load, -race) raises the
// bound by as much; an ack lost and held until AckWait still exceeds it.
const clusterResumeSlack = 8 * time.Second

// TestClusterLosesTheConsumerLeader: on a 3-server cluster with an R3
// stream, the server that leads the durable consumer is killed mid-stream.
// Every message is applied exactly once, and the consumer never stops for
// longer than clusterStallBound, or the time its durable took to elect a
// new leader plus clusterResumeSlack.
func TestClusterLosesTheConsumerLeader(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: starts a NATS cluster and kills a server")
	}
	t.Parallel()
	c := startCluster(t, false)
	type election struct {
		leader string
		after  time.Duration // since the kill
	}
	var elected atomic.Pointer[election] // once the durable has a new leader
	bound := func() time.Duration {
		e := elected.Load()
		if e == nil {
			return clusterStallBound
		}
		t.Logf("the durable's new leader: %s, %s after the kill", e.leader, e.after.Round(time.Millisecond))
		return max(clusterStallBound, e.after+clusterResumeSlack)
	}
	runClusterFault(t, c, c.URLs(), bound, func(ctx context.Context, j jetstream.JetStream, stream, durable string) {
		cons, err := j.Consumer(ctx, stream, durable)
		if err != nil {
			t.Fatal(err)
		}
		info, err := cons.Info(ctx)
		if err != nil || info.Cluster == nil || c.Node(info.Cluster.Leader) == nil {
			t.Fatalf("the durable's leader: %+v, %v", info.Cluster, err)
		}
		lost := info.Cluster.Leader
		meta, _ := c.Node(lost).MetaLeader(ctx)
		killed := time.Now()
		c.Node(lost).Kill()
		t.Logf("killed %s, the durable's leader (the meta leader: %s)", lost, meta)
		go func() {
			for ctx.Err() == nil {
				actx, cancel := context.WithTimeout(ctx, time.Second)
				info, err := cons.Info(actx)
				cancel()
				if err == nil && info.Cluster != nil && info.Cluster.Leader != "" && info.Cluster.Leader != lost {
					elected.Store(&election{info.Cluster.Leader, time.Since(killed)})
					return
				}
				time.Sleep(100 * time.Millisecond)
			}
		}()
	})
}

// runClusterFault publishes 3,000 messages to an R3 stream of c, consumes
// them through a Source on srcURL with a runtime that takes a few seconds
// in all, calls fault once a fifth is applied, and then checks that every
// message was applied exactly once and that no gap between two applies was
// over bound (asked at the end).
func runClusterFault(t *testing.T, c *natstest.Cluster, srcURL string, bound func() time.Duration,
	fault func(ctx context.Context, j jetstream.JetStream, stream, durable string)) {
	t.Helper()
	ctx := testCtx(t, 4*time.Minute)
	const total = 3000
	j, stream, subject, durable := clusterStream(ctx, t, c, total)

	e := newE2E(t)
	applied := pgx.Identifier{e.store.Schema(), "applied"}.Sanitize()
	if _, err := e.store.Pool().Exec(ctx, "CREATE TABLE "+applied+" (message_id text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())"); err != nil {
		t.Fatal(err)
	}
	src := newSource(t, natsjs.Config{URL: srcURL, Stream: stream, Subject: subject, Durable: durable})
	logger, logs := testlog.New(slog.LevelInfo)
	rt, err := consumer.New(consumer.Config{Name: "cluster", Source: src, Store: e.store, DeadLetterer: src.DeadLetterer(),
		Concurrency: 8, ShutdownTimeout: 10 * time.Second, Logger: logger,
		Handler: func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			time.Sleep(10 * time.Millisecond) // a few seconds of work in all
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
	faultAt := time.Now()
	fault(ctx, j, stream, durable)
	t.Logf("the fault at %s, after %d applied", faultAt.Format("15:04:05.000"), rt.Stats().Applied)
	waitFor(t, 3*time.Minute, "every message applied", func() bool {
		st := rt.Stats()
		return st.Applied+st.Duplicates >= total && st.InFlight == 0
	})
	var rows, distinct int
	var secs float64
	var gapEnd time.Time
	if err := e.store.Pool().QueryRow(ctx, `WITH g AS (SELECT message_id, at, at - lag(at) OVER (ORDER BY at) AS d FROM `+applied+`)
		SELECT count(*), count(DISTINCT message_id), coalesce(extract(epoch FROM max(d)), 0)::float8,
			coalesce((SELECT at FROM g WHERE d IS NOT NULL ORDER BY d DESC LIMIT 1), now()) FROM g`).
		Scan(&rows, &distinct, &secs, &gapEnd); err != nil {
		t.Fatal(err)
	}
	gap := time.Duration(secs * float64(time.Second))
	t.Logf("applied %d rows, %d ids; the longest gap between applies %s, ending %s after the fault; runtime %+v; source %+v",
		rows, distinct, gap.Round(time.Millisecond), gapEnd.Sub(faultAt).Round(time.Millisecond), rt.Stats(), src.Stats())
	if rows != total || distinct != total {
		t.Fatalf("%d effects of %d ids for %d messages: want each once", rows, distinct, total)
	}
	if b := bound(); gap > b {
		t.Fatalf("the consumer stalled %s, longer than %s; the runtime's log:\n%s", gap.Round(time.Millisecond), b.Round(time.Millisecond), logs)
	}
}

// clusterStream creates an R3 stream on c, with the R3 stream of its dead
// letters, and publishes total messages to it (ids c-0000 on). It returns
// a JetStream client on c and the stream's, its subject's and a durable's
// names.
func clusterStream(ctx context.Context, t *testing.T, c *natstest.Cluster, total int) (j jetstream.JetStream, stream, subject, durable string) {
	t.Helper()
	nc, err := nats.Connect(c.URLs())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	if j, err = jetstream.New(nc); err != nil {
		t.Fatal(err)
	}
	r := randomHex(4)
	stream, subject, durable = "IDEMQ_CLUSTER_"+r, "idemq-cluster."+r, "idemq-cluster-"+r
	for _, sc := range []jetstream.StreamConfig{
		{Name: stream, Subjects: []string{subject}, Replicas: 3},
		{Name: stream + natsjs.DLQStreamSuffix, Subjects: []string{subject + ".dlq"}, Replicas: 3},
	} {
		if _, err := j.CreateStream(ctx, sc); err != nil {
			t.Fatal(err)
		}
	}
	pub := newPublisher(t, natsjs.PublisherConfig{URL: c.URLs()})
	msgs := make([]*consumer.Message, total)
	for i := range msgs {
		msgs[i] = &consumer.Message{ID: fmt.Sprintf("c-%04d", i), Body: []byte("x")}
	}
	for i := 0; i < total; i += 500 {
		if err := pub.Publish(ctx, subject, msgs[i:min(i+500, total)]...); err != nil {
			t.Fatal(err)
		}
	}
	return j, stream, subject, durable
}

// clusterSlot lets one cluster test run at a time: each starts three
// nats-servers and times elections against a bound, and three clusters
// electing at once on two cores (under -race) stretched an election past
// it.
var clusterSlot = make(chan struct{}, 1)

// startCluster waits for the cluster slot, then starts a 3-server cluster,
// partitionable (its last server in a network namespace of its own) or
// not. The slot is freed at the test's cleanup, after the cluster stops.
func startCluster(t *testing.T, partitionable bool) *natstest.Cluster {
	t.Helper()
	clusterSlot <- struct{}{}
	t.Cleanup(func() { <-clusterSlot })
	if partitionable {
		return natstest.StartPartitionableCluster(t, 3)
	}
	return natstest.StartCluster(t, 3)
}
