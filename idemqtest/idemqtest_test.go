package idemqtest

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer"
)

// credit is the correct handler: it credits an account inside tx.
type creditMsg struct {
	Account string `json:"account"`
	Amount  int64  `json:"amount"`
}

func creditSetup(ctx context.Context, env *Env) error {
	_, err := env.Pool.Exec(ctx, `CREATE TABLE accounts (id text PRIMARY KEY, balance bigint NOT NULL DEFAULT 0);
CREATE TABLE entries (message_id text NOT NULL, account text NOT NULL, amount bigint NOT NULL, seq bigint, at timestamptz);
INSERT INTO accounts (id) VALUES ('a'), ('b')`)
	return err
}

var credit = consumer.JSON(func(ctx context.Context, tx pgx.Tx, msg *consumer.Message, c creditMsg) error {
	if _, err := tx.Exec(ctx, `UPDATE accounts SET balance = balance + $2 WHERE id = $1`, c.Account, c.Amount); err != nil {
		return err
	}
	_, err := tx.Exec(ctx, `INSERT INTO entries (message_id, account, amount) VALUES ($1, $2, $3)`, msg.ID, c.Account, c.Amount)
	return err
})

func creditBatch(ctx context.Context, tx pgx.Tx, msgs []*consumer.Message) error {
	for _, m := range msgs {
		if err := credit(ctx, tx, m); err != nil {
			return err
		}
	}
	return nil
}

func samples() []*consumer.Message {
	var out []*consumer.Message
	for i, c := range []creditMsg{{"a", 100}, {"b", 250}, {"a", 7}} {
		body, _ := json.Marshal(c)
		out = append(out, &consumer.Message{ID: fmt.Sprintf("credit-%d", i+1), Key: c.Account, Body: body})
	}
	return out
}

func suite() Suite {
	return Suite{
		Handler:  credit,
		Messages: samples(),
		Setup:    creditSetup,
		Effect: func(ctx context.Context, env *Env) (any, error) {
			acc, err := Rows(`SELECT id, balance FROM accounts`)(ctx, env)
			if err != nil {
				return nil, err
			}
			ent, err := Rows(`SELECT * FROM entries`)(ctx, env)
			return map[string]any{"accounts": acc, "entries": ent}, err
		},
	}
}

// checkSuite runs s under a collector and returns its results by case.
func checkSuite(t *testing.T, s Suite) map[string]Result {
	t.Helper()
	res, err := Check(context.Background(), s)
	if err != nil {
		t.Fatalf("Check: %v", err)
	}
	out := map[string]Result{}
	for _, r := range res {
		out[r.Case] = r
	}
	return out
}

// expectFailures checks that exactly the cases in want failed, each with
// a message containing all the given fragments.
func expectFailures(t *testing.T, got map[string]Result, want map[string][]string) {
	t.Helper()
	for name, r := range got {
		frags, should := want[name]
		switch {
		case should && !r.Failed:
			t.Errorf("case %s passed, want it to fail", name)
		case !should && r.Failed:
			t.Errorf("case %s failed, want it to pass:\n%s", name, r)
		case should:
			msg := strings.Join(r.Messages, "\n")
			for _, f := range frags {
				if !containsFragment(msg, f) {
					t.Errorf("case %s: message lacks %q:\n%s", name, f, msg)
				}
			}
			t.Logf("%s", r)
		}
	}
	for name := range want {
		if _, ok := got[name]; !ok {
			t.Errorf("no case %s", name)
		}
	}
}

// containsFragment reports whether msg contains f; a fragment starting
// with "+ " or "- " must be a diff line with that mark, whatever its
// indentation.
func containsFragment(msg, f string) bool {
	if strings.HasPrefix(f, "+ ") || strings.HasPrefix(f, "- ") {
		for _, l := range strings.Split(msg, "\n") {
			if strings.HasPrefix(l, f[:1]) && strings.TrimSpace(l[1:]) == strings.TrimSpace(f[2:]) {
				return true
			}
		}
		return false
	}
	return strings.Contains(msg, f)
}

func TestCorrectHandlerPasses(t *testing.T) {
	s := suite()
	s.BatchHandler = creditBatch
	got := checkSuite(t, s)
	if len(got) != 10 {
		t.Errorf("%d cases, want 10", len(got))
	}
	expectFailures(t, got, nil)
	if got["batch"].Skipped {
		t.Errorf("batch skipped with a BatchHandler")
	}
}

func TestRun(t *testing.T) {
	Run(t, suite())
}

