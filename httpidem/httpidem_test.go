package httpidem_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/httpidem"
	"github.com/idemq/idemq/internal/testdb"
)

func testCtx(t *testing.T, d time.Duration) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// app is a payments handler behind the middleware. Each applied payment is
// a row in a table with no unique constraint, so a double apply shows.
type app struct {
	pool     *pgxpool.Pool
	schema   string
	payments string
	mw       *httpidem.Middleware
	srv      *httptest.Server
	calls    atomic.Int64
	// before, if set, runs in the handler before the insert; it may
	// write a response itself and return false.
	before func(w http.ResponseWriter, r *http.Request) bool
}

func newApp(t *testing.T, cfg httpidem.Config) *app {
	t.Helper()
	ctx := testCtx(t, 30*time.Second)
	a := &app{pool: testdb.Pool(t), schema: testdb.Schema(t)}
	a.payments = pgx.Identifier{a.schema, "payments"}.Sanitize()
	if _, err := a.pool.Exec(ctx, "CREATE TABLE "+a.payments+" (id bigint GENERATED ALWAYS AS IDENTITY, account text, amount bigint)"); err != nil {
		t.Fatal(err)
	}
	cfg.Schema = a.schema
	mw, err := httpidem.New(a.pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := mw.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	a.mw = mw
	mux := http.NewServeMux()
	mux.HandleFunc("POST /payments", a.create)
	mux.HandleFunc("GET /payments", func(w http.ResponseWriter, r *http.Request) {
		_, ok := httpidem.Tx(r.Context())
		fmt.Fprintf(w, "tx=%v", ok)
	})
	a.srv = httptest.NewServer(mw.Wrap(mux))
	t.Cleanup(a.srv.Close)
	return a
}

func (a *app) create(w http.ResponseWriter, r *http.Request) {
	a.calls.Add(1)
	if a.before != nil && !a.before(w, r) {
		return
	}
	tx, ok := httpidem.Tx(r.Context())
	if !ok {
		http.Error(w, "no transaction", http.StatusInternalServerError)
		return
	}
	var p struct {
		Account string `json:"account"`
		Amount  int64  `json:"amount"`
	}
	if err := json.NewDecoder(r.Body).Decode(&p); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	var id int64
	if err := tx.QueryRow(r.Context(), "INSERT INTO "+a.payments+" (account, amount) VALUES ($1, $2) RETURNING id", p.Account, p.Amount).Scan(&id); err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Location", fmt.Sprintf("/payments/%d", id))
	w.Header().Set("X-Not-Replayed", "1")
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"id":%d,"account":%q,"amount":%d}`, id, p.Account, p.Amount)
}

func (a *app) effects(t *testing.T) int {
	t.Helper()
	var n int
	if err := a.pool.QueryRow(testCtx(t, 10*time.Second), "SELECT count(*) FROM "+a.payments).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

type resp struct {
	status int
	header http.Header
	body   string
}

func (a *app) post(t *testing.T, key, body string, hdr ...string) resp {
	t.Helper()
	return a.do(t, http.MethodPost, "/payments", key, body, hdr...)
}

func (a *app) do(t *testing.T, method, path, key, body string, hdr ...string) resp {
	t.Helper()
	req, err := http.NewRequestWithContext(testCtx(t, 30*time.Second), method, a.srv.URL+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	res, err := a.srv.Client().Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	return resp{status: res.StatusCode, header: res.Header, body: string(b)}
}

const pay = `{"account":"acct-1","amount":500}`

func TestRetryAfterLostResponseGetsTheOriginal(t *testing.T) {
	t.Parallel()
	a := newApp(t, httpidem.Config{})
	first := a.post(t, "k1", pay)
	if first.status != http.StatusCreated || first.header.Get(httpidem.ReplayedHeader) != "" {
		t.Fatalf("first: %+v", first)
	}
	// The client never saw that response; it retries, with the JSON keys
	// in another order and other whitespace.
	retry := a.post(t, "k1", `{ "amount": 500, "account": "acct-1" }`)
	if retry.status != http.StatusCreated || retry.body != first.body {
		t.Fatalf("retry: %+v, want the original %+v", retry, first)
	}
	if retry.header.Get("Location") != first.header.Get("Location") || retry.header.Get("Content-Type") != "application/json" {
		t.Fatalf("retry headers %v, want the stored Location and Content-Type", retry.header)
	}
	if retry.header.Get(httpidem.ReplayedHeader) != "true" || retry.header.Get("X-Not-Replayed") != "" {
		t.Fatalf("retry headers %v: want Idempotent-Replayed and only the selected headers", retry.header)
	}
	if n := a.effects(t); n != 1 || a.calls.Load() != 1 {
		t.Fatalf("effects %d, handler calls %d; want 1 and 1", n, a.calls.Load())
	}
	// Another key is another payment.
	if r := a.post(t, "k2", pay); r.status != http.StatusCreated || r.body == first.body {
		t.Fatalf("k2: %+v", r)
	}
}

func TestMutatedPayloadGets422(t *testing.T) {
	t.Parallel()
	a := newApp(t, httpidem.Config{IgnoreFields: []string{"sent_at", "meta.trace"}})
	if r := a.post(t, "k1", `{"account":"acct-1","amount":500,"sent_at":"10:00","meta":{"trace":"a","x":1}}`); r.status != http.StatusCreated {
		t.Fatalf("first: %+v", r)
	}
	// Volatile fields differ: still the same request.
	if r := a.post(t, "k1", `{"account":"acct-1","amount":500,"sent_at":"10:01","meta":{"trace":"b","x":1}}`); r.status != http.StatusCreated || r.header.Get(httpidem.ReplayedHeader) != "true" {
		t.Fatalf("retry with volatile fields changed: %+v", r)
	}
	for _, body := range []string{
		`{"account":"acct-1","amount":501,"sent_at":"10:00","meta":{"trace":"a","x":1}}`,
		`{"account":"acct-1","amount":500,"meta":{"trace":"a","x":2}}`,
	} {
		if r := a.post(t, "k1", body); r.status != http.StatusUnprocessableEntity {
			t.Fatalf("mutated %s: %+v, want 422", body, r)
		}
	}
	// Same body on another path or with a query is another request too.
	if r := a.do(t, http.MethodPost, "/payments?dry_run=1", "k1", `{"account":"acct-1","amount":500,"meta":{"x":1}}`); r.status != http.StatusUnprocessableEntity {
		t.Fatalf("other query: %+v", r)
	}
	if n := a.effects(t); n != 1 {
		t.Fatalf("effects = %d", n)
	}
}

// TestConcurrentDuplicatesGiveOneEffect: one request holds the claim while
// its duplicates arrive; they get 409 with Retry-After; then it completes
// and a retry replays its response.
func TestConcurrentDuplicatesGiveOneEffect(t *testing.T) {
	t.Parallel()
	a := newApp(t, httpidem.Config{})
	const n = 16
	var finished atomic.Int64
	others := make(chan struct{})
	a.before = func(http.ResponseWriter, *http.Request) bool {
		// The winner waits until every duplicate was answered.
		select {
		case <-others:
		case <-time.After(20 * time.Second):
			t.Error("duplicates were not answered while the first request ran")
		}
		return true
	}
	results := make([]resp, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i] = a.post(t, "same-key", pay)
			if finished.Add(1) == n-1 {
				close(others)
			}
		}()
	}
	wg.Wait()
	var created, conflicts int
	var body string
	for _, r := range results {
		switch r.status {
		case http.StatusCreated:
			created++
			body = r.body
		case http.StatusConflict:
			conflicts++
			if r.header.Get("Retry-After") == "" {
				t.Errorf("409 without Retry-After: %+v", r)
			}
		default:
			t.Errorf("unexpected response %+v", r)
		}
	}
	if created != 1 || conflicts != n-1 {
		t.Fatalf("created %d, conflicts %d; want 1 and %d", created, conflicts, n-1)
	}
	if e := a.effects(t); e != 1 || a.calls.Load() != 1 {
		t.Fatalf("effects %d, handler calls %d; want 1 and 1", e, a.calls.Load())
	}
	if r := a.post(t, "same-key", pay); r.status != http.StatusCreated || r.body != body {
		t.Fatalf("retry after completion: %+v", r)
	}
}

// TestConcurrentDuplicatesRace fires duplicates with no coordination at
// all: whatever interleaving happens, one effect and one distinct body.
func TestConcurrentDuplicatesRace(t *testing.T) {
	t.Parallel()
	a := newApp(t, httpidem.Config{})
	const n = 24
	var wg sync.WaitGroup
	results := make([]resp, n)
	for i := range n {
		wg.Add(1)
		go func() { defer wg.Done(); results[i] = a.post(t, fmt.Sprint("race-", i%3), pay) }()
	}
	wg.Wait()
	bodies := map[string]bool{}
	for _, r := range results {
		switch r.status {
		case http.StatusCreated:
			bodies[r.body] = true
		case http.StatusConflict:
		default:
			t.Errorf("unexpected %+v", r)
		}
	}
	if e := a.effects(t); e != 3 || len(bodies) != 3 {
		t.Fatalf("effects %d, distinct bodies %d; want 3 and 3", e, len(bodies))
	}
}

func Test5xxReleasesTheClaim(t *testing.T) {
	t.Parallel()
	a := newApp(t, httpidem.Config{})
	var fail atomic.Bool
	fail.Store(true)
	a.before = func(w http.ResponseWriter, r *http.Request) bool {
		if !fail.Load() {
			return true
		}
		// Do some database work, then fail: the work must roll back.
		tx, _ := httpidem.Tx(r.Context())
		if _, err := tx.Exec(r.Context(), "INSERT INTO "+a.payments+" (account, amount) VALUES ('x', 1)"); err != nil {
			t.Error(err)
		}
		http.Error(w, "downstream unavailable", http.StatusServiceUnavailable)
		return false
	}
	if r := a.post(t, "k1", pay); r.status != http.StatusServiceUnavailable {
		t.Fatalf("first: %+v", r)
	}
	if e := a.effects(t); e != 0 {
		t.Fatalf("effects after 5xx = %d, want 0", e)
	}
	fail.Store(false)
	if r := a.post(t, "k1", pay); r.status != http.StatusCreated || r.header.Get(httpidem.ReplayedHeader) != "" {
		t.Fatalf("retry after 5xx: %+v, want a fresh 201", r)
	}
	if e := a.effects(t); e != 1 || a.calls.Load() != 2 {
		t.Fatalf("effects %d, calls %d", e, a.calls.Load())
	}
}

func TestPanicReleasesTheClaim(t *testing.T) {
	t.Parallel()
	a := newApp(t, httpidem.Config{})
	var boom atomic.Bool
	boom.Store(true)
	a.before = func(w http.ResponseWriter, r *http.Request) bool {
		if boom.Load() {
			tx, _ := httpidem.Tx(r.Context())
			_, _ = tx.Exec(r.Context(), "INSERT INTO "+a.payments+" (account, amount) VALUES ('x', 1)")
			panic("boom")
		}
		return true
	}
	// Call the handler directly to see the panic re-raised.
	h := a.mw.Wrap(http.HandlerFunc(a.create))
	req := httptest.NewRequestWithContext(testCtx(t, 10*time.Second), http.MethodPost, "/payments", strings.NewReader(pay))
	req.Header.Set("Idempotency-Key", "k1")
	func() {
		defer func() {
			if p := recover(); p != "boom" {
				t.Errorf("recovered %v, want the handler's panic", p)
			}
		}()
		h.ServeHTTP(httptest.NewRecorder(), req)
	}()
	if e := a.effects(t); e != 0 {
		t.Fatalf("effects after panic = %d", e)
	}
	boom.Store(false)
	if r := a.post(t, "k1", pay); r.status != http.StatusCreated {
		t.Fatalf("retry after panic: %+v", r)
	}
}

// TestStaleClaimTakeover: a request that crashed after claiming leaves its
// claim in progress. Until LockTimeout passes, retries get 409; a different
// payload gets 422 before and after; after it, a retry with the same
// fingerprint takes the claim over and applies once.
func TestStaleClaimTakeover(t *testing.T) {
	t.Parallel()
	const lease = 400 * time.Millisecond
	a := newApp(t, httpidem.Config{LockTimeout: lease})
	crash := errors.New("crash")
	httpidem.SetAfterClaim(a.mw, func() error { return crash })
	a.post(t, "k1", pay) // claims, then "crashes": no handler, no release
	httpidem.SetAfterClaim(a.mw, nil)
	if a.calls.Load() != 0 {
		t.Fatal("handler ran")
	}
	r := a.post(t, "k1", pay)
	if r.status != http.StatusConflict || r.header.Get("Retry-After") != "1" {
		t.Fatalf("during the lease: %+v, want 409 with Retry-After 1", r)
	}
	if r := a.post(t, "k1", `{"account":"acct-2","amount":500}`); r.status != http.StatusUnprocessableEntity {
		t.Fatalf("other payload during the lease: %+v", r)
	}
	// Wait (by the database clock) until the lease is over.
	deadline := time.Now().Add(10 * time.Second)
	for {
		var expired bool
		err := a.pool.QueryRow(testCtx(t, 5*time.Second), "SELECT locked_until < now() FROM "+pgx.Identifier{a.schema, "idempotency_keys"}.Sanitize()+" WHERE key = 'k1'").Scan(&expired)
		if err != nil {
			t.Fatal(err)
		}
		if expired {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("lease never expired")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if r := a.post(t, "k1", `{"account":"acct-2","amount":500}`); r.status != http.StatusUnprocessableEntity {
		t.Fatalf("other payload after the lease: %+v, want 422: takeover needs the same fingerprint", r)
	}
	first := a.post(t, "k1", pay)
	if first.status != http.StatusCreated || first.header.Get(httpidem.ReplayedHeader) != "" {
		t.Fatalf("takeover: %+v", first)
	}
	if r := a.post(t, "k1", pay); r.status != http.StatusCreated || r.body != first.body {
		t.Fatalf("after takeover: %+v", r)
	}
	var takeovers int
	if err := a.pool.QueryRow(testCtx(t, 5*time.Second), "SELECT takeovers FROM "+pgx.Identifier{a.schema, "idempotency_keys"}.Sanitize()).Scan(&takeovers); err != nil || takeovers != 1 {
		t.Fatalf("takeovers = %d, %v", takeovers, err)
	}
	if e := a.effects(t); e != 1 || a.calls.Load() != 1 {
		t.Fatalf("effects %d, calls %d", e, a.calls.Load())
	}
}

// TestLongRequestIsNeverTakenOver: a request that outlives its lease still
// holds its claim's row lock; duplicates get 409, not a takeover.
func TestLongRequestIsNeverTakenOver(t *testing.T) {
	t.Parallel()
	a := newApp(t, httpidem.Config{LockTimeout: 50 * time.Millisecond})
	release := make(chan struct{})
	entered := make(chan struct{})
	var once sync.Once
	a.before = func(http.ResponseWriter, *http.Request) bool {
		once.Do(func() { close(entered) })
		select {
		case <-release:
		case <-time.After(20 * time.Second):
		}
		return true
	}
	done := make(chan resp, 1)
	go func() { done <- a.post(t, "k1", pay) }()
	<-entered
	deadline := time.Now().Add(10 * time.Second)
	for {
		var expired bool
		_ = a.pool.QueryRow(testCtx(t, 5*time.Second), "SELECT locked_until < now() FROM "+pgx.Identifier{a.schema, "idempotency_keys"}.Sanitize()).Scan(&expired)
		if expired {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("lease never expired")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if r := a.post(t, "k1", pay); r.status != http.StatusConflict {
		t.Fatalf("duplicate of a running request past its lease: %+v, want 409", r)
	}
	close(release)
	if r := <-done; r.status != http.StatusCreated {
		t.Fatalf("original: %+v", r)
	}
	if e := a.effects(t); e != 1 || a.calls.Load() != 1 {
		t.Fatalf("effects %d, calls %d", e, a.calls.Load())
	}
}

func TestStrictLaxScopeAndMethods(t *testing.T) {
	t.Parallel()
	strict := newApp(t, httpidem.Config{})
	if r := strict.post(t, "", pay); r.status != http.StatusBadRequest {
		t.Fatalf("strict without key: %+v", r)
	}
	if r := strict.post(t, strings.Repeat("k", httpidem.MaxKeyLen+1), pay); r.status != http.StatusBadRequest {
		t.Fatalf("long key: %+v", r)
	}
	if r := strict.do(t, http.MethodGet, "/payments", "", ""); r.status != http.StatusOK || r.body != "tx=false" {
		t.Fatalf("GET: %+v", r)
	}
	if e := strict.effects(t); e != 0 {
		t.Fatalf("effects %d", e)
	}

	lax := newApp(t, httpidem.Config{Mode: httpidem.Lax, Scope: func(r *http.Request) string { return r.Header.Get("X-Tenant") }, MaxBodyBytes: 100})
	for range 2 {
		if r := lax.post(t, "", pay); r.status != http.StatusCreated {
			t.Fatalf("lax without key: %+v", r)
		}
	}
	if e := lax.effects(t); e != 2 {
		t.Fatalf("lax without key applies every request: %d", e)
	}
	a := lax.post(t, "k", pay, "X-Tenant", "t1")
	b := lax.post(t, "k", pay, "X-Tenant", "t2")
	if a.status != http.StatusCreated || b.status != http.StatusCreated || a.body == b.body {
		t.Fatalf("same key in two scopes: %+v %+v", a, b)
	}
	if r := lax.post(t, "k", pay, "X-Tenant", "t1"); r.body != a.body {
		t.Fatalf("replay in scope t1: %+v", r)
	}
	if r := lax.post(t, "big", `{"account":"`+strings.Repeat("a", 200)+`"}`); r.status != http.StatusRequestEntityTooLarge {
		t.Fatalf("big body: %+v", r)
	}
}

func TestPurgeAndConfig(t *testing.T) {
	t.Parallel()
	a := newApp(t, httpidem.Config{})
	ctx := testCtx(t, 30*time.Second)
	for _, k := range []string{"old", "new"} {
		if r := a.post(t, k, pay); r.status != http.StatusCreated {
			t.Fatal(r)
		}
	}
	tbl := pgx.Identifier{a.schema, "idempotency_keys"}.Sanitize()
	if _, err := a.pool.Exec(ctx, "UPDATE "+tbl+" SET created_at = now() - interval '2 days' WHERE key = 'old'"); err != nil {
		t.Fatal(err)
	}
	n, err := a.mw.Purge(ctx, 24*time.Hour)
	if err != nil || n != 1 {
		t.Fatalf("Purge = %d, %v", n, err)
	}
	// A purged key is a new request.
	if r := a.post(t, "old", pay); r.status != http.StatusCreated || r.header.Get(httpidem.ReplayedHeader) != "" {
		t.Fatalf("after purge: %+v", r)
	}
	if _, err := a.mw.Purge(ctx, 0); err == nil {
		t.Error("Purge(0): want error")
	}
	if _, err := httpidem.New(nil, httpidem.Config{}); !errors.Is(err, consumer.ErrInvalidConfig) {
		t.Errorf("New(nil) = %v", err)
	}
	for _, cfg := range []httpidem.Config{{Table: "x-y"}, {LockTimeout: -1}, {Mode: 7}} {
		if _, err := httpidem.New(a.pool, cfg); !errors.Is(err, consumer.ErrInvalidConfig) {
			t.Errorf("New(%+v) = %v", cfg, err)
		}
	}
	m, err := httpidem.New(a.pool, httpidem.Config{Schema: a.schema, Table: "not_migrated"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m.Purge(ctx, time.Hour); !errors.Is(err, consumer.ErrNotMigrated) {
		t.Fatalf("Purge before Migrate: %v", err)
	}
}

func TestCanonicalJSON(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{`{"b":1,"a":[2,{"d":1,"c":2}]}`, `{"a":[2,{"c":2,"d":1}],"b":1}`},
		{`{"n":1.50,"drop":1}`, `{"n":1.50}`},
		{`{"m":{"drop":1,"keep":2}}`, `{"m":{"keep":2}}`},
		{`not json`, `not json`},
		{``, ``},
	} {
		got, err := httpidem.CanonicalJSON([]byte(c.in), "drop", "m.drop")
		if err != nil || string(got) != c.want {
			t.Errorf("CanonicalJSON(%s) = %s, %v; want %s", c.in, got, err, c.want)
		}
	}
}

func TestRetryAfterFormula(t *testing.T) {
	const lock = time.Minute
	for _, c := range []struct {
		remaining, lockTimeout time.Duration
		want                   int64
	}{
		{lock - 20*time.Millisecond, lock, 1},   // a request 20ms old
		{lock - 1500*time.Millisecond, lock, 2}, // 1.5s old: about as long again
		{lock - 10*time.Second, lock, 10},
		{lock - 50*time.Second, lock, 10}, // 50s old, but the lock ends in 10s
		{200 * time.Millisecond, lock, 1}, // the lock ends in 200ms
		{-5 * time.Second, lock, 60},      // past its lock, still running: at most the lock timeout
		{-5 * time.Second, 100 * time.Millisecond, 1},
		{2 * lock, lock, 1}, // locked with a longer timeout than today's
		{400 * time.Millisecond, 400 * time.Millisecond, 1},
	} {
		if got := httpidem.RetryAfter(c.remaining, c.lockTimeout); got != c.want {
			t.Errorf("RetryAfter(remaining %s, lock timeout %s) = %d, want %d", c.remaining, c.lockTimeout, got, c.want)
		}
	}
}

// TestRetryAfterFollowsTheRequestsAge: with the default one-minute lock,
// duplicates of a request that has just started are told to retry after
// 1s, and after about its age once it has run for a while; never after the
// whole lock timeout.
func TestRetryAfterFollowsTheRequestsAge(t *testing.T) {
	t.Parallel()
	a := newApp(t, httpidem.Config{})
	release := make(chan struct{})
	entered := make(chan struct{})
	var once sync.Once
	a.before = func(http.ResponseWriter, *http.Request) bool {
		once.Do(func() { close(entered) })
		select {
		case <-release:
		case <-time.After(20 * time.Second):
		}
		return true
	}
	started := time.Now()
	done := make(chan resp, 1)
	go func() { done <- a.post(t, "k1", pay) }()
	<-entered
	retryAfter := func() int {
		t.Helper()
		r := a.post(t, "k1", pay)
		if r.status != http.StatusConflict {
			t.Fatalf("duplicate: %+v, want 409", r)
		}
		var n int
		if _, err := fmt.Sscan(r.header.Get("Retry-After"), &n); err != nil {
			t.Fatalf("Retry-After %q: %v", r.header.Get("Retry-After"), err)
		}
		return n
	}
	if n, age := retryAfter(), time.Since(started); n < 1 || time.Duration(n-1)*time.Second > age {
		t.Errorf("Retry-After %d for a request %s old, want 1 (its age, at least 1s)", n, age)
	}
	time.Sleep(2100*time.Millisecond - time.Since(started))
	if n, age := retryAfter(), time.Since(started); n < 2 || time.Duration(n-1)*time.Second > age {
		t.Errorf("Retry-After %d for a request %s old, want its age in seconds", n, age)
	}
	close(release)
	if r := <-done; r.status != http.StatusCreated {
		t.Fatalf("first request: %+v", r)
	}
}
