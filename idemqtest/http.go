package idemqtest

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"sync"
	"time"

	"github.com/idemq/idemq/httpidem"
)

// Request is one sample request of an HTTPSuite. The kit sets the
// idempotency key header itself.
type Request struct {
	// Method defaults to POST.
	Method string
	// Target is the path and query, such as "/payments".
	Target string
	// Header holds extra request headers, such as Content-Type or the
	// header the middleware's Scope reads.
	Header http.Header
	// Body is the request body.
	Body string
}

func (r Request) String() string { return r.Method + " " + r.Target }

// HTTPSuite describes an HTTP API made idempotent by httpidem: the API, a
// few sample requests, and how to read the effect they leave. The zero
// value of every optional field selects a documented default.
//
// Run tests it with these cases, each checking that the end state equals
// the state after each sample request was applied once, and the responses
// the client sees:
//
//   - determinism: two clean runs leave the same effect.
//   - concurrent-duplicates: Duplicates requests with one key at once get
//     exactly one original response; the others get 409 Conflict or a
//     replay, and retried after a 409 get the replay.
//   - crash-before-response: the connection dies when the response is
//     written, after the transaction committed; the retry gets the stored
//     response, replayed.
//   - mutated-body: the key reused with a different body gets 422.
//   - after-retention: a key is kept by a purge with a long retention and
//     replayed; once purged, a request reusing it is a new request, as
//     httpidem documents: the end state is compared with each request
//     applied twice under two keys, so leave the key itself out of the
//     effect (skipped when Handler returns no middleware).
//   - replay-consistent: replays repeat the original status, body and
//     replayed headers, with Idempotent-Replayed: true.
//
// Requests are served in process, through Handler's http.Handler; no
// server is started.
type HTTPSuite struct {
	// Handler builds the API for one run: the handler to serve, wrapped in
	// its httpidem middleware, and the middleware itself (the kit purges
	// keys through it; nil skips the after-retention case). Configure the
	// middleware with DB env.Pool and Schema env.Schema. Required.
	Handler func(ctx context.Context, env *Env) (http.Handler, *httpidem.Middleware, error)
	// Requests are the samples: requests the API handles with a stored
	// response (any status below 500). Required.
	Requests []Request
	// Setup creates the API's tables in the run's schema before Handler is
	// called. Defaults to nothing.
	Setup func(ctx context.Context, env *Env) error
	// Effect reads the end state to compare. Required.
	Effect EffectFunc
	// Ignore are object keys dropped from the effect before it is
	// compared, as in Suite. Defaults to none.
	Ignore []string
	// KeyHeader is the idempotency key header. Defaults to
	// "Idempotency-Key", as httpidem.Config.Header does.
	KeyHeader string
	// Mutate returns a different request body for the same operation's
	// key, for the mutated-body case. Defaults to adding the field
	// "idemqtest_mutated": true to a JSON object body, and appending a
	// line to any other body.
	Mutate func(body []byte) []byte
	// Duplicates is how many requests the concurrent case sends at once
	// with one key. Defaults to 4.
	Duplicates int
	// DatabaseURL and Timeout are as in Suite.
	DatabaseURL string
	Timeout     time.Duration
}

func (s HTTPSuite) withDefaults() HTTPSuite {
	if s.KeyHeader == "" {
		s.KeyHeader = "Idempotency-Key"
	}
	if s.Mutate == nil {
		s.Mutate = mutateBody
	}
	if s.Duplicates == 0 {
		s.Duplicates = 4
	}
	s.DatabaseURL = databaseURL(s.DatabaseURL)
	if s.Timeout == 0 {
		s.Timeout = 30 * time.Second
	}
	reqs := make([]Request, len(s.Requests))
	for i, r := range s.Requests {
		if r.Method == "" {
			r.Method = http.MethodPost
		}
		reqs[i] = r
	}
	s.Requests = reqs
	return s
}

