package natsjs_test

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
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
	if testing.Short() {
		t.Skip("-short: starts a NATS cluster and partitions it")
	}
	t.Parallel()
	c := startCluster(t, true)
	cut := c.Node("n3")
	// The Source knows the cut-off server only; the others it learns
	// from it, as a client given one URL does.
	runClusterFault(t, c, cut.URL, func() time.Duration { return partitionStallBound }, func(context.Context, jetstream.JetStream, string, string) {
		if err := cut.Partition(); err != nil {
			t.Fatal(err)
		}
		t.Logf("cut off %s", cut.Name)
	})
}
