package main

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/idemq/idemq/cmd/idemq/internal/bench"
	"github.com/idemq/idemq/internal/testdb"
)

func TestBenchJSON(t *testing.T) {
	r := idemq(t, "bench", "--messages", "300", "--batch-size", "20", "--json", "--database-url", testdb.URL())
	if r.code != 0 {
		t.Fatalf("exit %d\nstdout: %s\nstderr: %s", r.code, r.stdout, r.stderr)
	}
	lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
	if len(lines) != len(bench.AllModes) {
		t.Fatalf("%d lines of JSON, want one per mode:\n%s", len(lines), r.stdout)
	}
	for i, line := range lines {
		var res bench.Result
		if err := json.Unmarshal([]byte(line), &res); err != nil {
			t.Fatalf("line %d: %v: %s", i, err, line)
		}
		if res.Mode != bench.AllModes[i] || !res.Verified || res.Broker != "memory" || res.Messages != 300 || res.MsgsPerSec <= 0 {
			t.Errorf("line %d: %s", i, line)
		}
		if res.Mode != bench.ModeBrokerOnly && res.Effects != int64(res.Unique) {
			t.Errorf("line %d: effects %d, unique %d", i, res.Effects, res.Unique)
		}
	}
}

func TestBenchTable(t *testing.T) {
	r := idemq(t, "bench", "--broker", "rabbitmq", "--modes", "naive,idemq-batch", "--messages", "200",
		"--batch-size", "20", "--dup-rate", "0.1", "--database-url", testdb.URL())
	want(t, r, 0, "idemq-batch", "")
	for _, s := range []string{"broker rabbitmq, 200 messages", "dup-rate 0.1", "msgs/s", "×naive", "naive", "yes"} {
		if !strings.Contains(r.stdout, s) {
			t.Errorf("table lacks %q:\n%s", s, r.stdout)
		}
	}
	if strings.Contains(r.stdout, "NO") {
		t.Errorf("a mode failed:\n%s", r.stdout)
	}
}

func TestBenchCompareTable(t *testing.T) {
	r := idemq(t, "bench", "--modes", "idemq", "--messages", "200", "--prefill", "500", "--purge-during", "--compare",
		"--cpuprofile", t.TempDir()+"/cpu.prof", "--database-url", testdb.URL())
	want(t, r, 0, "×prev phase", "")
	for _, s := range []string{"base", "prefill", "purge", "idemq@purge: purged"} {
		if !strings.Contains(r.stdout, s) {
			t.Errorf("table lacks %q:\n%s", s, r.stdout)
		}
	}
}

func TestBenchUsage(t *testing.T) {
	for _, args := range [][]string{
		{"bench", "--broker", "pulsar"},
		{"bench", "--modes", "naive,warp"},
		{"bench", "--messages", "0"},
		{"bench", "--dup-rate", "1.5"},
		{"bench", "--batch-size", "1"},
		{"bench", "--compare"},
		{"bench", "--rounds", "0"},
		{"bench", "--rounds", "2", "--prefill", "10", "--compare"},
		{"bench", "extra"},
	} {
		want(t, idemq(t, args...), exitUsage, "", "Run 'idemq bench --help'")
	}
	want(t, idemq(t, "bench", "--help"), 0, "--dup-rate", "")
}

func TestBenchBadDatabase(t *testing.T) {
	r := idemq(t, "bench", "--messages", "10", "--database-url", "postgres://nobody@127.0.0.1:1/none?connect_timeout=2")
	want(t, r, exitFail, "", "idemq bench: connect to Postgres at postgres://nobody@127.0.0.1:1/none")
	noStutter(t, r)
}

// noStutter fails the test if an error names the bench layer twice.
func noStutter(t *testing.T, r result) {
	t.Helper()
	if strings.Contains(r.stderr, "bench: bench:") || strings.Count(r.stderr, "bench:") != 1 {
		t.Errorf("the error repeats its prefix: %s", r.stderr)
	}
}

// TestBenchUnreachableRabbitMQ: a RabbitMQ nothing listens on fails the
// run at once with the address, not a panic in the cleanup, and without the
// password.
func TestBenchUnreachableRabbitMQ(t *testing.T) {
	port := deadPort(t)
	r := idemq(t, "bench", "--broker", "rabbitmq", "--messages", "10", "--database-url", testdb.URL(),
		"--amqp-url", "amqp://app:"+secret+"@127.0.0.1:"+port+"/")
	want(t, r, exitFail, "", "idemq bench: connect to RabbitMQ at amqp://app:xxxxx@127.0.0.1:"+port+"/")
	want(t, r, exitFail, "", "connection refused")
	noSecret(t, r)
	noStutter(t, r)
}

// TestBenchAMQPURLFromEnvironment: without --amqp-url, bench uses
// $AMQP_URL like the other commands; the flag wins over it.
func TestBenchAMQPURLFromEnvironment(t *testing.T) {
	port := deadPort(t)
	t.Setenv("AMQP_URL", "amqp://app:"+secret+"@127.0.0.1:"+port+"/")
	r := idemq(t, "bench", "--broker", "rabbitmq", "--messages", "10", "--database-url", testdb.URL())
	want(t, r, exitFail, "", "127.0.0.1:"+port)
	noSecret(t, r)
	want(t, idemq(t, "bench", "--broker", "rabbitmq", "--modes", "broker-only", "--messages", "10",
		"--database-url", testdb.URL(), "--amqp-url", "amqp://guest:guest@127.0.0.1:5672/"), 0, "broker-only", "")
}