func (s HTTPSuite) validate() error {
	bad := func(field, format string, args ...any) error {
		return fmt.Errorf("idemqtest: invalid HTTPSuite: %s: %s", field, fmt.Sprintf(format, args...))
	}
	switch {
	case s.Handler == nil:
		return bad("Handler", "required")
	case len(s.Requests) == 0:
		return bad("Requests", "required: give a few sample requests the API handles")
	case s.Effect == nil:
		return bad("Effect", "required: a function that reads the end state, such as idemqtest.Rows(\"SELECT ... FROM your_table\")")
	case s.Duplicates < 2:
		return bad("Duplicates", "%d, must be at least 2", s.Duplicates)
	case s.Timeout < 0:
		return bad("Timeout", "negative")
	}
	for i, r := range s.Requests {
		if !strings.HasPrefix(r.Target, "/") {
			return bad(fmt.Sprintf("Requests[%d].Target", i), "%q, want a path such as /payments", r.Target)
		}
	}
	return nil
}

// mutateBody is the default HTTPSuite.Mutate.
func mutateBody(body []byte) []byte {
	var obj map[string]any
	if json.Unmarshal(body, &obj) == nil && obj != nil {
		obj["idemqtest_mutated"] = true
		if b, err := json.Marshal(obj); err == nil {
			return b
		}
	}
	return append(append([]byte(nil), body...), "\nidemqtest: mutated"...)
}

type httpKit struct {
	ctx       context.Context
	s         HTTPSuite
	adm       *admin
	ref, ref2 any
	vol       map[string]bool
	refResp   []response
}

// response is what a client got.
type response struct {
	status int
	header http.Header
	body   []byte
	// aborted: the connection died before the response was sent.
	aborted bool
}

func (r response) replayed() bool { return r.header.Get(httpidem.ReplayedHeader) == "true" }

func (r response) String() string {
	if r.aborted {
		return "no response (connection lost)"
	}
	s := fmt.Sprintf("%d %s", r.status, http.StatusText(r.status))
	if r.replayed() {
		s += " (replayed)"
	}
	return s
}

type httpRun struct {
	k   *httpKit
	env *Env
	h   http.Handler
	mw  *httpidem.Middleware
}

func runHTTP(ctx context.Context, t tb, s HTTPSuite) {
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
	k := &httpKit{ctx: ctx, s: s, adm: adm}
	if k.ref, k.refResp, err = k.clean(); err == nil {
		k.ref2, _, err = k.clean()
	}
	if err != nil {
		t.Fatalf("idemqtest: clean run (each sample request sent once): %v", err)
	}
	k.vol = volatile(k.ref, k.ref2)

	t.Run("determinism", k.determinism)
	t.Run("concurrent-duplicates", k.concurrentDuplicates)
	t.Run("crash-before-response", k.crashBeforeResponse)
	t.Run("mutated-body", k.mutatedBody)
	t.Run("after-retention", k.afterRetention)
	t.Run("replay-consistent", k.replayConsistent)
}

func (k *httpKit) with(f func(ctx context.Context, r *httpRun) error) error {
	ctx, cancel := context.WithTimeout(k.ctx, k.s.Timeout)
	defer cancel()
	env, cleanup, err := k.adm.newEnv(ctx, int32(k.s.Duplicates+4))
	if err != nil {
		return err
	}
	defer cleanup()
	if k.s.Setup != nil {
		if err := k.s.Setup(ctx, env); err != nil {
			return fmt.Errorf("idemqtest: HTTPSuite.Setup: %w", err)
		}
	}
	h, mw, err := k.s.Handler(ctx, env)
	if err != nil {
		return fmt.Errorf("idemqtest: HTTPSuite.Handler: %w", err)
	}
	if h == nil {
		return errors.New("idemqtest: HTTPSuite.Handler returned a nil http.Handler")
	}
	return f(ctx, &httpRun{k: k, env: env, h: h, mw: mw})
}

