package idemqtest

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/processed"
)

// Suite describes a consumer handler under test: the handler, a few sample
// messages, and how to read the effect they leave. The zero value of every
// optional field selects a documented default.
//
// Run tests it with these cases:
//
//   - determinism: two clean runs in two fresh schemas leave the same
//     effect (catches now(), random ids, and state kept in memory between
//     runs). Values that differ are masked in the other cases, so that
//     they report only their own difference.
//   - duplicates-sequential: each sample delivered Duplicates times, one
//     after another.
//   - duplicates-concurrent: each sample delivered Duplicates times at
//     once to Concurrency workers (with its ordering Key cleared, as
//     redeliveries to another process would be).
//   - crash-after-commit: each message's first ack is lost after its
//     transaction committed; the redelivery must be skipped.
//   - commit-fails: each message's first COMMIT fails after the handler
//     returned nil (the transaction rolls back), then the retry runs
//     (catches writes outside the transaction, calls to other services,
//     state kept in memory across attempts).
//   - handler-error-retried: each message's first attempt returns a
//     transient error after the handler ran; the retry applies it.
//   - fingerprint-mismatch: each id re-sent with a different payload is
//     dead-lettered as fingerprint-mismatch, with no second effect.
//   - dlq-replay: messages dead-lettered by a bug are replayed with
//     dlq.Replay after the fix and applied once; replayed again, skipped.
//   - batch: the BatchHandler leaves the same end state as Handler
//     (skipped without one).
//   - rolled-back: the handler runs on each sample in a transaction that
//     is then rolled back, and no table of the run's schema (but the
//     dedup store's) and no Recorder call may change (catches writes
//     outside the transaction that a retry cannot double).
//
// Every case but rolled-back also checks that each sample ended applied,
// with its dedup row, and none was dead-lettered but those the case
// dead-letters on purpose (catches a handler that fails when run again).
//
// Run drives the real consumer runtime over the in-memory broker, with the
// faults injected around it (a Store whose transaction fails at COMMIT, a
// Source that loses an ack), so the cases exercise the production path. It
// needs no broker.
type Suite struct {
	// Handler is the handler under test. Set exactly one of Handler and
	// NewHandler.
	Handler consumer.Handler
	// NewHandler builds the handler for one run, given the run's Env: use
	// it when the handler needs the run's schema, pool or Recorder, or has
	// state of its own, so that every run starts from a fresh handler as
	// a freshly started process would.
	NewHandler func(env *Env) consumer.Handler
	// BatchHandler, if set (or NewBatchHandler), is the handler's batch
	// form: the batch case checks that it leaves the same end state as
	// Handler. Defaults to none: the batch case is skipped.
	BatchHandler    consumer.BatchHandler
	NewBatchHandler func(env *Env) consumer.BatchHandler

	// Messages are the samples, each with its own id: messages the
	// handler applies successfully. The kit makes the duplicates,
	// redeliveries and mutated copies itself. Required.
	Messages []*consumer.Message
	// MessageID extracts the dedup id, as in consumer.Config. Defaults to
	// Message.ID.
	MessageID func(*consumer.Message) (string, error)
	// Name is the consumer's name, its dedup scope. Defaults to
	// "idemqtest".
	Name string

	// Setup creates the handler's tables in the run's fresh schema (use
	// unqualified names, or env.Schema). It runs before the dedup table
	// is migrated, once per run. Defaults to nothing.
	Setup func(ctx context.Context, env *Env) error
	// Effect reads the end state to compare, such as
	// Rows("SELECT id, balance FROM accounts"). Required.
	Effect EffectFunc
	// Ignore are object keys (column names) dropped from the effect, at
	// any depth, before it is compared: volatile values such as a
	// created_at default now(). Defaults to none.
	Ignore []string

	// Duplicates is how many times the duplicate cases deliver each
	// sample. Defaults to 3.
	Duplicates int
	// Concurrency is the number of workers of the concurrent case.
	// Defaults to 4.
	Concurrency int
	// DatabaseURL is the test database, where the kit creates and drops
	// one schema per run. Defaults to $IDEMQ_TEST_DATABASE_URL, then
	// $DATABASE_URL, then
	// postgres://postgres@127.0.0.1:5432/test?sslmode=disable.
	DatabaseURL string
	// Timeout bounds each run. Defaults to 30s.
	Timeout time.Duration
	// Logger receives the runtime's logs. Defaults to discarding them.
	Logger *slog.Logger
}

