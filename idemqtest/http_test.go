package idemqtest

import (
	"context"
	"encoding/json"
	"net/http"
	"testing"

	"github.com/idemq/idemq/httpidem"
)

// creditAPI is POST /credit {"account", "amount"} behind httpidem, with
// the middleware configured by cfg (Schema is filled in).
func creditAPI(cfg httpidem.Config) func(ctx context.Context, env *Env) (http.Handler, *httpidem.Middleware, error) {
	return func(ctx context.Context, env *Env) (http.Handler, *httpidem.Middleware, error) {
		cfg.Schema = env.Schema
		mw, err := httpidem.New(env.Pool, cfg)
		if err != nil {
			return nil, nil, err
		}
		if err := mw.Migrate(ctx); err != nil {
			return nil, nil, err
		}
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			tx, _ := httpidem.Tx(r.Context())
			var c creditMsg
			if err := json.NewDecoder(r.Body).Decode(&c); err != nil {
				http.Error(w, err.Error(), http.StatusBadRequest)
				return
			}
			var balance int64
			err := tx.QueryRow(r.Context(), `UPDATE accounts SET balance = balance + $2 WHERE id = $1 RETURNING balance`, c.Account, c.Amount).Scan(&balance)
			if err == nil {
				_, err = tx.Exec(r.Context(), `INSERT INTO entries (message_id, account, amount) VALUES ('http', $1, $2)`, c.Account, c.Amount)
			}
			if err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			w.Header().Set("Content-Type", "application/json")
			w.Header().Set("Location", "/accounts/"+c.Account)
			w.WriteHeader(http.StatusCreated)
			_ = json.NewEncoder(w).Encode(map[string]any{"account": c.Account, "balance": balance})
		})
		return mw.Wrap(h), mw, nil
	}
}

func httpSuite(cfg httpidem.Config) HTTPSuite {
	return HTTPSuite{
		Setup:   creditSetup,
		Handler: creditAPI(cfg),
		Requests: []Request{
			{Target: "/credit", Body: `{"account": "a", "amount": 100}`},
			{Target: "/credit", Body: `{"account": "b", "amount": 250}`},
		},
		Effect: suite().Effect,
	}
}

func checkHTTP(t *testing.T, s HTTPSuite) map[string]Result {
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

func TestHTTPCorrectAPIPasses(t *testing.T) {
	got := checkHTTP(t, httpSuite(httpidem.Config{}))
	if len(got) != 6 {
		t.Errorf("%d cases, want 6", len(got))
	}
	expectFailures(t, got, nil)
}

func TestRunHTTPSuite(t *testing.T) {
	Run(t, httpSuite(httpidem.Config{}))
}

// A middleware whose fingerprint ignores the body: a reused key with
// another body is replayed instead of refused.
func TestHTTPBrokenIgnoresBodyHash(t *testing.T) {
	s := httpSuite(httpidem.Config{Canonicalize: func(*http.Request, []byte) ([]byte, error) { return nil, nil }})
	expectFailures(t, checkHTTP(t, s), map[string][]string{
		"mutated-body": {"mutated-body: request 0 (POST /credit): the same Idempotency-Key with a different body got 201 Created (replayed), want 422 Unprocessable Entity"},
	})
}

func TestHTTPNoMiddlewareSkipsRetention(t *testing.T) {
	s := httpSuite(httpidem.Config{})
	inner := s.Handler
	s.Handler = func(ctx context.Context, env *Env) (http.Handler, *httpidem.Middleware, error) {
		h, _, err := inner(ctx, env)
		return h, nil, err
	}
	got := checkHTTP(t, s)
	if !got["after-retention"].Skipped {
		t.Errorf("after-retention: %s, want skipped", got["after-retention"])
	}
	expectFailures(t, got, nil)
}