// send serves sample i with key (and body, if not nil) and returns the
// response. With crash, the connection dies when the response is written.
func (r *httpRun) send(ctx context.Context, i int, key string, body []byte, crash bool) response {
	sr := r.k.s.Requests[i]
	if body == nil {
		body = []byte(sr.Body)
	}
	req := httptest.NewRequestWithContext(ctx, sr.Method, sr.Target, bytes.NewReader(body))
	for h, vs := range sr.Header {
		req.Header[h] = append([]string(nil), vs...)
	}
	req.Header.Set(r.k.s.KeyHeader, key)
	rec := httptest.NewRecorder()
	if crash {
		w := &crashWriter{header: http.Header{}}
		func() {
			defer func() {
				if v := recover(); v != nil && v != http.ErrAbortHandler {
					panic(v)
				}
			}()
			r.h.ServeHTTP(w, req)
		}()
		return response{aborted: true, header: http.Header{}}
	}
	r.h.ServeHTTP(rec, req)
	res := rec.Result()
	return response{status: res.StatusCode, header: res.Header, body: rec.Body.Bytes()}
}

// crashWriter is a connection that dies when the response is written.
type crashWriter struct{ header http.Header }

func (w *crashWriter) Header() http.Header       { return w.header }
func (w *crashWriter) WriteHeader(int)           { panic(http.ErrAbortHandler) }
func (w *crashWriter) Write([]byte) (int, error) { panic(http.ErrAbortHandler) }

func (r *httpRun) state(ctx context.Context) (any, error) {
	return readState(ctx, r.env, r.k.s.Effect, r.k.s.Ignore)
}

// clean sends each sample once, with its own key.
func (k *httpKit) clean() (any, []response, error) {
	var (
		st    any
		resps []response
	)
	err := k.with(func(ctx context.Context, r *httpRun) error {
		for i, sr := range k.s.Requests {
			res := r.send(ctx, i, fmt.Sprintf("idemqtest-%d", i), nil, false)
			if res.status >= 500 {
				return fmt.Errorf("request %d (%s) got %s: %s; every sample must be a request the API handles", i, sr, res, bytes.TrimSpace(res.body))
			}
			resps = append(resps, res)
		}
		var err error
		st, err = r.state(ctx)
		return err
	})
	return st, resps, err
}

func (k *httpKit) compareTo(t tb, ref any, label, name, what string, got any) {
	t.Helper()
	want := mask(ref, k.vol)
	g := mask(got, k.vol)
	if reflect.DeepEqual(want, g) {
		return
	}
	note := ""
	if len(k.vol) > 0 {
		note = "\n(values that differ between two clean runs are masked; see the determinism case)"
	}
	t.Errorf("%s: %s\n%s%s", name, what, diff(label, "got", want, g), note)
}

// runCase runs f in a fresh run, then compares the state with the
// reference (ref2 with twice).
func (k *httpKit) runCase(t tb, name, what string, twice bool, f func(ctx context.Context, r *httpRun) error) {
	t.Helper()
	err := k.with(func(ctx context.Context, r *httpRun) error {
		if err := f(ctx, r); err != nil {
			return err
		}
		st, err := r.state(ctx)
		if err != nil {
			return err
		}
		ref, label := k.ref, "want (each request applied once)"
		if twice {
			label = "want (each request applied twice, under two keys)"
			if ref, err = k.cleanTwice(); err != nil {
				return err
			}
		}
		k.compareTo(t, ref, label, name, what, st)
		return nil
	})
	var skip skipError
	switch {
	case errors.As(err, &skip):
		t.Skipf("%s", skip.reason)
	case err != nil:
		t.Fatalf("%s: %v", name, err)
	}
}

// skipError, returned by a case's run, skips the case.
type skipError struct{ reason string }

func (e skipError) Error() string { return e.reason }