// A handler that writes its ledger entry through the pool instead of tx.
func TestBrokenPoolWrite(t *testing.T) {
	s := suite()
	s.Handler = nil
	s.NewHandler = func(env *Env) consumer.Handler {
		return consumer.JSON(func(ctx context.Context, tx pgx.Tx, msg *consumer.Message, c creditMsg) error {
			if _, err := tx.Exec(ctx, `UPDATE accounts SET balance = balance + $2 WHERE id = $1`, c.Account, c.Amount); err != nil {
				return err
			}
			_, err := env.Pool.Exec(ctx, `INSERT INTO entries (message_id, account, amount) VALUES ($1, $2, $3)`, msg.ID, c.Account, c.Amount)
			return err
		})
	}
	expectFailures(t, checkSuite(t, s), map[string][]string{
		"commit-fails":          {"commit-fails: each message's first COMMIT failed", "outside its transaction", `+ "message_id": "credit-1",`},
		"handler-error-retried": {"handler-error-retried: each message's first attempt failed with a transient error"},
		"rolled-back":           {"table entries changed", "outside its transaction"},
	})
}

// A handler that keeps a running counter in memory and writes it.
func TestBrokenMemoryCounter(t *testing.T) {
	s := suite()
	s.Handler = nil
	s.NewHandler = func(env *Env) consumer.Handler {
		var mu sync.Mutex
		n := 0
		return consumer.JSON(func(ctx context.Context, tx pgx.Tx, msg *consumer.Message, c creditMsg) error {
			mu.Lock()
			n++
			seq := n
			mu.Unlock()
			_, err := tx.Exec(ctx, `INSERT INTO entries (message_id, account, amount, seq) VALUES ($1, $2, $3, $4)`, msg.ID, c.Account, c.Amount, seq)
			return err
		})
	}
	expectFailures(t, checkSuite(t, s), map[string][]string{
		// How far the counter runs ahead depends on how the runtime
		// grouped the deliveries; that it differs is the failure.
		"commit-fails":          {"carried state in memory", `- "seq": 1`},
		"handler-error-retried": {"handler-error-retried:"},
	})
}

// The same counter shared by every run: it leaks from one run into the
// next, which the determinism case reports.
func TestBrokenMemoryCounterShared(t *testing.T) {
	s := suite()
	var mu sync.Mutex
	n := 0
	s.Handler = consumer.JSON(func(ctx context.Context, tx pgx.Tx, msg *consumer.Message, c creditMsg) error {
		mu.Lock()
		n++
		seq := n
		mu.Unlock()
		_, err := tx.Exec(ctx, `INSERT INTO entries (message_id, account, amount, seq) VALUES ($1, $2, $3, $4)`, msg.ID, c.Account, c.Amount, seq)
		return err
	})
	expectFailures(t, checkSuite(t, s), map[string][]string{
		"determinism": {"determinism: applying the same messages in two fresh schemas left different effects", "state the handler keeps in memory"},
	})
}

// A handler that puts now() in its effect.
func TestBrokenClock(t *testing.T) {
	s := suite()
	s.Handler = consumer.JSON(func(ctx context.Context, tx pgx.Tx, msg *consumer.Message, c creditMsg) error {
		_, err := tx.Exec(ctx, `INSERT INTO entries (message_id, account, amount, at) VALUES ($1, $2, $3, now())`, msg.ID, c.Account, c.Amount)
		return err
	})
	expectFailures(t, checkSuite(t, s), map[string][]string{
		"determinism": {"the clock (now(), time.Now, or the Timestamp", `--- first clean run`, `"at": "20`},
	})
	// Ignoring the column fixes it.
	s.Ignore = []string{"at"}
	expectFailures(t, checkSuite(t, s), nil)
}

// A handler that calls another service (the Recorder) from inside the
// transaction.
func TestBrokenOutOfProcessCall(t *testing.T) {
	s := suite()
	s.Handler = nil
	s.NewHandler = func(env *Env) consumer.Handler {
		return func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
			if err := credit(ctx, tx, msg); err != nil {
				return err
			}
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, env.Recorder.URL+"/emails", strings.NewReader(msg.ID))
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				return err
			}
			return resp.Body.Close()
		}
	}
	expectFailures(t, checkSuite(t, s), map[string][]string{
		"commit-fails":          {"a call to another service", `+ "body": "credit-1",`},
		"handler-error-retried": {"handler-error-retried:", `"path": "/emails"`},
		"rolled-back":           {"call(s) to the Recorder", "called another service"},
	})
}

func TestInvalidSuite(t *testing.T) {
	for _, c := range []struct {
		mod  func(*Suite)
		want string
	}{
		{func(s *Suite) { s.Handler = nil }, "Handler: required"},
		{func(s *Suite) { s.Messages = nil }, "Messages: required"},
		{func(s *Suite) { s.Effect = nil }, "Effect: required"},
		{func(s *Suite) { s.Messages = append(s.Messages, s.Messages[0]) }, `Messages[3]: has the id "credit-1" of Messages[0]`},
		{func(s *Suite) { s.Messages[1].ID = "" }, "Messages[1]: has no message id"},
	} {
		s := suite()
		c.mod(&s)
		_, err := Check(context.Background(), s)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("got %v, want %q", err, c.want)
		}
	}
}