func (s Suite) withDefaults() Suite {
	if s.MessageID == nil {
		s.MessageID = func(m *consumer.Message) (string, error) { return m.ID, nil }
	}
	if s.Name == "" {
		s.Name = "idemqtest"
	}
	if s.Duplicates == 0 {
		s.Duplicates = 3
	}
	if s.Concurrency == 0 {
		s.Concurrency = 4
	}
	s.DatabaseURL = databaseURL(s.DatabaseURL)
	if s.Timeout == 0 {
		s.Timeout = 30 * time.Second
	}
	if s.Logger == nil {
		s.Logger = slog.New(slog.DiscardHandler)
	}
	return s
}

func (s Suite) validate() error {
	bad := func(field, format string, args ...any) error {
		return fmt.Errorf("idemqtest: invalid Suite: %s: %s", field, fmt.Sprintf(format, args...))
	}
	switch {
	case s.Handler == nil && s.NewHandler == nil:
		return bad("Handler", "required (or NewHandler)")
	case s.Handler != nil && s.NewHandler != nil:
		return bad("NewHandler", "set Handler or NewHandler, not both")
	case s.BatchHandler != nil && s.NewBatchHandler != nil:
		return bad("NewBatchHandler", "set BatchHandler or NewBatchHandler, not both")
	case len(s.Messages) == 0:
		return bad("Messages", "required: give a few sample messages the handler applies")
	case s.Effect == nil:
		return bad("Effect", "required: a function that reads the end state, such as idemqtest.Rows(\"SELECT ... FROM your_table\")")
	case s.Duplicates < 2:
		return bad("Duplicates", "%d, must be at least 2", s.Duplicates)
	case s.Concurrency < 2:
		return bad("Concurrency", "%d, must be at least 2", s.Concurrency)
	case s.Timeout < 0:
		return bad("Timeout", "negative")
	}
	seen := map[string]int{}
	for i, m := range s.Messages {
		if m == nil {
			return bad(fmt.Sprintf("Messages[%d]", i), "nil")
		}
		id, err := s.MessageID(m)
		switch {
		case err != nil:
			return bad(fmt.Sprintf("Messages[%d]", i), "MessageID: %v", err)
		case id == "":
			return bad(fmt.Sprintf("Messages[%d]", i), "has no message id")
		}
		if j, ok := seen[id]; ok {
			return bad(fmt.Sprintf("Messages[%d]", i), "has the id %q of Messages[%d]: give each sample its own id (the kit makes the duplicates)", id, j)
		}
		seen[id] = i
	}
	return nil
}

// Run tests what s describes, one subtest per case, each in fresh schemas
// of the test database that it creates and drops: for a Suite, a consumer
// handler (the cases are listed under Suite); for an HTTPSuite, an HTTP
// API behind httpidem (listed under HTTPSuite). Every case checks that the
// end state equals the state after applying each sample exactly once (a
// clean run in a fresh schema); a failure names the case, says what was
// done, and shows a diff of the effect.
func Run[S Suite | HTTPSuite](t *testing.T, s S) {
	t.Helper()
	run(t.Context(), stdT{t}, s)
}

// Check runs the same cases as Run without a *testing.T and returns their
// results, in order. The error reports a suite that could not run: an
// invalid suite, an unreachable database, or a clean run that failed.
func Check[S Suite | HTTPSuite](ctx context.Context, s S) ([]Result, error) {
	return check(func(t tb) { run(ctx, t, s) })
}

// run runs a Suite or an HTTPSuite.
func run(ctx context.Context, t tb, s any) {
	switch s := s.(type) {
	case Suite:
		runSuite(ctx, t, s)
	case HTTPSuite:
		runHTTP(ctx, t, s)
	}
}

func check(f func(tb)) ([]Result, error) {
	root := newCollector("")
	root.do(root, f)
	if len(root.res.Messages) > 0 {
		return *root.results, errors.New(strings.Join(root.res.Messages, "\n"))
	}
	return *root.results, nil
}

// kit is one Run of a Suite.
type kit struct {
	ctx context.Context
	s   Suite
	adm *admin
	n   int
	// ref is the state after a clean run; vol the paths that differed
	// between two clean runs, masked in every case but determinism.
	ref, ref2 any
	vol       map[string]bool
}

