package main

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemq/idemq/httpidem"
	"github.com/idemq/idemq/internal/testdb"
)

// TestWalkThrough runs the README's curl walk-through against the API.
func TestWalkThrough(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	pool := testdb.Pool(t)
	schema := testdb.Schema(t)
	h, _, err := newApp(ctx, pool, schema, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	defer srv.Close()

	do := func(method, path, key, body string) (int, http.Header, string) {
		t.Helper()
		req, err := http.NewRequestWithContext(ctx, method, srv.URL+path, strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("X-Client-Id", "shop-1")
		if key != "" {
			req.Header.Set("Idempotency-Key", key)
		}
		res, err := srv.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer res.Body.Close()
		b, _ := io.ReadAll(res.Body)
		return res.StatusCode, res.Header, string(b)
	}

	// 1. A payment.
	st, hdr, first := do("POST", "/payments", "pay-001", `{"account":"acct-1","amount_cents":500,"client_time":"10:00:00"}`)
	if st != http.StatusCreated || hdr.Get("Location") == "" {
		t.Fatalf("create: %d %s", st, first)
	}
	// 2. The response was lost; the client retries (its clock moved on).
	st, hdr, again := do("POST", "/payments", "pay-001", `{"account":"acct-1","amount_cents":500,"client_time":"10:00:05"}`)
	if st != http.StatusCreated || again != first || hdr.Get(httpidem.ReplayedHeader) != "true" {
		t.Fatalf("retry: %d %s %v", st, again, hdr)
	}
	// 3. The same key for another payment is a client bug.
	if st, _, b := do("POST", "/payments", "pay-001", `{"account":"acct-1","amount_cents":900}`); st != http.StatusUnprocessableEntity {
		t.Fatalf("reused key: %d %s", st, b)
	}
	// 4. No key.
	if st, _, b := do("POST", "/payments", "", `{"account":"acct-1","amount_cents":500}`); st != http.StatusBadRequest {
		t.Fatalf("no key: %d %s", st, b)
	}
	// 5. A burst of concurrent duplicates of a new payment.
	var wg sync.WaitGroup
	statuses := make([]int, 10)
	for i := range statuses {
		wg.Add(1)
		go func() {
			defer wg.Done()
			statuses[i], _, _ = do("POST", "/payments", "pay-002", `{"account":"acct-1","amount_cents":250}`)
		}()
	}
	wg.Wait()
	for _, s := range statuses {
		if s != http.StatusCreated && s != http.StatusConflict {
			t.Fatalf("concurrent duplicate: %d", s)
		}
	}
	// The burst may have ended with only 409s answered after the winner;
	// a retry gets the winner's answer.
	if st, _, b := do("POST", "/payments", "pay-002", `{"account":"acct-1","amount_cents":250}`); st != http.StatusCreated {
		t.Fatalf("pay-002 retry: %d %s", st, b)
	}
	// 6. The balance: each payment credited once.
	st, _, b := do("GET", "/accounts/acct-1", "", "")
	var acct struct {
		Balance int64 `json:"balance_cents"`
	}
	if err := json.Unmarshal([]byte(b), &acct); st != http.StatusOK || err != nil || acct.Balance != 750 {
		t.Fatalf("balance: %d %s %v, want 750", st, b, err)
	}
	var payments int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+schema+`.payments`).Scan(&payments); err != nil || payments != 2 {
		t.Fatalf("payments = %d, %v; want 2", payments, err)
	}
}
