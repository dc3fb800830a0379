package httpidem_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/httpidem"
)

// lossyDB is a pool whose next transaction's COMMIT succeeds but answers
// an error, as when the request is cancelled while the COMMIT is in
// flight, or the connection drops before its answer.
type lossyDB struct {
	*pgxpool.Pool
	loseNextCommit atomic.Bool
}

func (d *lossyDB) Begin(ctx context.Context) (pgx.Tx, error) {
	tx, err := d.Pool.Begin(ctx)
	if err == nil && d.loseNextCommit.CompareAndSwap(true, false) {
		return lossyTx{tx}, nil
	}
	return tx, err
}

type lossyTx struct{ pgx.Tx }

func (t lossyTx) Commit(ctx context.Context) error {
	if err := t.Tx.Commit(ctx); err != nil {
		return err
	}
	return errors.New("conn closed: the COMMIT's answer was lost")
}

// TestClaimCommitLostIsReleased: a claim committed, but its COMMIT's
// answer was lost. The request is answered 503, and a retry with the same
// key and body is served at once: the claim is released, not left to
// refuse retries with 409 until LockTimeout (a minute), as it did.
func TestClaimCommitLostIsReleased(t *testing.T) {
	t.Parallel()
	a := newApp(t, httpidem.Config{})
	db := &lossyDB{Pool: a.pool}
	mw, err := httpidem.New(db, httpidem.Config{Schema: a.schema})
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /payments", a.create)
	srv := httptest.NewServer(mw.Wrap(mux))
	t.Cleanup(srv.Close)
	post := func() int {
		t.Helper()
		req, err := http.NewRequestWithContext(testCtx(t, 30*time.Second), http.MethodPost, srv.URL+"/payments", strings.NewReader(`{"account":"a","amount":5}`))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Idempotency-Key", "lost-commit-1")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	db.loseNextCommit.Store(true)
	if got := post(); got != http.StatusServiceUnavailable {
		t.Fatalf("the request whose claim's COMMIT answer was lost: %d, want 503", got)
	}
	if got := post(); got != http.StatusCreated {
		t.Fatalf("its retry: %d, want 201 (409 means the claim was left locked)", got)
	}
	if n := a.effects(t); n != 1 {
		t.Fatalf("%d effects, want 1", n)
	}
}

// TestCancelledRequestsLeaveTheirKeyFree: clients that give up on a request
// at once (a timeout of a millisecond or two, cutting it off at any point:
// the claim, the handler, the commit) get their retry served within
// seconds. pgx answers a cancelled COMMIT at once, and a claim cancelled
// half-way could commit after the release meant to undo it: before the
// claim ran to its end, some of these keys answered 409 for a minute.
func TestCancelledRequestsLeaveTheirKeyFree(t *testing.T) {
	t.Parallel()
	a := newApp(t, httpidem.Config{})
	post := func(ctx context.Context, key string) (int, error) {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, a.srv.URL+"/payments", strings.NewReader(`{"account":"a","amount":5}`))
		if err != nil {
			return 0, err
		}
		req.Header.Set("Idempotency-Key", key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return 0, err
		}
		resp.Body.Close()
		return resp.StatusCode, nil
	}
	const keys = 200
	var wg sync.WaitGroup
	errs := make(chan error, keys)
	slots := make(chan struct{}, 8) // eight clients at once
	for i := range keys {
		wg.Add(1)
		go func() {
			defer wg.Done()
			slots <- struct{}{}
			defer func() { <-slots }()
			key := fmt.Sprintf("cancelled-%d", i)
			ctx, cancel := context.WithTimeout(context.Background(), time.Duration(i%4)*500*time.Microsecond+200*time.Microsecond)
			_, _ = post(ctx, key)
			cancel()
			deadline := time.Now().Add(10 * time.Second)
			for {
				status, err := post(testCtx(t, 30*time.Second), key)
				if err == nil && status == http.StatusCreated {
					return
				}
				if time.Now().After(deadline) {
					errs <- fmt.Errorf("%s: still %d (%v) 10 s after the cancelled request", key, status, err)
					return
				}
				time.Sleep(100 * time.Millisecond)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if n := a.effects(t); n != keys {
		t.Errorf("%d effects for %d keys", n, keys)
	}
}
