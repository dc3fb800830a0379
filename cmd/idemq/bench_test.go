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
