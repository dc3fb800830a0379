package natsjs

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/idemq/idemq/consumer"
)

// ackBody is what JetStream reads as an ack.
var ackBody = []byte("+ACK")

// acker sends the Source's acks and waits for the server to answer each.
//
// Every ack asks for its answer on a subject of the Source's own inbox,
// and one subscription to that inbox takes all the answers, so a batch of
// acks is as many publishes and one wait. DoubleAck, a request per ack,
// each with its own context, reply channel and (for a batch) goroutine,
// took 12 µs more of the process's CPU per message in batch mode than acks
// that ask for no answer; this takes under 1 µs more than they do
// (docs/bench-ceiling.md, "The bound on NATS").
type acker struct {
	src    *Source
	prefix string // the inbox, with its trailing dot

	mu      sync.Mutex
	next    uint64
	waiting map[uint64]*ackWait
}

// ackWait is one ack awaiting its answer. Its fields are guarded by
// acker.mu.
type ackWait struct {
	call     *ackCall
	answered bool
}

// ackCall is one call's acks: it is done when every one is answered, or
// nudged when the server says that nobody took one.
type ackCall struct {
	left  int
	done  chan struct{}
	nudge chan struct{} // buffered: a no-responders answer came
}

func newAcker(s *Source) (*acker, error) {
	a := &acker{src: s, prefix: s.nc.NewInbox() + ".", waiting: map[uint64]*ackWait{}}
	sub, err := s.nc.Subscribe(a.prefix+"*", a.answer)
	if err != nil {
		return nil, fmt.Errorf("natsjs: subscribe to the ack answers: %w", err)
	}
	// The answers are few (at most MaxAckPending at once) and tiny; the
	// subscription must never drop one for a slow handler.
	if err := sub.SetPendingLimits(-1, -1); err != nil {
		_ = sub.Unsubscribe()
		return nil, fmt.Errorf("natsjs: ack answers: %w", err)
	}
	return a, nil
}

// answer takes the server's answer to one ack. A no-responders status
// (the durable has no leader: its acks reach nobody) answers nothing, but
// tells the waiter to send its acks again after its backoff rather than
// at the end of the attempt.
func (a *acker) answer(m *nats.Msg) {
	tok, err := strconv.ParseUint(m.Subject[len(a.prefix):], 10, 64)
	if err != nil {
		return
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	w := a.waiting[tok]
	if w == nil || w.answered {
		return // answered already (the ack was sent twice), or given up
	}
	if m.Header.Get("Status") != "" {
		select {
		case w.call.nudge <- struct{}{}:
		default:
		}
		return
	}
	w.answered = true
	w.call.left--
	if w.call.left == 0 {
		close(w.call.done)
	}
}

// ack acks every delivery of ds, which are settled and the Source's own,
// and waits for the server to answer each.
//
// An ack that gets no answer within ackAttempt (the durable's leader is
// gone while its replicas elect another, the connection is being
// re-established) is sent again, with backoff, until the server answers or
// the delivery's AckWait runs out: JetStream acks by stream sequence, so
// the ack is good on any connection and any leader until then, and a
// leader election costs its own length rather than AckWait. After that,
// or once ctx ends, the delivery's ack fails with an error wrapping
// consumer.ErrDeliveryStale: the message comes back, and dedup skips it.
func (a *acker) ack(ctx context.Context, ds []*delivery) error {
	call := &ackCall{left: len(ds), done: make(chan struct{}), nudge: make(chan struct{}, 1)}
	waits := make([]ackWait, len(ds))
	toks := make([]uint64, len(ds))
	due := make([]time.Time, len(ds))
	a.mu.Lock()
	for i := range ds {
		a.next++
		toks[i] = a.next
		waits[i].call = call
		a.waiting[a.next] = &waits[i]
	}
	a.mu.Unlock()
	defer func() {
		a.mu.Lock()
		for _, t := range toks {
			delete(a.waiting, t)
		}
		a.mu.Unlock()
	}()
	for i, d := range ds {
		d.mu.Lock()
		due[i] = d.due
		d.mu.Unlock()
	}
	send := func(i int) {
		// An error here (the connection is closed, or its reconnect
		// buffer is full) is an ack without an answer: sent again.
		_ = a.src.nc.PublishRequest(ds[i].m.Reply(), a.prefix+strconv.FormatUint(toks[i], 10), ackBody)
	}
	for i := range ds {
		send(i)
	}
	errs := make([]error, len(ds))
	failed := 0
	open := make([]int, len(ds)) // the acks neither answered nor given up
	for i := range open {
		open[i] = i
	}
	backoff := ackRetryInitial
	for {
		if len(open) == 0 {
			a.src.acked.Add(int64(len(ds) - failed))
			return errors.Join(errs...)
		}
		// One attempt: until every ack is answered, ackAttempt has
		// passed, or the first open ack's AckWait runs out.
		end := time.Now().Add(ackAttempt)
		for _, i := range open {
			end = earliest(end, due[i])
		}
		a.src.wait(ctx, time.Until(end), call.done, call.nudge)
		// Give up on the acks no answer can help any more.
		cerr, now := a.src.closedErr(), time.Now()
		open = slices.DeleteFunc(a.open(waits, errs), func(i int) bool {
			switch seq := ds[i].msg.Offset; {
			case cerr != nil:
				errs[i] = fmt.Errorf("natsjs: ack stream seq %d: %w", seq, cerr)
			case ctx.Err() != nil:
				errs[i] = fmt.Errorf("natsjs: ack stream seq %d: %w (%v)", seq, consumer.ErrDeliveryStale, ctx.Err())
			case !now.Before(due[i]):
				errs[i] = fmt.Errorf("natsjs: ack stream seq %d: %w (no answer within AckWait)", seq, consumer.ErrDeliveryStale)
			default:
				return false
			}
			failed++
			a.src.ackFailures.Add(1)
			return true
		})
		if len(open) == 0 {
			continue
		}
		// Back off (an answer may still come meanwhile), then send the
		// rest again.
		next := now.Add(backoff)
		for _, i := range open {
			next = earliest(next, due[i])
		}
		a.src.wait(ctx, time.Until(next), call.done, nil)
		backoff = min(2*backoff, ackRetryMax)
		if ctx.Err() != nil || a.src.life.Err() != nil {
			continue // the next attempt ends at once, and fails what is open
		}
		select {
		case <-call.nudge: // answered by what is sent now, if at all
		default:
		}
		open = a.open(waits, errs)
		for _, i := range open {
			a.src.ackRetries.Add(1)
			send(i)
		}
	}
}

// open returns the indexes of the acks neither answered nor given up.
func (a *acker) open(waits []ackWait, errs []error) []int {
	var open []int
	a.mu.Lock()
	defer a.mu.Unlock()
	for i := range waits {
		if errs[i] == nil && !waits[i].answered {
			open = append(open, i)
		}
	}
	return open
}

// wait waits for d, for done or nudge (either may be nil), for ctx, or
// for Close.
func (s *Source) wait(ctx context.Context, d time.Duration, done, nudge <-chan struct{}) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-done:
	case <-nudge:
	case <-ctx.Done():
	case <-s.life.Done():
	}
}
