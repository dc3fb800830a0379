package main

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/brokers/redisstream"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
)

// TestDLQTruncatedSaidSo: a dead letter cut to fit its broker is counted as
// truncated by inspect (in its group too), the dry run and replay, with
// --json as well; replay leaves it in the DLQ, republishing only the whole
// one, and says on stderr how to recover the original.
func TestDLQTruncatedSaidSo(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	_, db := migrated(t)
	f := newRedisFixture(ctx, t, dlq.Options{})
	f.deadLetter(ctx, t, "whole-1", `{"n":1}`, consumer.Failure{Class: consumer.ClassPermanent, Err: errors.New("bug")})

	// A dead-letterer whose broker refuses the first, whole, copy for its
	// size: the dead letter it writes is truncated.
	pub, err := redisstream.NewPublisher(ctx, redisstream.PublisherConfig{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	refused := false
	dl, err := dlq.NewDeadLetterer(func(ctx context.Context, m *consumer.Message) error {
		if !refused {
			refused = true
			return consumer.ErrMessageTooLarge
		}
		_, err := pub.Publish(ctx, f.dead, m)
		return err
	}, dlq.Options{})
	if err != nil {
		t.Fatal(err)
	}
	big := &consumer.Message{ID: "big-1", Body: []byte(strings.Repeat("x", 5000)), Source: f.work, Partition: -1, Offset: -1}
	if err := dl.DeadLetter(ctx, big, consumer.Failure{Consumer: "billing", MessageID: "big-1", Class: consumer.ClassPermanent,
		Attempts: 1, FirstFailure: time.Now(), LastFailure: time.Now(), Err: errors.New("bug")}); err != nil {
		t.Fatal(err)
	}

	want(t, idemq(t, append([]string{"dlq", "inspect"}, f.args...)...), exitOK, "1 truncated to fit the broker", "")
	r := idemq(t, append([]string{"dlq", "inspect", "--json"}, f.args...)...)
	var rep dlq.Report
	if err := json.Unmarshal([]byte(r.stdout), &rep); err != nil || rep.Truncated != 1 || len(rep.Groups) != 1 || rep.Groups[0].Truncated != 1 {
		t.Fatalf("inspect --json: %v\n%s", err, r.stdout)
	}
	replay := append(append([]string{"dlq", "replay"}, f.args...), append([]string{"--retention", "72h"}, db...)...)
	want(t, idemq(t, append(replay, "--dry-run")...), exitOK, "1 will apply", "")
	want(t, idemq(t, append(replay, "--dry-run")...), exitOK, "1 truncated", "")
	r = idemq(t, replay...)
	want(t, r, exitOK, "republished 1", "1 truncated dead letter")
	t.Logf("replay:\n%s%s", r.stdout, r.stderr)
	var ids []string
	for _, m := range f.read(ctx, t, f.work) {
		ids = append(ids, m.ID)
	}
	if len(ids) != 1 || ids[0] != "whole-1" {
		t.Fatalf("replay republished %v, want only whole-1", ids)
	}
	left := f.read(ctx, t, f.dead)
	if len(left) != 1 || left[0].Headers[dlq.HeaderTruncated] == "" {
		t.Fatalf("the DLQ holds %d messages after the replay, want the truncated one", len(left))
	}
}
