package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/brokers/memory"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/outbox"
)

// TestEdgePoisonRowFailsAlone: one row of a destination group can never be
// published. The good rows of the group are published once and marked sent;
// the poison row alone is retried, with its own attempts and error, and its
// retries publish nothing else.
func TestEdgePoisonRowFailsAlone(t *testing.T) {
	t.Parallel()
	const good = 4
	errPoison := errors.New("broker rejects this message")

	// relayRounds enqueues good rows and one poison row (the third) to one
	// destination, runs rounds batches (making the failed row due again
	// between them) and checks the rows.
	relayRounds := func(t *testing.T, dest string, publish outbox.PublishFunc, poisonHeaders map[string]string, wantErr string) *outbox.Relay {
		t.Helper()
		f := newFixture(t)
		ctx := testCtx(t, 60*time.Second)
		for i := range good + 1 {
			m := outbox.Message{Destination: dest, ID: fmt.Sprintf("e%d", i), Body: []byte(fmt.Sprint("event ", i))}
			if i == 2 {
				m.ID = "poison"
				m.Headers = poisonHeaders
			}
			f.placeOrder(t, fmt.Sprint("o", i), m, true)
		}
		relay, err := outbox.NewRelay(f.ob, outbox.RelayConfig{Publish: publish})
		if err != nil {
			t.Fatal(err)
		}
		const rounds = 3
		for round := range rounds {
			if round > 0 {
				if _, err := f.pool.Exec(ctx, "UPDATE "+f.table()+" SET next_attempt_at = now() WHERE sent_at IS NULL"); err != nil {
					t.Fatal(err)
				}
			}
			if _, err := relay.RelayOnce(ctx); err != nil {
				t.Fatalf("round %d: RelayOnce: %v", round, err)
			}
		}
		if n := f.count(t, f.table(), "sent_at IS NOT NULL AND message_id <> 'poison' AND attempts = 1"); n != good {
			t.Errorf("good rows sent at their first attempt = %d, want %d", n, good)
		}
		var (
			attempts int
			lastErr  *string
			sent     *time.Time
		)
		if err := f.pool.QueryRow(ctx, "SELECT attempts, last_error, sent_at FROM "+f.table()+" WHERE message_id = 'poison'").Scan(&attempts, &lastErr, &sent); err != nil {
			t.Fatal(err)
		}
		if attempts != rounds || lastErr == nil || !strings.Contains(*lastErr, wantErr) || sent != nil {
			t.Errorf("poison row: attempts %d, last_error %v, sent_at %v; want %d attempts, an error containing %q, unsent", attempts, deref(lastErr), sent, rounds, wantErr)
		}
		if n := f.count(t, f.table(), "message_id <> 'poison' AND last_error IS NOT NULL"); n != 0 {
			t.Errorf("good rows with an error recorded = %d, want 0", n)
		}
		if s := relay.Stats(); s.Published != good || s.Failed != rounds {
			t.Errorf("relay stats = %+v, want %d published and %d failed", s, good, rounds)
		}
		return relay
	}

	// copies counts the messages the broker holds, by id.
	copies := func(msgs []*consumer.Message) map[string]int {
		n := map[string]int{}
		for _, m := range msgs {
			n[m.ID]++
		}
		return n
	}
	checkCopies := func(t *testing.T, got map[string]int, want int) {
		t.Helper()
		for i := range good + 1 {
			id := fmt.Sprintf("e%d", i)
			if i == 2 {
				id = "poison"
				if got[id] != 0 {
					t.Errorf("copies of the poison message = %d, want 0", got[id])
				}
				continue
			}
			if got[id] != want {
				t.Errorf("copies of %s = %d, want %d", id, got[id], want)
			}
		}
	}

	// RabbitMQ refuses the whole call (a header name longer than AMQP
	// allows) and says nothing about which message was at fault: the relay
	// publishes the group's messages one at a time.
	t.Run("RabbitMQRefusesTheCall", func(t *testing.T) {
		t.Parallel()
		q := newQueue(t)
		pub := newPublisher(t)
		var (
			mu        sync.Mutex
			confirmed = map[string]int{}
		)
		publish := func(ctx context.Context, dest string, msgs ...*consumer.Message) error {
			if err := pub.Publish(ctx, "", dest, msgs...); err != nil {
				return err
			}
			mu.Lock()
			defer mu.Unlock()
			for _, m := range msgs {
				confirmed[m.ID]++
			}
			return nil
		}
		relayRounds(t, q, publish, map[string]string{strings.Repeat("h", 300): "x"}, "255 bytes")
		mu.Lock()
		defer mu.Unlock()
		checkCopies(t, confirmed, 1)
		if n := queueDepth(t, q); n != good {
			t.Errorf("queue depth = %d, want %d", n, good)
		}
	})

	// The publisher confirms the good messages and names the poison one
	// with *outbox.MessageError: no message is published twice, and the
	// poison one's retries are calls of its own.
	t.Run("PublisherNamesTheFailedMessage", func(t *testing.T) {
		t.Parallel()
		broker := memory.NewBroker()
		var (
			mu    sync.Mutex
			calls []int
		)
		publish := func(ctx context.Context, dest string, msgs ...*consumer.Message) error {
			mu.Lock()
			calls = append(calls, len(msgs))
			mu.Unlock()
			var errs []error
			for i, m := range msgs {
				if m.ID == "poison" {
					errs = append(errs, &outbox.MessageError{Index: i, Err: errPoison})
					continue
				}
				if err := broker.Publish(ctx, dest, m); err != nil {
					return err
				}
			}
			return errors.Join(errs...)
		}
		relayRounds(t, "q", publish, nil, errPoison.Error())
		checkCopies(t, copies(broker.Messages("q")), 1)
		mu.Lock()
		defer mu.Unlock()
		if want := []int{good + 1, 1, 1}; fmt.Sprint(calls) != fmt.Sprint(want) {
			t.Errorf("Publish calls of %v messages, want %v", calls, want)
		}
	})

	// The publisher confirms the good messages but its error names none:
	// the one-at-a-time pass publishes each good message once more, and
	// the poison message's retries never again.
	t.Run("PublisherSaysNothing", func(t *testing.T) {
		t.Parallel()
		broker := memory.NewBroker()
		publish := func(ctx context.Context, dest string, msgs ...*consumer.Message) error {
			var err error
			for _, m := range msgs {
				if m.ID == "poison" {
					err = errPoison
					continue
				}
				if err := broker.Publish(ctx, dest, m); err != nil {
					return err
				}
			}
			return err
		}
		relayRounds(t, "q", publish, nil, errPoison.Error())
		checkCopies(t, copies(broker.Messages("q")), 2)
	})
}