func runSuite(ctx context.Context, t tb, s Suite) {
	t.Helper()
	s = s.withDefaults()
	if err := s.validate(); err != nil {
		t.Fatalf("%v", err)
	}
	octx, cancel := context.WithTimeout(ctx, s.Timeout)
	adm, err := openAdmin(octx, s.DatabaseURL)
	cancel()
	if err != nil {
		t.Fatalf("%v", err)
	}
	defer adm.close()
	k := &kit{ctx: ctx, s: s, adm: adm, n: len(s.Messages)}
	if k.ref, err = k.clean(); err == nil {
		k.ref2, err = k.clean()
	}
	if err != nil {
		t.Fatalf("idemqtest: clean run (each sample delivered once, no faults): %v", err)
	}
	k.vol = volatile(k.ref, k.ref2)

	t.Run("determinism", k.determinism)
	t.Run("duplicates-sequential", k.duplicatesSequential)
	t.Run("duplicates-concurrent", k.duplicatesConcurrent)
	t.Run("crash-after-commit", k.crashAfterCommit)
	t.Run("commit-fails", k.commitFails)
	t.Run("handler-error-retried", k.handlerErrorRetried)
	t.Run("fingerprint-mismatch", k.fingerprintMismatch)
	t.Run("dlq-replay", k.dlqReplay)
	t.Run("batch", k.batch)
	t.Run("rolled-back", k.rolledBack)
}

// clean applies each sample once and returns the state.
func (k *kit) clean() (any, error) {
	var st any
	err := k.with(func(ctx context.Context, r *consumerRun) error {
		if err := r.consume(ctx, faults{}, false, 1, k.samples()); err != nil {
			return err
		}
		if err := k.allApplied(r); err != nil {
			return err
		}
		var err error
		st, err = r.state(ctx)
		return err
	})
	return st, err
}

// allApplied checks that a clean run applied every sample.
func (k *kit) allApplied(r *consumerRun) error {
	var msgs []string
	for _, f := range r.deadLetters() {
		msgs = append(msgs, fmt.Sprintf("message %q was dead-lettered (%s): %v", f.MessageID, f.Class, f.Err))
	}
	if len(msgs) > 0 {
		return fmt.Errorf("every sample must be one the handler applies:\n%s", strings.Join(msgs, "\n"))
	}
	if r.stats.Applied != int64(k.n) {
		return fmt.Errorf("%d of %d samples applied", r.stats.Applied, k.n)
	}
	return nil
}

// with runs f on a fresh run under the suite's timeout.
func (k *kit) with(f func(ctx context.Context, r *consumerRun) error) error {
	ctx, cancel := context.WithTimeout(k.ctx, k.s.Timeout)
	defer cancel()
	r, cleanup, err := k.newRun(ctx)
	if err != nil {
		return err
	}
	defer cleanup()
	return f(ctx, r)
}

// samples returns fresh copies of the samples.
func (k *kit) samples() []*consumer.Message {
	out := make([]*consumer.Message, k.n)
	for i, m := range k.s.Messages {
		out[i] = m.Clone()
	}
	return out
}

// compare reports a difference between the reference and got.
func (k *kit) compare(t tb, name, what string, got any) {
	t.Helper()
	want := mask(k.ref, k.vol)
	g := mask(got, k.vol)
	label := wantOnce
	if reflect.DeepEqual(want, g) {
		return
	}
	note := ""
	if len(k.vol) > 0 {
		note = "\n(values that differ between two clean runs are masked; see the determinism case)"
	}
	t.Errorf("%s: %s\n%s%s", name, what, diff(label, "got", want, g), note)
}

// runCase runs a case's run and compares its state; then every sample must
// have ended applied, with its dedup row, and none dead-lettered but those
// expected allows (nil: none).
func (k *kit) runCase(t tb, name, what string, expected func(consumer.Failure) bool, f func(ctx context.Context, r *consumerRun) error) {
	t.Helper()
	err := k.with(func(ctx context.Context, r *consumerRun) error {
		if err := f(ctx, r); err != nil {
			return err
		}
		st, err := r.state(ctx)
		if err != nil {
			return err
		}
		k.compare(t, name, what, st)
		return k.endedApplied(ctx, t, name, r, expected)
	})
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
}