// A BatchHandler that applies only the first message of each batch.
func TestBrokenBatchHandler(t *testing.T) {
	s := suite()
	s.BatchHandler = func(ctx context.Context, tx pgx.Tx, msgs []*consumer.Message) error {
		return credit(ctx, tx, msgs[0])
	}
	expectFailures(t, checkSuite(t, s), map[string][]string{
		"batch": {"batch: the BatchHandler, given every sample twice in batches, left a different end state", `- "message_id": "credit-2",`},
	})
}

// A sample the handler cannot apply stops the suite with a clear error.
func TestSampleDeadLettered(t *testing.T) {
	s := suite()
	s.Messages[1].Body = []byte(`not json`)
	_, err := Check(context.Background(), s)
	if err == nil || !strings.Contains(err.Error(), `every sample must be one the handler applies:
message "credit-2" was dead-lettered (permanent): permanent: decode JSON body`) {
		t.Errorf("got %v", err)
	}
}

func TestUnreachableDatabase(t *testing.T) {
	s := suite()
	s.DatabaseURL = "postgres://nobody@127.0.0.1:1/none?connect_timeout=1"
	_, err := Check(context.Background(), s)
	if err == nil || !strings.Contains(err.Error(), `idemqtest: cannot reach the test database "none" on 127.0.0.1:1`) {
		t.Errorf("got %v", err)
	}
}

// A handler that writes its whole effect through the pool, with statements
// a retry cannot double (ON CONFLICT DO NOTHING, a balance set rather than
// added to): the end states match, yet nothing it does is in the
// transaction that holds the claim. The probe that rolls the handler's
// transaction back finds it.
func TestBrokenPoolWriteIdempotent(t *testing.T) {
	s := suite()
	s.Setup = func(ctx context.Context, env *Env) error {
		_, err := env.Pool.Exec(ctx, `CREATE TABLE entries (message_id text PRIMARY KEY, account text NOT NULL, amount bigint NOT NULL)`)
		return err
	}
	s.Effect = Rows(`SELECT * FROM entries`)
	s.Handler = nil
	s.NewHandler = func(env *Env) consumer.Handler {
		return consumer.JSON(func(ctx context.Context, _ pgx.Tx, msg *consumer.Message, c creditMsg) error {
			_, err := env.Pool.Exec(ctx, `INSERT INTO entries (message_id, account, amount) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING`, msg.ID, c.Account, c.Amount)
			return err
		})
	}
	expectFailures(t, checkSuite(t, s), map[string][]string{
		"rolled-back": {"rolled-back: each sample's handler ran in a transaction that was then rolled back", "table entries changed", "outside its transaction"},
	})
}

// A handler that writes part of its effect through the pool with ON
// CONFLICT DO NOTHING, the rest in its transaction.
func TestBrokenPartialPoolWrite(t *testing.T) {
	s := suite()
	s.Setup = func(ctx context.Context, env *Env) error {
		if err := creditSetup(ctx, env); err != nil {
			return err
		}
		_, err := env.Pool.Exec(ctx, `CREATE UNIQUE INDEX ON entries (message_id)`)
		return err
	}
	s.Handler = nil
	s.NewHandler = func(env *Env) consumer.Handler {
		return consumer.JSON(func(ctx context.Context, tx pgx.Tx, msg *consumer.Message, c creditMsg) error {
			if _, err := tx.Exec(ctx, `UPDATE accounts SET balance = balance + $2 WHERE id = $1`, c.Account, c.Amount); err != nil {
				return err
			}
			_, err := env.Pool.Exec(ctx, `INSERT INTO entries (message_id, account, amount) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING`, msg.ID, c.Account, c.Amount)
			return err
		})
	}
	expectFailures(t, checkSuite(t, s), map[string][]string{
		"rolled-back": {"table entries changed", "outside its transaction"},
	})
}

// A handler that fails on every retry: the cases that retry must say that
// the samples ended dead-lettered rather than applied, whatever the end
// state.
func TestRetriedSamplesMustEndApplied(t *testing.T) {
	s := suite()
	s.Handler = nil
	s.NewHandler = func(env *Env) consumer.Handler {
		var mu sync.Mutex
		seen := map[string]bool{}
		return func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
			mu.Lock()
			again := seen[msg.ID]
			seen[msg.ID] = true
			mu.Unlock()
			if again {
				return consumer.Permanent(fmt.Errorf("fails when run again"))
			}
			return credit(ctx, tx, msg)
		}
	}
	got := checkSuite(t, s)
	for _, name := range []string{"commit-fails", "handler-error-retried"} {
		r := got[name]
		if !r.Failed || !containsFragment(strings.Join(r.Messages, "\n"), "ended dead-lettered") {
			t.Errorf("case %s: %s; want it to fail, saying samples ended dead-lettered", name, r)
		}
	}
}
