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

// clusterStallBound is the longest gap between two applies
// TestClusterLosesTheConsumerLeader allows while a JetStream server is
// lost: the durable consumer's new leader is elected in a few seconds, and
// an ack that got no answer is sent again within 2 s. Without the ack
// retry, the acks lost with the leader held MaxAckPending until AckWait,
// 30 s.
const clusterStallBound = 12 * time.Second

// TestClusterLosesTheConsumerLeader: on a 3-server cluster with an R3
// stream, the server that leads the durable consumer is killed mid-stream.
// Every message is applied exactly once, and the consumer never stops for
// longer than clusterStallBound.
func TestClusterLosesTheConsumerLeader(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: starts a NATS cluster and kills a server")
	}
	t.Parallel()
	c := startCluster(t, false)
	runClusterFault(t, c, c.URLs(), clusterStallBound, func(ctx context.Context, j jetstream.JetStream, stream, durable string) {
		cons, err := j.Consumer(ctx, stream, durable)
		if err != nil {
			t.Fatal(err)
		}
		info, err := cons.Info(ctx)
		if err != nil || info.Cluster == nil || c.Node(info.Cluster.Leader) == nil {
			t.Fatalf("the durable's leader: %+v, %v", info.Cluster, err)
		}
		c.Node(info.Cluster.Leader).Kill()
		t.Logf("killed %s, the durable's leader", info.Cluster.Leader)
	})
}

// runClusterFault publishes 3,000 messages to an R3 stream of c, consumes
// them through a Source on srcURL with a runtime that takes a few seconds
// in all, calls fault once a fifth is applied, and then checks that every
// message was applied exactly once and that no gap between two applies was
// over bound.
func runClusterFault(t *testing.T, c *natstest.Cluster, srcURL string, bound time.Duration,
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
	rt, err := consumer.New(consumer.Config{Name: "cluster", Source: src, Store: e.store, DeadLetterer: src.DeadLetterer(),
		Concurrency: 8, ShutdownTimeout: 10 * time.Second,
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
	fault(ctx, j, stream, durable)
	t.Logf("the fault after %d applied", rt.Stats().Applied)
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
	if gap > bound {
		t.Fatalf("the consumer stalled %s, longer than %s", gap.Round(time.Millisecond), bound)
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