// endedApplied reports the samples that did not end applied: dead-lettered
// (unless expected), or without a dedup row.
func (k *kit) endedApplied(ctx context.Context, t tb, name string, r *consumerRun, expected func(consumer.Failure) bool) error {
	t.Helper()
	for _, f := range r.deadLetters() {
		if expected == nil || !expected(f) {
			t.Errorf("%s: message %q ended dead-lettered (%s) instead of applied: %v. "+
				"Every sample must end applied once: a handler that fails when retried, or on a redelivery, loses messages that a fault made it run twice.",
				name, f.MessageID, f.Class, f.Err)
		}
	}
	for _, m := range k.s.Messages {
		id := r.id(m)
		if _, err := r.store.Lookup(ctx, k.s.Name, id); err != nil {
			if errors.Is(err, processed.ErrNotFound) {
				t.Errorf("%s: message %q ended without its dedup row: it was never applied", name, id)
				continue
			}
			return err
		}
	}
	return nil
}

const outsideTx = "A difference means the handler changed something outside its transaction " +
	"(a write through a pool or another connection, a call to another service: see Recorder), " +
	"or carried state in memory from the rolled-back attempt into the retry."

func (k *kit) determinism(t tb) {
	if len(k.vol) == 0 {
		return
	}
	t.Errorf("determinism: applying the same messages in two fresh schemas left different effects, so the effect depends on more than the messages: "+
		"the clock (now(), time.Now, or the Timestamp of a sample that has none, which the broker stamps), random or sequence values, "+
		"or state the handler keeps in memory between runs. "+
		"Derive such values from the message, or leave volatile columns out of Effect (or list them in Suite.Ignore).\n%s",
		diff("first clean run", "second clean run", k.ref, k.ref2))
}

func (k *kit) duplicatesSequential(t tb) {
	const name = "duplicates-sequential"
	k.runCase(t, name, fmt.Sprintf("every sample was delivered %d times, one delivery after another; the end state differs from applying each message once.", k.s.Duplicates), nil,
		func(ctx context.Context, r *consumerRun) error {
			var msgs []*consumer.Message
			for range k.s.Duplicates {
				msgs = append(msgs, k.samples()...)
			}
			if err := r.consume(ctx, faults{}, false, 1, msgs); err != nil {
				return err
			}
			if r.stats.Applied != int64(k.n) {
				t.Errorf("%s: the runtime applied %d messages for %d distinct samples (is Suite.MessageID deterministic?)", name, r.stats.Applied, k.n)
			}
			return nil
		})
}

func (k *kit) duplicatesConcurrent(t tb) {
	const name = "duplicates-concurrent"
	k.runCase(t, name, fmt.Sprintf("every sample was delivered %d times at once to %d workers; the end state differs from applying each message once.", k.s.Duplicates, k.s.Concurrency), nil,
		func(ctx context.Context, r *consumerRun) error {
			var phases [][]*consumer.Message
			for _, m := range k.s.Messages {
				var p []*consumer.Message
				for range k.s.Duplicates {
					c := m.Clone()
					c.Key = ""
					p = append(p, c)
				}
				phases = append(phases, p)
			}
			if err := r.consume(ctx, faults{}, false, k.s.Concurrency, phases...); err != nil {
				return err
			}
			if r.stats.Applied != int64(k.n) {
				t.Errorf("%s: the runtime applied %d messages for %d distinct samples", name, r.stats.Applied, k.n)
			}
			return nil
		})
}

func (k *kit) crashAfterCommit(t tb) {
	const name = "crash-after-commit"
	k.runCase(t, name, "each message's first ack was lost after its transaction committed (a crash between COMMIT and ack), and the broker redelivered it; "+
		"the redelivery must be skipped as a duplicate, but the end state differs from applying each message once.", nil,
		func(ctx context.Context, r *consumerRun) error {
			if err := r.consume(ctx, faults{dropFirstAck: true}, false, 1, k.samples()); err != nil {
				return err
			}
			if r.stats.Duplicates != int64(k.n) {
				t.Errorf("%s: %d of %d redeliveries after a commit were skipped as duplicates", name, r.stats.Duplicates, k.n)
			}
			return nil
		})
}

