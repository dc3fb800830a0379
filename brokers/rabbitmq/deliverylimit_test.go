package rabbitmq_test

import (
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/brokers/brokertest"
	"github.com/idemq/idemq/brokers/rabbitmq"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testlog"
)

// TestDeliveryLimitWarning: a Source whose topology gives its quorum queue
// a delivery limit below 20 warns, when it starts consuming, that lost
// connections can make the broker dead-letter messages never applied, and
// says how large the limit must be; 20, or no limit, is quiet.
func TestDeliveryLimitWarning(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		limit int
		warn  bool
	}{{2, true}, {20, false}, {0, false}} {
		ctx := testCtx(t, 30*time.Second)
		topo := rabbitmq.Topology{Queue: uniqueName(t), Quorum: true, DeliveryLimit: tc.limit}
		deleteTopologyLater(t, topo)
		log, logs := testlog.New(slog.LevelDebug)
		src := newSource(t, rabbitmq.Config{Queue: topo.Queue, Topology: &topo})
		src.Configure(consumer.SourceSettings{Logger: log}) // the runtime's logger
		pub := newPublisher(t, rabbitmq.PublisherConfig{})
		if err := pub.Publish(ctx, "", topo.Queue, &consumer.Message{ID: "m", Body: []byte("x")}); err != nil {
			t.Fatal(err)
		}
		mustAck(ctx, t, brokertest.Receive(ctx, t, src))
		got := logs.String()
		warned := strings.Contains(got, "delivery limit is 2") && strings.Contains(got, "set Topology.DeliveryLimit to 20 or more") &&
			strings.Contains(got, "class broker")
		if warned != tc.warn {
			t.Errorf("delivery limit %d: warned %v, want %v; logs:\n%s", tc.limit, warned, tc.warn, got)
		}
	}
}
