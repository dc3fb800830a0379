package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"

	"github.com/idemq/idemq/brokers/kafka"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/dedup"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/internal/kafkatest"
)

// kafkaRecords reads every record of topic, without a group.
func kafkaRecords(ctx context.Context, t *testing.T, brokers []string, topic string) []*consumer.Message {
	t.Helper()
	b, err := kafka.NewBrowser(ctx, kafka.BrowserConfig{Brokers: brokers, Topic: topic, FetchMaxWait: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	var out []*consumer.Message
	for {
		d, err := b.Next(ctx)
		if errors.Is(err, io.EOF) {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, d.Message())
	}
}

// kafkaGroups lists the cluster's consumer groups.
func kafkaGroups(ctx context.Context, t *testing.T, brokers []string) []string {
	t.Helper()
	transport := &kafkago.Transport{}
	defer transport.CloseIdleConnections()
	client := &kafkago.Client{Addr: kafkago.TCP(brokers...), Transport: transport}
	resp, err := client.ListGroups(ctx, &kafkago.ListGroupsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, g := range resp.Groups {
		out = append(out, g.GroupID)
	}
	return out
}

func TestDLQInspectAndReplayKafka(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	store, dbArgs := migrated(t)
	c := kafkatest.Start(t)
	brokers := c.Addrs()
	work := kafkatest.Name(t, "payments")
	dead := work + ".dlq"
	c.CreateTopic(t, work, 2)
	c.CreateTopic(t, dead, 2)
	kargs := []string{"--broker", "kafka", "--kafka-brokers", strings.Join(brokers, ","), "--topic", dead}

	// The dead letters are written without an idempotency-key header (the
	// DLQ publish drops Message.ID): their ids live only in their
	// envelopes, which is what the replay must republish.
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: brokers})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	dl, err := dlq.NewDeadLetterer(func(ctx context.Context, m *consumer.Message) error {
		m = m.Clone()
		m.ID = ""
		return pub.Publish(ctx, dead, m)
	}, dlq.Options{})
	if err != nil {
		t.Fatal(err)
	}
	// Five dead letters: three permanent, one timeout, and one whose id
	// was in fact applied.
	bodies := map[string]string{}
	for i := range 5 {
		id := fmt.Sprintf("m-%d", i)
		class, reason := consumer.ClassPermanent, "unknown account"
		if i == 3 {
			class, reason = consumer.ClassTimeout, "handler timed out"
		}
		body := fmt.Sprintf(`{"n":%d}`, i)
		bodies[id] = body
		err := dl.DeadLetter(ctx, &consumer.Message{ID: id, Key: work + "/1", Body: []byte(body), Source: work, Partition: 1, Offset: int64(40 + i)},
			consumer.Failure{Consumer: "billing", MessageID: id, Class: class, Err: errors.New(reason), Attempts: 1,
				FirstFailure: time.Now(), LastFailure: time.Now()})
		if err != nil {
			t.Fatal(err)
		}
	}
	fp := (&consumer.Message{Body: []byte(`{"n":4}`)}).Fingerprint()
	claim(t, store, dedup.Claim{Consumer: "billing", MessageID: "m-4", Fingerprint: fp, Partition: 1, Offset: 44})

	r := idemq(t, append([]string{"dlq", "inspect"}, kargs...)...)
	want(t, r, 0, "5 dead-lettered messages in 2 groups", "")
	want(t, r, 0, "unknown account", "")
	want(t, r, 0, work, "")
	r = idemq(t, append([]string{"dlq", "inspect", "--json", "--class", "timeout"}, kargs...)...)
	var rep dlq.Report
	if err := json.Unmarshal([]byte(r.stdout), &rep); err != nil || rep.Total != 1 || rep.Groups[0].Class != consumer.ClassTimeout ||
		!slices.Equal(rep.Groups[0].Sample, []string{"m-3"}) {
		t.Fatalf("inspect --json: %v %+v\n%s", err, rep, r.stdout)
	}

	r = idemq(t, append(append([]string{"dlq", "replay", "--dry-run", "--retention", "72h"}, kargs...), dbArgs...)...)
	want(t, r, 0, "4 will apply, 1 already applied, 0 fingerprint mismatch, 0 missing id", "")
	want(t, r, 0, "Nothing was consumed.", "")
	if n := len(kafkaRecords(ctx, t, brokers, work)); n != 0 {
		t.Fatalf("the dry run republished %d records", n)
	}
	if g := kafkaGroups(ctx, t, brokers); len(g) != 0 {
		t.Fatalf("inspect or the dry run made consumer groups %v", g)
	}
	if n := len(kafkaRecords(ctx, t, brokers, dead)); n != 5 {
		t.Fatalf("DLQ topic holds %d records", n)
	}

	r = idemq(t, append(append([]string{"dlq", "replay", "--class", "permanent", "--retention", "72h"}, kargs...), dbArgs...)...)
	want(t, r, 0, "republished 3", "")
	want(t, r, 0, "skipped 1 already applied", "")
	got := kafkaRecords(ctx, t, brokers, work)
	var ids []string
	for _, m := range got {
		ids = append(ids, m.ID)
		if m.Header("idempotency-key") != m.ID || string(m.Body) != bodies[m.ID] || m.Header("x-idemq-source") != work {
			t.Errorf("republished record %q: body %q headers %v", m.ID, m.Body, m.Headers)
		}
	}
	slices.Sort(ids)
	if !slices.Equal(ids, []string{"m-0", "m-1", "m-2"}) {
		t.Fatalf("original topic received %v, want m-0, m-1 and m-2 with their envelope ids", ids)
	}
	if g := kafkaGroups(ctx, t, brokers); len(g) != 0 {
		t.Fatalf("replay made consumer groups %v", g)
	}

	want(t, idemq(t, "dlq", "inspect", "--broker", "kafka", "--kafka-brokers", strings.Join(brokers, ",")), 2, "", "--topic is required")
	want(t, idemq(t, "dlq", "inspect", "--broker", "kafka", "--kafka-brokers", ",", "--topic", dead), 2, "", "--kafka-brokers")
	want(t, idemq(t, "dlq", "inspect", "--broker", "kafka", "--kafka-brokers", strings.Join(brokers, ","), "--topic", dead+"-missing"), 1, "", "Unknown Topic Or Partition")
}