// TestBenchUnreachableKafka: brokers nothing listens on are reported as
// such before any mode runs, not as a failed verification.
func TestBenchUnreachableKafka(t *testing.T) {
	port := deadPort(t)
	r := idemq(t, "bench", "--broker", "kafka", "--kafka-brokers", "127.0.0.1:"+port, "--messages", "10", "--database-url", testdb.URL())
	want(t, r, exitFail, "", "idemq bench: could not connect to the Kafka brokers 127.0.0.1:"+port)
	if strings.Contains(r.stderr, "verification") || r.stdout != "" {
		t.Errorf("reported as a run:\nstdout: %s\nstderr: %s", r.stdout, r.stderr)
	}
	noStutter(t, r)
}

func TestBenchRounds(t *testing.T) {
	r := idemq(t, "bench", "--rounds", "3", "--modes", "naive,idemq", "--messages", "200", "--json", "--database-url", testdb.URL())
	if r.code != 0 {
		t.Fatalf("exit %d\nstdout: %s\nstderr: %s", r.code, r.stdout, r.stderr)
	}
	var order []string
	for i, line := range strings.Split(strings.TrimSpace(r.stdout), "\n") {
		var res bench.Result
		if err := json.Unmarshal([]byte(line), &res); err != nil {
			t.Fatalf("line %d: %v: %s", i, err, line)
		}
		if !res.Verified || res.Round != i/2+1 {
			t.Errorf("line %d: round %d, verified %v, want round %d: %s", i, res.Round, res.Verified, i/2+1, line)
		}
		order = append(order, string(res.Mode))
	}
	// The order is reversed in every other round.
	if got, want := strings.Join(order, " "), "naive idemq idemq naive naive idemq"; got != want {
		t.Errorf("modes ran in the order %q, want %q", got, want)
	}

	r = idemq(t, "bench", "--rounds", "2", "--modes", "idemq,naive", "--messages", "200", "--database-url", testdb.URL())
	want(t, r, 0, "medians over 2 rounds", "")
	for _, s := range []string{"round 1 of 2: idemq,naive", "round 2 of 2: naive,idemq", "p99 ×naive"} {
		if !strings.Contains(r.stdout, s) {
			t.Errorf("output lacks %q:\n%s", s, r.stdout)
		}
	}
}

func TestRoundsSummary(t *testing.T) {
	res := func(m bench.Mode, rate, p99, xNaive float64) bench.Result {
		return bench.Result{Mode: m, Verified: true, MsgsPerSec: rate, P99Ms: p99, RatioNaive: xNaive}
	}
	rounds := [][]bench.Result{
		{res(bench.ModeNaive, 100, 4, 1), res(bench.ModeIdemq, 90, 8, 0.9)},
		{res(bench.ModeIdemq, 120, 2, 1.2), res(bench.ModeNaive, 100, 4, 1)},
		{res(bench.ModeNaive, 200, 10, 1), res(bench.ModeIdemq, 100, 5, 0.5)},
		// A round whose runtime mode failed its check counts for nothing.
		{res(bench.ModeNaive, 100, 4, 1), {Mode: bench.ModeIdemq, MsgsPerSec: 1e6, P99Ms: 0.1, RatioNaive: 1e4}},
		// A round whose recipe failed: the runtime's figures count, its
		// ratios to the recipe do not.
		{{Mode: bench.ModeNaive, MsgsPerSec: 1, P99Ms: 0.01}, res(bench.ModeIdemq, 100, 5, 100)},
	}
	var b strings.Builder
	printRoundsSummary(&b, []bench.Mode{bench.ModeNaive, bench.ModeIdemq}, rounds)
	var line string
	for _, l := range strings.Split(b.String(), "\n") {
		if f := strings.Fields(l); len(f) > 0 && f[0] == string(bench.ModeIdemq) {
			line = l
		}
	}
	if !strings.Contains(b.String(), "medians over 3 rounds (and 2 that did not complete") {
		t.Errorf("summary does not say 3 rounds completed of 5:\n%s", b.String())
	}
	// Medians of 4 rounds: rate 100 (90–120), p99 5.0 (2.0–8.0); of 3
	// rounds with the recipe: ×naive 0.90 (0.50–1.20), p99 ×naive 0.50
	// (0.50–2.00).
	for _, s := range []string{" 4 ", "100 (90–120)", "5.0 (2.0–8.0)", "0.90 (0.50–1.20)", "0.50 (0.50–2.00)"} {
		if !strings.Contains(line, s) {
			t.Errorf("summary line %q lacks %q\n%s", line, s, b.String())
		}
	}
	if s := summarise([]float64{3, 0, 1, 4, 2}); s.n != 4 || s.median != 2.5 || s.low != 1 || s.high != 4 {
		t.Errorf("summarise = %+v, want 4 values, median 2.5, 1 to 4", s)
	}
}
