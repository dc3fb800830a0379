package chaos

import (
	"context"
	"fmt"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"

	"github.com/idemq/idemq/brokers/kafka"
	"github.com/idemq/idemq/internal/kafkatest"
)

// TestGroupMembersNameTheirWorker: the broker describes a worker's group
// member with the client id the harness parses back into slot and
// incarnation, and deadGroupMembers reports the member only once its worker
// has exited: a stall with live members must not be nudged away.
func TestGroupMembersNameTheirWorker(t *testing.T) {
	c := kafkatest.Start(t)
	r := &run{h: &harness{}, s: Scenario{Name: kafkatest.Name(t, "group")}, kafkaBrokers: c.Addrs(), procs: map[incKey]*proc{}}
	topic, group := kafkatest.Name(t, "chaos-group"), r.consumer()
	c.CreateTopic(t, topic, 2)
	src, err := kafka.NewSource(kafka.Config{
		Brokers: c.Addrs(), Topic: topic, GroupID: group,
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
	tr := &kafkago.Transport{}
	defer tr.CloseIdleConnections()
	client := &kafkago.Client{Addr: kafkago.TCP(c.Addrs()...), Timeout: 5 * time.Second, Transport: tr}
	for {
		resp, err := client.DescribeGroups(ctx, &kafkago.DescribeGroupsRequest{GroupIDs: []string{group}})
		if err == nil && len(resp.Groups) == 1 && len(resp.Groups[0].Members) == 1 {
			m := resp.Groups[0].Members[0]
			var k incKey
			if _, err := fmt.Sscanf(m.ClientID, kafkaClientID, &k.slot, &k.inc); err != nil || k != (incKey{3, 7}) {
				t.Fatalf("member client id %q parsed as %+v, %v", m.ClientID, k, err)
			}
			if len(m.MemberAssignments.Topics) > 0 {
				r.procs[k] = &proc{} // the worker is alive
				if dead := r.deadGroupMembers(ctx); len(dead) != 0 {
					t.Fatalf("a live worker's member reported dead: %v", dead)
				}
				delete(r.procs, k) // it has exited
				if dead := r.deadGroupMembers(ctx); len(dead) != 1 || dead[0] != "worker 3.7 holding partitions [0 1]" {
					t.Fatalf("dead members %q, want worker 3.7 with both partitions", dead)
				}
				return
			}
			// Described before the sync: try again.
		}
		if ctx.Err() != nil {
			t.Fatalf("group never described with one member: %+v, %v", resp, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}
