package console

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"strings"
	"testing"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
)

// TestConsoleTruncatedDeadLetter: a dead letter cut to fit its broker is
// said to be so on the group list, on the group page (with the original's
// size, SHA-256 and coordinates), in the dry run (a warning tile) and in
// a replay's result and audit row; the replay leaves it in the queue and
// republishes nothing of it.
func TestConsoleTruncatedDeadLetter(t *testing.T) {
	b := newBundle(t)
	refused := false
	dl, err := dlq.NewDeadLetterer(func(_ context.Context, m *consumer.Message) error {
		if !refused {
			refused = true
			return consumer.ErrMessageTooLarge
		}
		b.q.add(m)
		return nil
	}, dlq.Options{SigningKey: signingKey})
	if err != nil {
		t.Fatal(err)
	}
	body := []byte(strings.Repeat("z", 5000))
	if err := dl.DeadLetter(context.Background(), &consumer.Message{ID: "big-1", Body: body, Source: "payments", Partition: 3, Offset: 77},
		consumer.Failure{Consumer: "ledger", MessageID: "big-1", Class: consumer.ClassPermanent, Err: errors.New("cannot parse the statement"), Attempts: 1}); err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(body)
	c := b.client()
	c.login("alice-secret-1")
	fp := b.fingerprint("big-1")

	must(t, c.mustGet("/dead-letters"), `<span class="truncated-mark">1 truncated</span>`)
	must(t, c.mustGet("/group?"+sel(fp)), `class="banner-truncated"`, "Truncated to fit the broker", "lacks the original's body",
		"5000 bytes", hex.EncodeToString(sum[:]), "payments [3] @77", "Replay and requeue leave it in the queue")
	got := tiles(t, c.mustGet("/dry-run?"+sel(fp)))
	if got["truncated"][0] != "1" || !strings.Contains(got["truncated"][1], "tile-warn") {
		t.Fatalf("truncated tile %v, want 1 in a warning", got["truncated"])
	}

	j := runAction(t, b, c, "replay", sel(fp))
	if j.Outcome != "done" || j.Result.Truncated != 1 || j.Result.Republished != 0 {
		t.Fatalf("replay: %+v", j)
	}
	if s := b.q.sent(); len(s) != 0 {
		t.Fatalf("republished %+v", s)
	}
	must(t, c.mustGet("/audit"), "1 truncated to fit the broker", "left 1 truncated")
}
