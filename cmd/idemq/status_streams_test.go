package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/dedup"
	"github.com/idemq/idemq/dlq"
)

// TestStatusStreamsDepth: status reads a NATS dead-letter subject's and a
// Redis dead-letter stream's depth and oldest dead letter, consuming
// nothing.
func TestStatusStreamsDepth(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	_, args := migrated(t)
	nf := newNATSFixture(ctx, t, dlq.Options{})
	rf := newRedisFixture(ctx, t, dlq.Options{})
	before := time.Now().Add(-time.Second)
	for i := range 3 {
		nf.deadLetter(ctx, t, fmt.Sprint("n-", i), "x", consumer.Failure{Class: consumer.ClassPermanent, Err: errors.New("bug")})
	}
	for i := range 2 {
		rf.deadLetter(ctx, t, fmt.Sprint("r-", i), "x", consumer.Failure{Class: consumer.ClassPermanent, Err: errors.New("bug")})
	}
	base := append([]string{"status", "--consumer", "billing"}, args...)
	r := idemq(t, append(base, "--dlq-subject", nf.dead, "--dlq-stream-key", rf.dead)...)
	t.Logf("idemq status:\n%s", r.stdout)
	want(t, r, exitOK, "dlq nats:        "+nf.dead+": 3 messages in stream "+nf.deadStream+", oldest 20", "")
	want(t, r, exitOK, "dlq redis:       "+rf.dead+": 2 entries, oldest 20", "")
	if n, m := len(nf.read(ctx, t, nf.dead)), len(rf.read(ctx, t, rf.dead)); n != 3 || m != 2 {
		t.Errorf("after status: %d and %d dead letters, want 3 and 2", n, m)
	}

	r = idemq(t, append(base, "--json", "--dlq-subject", nf.dead, "--dlq-stream", nf.deadStream, "--dlq-stream-key", rf.dead)...)
	var got statusReport
	if err := json.Unmarshal([]byte(r.stdout), &got); err != nil {
		t.Fatalf("%v\n%s", err, r.stdout)
	}
	if len(got.DLQ) != 2 {
		t.Fatalf("dlq %+v", got.DLQ)
	}
	for i, w := range []struct {
		broker, name, stream string
		depth                int64
	}{{"nats", nf.dead, nf.deadStream, 3}, {"redis", rf.dead, "", 2}} {
		d := got.DLQ[i]
		if d.Broker != w.broker || d.Name != w.name || d.Stream != w.stream || d.Depth == nil || *d.Depth != w.depth ||
			d.Oldest == nil || d.Oldest.Before(before) || d.Oldest.After(time.Now()) || d.Error != "" {
			t.Errorf("dlq %d: %+v, want %+v", i, d, w)
		}
	}

	// A Redis stream nothing was dead-lettered to yet is empty; a subject
	// no stream captures, or a key holding something else, is an error,
	// and the rest is printed all the same.
	rdb := redisClient(t)
	notStream := rf.work + ".string"
	if err := rdb.Set(ctx, notStream, "x", time.Minute).Err(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rdb.Del(context.Background(), notStream).Err() })
	r = idemq(t, append(base, "--dlq-stream-key", rf.work+".none")...)
	want(t, r, exitOK, "dlq redis:       "+rf.work+".none: 0 entries\n", "")
	r = idemq(t, append(base, "--dlq-subject", nf.work+".none", "--dlq-stream-key", notStream)...)
	want(t, r, exitFail, "dedup rows:", "cannot read the dead-letter queue depth")
	want(t, r, exitFail, "dlq nats:        "+nf.work+".none: error: no stream captures the subject", `NATS subject "`+nf.work+`.none"`)
	want(t, r, exitFail, "dlq redis:       "+notStream+": error: ", "WRONGTYPE")

	want(t, idemq(t, append(base, "--dlq-stream", nf.deadStream)...), exitUsage, "", "--dlq-stream needs --dlq-subject")
	want(t, idemq(t, append(base, "--dlq-subject", "a.>")...), exitUsage, "", "no wildcards")
}

