package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemq/idemq/brokers/kafka"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/dedup"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/internal/kafkatest"
	"github.com/idemq/idemq/internal/testdb"
)

// lockedBuffer is a bytes.Buffer safe for the server's goroutines.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

var servingRE = regexp.MustCompile(`serving on (http://[^/]+)/`)

// startConsole runs `idemq console args` on a free loopback port and
// returns its URL; it stops at cleanup.
func startConsole(t *testing.T, environ map[string]string, args ...string) (string, *lockedBuffer) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var stdout, stderr lockedBuffer
	e := &env{stdout: &stdout, stderr: &stderr, getenv: func(k string) string { return environ[k] }}
	done := make(chan int, 1)
	go func() { done <- runEnv(ctx, append([]string{"console", "--addr", "127.0.0.1:0"}, args...), e) }()
	t.Cleanup(func() {
		cancel()
		if code := <-done; code != exitOK {
			t.Errorf("idemq console exited %d:\n%s", code, stderr.String())
		}
	})
	deadline := time.Now().Add(20 * time.Second)
	for {
		if m := servingRE.FindStringSubmatch(stderr.String()); m != nil {
			return m[1], &stderr
		}
		select {
		case code := <-done:
			done <- code
			t.Fatalf("idemq console exited %d:\n%s", code, stderr.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("idemq console did not start:\n%s", stderr.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

type browser struct {
	t    *testing.T
	base string
	c    *http.Client
	csrf string
}

func newBrowser(t *testing.T, base string) *browser {
	jar, _ := cookiejar.New(nil)
	return &browser{t: t, base: base, c: &http.Client{Jar: jar, Timeout: 60 * time.Second,
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}}
}

var consoleCSRF = regexp.MustCompile(`name="csrf" value="([^"]+)"`)

func (b *browser) get(path string) string {
	b.t.Helper()
	resp, err := b.c.Get(b.base + path)
	if err != nil {
		b.t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		b.t.Fatalf("GET %s: %d\n%s", path, resp.StatusCode, body)
	}
	if m := consoleCSRF.FindSubmatch(body); m != nil {
		b.csrf = string(m[1])
	}
	return string(body)
}

// signIn checks that the console sends an anonymous browser to its
// sign-in page, then signs in with token, typed as it was configured.
func (b *browser) signIn(token string) {
	b.t.Helper()
	resp, err := b.c.Get(b.base + "/dead-letters")
	if err != nil {
		b.t.Fatal(err)
	}
	resp.Body.Close()
	if loc := resp.Header.Get("Location"); resp.StatusCode != http.StatusSeeOther || loc != "/login?next=%2Fdead-letters" {
		b.t.Fatalf("anonymous GET /dead-letters: %d to %q, want 303 to the sign-in page", resp.StatusCode, loc)
	}
	b.get("/login")
	if code, body := b.post("/login", url.Values{"csrf": {b.csrf}, "token": {token}}); code != http.StatusSeeOther {
		b.t.Fatalf("sign in: %d %s", code, body)
	}
}

func (b *browser) post(path string, form url.Values) (int, string) {
	b.t.Helper()
	req, _ := http.NewRequest(http.MethodPost, b.base+path, strings.NewReader(form.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Origin", b.base)
	resp, err := b.c.Do(req)
	if err != nil {
		b.t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header.Get("Location") + string(body)
}

func contains(t *testing.T, page string, want ...string) {
	t.Helper()
	for _, w := range want {
		if !strings.Contains(page, w) {
			t.Errorf("page lacks %q", w)
		}
	}
}

// TestConsoleRabbitMQAndKafka runs the command against a RabbitMQ DLQ and
// a Kafka DLQ: the overview reads their depths as `status` does, the
// groups are `dlq inspect`'s, and a replay from the console republishes as
// `dlq replay` does, recorded in the audit table under the token's name.
func TestConsoleRabbitMQAndKafka(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	store, dbArgs := statusFixture(t)
	work, dead := rmqQueues(t)
	dl := rmqDeadLetterer(ctx, t, dead, dlq.Options{})
	for i := range 3 {
		id := fmt.Sprintf("d-%d", i)
		err := dl.DeadLetter(ctx, &consumer.Message{ID: id, Body: []byte(`{"n":1}`), Source: work, Partition: -1, Offset: -1},
			consumer.Failure{Consumer: "billing", MessageID: id, Class: consumer.ClassPermanent, Err: fmt.Errorf("account %d unknown", 100+i),
				Attempts: 1, FirstFailure: time.Now(), LastFailure: time.Now()})
		if err != nil {
			t.Fatal(err)
		}
	}
	kc := kafkatest.Start(t)
	topic := kafkatest.Name(t, "orders")
	kc.CreateTopic(t, topic, 1)
	kc.CreateTopic(t, topic+".dlq", 1)
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: kc.Addrs()})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	kdl, err := dlq.NewDeadLetterer(func(ctx context.Context, m *consumer.Message) error { return pub.Publish(ctx, topic+".dlq", m) }, dlq.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if err := kdl.DeadLetter(ctx, &consumer.Message{ID: "o-1", Body: []byte("o"), Source: topic, Partition: 0, Offset: 5},
		consumer.Failure{Consumer: "shipping", MessageID: "o-1", Class: consumer.ClassTimeout, Err: errors.New("handler timed out"),
			Attempts: 2, FirstFailure: time.Now(), LastFailure: time.Now()}); err != nil {
		t.Fatal(err)
	}

	base, stderr := startConsole(t, map[string]string{"IDEMQ_CONSOLE_TOKEN": "bob:bob-secret-42"}, append(dbArgs,
		"--retention", "7d", "--dlq-queue", dead, "--dlq-topic", topic+".dlq", "--kafka-brokers", strings.Join(kc.Addrs(), ","))...)
	contains(t, stderr.String(), "1 token(s) may replay")
	b := newBrowser(t, base)
	b.signIn("bob:bob-secret-42")
	page := b.get("/")
	contains(t, page, `<a href="/lookup?consumer=billing">billing</a>`, "<code>m-3</code>", "payments [2] @7", // status's last applied
		"(older than 168h0m0s)", `<td class="num">1</td>`, // status's purge-eligible
		dead, topic+".dlq", `<td class="num">3</td>`, "postgres://postgres@127.0.0.1:5432", "amqp://guest:xxxxx@")
	if strings.Contains(page, "guest:guest") {
		t.Errorf("the overview shows the AMQP password")
	}

	page = b.get("/dead-letters")
	contains(t, page, "4 dead letters in 2 groups", "account &lt;n&gt; unknown", "handler timed out")
	fp := regexp.MustCompile(`data-fingerprint="([0-9a-f]{16})">\s*<td class="num"><a href="[^"]+">3<`).FindStringSubmatch(page)
	if fp == nil {
		t.Fatalf("no group of 3:\n%s", page)
	}
	sel := url.Values{"dlq": {"rabbitmq:" + dead}, "fp": {fp[1]}}
	contains(t, b.get("/group?"+sel.Encode()), "d-0", "d-1", "d-2", "x-idemq-consumer")
	kpage := b.get("/dead-letters?dlq=" + url.QueryEscape("kafka:"+topic+".dlq"))
	contains(t, kpage, "1 dead letters in 1 groups", topic)

	page = b.get("/dry-run?" + sel.Encode())
	contains(t, page, `data-count="will-apply">3<`)
	confirm := regexp.MustCompile(`name="confirm" value="([^"]+)"`).FindStringSubmatch(page)[1]
	form := url.Values{"dlq": sel["dlq"], "fp": sel["fp"], "csrf": {b.csrf}, "confirm": {confirm}, "action": {"replay"}}
	code, loc := b.post("/actions", form)
	if code != http.StatusSeeOther {
		t.Fatalf("replay: %d %s", code, loc)
	}
	deadline := time.Now().Add(30 * time.Second)
	for !strings.Contains(b.get(loc), `id="job-outcome">done<`) {
		if time.Now().After(deadline) {
			t.Fatalf("the replay did not finish:\n%s", b.get(loc))
		}
		time.Sleep(50 * time.Millisecond)
	}
	if w, d := rmqDepth(t, work), rmqDepth(t, dead); w != 3 || d != 0 {
		t.Fatalf("after the replay: work queue %d (want 3), DLQ %d (want 0)", w, d)
	}
	contains(t, b.get("/audit"), "<td>bob</td><td>replay</td><td>rabbitmq:"+dead+"</td>", "group "+fp[1]+", every message",
		"3 selected, 3 would apply, 0 already applied", "republished 3, skipped 0 as already applied, 3 scanned", `&#34;republished&#34;: 3`)
	contains(t, b.get("/lookup?consumer=billing&id=m-3"), "<strong>Applied</strong>", "<dd>payments</dd>", "<dd>7</dd>")
	_ = store
}

func TestConsoleReadOnlyCommand(t *testing.T) {
	t.Parallel()
	_, dbArgs := migrated(t)
	base, stderr := startConsole(t, map[string]string{"IDEMQ_CONSOLE_TOKEN": "bob:bob-secret-42"}, append(dbArgs, "--read-only")...)
	contains(t, stderr.String(), "(read-only)")
	b := newBrowser(t, base)
	// With a token, even a read-only console shows nothing before a
	// sign-in; after it, nothing can be replayed.
	b.signIn("bob-secret-42")
	contains(t, b.get("/"), "read-only")
	if code, _ := b.post("/actions", url.Values{"csrf": {b.csrf}, "action": {"replay"}}); code != http.StatusForbidden {
		t.Errorf("an action on a read-only console: %d, want 403", code)
	}
}

// TestConsolePartitioned: the console opens a dedup table of the
// partitioned layout (its pool's store takes the layout the table has)
// and looks records up in it.
func TestConsolePartitioned(t *testing.T) {
	t.Parallel()
	store, dbArgs := migrated(t)
	claim(t, store, dedup.Claim{Consumer: "billing", MessageID: "m-1", Source: "payments", Partition: -1, Offset: -1})
	want(t, idemq(t, append([]string{"migrate", "--partitioned"}, dbArgs...)...), exitOK, "converted to the partitioned layout", "")
	base, _ := startConsole(t, nil, append(dbArgs, "--read-only")...)
	b := newBrowser(t, base)
	contains(t, b.get("/"), `<a href="/lookup?consumer=billing">billing</a>`)
	contains(t, b.get("/lookup?consumer=billing&id=m-1"), "<strong>Applied</strong>", "<dd>payments</dd>")
}

func TestConsoleTokenFile(t *testing.T) {
	t.Parallel()
	_, dbArgs := migrated(t)
	f := filepath.Join(t.TempDir(), "tokens")
	if err := os.WriteFile(f, []byte("# operators\ncarol:carol-secret-9\n\ndave:dave-secret-9\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	base, stderr := startConsole(t, nil, append(dbArgs, "--token-file", f)...)
	contains(t, stderr.String(), "2 token(s) may replay")
	b := newBrowser(t, base)
	b.signIn("dave-secret-9")
	contains(t, b.get("/"), "signed in as <strong>dave</strong>")
}

func TestConsoleUsage(t *testing.T) {
	t.Parallel()
	noDB := []string{"--database-url", "postgres://postgres@127.0.0.1:1/x"}
	for _, tc := range []struct {
		args   []string
		env    map[string]string
		stderr string
	}{
		{[]string{"--addr", "0.0.0.0:8080"}, nil, "not a loopback address: give a token"},
		{[]string{"--addr", ":8080"}, nil, "not a loopback address"},
		{[]string{"--rate", "0"}, nil, "--rate must be positive"},
		{[]string{"--retention", "-1h"}, nil, "--retention must be positive"},
		{[]string{"--token", "alice:short"}, nil, "at least 8 bytes"},
		{[]string{"--token", "a:secret-one", "--token", "a:secret-two"}, nil, `token "a" given twice`},
		{[]string{"--token-file", "/nonexistent/tokens"}, nil, "--token-file"},
		{[]string{"--dlq-topic", "x.dlq"}, nil, "--kafka-brokers (or $KAFKA_BROKERS) is required"},
		{[]string{"--outbox-table", ".outbox"}, nil, "want schema.table, or a table"},
		{[]string{"extra"}, nil, `unexpected argument "extra"`},
		{nil, map[string]string{"IDEMQ_CONSOLE_TOKEN": ":"}, "neither may be empty"},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			var out, errOut bytes.Buffer
			e := &env{stdout: &out, stderr: &errOut, getenv: func(k string) string { return tc.env[k] }}
			code := runEnv(context.Background(), append(append([]string{"console"}, tc.args...), noDB...), e)
			if code != exitUsage || !strings.Contains(errOut.String(), tc.stderr) {
				t.Fatalf("exit %d, stderr %q; want 2 and %q", code, errOut.String(), tc.stderr)
			}
			if strings.Contains(errOut.String(), "secret-") {
				t.Errorf("a token's secret was printed: %s", errOut.String())
			}
		})
	}
	// A non-loopback address is fine with a token; then the database is
	// what fails, with its password masked.
	var out, errOut bytes.Buffer
	e := &env{stdout: &out, stderr: &errOut, getenv: func(string) string { return "" }}
	code := runEnv(context.Background(), []string{"console", "--addr", "0.0.0.0:0", "--token", "a:secret-one",
		"--database-url", "postgres://app:pa55word-very-secret@127.0.0.1:1/x?connect_timeout=2"}, e)
	if code != exitFail || strings.Contains(errOut.String(), "pa55word") || !strings.Contains(errOut.String(), "xxxxx") {
		t.Fatalf("exit %d, stderr %s", code, errOut.String())
	}
	_ = testdb.URL
}
