package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strconv"
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
	// Its Location is the payment.
	var receipt Receipt
	if err := json.Unmarshal([]byte(first), &receipt); err != nil {
		t.Fatal(err)
	}
	location := hdr.Get("Location")
	st, _, b := do("GET", location, "", "")
	var rec PaymentRecord
	if err := json.Unmarshal([]byte(b), &rec); st != http.StatusOK || err != nil || rec.PaymentID != receipt.PaymentID ||
		rec.Account != "acct-1" || rec.AmountCents != 500 || rec.CreatedAt.IsZero() {
		t.Fatalf("GET %s: %d %s %v", location, st, b, err)
	}
	for _, path := range []string{"/payments/999999", "/payments/x", "/payments/99999999999999999999"} {
		if st, _, b := do("GET", path, "", ""); st != http.StatusNotFound {
			t.Errorf("GET %s: %d %s, want 404", path, st, b)
		}
	}
	// 2. The response was lost; the client retries (its clock moved on).
	st, hdr, again := do("POST", "/payments", "pay-001", `{"account":"acct-1","amount_cents":500,"client_time":"10:00:05"}`)
	if st != http.StatusCreated || again != first || hdr.Get(httpidem.ReplayedHeader) != "true" || hdr.Get("Location") != location {
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
	headers := make([]http.Header, 10)
	burst := time.Now()
	for i := range statuses {
		wg.Add(1)
		go func() {
			defer wg.Done()
			statuses[i], headers[i], _ = do("POST", "/payments", "pay-002", `{"account":"acct-1","amount_cents":250}`)
		}()
	}
	wg.Wait()
	for i, s := range statuses {
		if s != http.StatusCreated && s != http.StatusConflict {
			t.Fatalf("concurrent duplicate: %d", s)
		}
		// A 409 says to retry after about as long as the first request
		// has run: a second or so here, not the one-minute lock.
		if s == http.StatusConflict {
			n, err := strconv.Atoi(headers[i].Get("Retry-After"))
			if err != nil || n < 1 || time.Duration(n-1)*time.Second > time.Since(burst) {
				t.Errorf("409 with Retry-After %q after %s", headers[i].Get("Retry-After"), time.Since(burst))
			}
		}
	}
	// The burst may have ended with only 409s answered after the winner;
	// a retry gets the winner's answer.
	if st, _, b := do("POST", "/payments", "pay-002", `{"account":"acct-1","amount_cents":250}`); st != http.StatusCreated {
		t.Fatalf("pay-002 retry: %d %s", st, b)
	}
	// 6. The balance: each payment credited once.
	st, _, b = do("GET", "/accounts/acct-1", "", "")
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

// TestMain runs main instead of the tests when the test binary is started
// by runMain, so tests can see main's output and exit status.
func TestMain(m *testing.M) {
	if os.Getenv("HTTP_PAYMENTS_TEST_MAIN") == "1" {
		os.Args = append([]string{"http-payments"}, os.Args[1:]...)
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// runMain runs the program with args and the environment plus env, and
// returns its exit status and output.
func runMain(t *testing.T, env []string, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	cmd := exec.Command(os.Args[0], args...)
	cmd.Env = append(append(os.Environ(), "HTTP_PAYMENTS_TEST_MAIN=1"), env...)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	var ee *exec.ExitError
	if err != nil && !errors.As(err, &ee) {
		t.Fatal(err)
	}
	return cmd.ProcessState.ExitCode(), out.String(), errOut.String()
}

// secret is the password of the database URLs below.
const secret = "hunter2Secret"

// TestPasswordNeverPrinted runs the program against unreachable and
// unparseable DATABASE_URLs that carry a password: it fails before
// listening, with a clear error that does not contain the password.
func TestPasswordNeverPrinted(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := strconv.Itoa(l.Addr().(*net.TCPAddr).Port)
	_ = l.Close()
	for _, c := range []struct{ url, stderr string }{
		{"postgres://app:" + secret + "@127.0.0.1:" + port + "/test?connect_timeout=2", "cannot reach Postgres at 127.0.0.1:" + port + "/test (start it, or set DATABASE_URL): "},
		{"postgres://app@127.0.0.1:" + port + "/test?password=" + secret, "cannot reach Postgres at 127.0.0.1:" + port + "/test (start it, or set DATABASE_URL): "},
		{"host=127.0.0.1 port=" + port + " user=app sslpassword=" + secret + " password=" + secret, "cannot reach Postgres at 127.0.0.1:" + port + "/"},
		{"postgres://app:" + secret + "%zz@127.0.0.1/test", "invalid DATABASE_URL: check its syntax and parameters"},
	} {
		code, stdout, stderr := runMain(t, []string{"DATABASE_URL=" + c.url}, "-addr", "127.0.0.1:0")
		if code != 1 || !strings.Contains(stderr, c.stderr) {
			t.Errorf("DATABASE_URL %s: exit %d, stderr %q; want 1 and %q", c.url, code, stderr, c.stderr)
		}
		if strings.Contains(stdout+stderr, secret) {
			t.Errorf("the password leaked:\nstdout: %s\nstderr: %s", stdout, stderr)
		}
	}
}

// TestHelp: -h and --help print the usage and exit 0; a bad flag exits 2.
func TestHelp(t *testing.T) {
	var out bytes.Buffer
	if err := run(context.Background(), []string{"-h"}, &out, io.Discard); !errors.Is(err, flag.ErrHelp) || !strings.Contains(out.String(), "-addr") {
		t.Fatalf("run -h: %v\n%s", err, out.String())
	}
	for _, arg := range []string{"-h", "--help"} {
		code, stdout, stderr := runMain(t, nil, arg)
		if code != 0 || !strings.Contains(stdout, "Usage: go run ./examples/http-payments") || !strings.Contains(stdout, "-schema") || stderr != "" {
			t.Errorf("%s: exit %d\nstdout: %s\nstderr: %s", arg, code, stdout, stderr)
		}
	}
	if code, _, stderr := runMain(t, nil, "-nosuchflag"); code != 2 || !strings.Contains(stderr, "-nosuchflag") {
		t.Errorf("bad flag: exit %d, stderr %s", code, stderr)
	}
}