func deref(s *string) any {
	if s == nil {
		return nil
	}
	return *s
}

// TestEdgeNoTransactionAcrossPublish runs two relays whose sessions have a
// low idle_in_transaction_session_timeout and whose publishes take longer
// than it. While both relays are inside Publish, neither holds a
// transaction open; no row is published twice, concurrently or at all, and
// no batch fails.
func TestEdgeNoTransactionAcrossPublish(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ctx := testCtx(t, 90*time.Second)
	const (
		total       = 40
		idleTimeout = 250 * time.Millisecond
		slow        = 400 * time.Millisecond
	)
	for i := range total {
		f.placeOrder(t, fmt.Sprint("o", i), outbox.Message{Destination: "q", ID: fmt.Sprintf("e%02d", i), Body: []byte("x")}, true)
	}

	appName := "idemq-outbox-idle-" + strings.ToLower(strings.ReplaceAll(f.schema, "_", "-"))
	pcfg, err := pgxpool.ParseConfig(testdb.URL())
	if err != nil {
		t.Fatal(err)
	}
	pcfg.MaxConns = 4
	pcfg.ConnConfig.RuntimeParams["application_name"] = appName
	pcfg.ConnConfig.RuntimeParams["idle_in_transaction_session_timeout"] = fmt.Sprint(idleTimeout.Milliseconds())
	relayPool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		t.Fatal(err)
	}
	defer relayPool.Close()
	relayOb, err := outbox.New(relayPool, outbox.Config{Schema: f.schema})
	if err != nil {
		t.Fatal(err)
	}

	broker := memory.NewBroker()
	var (
		mu        sync.Mutex
		inFlight  = map[string]bool{}
		published = map[string]int{}
		arrive    sync.WaitGroup
		openTx    = -1 // relay sessions with a transaction open while both relays publish
	)
	arrive.Add(2)
	bothIn := make(chan struct{})
	checked := make(chan struct{})
	go func() {
		arrive.Wait()
		close(bothIn)
	}()
	go func() {
		defer close(checked)
		select {
		case <-bothIn:
		case <-ctx.Done():
			return
		}
		// Both relays are inside Publish now; look at their sessions.
		var n int
		err := f.pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
WHERE application_name = $1 AND (xact_start IS NOT NULL OR state LIKE 'idle in transaction%')`, appName).Scan(&n)
		if err != nil {
			t.Errorf("pg_stat_activity: %v", err)
		}
		mu.Lock()
		openTx = n
		mu.Unlock()
	}()
	newRelay := func() *outbox.Relay {
		first := true
		r, err := outbox.NewRelay(relayOb, outbox.RelayConfig{
			BatchSize:      5,
			PollInterval:   10 * time.Millisecond,
			PublishTimeout: 2 * time.Second,
			Lease:          10 * time.Second,
			Publish: func(ctx context.Context, dest string, msgs ...*consumer.Message) error {
				mu.Lock()
				for _, m := range msgs {
					if inFlight[m.ID] {
						t.Errorf("%s published by both relays at once", m.ID)
					}
					inFlight[m.ID] = true
				}
				mu.Unlock()
				defer func() {
					mu.Lock()
					for _, m := range msgs {
						delete(inFlight, m.ID)
					}
					mu.Unlock()
				}()
				if first {
					// Hold this publish until the other relay is
					// publishing too and the sessions were inspected.
					first = false
					arrive.Done()
					select {
					case <-checked:
					case <-time.After(20 * time.Second):
						t.Error("the other relay never published while this one did")
					}
				}
				time.Sleep(slow) // longer than idle_in_transaction_session_timeout
				if err := broker.Publish(ctx, dest, msgs...); err != nil {
					return err
				}
				mu.Lock()
				for _, m := range msgs {
					published[m.ID]++
				}
				mu.Unlock()
				return nil
			},
		})
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	r1, r2 := newRelay(), newRelay()
	stop1, stop2 := runRelay(t, r1), runRelay(t, r2)
	// Wait without failing at once, so that a failure also reports what
	// the relays did.
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if n := f.count(t, f.table(), "sent_at IS NOT NULL"); n == total {
			break
		} else if time.Now().After(deadline) {
			t.Errorf("rows sent after 30s = %d, want %d", n, total)
			break
		}
	}
	stop1()
	stop2()

	mu.Lock()
	defer mu.Unlock()
	if openTx != 0 {
		t.Errorf("relay sessions with a transaction open while both relays were publishing = %d, want 0", openTx)
	}
	if len(published) != total {
		t.Errorf("distinct ids published = %d, want %d", len(published), total)
	}
	for id, n := range published {
		if n != 1 {
			t.Errorf("%s published %d times, want once", id, n)
		}
	}
	s1, s2 := r1.Stats(), r2.Stats()
	if s1.Errors != 0 || s2.Errors != 0 || s1.Published+s2.Published != total {
		t.Errorf("relay stats %+v and %+v: want no failed batch and %d published in all", s1, s2, total)
	}
	if n := len(broker.Messages("q")); n != total {
		t.Errorf("broker holds %d messages, want %d", n, total)
	}
}

// TestEdgeFencingExpiredLeaseCannotMarkSent: relay A claims a row and stalls
// in Publish past its lease (a paused process; the publish ignores its
// context). Relay B claims the row and is publishing it when A's publish
// returns: A's "sent" is fenced off by the lease token and B's outcome is
// the one recorded.
func TestEdgeFencingExpiredLeaseCannotMarkSent(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ctx := testCtx(t, 60*time.Second)
	f.placeOrder(t, "o1", outbox.Message{Destination: "q", ID: "e1", Body: []byte("x")}, true)
	broker := memory.NewBroker()

	type stalled struct {
		relay   *outbox.Relay
		started chan struct{}
		release chan struct{}
		free    func() // closes release, once
		running bool
		done    chan struct{}
		n       int // RelayOnce's results, once done is closed
		err     error
	}
	newStalled := func() *stalled {
		s := &stalled{started: make(chan struct{}), release: make(chan struct{}), done: make(chan struct{})}
		var once, freeOnce sync.Once
		s.free = func() { freeOnce.Do(func() { close(s.release) }) }
		r, err := outbox.NewRelay(f.ob, outbox.RelayConfig{
			PublishTimeout: 100 * time.Millisecond,
			Lease:          400 * time.Millisecond,
			Publish: func(_ context.Context, dest string, msgs ...*consumer.Message) error {
				once.Do(func() { close(s.started) })
				<-s.release
				return broker.Publish(context.Background(), dest, msgs...)
			},
		})
		if err != nil {
			t.Fatal(err)
		}
		s.relay = r
		return s
	}
	start := func(s *stalled) {
		s.running = true
		go func() {
			defer close(s.done)
			s.n, s.err = s.relay.RelayOnce(ctx)
		}()
	}
	a, b := newStalled(), newStalled()
	t.Cleanup(func() {
		a.free()
		b.free()
		for _, s := range []*stalled{a, b} {
			if !s.running {
				continue
			}
			select {
			case <-s.done:
			case <-time.After(10 * time.Second):
			}
		}
	})

	start(a)
	select {
	case <-a.started:
	case <-time.After(10 * time.Second):
		t.Fatal("relay A never published")
	}
	eventually(t, 10*time.Second, "A's lease to expire", func() bool {
		return f.count(t, f.table(), "next_attempt_at <= now() AND sent_at IS NULL") == 1
	})
	start(b)
	select {
	case <-b.started:
	case <-b.done:
		t.Fatalf("relay B claimed %d rows (%v) and published nothing: the row whose lease expired was not claimable", b.n, b.err)
	case <-time.After(10 * time.Second):
		t.Fatal("relay B never published")
	}
	var ownerB string
	if err := f.pool.QueryRow(ctx, "SELECT lease_owner FROM "+f.table()).Scan(&ownerB); err != nil {
		t.Fatal(err)
	}

	// A wakes up: the broker confirms its publish, and it tries to mark
	// the row sent.
	a.free()
	select {
	case <-a.done:
		if a.err != nil || a.n != 1 {
			t.Fatalf("A: RelayOnce = %d, %v", a.n, a.err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("A's RelayOnce did not return")
	}
	var (
		owner *string
		sent  *time.Time
		att   int
	)
	if err := f.pool.QueryRow(ctx, "SELECT lease_owner, sent_at, attempts FROM "+f.table()).Scan(&owner, &sent, &att); err != nil {
		t.Fatal(err)
	}
	if sent != nil || att != 0 || owner == nil || *owner != ownerB {
		t.Fatalf("after A's late outcome: sent_at %v, attempts %d, lease_owner %v; want the row still leased to B (%s), unsent", sent, att, deref(owner), ownerB)
	}
	if s := a.relay.Stats(); s.Published != 0 || s.Fenced != 1 {
		t.Fatalf("A's stats = %+v, want its outcome fenced", s)
	}

	// B finishes and records its outcome.
	b.free()
	select {
	case <-b.done:
		if b.err != nil || b.n != 1 {
			t.Fatalf("B: RelayOnce = %d, %v", b.n, b.err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("B's RelayOnce did not return")
	}
	if n := f.count(t, f.table(), "sent_at IS NOT NULL AND attempts = 1 AND lease_token IS NULL"); n != 1 {
		t.Fatalf("rows sent by B = %d, want 1", n)
	}
	if s := b.relay.Stats(); s.Published != 1 || s.Fenced != 0 {
		t.Fatalf("B's stats = %+v", s)
	}
	if n := len(broker.Messages("q")); n != 2 {
		t.Fatalf("broker holds %d copies, want 2 (A's late one and B's; consumers dedup by id)", n)
	}
}