func (k *kit) commitFails(t tb) {
	k.runCase(t, "commit-fails", "each message's first COMMIT failed after the handler returned nil (the transaction rolled back), and the runtime retried it; "+
		"the end state differs from applying each message once. "+outsideTx, nil,
		func(ctx context.Context, r *consumerRun) error {
			return r.consume(ctx, faults{failCommit: true}, false, 1, k.samples())
		})
}

func (k *kit) handlerErrorRetried(t tb) {
	k.runCase(t, "handler-error-retried", "each message's first attempt failed with a transient error after the handler's statements ran (the transaction rolled back), "+
		"and the runtime retried it; the end state differs from applying each message once. "+outsideTx, nil,
		func(ctx context.Context, r *consumerRun) error {
			return r.consume(ctx, faults{failAfterHandler: true}, false, 1, k.samples())
		})
}

// mutated returns m with the same id and a different body: a newline
// appended, which keeps a JSON body valid and any id in it unchanged.
func mutated(m *consumer.Message) *consumer.Message {
	c := m.Clone()
	c.Body = append(c.Body, '\n')
	return c
}

func (k *kit) fingerprintMismatch(t tb) {
	const name = "fingerprint-mismatch"
	k.runCase(t, name, "each sample was applied, then re-sent with the same id and a different payload; that must be dead-lettered, not applied, "+
		"but the end state differs from applying each original once.",
		func(f consumer.Failure) bool { return f.Class == consumer.ClassFingerprintMismatch },
		func(ctx context.Context, r *consumerRun) error {
			var m []*consumer.Message
			for _, s := range k.s.Messages {
				m = append(m, mutated(s))
			}
			if err := r.consume(ctx, faults{}, false, 1, k.samples(), m); err != nil {
				return err
			}
			got := 0
			for _, f := range r.deadLetters() {
				if f.Class == consumer.ClassFingerprintMismatch {
					got++
				}
			}
			if got != k.n {
				t.Errorf("%s: %d of %d messages re-sent with a known id and a different payload were dead-lettered as %s (applied: %d)",
					name, got, k.n, consumer.ClassFingerprintMismatch, r.stats.Applied-int64(k.n))
			}
			return nil
		})
}

func (k *kit) dlqReplay(t tb) {
	const name = "dlq-replay"
	k.runCase(t, name, "every sample was dead-lettered by a handler bug, then replayed from the dead-letter queue after the fix, then replayed again; "+
		"the end state differs from applying each message once.",
		func(f consumer.Failure) bool { return errors.Is(f.Err, errInjectedBug) },
		func(ctx context.Context, r *consumerRun) error {
			if err := r.consume(ctx, faults{bug: true}, false, 1, k.samples()); err != nil {
				return err
			}
			if n := r.broker.Ready(dlqName); n != k.n {
				return fmt.Errorf("%d of %d messages dead-lettered by the injected bug", n, k.n)
			}
			letters := r.broker.Messages(dlqName)
			res, err := r.replay(ctx)
			if err != nil {
				return fmt.Errorf("replay: %w", err)
			}
			if res.Applied != int64(k.n) {
				t.Errorf("%s: the replay after the fix applied %d of %d dead letters (skipped %d, failed again %d, mismatched %d)",
					name, res.Applied, k.n, res.Skipped, res.FailedAgain, res.Mismatched)
			}
			if err := r.broker.Publish(ctx, dlqName, letters...); err != nil {
				return err
			}
			res, err = r.replay(ctx)
			if err != nil {
				return fmt.Errorf("second replay: %w", err)
			}
			if res.Skipped != int64(k.n) || res.Applied != 0 {
				t.Errorf("%s: replaying the same dead letters again applied %d and skipped %d, want all %d skipped as already applied",
					name, res.Applied, res.Skipped, k.n)
			}
			return nil
		})
}

func (k *kit) batch(t tb) {
	if k.s.BatchHandler == nil && k.s.NewBatchHandler == nil {
		t.Skipf("Suite.BatchHandler is not set")
	}
	k.runCase(t, "batch", "the BatchHandler, given every sample twice in batches, left a different end state from the per-message Handler applying each once.", nil,
		func(ctx context.Context, r *consumerRun) error {
			if r.bh == nil {
				return errors.New("Suite.NewBatchHandler returned nil")
			}
			return r.consume(ctx, faults{}, true, 1, append(k.samples(), k.samples()...))
		})
}