// TestConsoleNATSAndRedis runs the console on a NATS JetStream and a Redis
// Streams DLQ: the overview reads their depths as status does, the
// dead-letter pages group them as dlq inspect does, and a replay (NATS)
// and a requeue (Redis) from the console republish to the work streams.
func TestConsoleNATSAndRedis(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	store, dbArgs := migrated(t)
	nf := newNATSFixture(ctx, t, dlq.Options{})
	rf := newRedisFixture(ctx, t, dlq.Options{})
	for i := range 3 {
		nf.deadLetter(ctx, t, fmt.Sprintf("d-%d", i), `{"n":1}`, consumer.Failure{Class: consumer.ClassPermanent, Err: fmt.Errorf("account %d unknown", 100+i)})
	}
	// One of them was applied meanwhile: the replay removes it.
	claim(t, store, dedup.Claim{Consumer: "billing", MessageID: "d-2", Fingerprint: (&consumer.Message{Body: []byte(`{"n":1}`)}).Fingerprint(), Partition: -1, Offset: -1})
	for i := range 2 {
		rf.deadLetter(ctx, t, fmt.Sprintf("o-%d", i), "o", consumer.Failure{Consumer: "shipping", Class: consumer.ClassTimeout, Err: errors.New("handler timed out")})
	}

	base, _ := startConsole(t, map[string]string{"IDEMQ_CONSOLE_TOKEN": "bob:bob-secret-42"}, append(dbArgs,
		"--dlq-subject", nf.dead, "--dlq-stream-key", rf.dead)...)
	b := newBrowser(t, base)
	b.signIn("bob:bob-secret-42")
	page := b.get("/")
	for _, row := range []string{
		`<td>nats</td><td><a href="[^"]*">` + regexp.QuoteMeta(nf.dead) + `</a></td>\s*<td class="num">3</td><td class="num">1</td>`,
		`<td>redis</td><td><a href="[^"]*">` + regexp.QuoteMeta(rf.dead) + `</a></td>\s*<td class="num">2</td><td class="num">1</td>`,
	} {
		if !regexp.MustCompile(row).MatchString(page) {
			t.Errorf("the overview lacks %s:\n%s", row, page)
		}
	}
	contains(t, page, "nats://127.0.0.1:4222", "redis://127.0.0.1:6379/0")

	page = b.get("/dead-letters")
	contains(t, page, "5 dead letters in 2 groups", "account &lt;n&gt; unknown", "handler timed out")
	group := func(id string) string {
		t.Helper()
		page := b.get("/dead-letters?dlq=" + url.QueryEscape(id))
		fp := regexp.MustCompile(`data-fingerprint="([0-9a-f]{16})"`).FindStringSubmatch(page)
		if fp == nil {
			t.Fatalf("no group in %s:\n%s", id, page)
		}
		return fp[1]
	}
	nsel := url.Values{"dlq": {"nats:" + nf.dead}, "fp": {group("nats:" + nf.dead)}}
	rsel := url.Values{"dlq": {"redis:" + rf.dead}, "fp": {group("redis:" + rf.dead)}}
	contains(t, b.get("/group?"+nsel.Encode()), "d-0", "d-1", "d-2", "x-idemq-consumer", nf.work)
	contains(t, b.get("/group?"+rsel.Encode()), "o-0", "o-1", "shipping", rf.work)

	act := func(sel url.Values, action string, counts ...string) {
		t.Helper()
		page := b.get("/dry-run?" + sel.Encode())
		contains(t, page, counts...)
		confirm := regexp.MustCompile(`name="confirm" value="([^"]+)"`).FindStringSubmatch(page)[1]
		code, loc := b.post("/actions", url.Values{"dlq": sel["dlq"], "fp": sel["fp"], "csrf": {b.csrf}, "confirm": {confirm}, "action": {action}})
		if code != http.StatusSeeOther {
			t.Fatalf("%s: %d %s", action, code, loc)
		}
		deadline := time.Now().Add(30 * time.Second)
		for !strings.Contains(b.get(loc), `id="job-outcome">done<`) {
			if time.Now().After(deadline) {
				t.Fatalf("the %s did not finish:\n%s", action, b.get(loc))
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	act(nsel, "replay", `data-count="will-apply">2<`, `data-count="already-applied">1<`)
	if w, d := len(nf.read(ctx, t, nf.work)), len(nf.read(ctx, t, nf.dead)); w != 2 || d != 0 {
		t.Fatalf("after the replay: work subject %d (want 2), DLQ %d (want 0)", w, d)
	}
	act(rsel, "requeue", `data-count="will-apply">2<`)
	if w, d := len(rf.read(ctx, t, rf.work)), len(rf.read(ctx, t, rf.dead)); w != 2 || d != 0 {
		t.Fatalf("after the requeue: work stream %d (want 2), DLQ %d (want 0)", w, d)
	}
	contains(t, b.get("/audit"), "<td>bob</td><td>replay</td><td>nats:"+nf.dead+"</td>", "republished 2, skipped 1 as already applied, 3 scanned",
		`&#34;republished&#34;: 2`, "<td>bob</td><td>requeue</td><td>redis:"+rf.dead+"</td>", "republished 2, skipped 0 as already applied, 2 scanned")
}

// TestConsoleStreamURLPasswordNeverShown: the console's overview shows a
// NATS and a Redis URL with their passwords masked, and so are the errors
// of the brokers it cannot reach.
func TestConsoleStreamURLPasswordNeverShown(t *testing.T) {
	t.Parallel()
	_, dbArgs := migrated(t)
	port := deadPort(t)
	base, stderr := startConsole(t, nil, append(dbArgs, "--dlq-subject", "a.dlq", "--dlq-stream-key", "b.dlq",
		"--nats-url", "nats://app:"+secret+"@127.0.0.1:"+port+","+secret+"@127.0.0.1:"+port,
		"--redis-url", "redis://app:"+secret+"@127.0.0.1:"+port+"/0")...)
	b := newBrowser(t, base)
	for _, path := range []string{"/", "/dead-letters", "/dead-letters?dlq=nats:a.dlq", "/dead-letters?dlq=redis:b.dlq"} {
		page := b.get(path)
		if strings.Contains(page, secret) {
			t.Errorf("%s shows the password:\n%s", path, page)
		}
		if path == "/" {
			contains(t, page, "nats://app:xxxxx@127.0.0.1:"+port+",nats://xxxxx@127.0.0.1:"+port, "redis://app:xxxxx@127.0.0.1:"+port, "cannot reach")
		}
	}
	if strings.Contains(stderr.String(), secret) {
		t.Errorf("the log shows the password:\n%s", stderr.String())
	}
}

func TestConsoleStreamsUsage(t *testing.T) {
	t.Parallel()
	noDB := []string{"--database-url", "postgres://postgres@127.0.0.1:1/x"}
	for _, tc := range []struct {
		args   []string
		stderr string
	}{
		{[]string{"--dlq-stream", "ORDERS_DLQ"}, "--dlq-stream needs --dlq-subject"},
		{[]string{"--dlq-subject", "orders.>"}, "no wildcards"},
		{[]string{"--dlq-subject", "orders.dlq", "--dlq-stream", "orders.dlq"}, "--dlq-stream"},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			var out, errOut strings.Builder
			e := &env{stdout: &out, stderr: &errOut, getenv: func(string) string { return "" }}
			if code := runEnv(context.Background(), append(append([]string{"console"}, tc.args...), noDB...), e); code != exitUsage || !strings.Contains(errOut.String(), tc.stderr) {
				t.Fatalf("exit %d, stderr %q; want 2 and %q", code, errOut.String(), tc.stderr)
			}
		})
	}
}