// cleanTwice sends each sample twice, with two keys, and returns the state.
func (k *httpKit) cleanTwice() (any, error) {
	var st any
	err := k.with(func(ctx context.Context, r *httpRun) error {
		for i := range k.s.Requests {
			r.send(ctx, i, fmt.Sprintf("idemqtest-%d-a", i), nil, false)
			r.send(ctx, i, fmt.Sprintf("idemqtest-%d-b", i), nil, false)
		}
		var err error
		st, err = r.state(ctx)
		return err
	})
	return st, err
}

func (k *httpKit) determinism(t tb) {
	if len(k.vol) == 0 {
		return
	}
	t.Errorf("determinism: sending the same requests in two fresh schemas left different effects, so the effect depends on more than the requests: "+
		"the clock (now(), time.Now), random or sequence values, or state the API keeps in memory between runs. "+
		"Leave volatile columns out of Effect (or list them in HTTPSuite.Ignore).\n%s",
		diff("first clean run", "second clean run", k.ref, k.ref2))
}

func (k *httpKit) concurrentDuplicates(t tb) {
	const name = "concurrent-duplicates"
	h := k.s.KeyHeader
	k.runCase(t, name, fmt.Sprintf("each request was sent %d times at once with one %s; the end state differs from applying each request once.", k.s.Duplicates, h), false,
		func(ctx context.Context, r *httpRun) error {
			for i, sr := range k.s.Requests {
				key := fmt.Sprintf("idemqtest-%d", i)
				resps := make([]response, k.s.Duplicates)
				start := make(chan struct{})
				var wg sync.WaitGroup
				for j := range resps {
					wg.Add(1)
					go func() {
						defer wg.Done()
						<-start
						resps[j] = r.send(ctx, i, key, nil, false)
					}()
				}
				close(start)
				wg.Wait()
				var originals []response
				var statuses []string
				for _, res := range resps {
					statuses = append(statuses, res.String())
					if !res.replayed() && res.status != http.StatusConflict {
						originals = append(originals, res)
					}
				}
				if len(originals) != 1 {
					t.Errorf("%s: request %d (%s): %d concurrent requests with one %s got %d original responses (%s), want exactly one, the others 409 Conflict or a replay (%s: true)",
						name, i, sr, k.s.Duplicates, h, len(originals), strings.Join(statuses, ", "), httpidem.ReplayedHeader)
					continue
				}
				orig := originals[0]
				for j, res := range resps {
					for try := 0; res.status == http.StatusConflict && !res.replayed() && try < 100; try++ {
						time.Sleep(10 * time.Millisecond)
						res = r.send(ctx, i, key, nil, false)
					}
					if res.replayed() && (res.status != orig.status || !bytes.Equal(res.body, orig.body)) {
						t.Errorf("%s: request %d (%s): duplicate %d got %s with body %q, want the original %s with body %q",
							name, i, sr, j, res, bytes.TrimSpace(res.body), orig, bytes.TrimSpace(orig.body))
					}
				}
			}
			return nil
		})
}

func (k *httpKit) crashBeforeResponse(t tb) {
	const name = "crash-before-response"
	h := k.s.KeyHeader
	k.runCase(t, name, fmt.Sprintf("each request's connection died when its response was written, after its transaction committed, and the client retried with the same %s; "+
		"the end state differs from applying each request once.", h), false,
		func(ctx context.Context, r *httpRun) error {
			for i, sr := range k.s.Requests {
				key := fmt.Sprintf("idemqtest-%d", i)
				r.send(ctx, i, key, nil, true)
				res := r.send(ctx, i, key, nil, false)
				want := k.refResp[i]
				if res.status != want.status || !res.replayed() {
					t.Errorf("%s: request %d (%s): the response was lost after the commit; the retry with the same %s got %s, want the stored response: %d %s (replayed)",
						name, i, sr, h, res, want.status, http.StatusText(want.status))
				}
			}
			return nil
		})
}

