package chaos

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"

	"github.com/idemq/idemq/brokers/kafka"
	"github.com/idemq/idemq/internal/kafkatest"
)

// TestGroupMembersNameTheirWorker: the broker knows a worker's group member
// by the client id the harness parses back into slot and incarnation, so
// the stall report and the session-eviction events name the worker and say
// whether its process is still running.
func TestGroupMembersNameTheirWorker(t *testing.T) {
	c := kafkatest.Start(t)
	r := &run{h: &harness{}, s: Scenario{Name: kafkatest.Name(t, "group")}, kcluster: c, kafkaBrokers: c.Addrs(), procs: map[incKey]*proc{}}
	topic := kafkatest.Name(t, "chaos-group")
	c.CreateTopic(t, topic, 2)
	src, err := kafka.NewSource(kafka.Config{
		Brokers: c.Addrs(), Topic: topic, GroupID: r.consumer(),
		SessionTimeout: KafkaSessionTimeout, HeartbeatInterval: 200 * time.Millisecond, JoinGroupBackoff: 100 * time.Millisecond,
		Dialer: &kafkago.Dialer{Timeout: 10 * time.Second, DualStack: true, ClientID: fmt.Sprintf(kafkaClientID, 3, 7)},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	go func() { _, _ = src.Receive(ctx) }() // joins the group
	for {
		if gi := c.GroupInfo(r.consumer()); gi != nil && gi.State == "Stable" && gi.NumAssigned() == 2 {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("group never stable: %s", r.groupSummary())
		}
		time.Sleep(50 * time.Millisecond)
	}
	r.procs[incKey{3, 7}] = &proc{} // the worker is alive
	if got, want := r.groupSummary(), "worker 3.7 (live) holding partitions [0 1]"; !strings.Contains(got, want) {
		t.Fatalf("summary %q, want it to contain %q", got, want)
	}
	delete(r.procs, incKey{3, 7}) // it has exited
	if got, want := r.groupSummary(), "worker 3.7 (exited) holding partitions [0 1]"; !strings.Contains(got, want) {
		t.Fatalf("summary %q, want it to contain %q", got, want)
	}
	if got := r.describeClient("someone-else"); got != `client "someone-else"` {
		t.Fatalf("describeClient of a foreign client: %q", got)
	}
}