func (k *httpKit) mutatedBody(t tb) {
	const name = "mutated-body"
	h := k.s.KeyHeader
	k.runCase(t, name, fmt.Sprintf("each request was sent, then its %s was reused with a different body; the end state differs from applying each original request once.", h), false,
		func(ctx context.Context, r *httpRun) error {
			for i, sr := range k.s.Requests {
				key := fmt.Sprintf("idemqtest-%d", i)
				r.send(ctx, i, key, nil, false)
				res := r.send(ctx, i, key, k.s.Mutate([]byte(sr.Body)), false)
				if res.status != http.StatusUnprocessableEntity {
					t.Errorf("%s: request %d (%s): the same %s with a different body got %s, want 422 Unprocessable Entity: "+
						"a key reused for another request must be refused, not replayed or applied (does the fingerprint ignore the body?)",
						name, i, sr, h, res)
				}
			}
			return nil
		})
}

func (k *httpKit) afterRetention(t tb) {
	const name = "after-retention"
	h := k.s.KeyHeader
	k.runCase(t, name, fmt.Sprintf("each request was sent, replayed, and once its %s was purged sent again, which makes it a new request; "+
		"the end state differs from applying each request twice with two keys.", h), true,
		func(ctx context.Context, r *httpRun) error {
			if r.mw == nil {
				return skipError{"HTTPSuite.Handler returned no *httpidem.Middleware to purge keys with"}
			}
			for i, sr := range k.s.Requests {
				key := fmt.Sprintf("idemqtest-%d", i)
				first := r.send(ctx, i, key, nil, false)
				n, err := r.mw.Purge(ctx, time.Hour)
				if err != nil {
					return fmt.Errorf("purge: %w", err)
				}
				res := r.send(ctx, i, key, nil, false)
				if n != 0 || !res.replayed() || res.status != first.status {
					t.Errorf("%s: request %d (%s): a purge with a 1h retention deleted %d keys and the retry with the same %s got %s, want no key deleted and the stored %s replayed",
						name, i, sr, n, h, res, first)
				}
				time.Sleep(5 * time.Millisecond)
				if n, err = r.mw.Purge(ctx, time.Millisecond); err != nil {
					return fmt.Errorf("purge: %w", err)
				}
				res = r.send(ctx, i, key, nil, false)
				if n < 1 || res.replayed() || res.status != first.status {
					t.Errorf("%s: request %d (%s): after its key was purged (%d deleted), a request reusing the %s got %s, want %d %s handled as a new request, as httpidem documents",
						name, i, sr, n, h, res, first.status, http.StatusText(first.status))
				}
			}
			return nil
		})
}

func (k *httpKit) replayConsistent(t tb) {
	const name = "replay-consistent"
	h := k.s.KeyHeader
	k.runCase(t, name, fmt.Sprintf("each request was sent, then replayed twice with the same %s; the end state differs from applying each request once.", h), false,
		func(ctx context.Context, r *httpRun) error {
			for i, sr := range k.s.Requests {
				key := fmt.Sprintf("idemqtest-%d", i)
				first := r.send(ctx, i, key, nil, false)
				for j := 1; j <= 2; j++ {
					res := r.send(ctx, i, key, nil, false)
					if res.status != first.status || !bytes.Equal(res.body, first.body) || !res.replayed() {
						t.Errorf("%s: request %d (%s): replay %d got %s with body %q, want the first response again, %s: true: %d %s with body %q",
							name, i, sr, j, res, bytes.TrimSpace(res.body), httpidem.ReplayedHeader, first.status, http.StatusText(first.status), bytes.TrimSpace(first.body))
						continue
					}
					for _, hd := range []string{"Content-Type", "Location"} {
						if got, want := res.header.Get(hd), first.header.Get(hd); want != "" && got != want {
							t.Errorf("%s: request %d (%s): replay %d has %s %q, want %q as in the first response", name, i, sr, j, hd, got, want)
						}
					}
				}
			}
			return nil
		})
}
