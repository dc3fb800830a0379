package redisstream_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/brokers/redisstream"
)

// testURL is the shared server the tests use, unless IDEMQ_TEST_REDIS_URL
// names another. It need not persist anything: tests that need persistence
// start a server of their own (startRedis).
func testURL() string {
	if u := os.Getenv("IDEMQ_TEST_REDIS_URL"); u != "" {
		return u
	}
	return redisstream.DefaultURL
}

func testCtx(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func randomName(prefix string) string {
	var b [5]byte
	_, _ = rand.Read(b[:])
	return prefix + "." + hex.EncodeToString(b[:])
}

// client returns a plain client on url, closed at cleanup.
func client(t testing.TB, url string) *redis.Client {
	t.Helper()
	opt, err := redis.ParseURL(url)
	if err != nil {
		t.Fatal(err)
	}
	c := redis.NewClient(opt)
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// newStream names a fresh stream and deletes it and its dead-letter stream
// at cleanup.
func newStream(t testing.TB, url string) string {
	t.Helper()
	s := randomName("idemq-test")
	c := client(t, url)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = c.Del(ctx, s, redisstream.DLQName(s)).Err()
	})
	return s
}

// newSource opens a Source with cfg (URL defaulted to the test server),
// closed at cleanup.
func newSource(t testing.TB, cfg redisstream.Config) *redisstream.Source {
	t.Helper()
	if cfg.URL == "" {
		cfg.URL = testURL()
	}
	src, err := redisstream.NewSource(testCtx(t, 10*time.Second), cfg)
	if err != nil {
		t.Fatalf("NewSource: %v", err)
	}
	t.Cleanup(func() { _ = src.Close() })
	return src
}

func newPublisher(t testing.TB, cfg redisstream.PublisherConfig) *redisstream.Publisher {
	t.Helper()
	if cfg.URL == "" {
		cfg.URL = testURL()
	}
	p, err := redisstream.NewPublisher(testCtx(t, 10*time.Second), cfg)
	if err != nil {
		t.Fatalf("NewPublisher: %v", err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p
}

func waitFor(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", d, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// redisServer is a redis-server of the test's own, persisting every write:
// appendonly yes, appendfsync always, in a t.TempDir().
type redisServer struct {
	t    testing.TB
	dir  string
	port int
	cmd  *exec.Cmd
	args []string
}

// startRedis starts a persistent server on a free port; extra arguments
// override the persistence ones. It is killed at cleanup.
func startRedis(t testing.TB, extra ...string) *redisServer {
	t.Helper()
	_, err := exec.LookPath("redis-server")
	if err != nil {
		t.Fatalf("redis-server not found: %v", err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	_ = l.Close()
	s := &redisServer{t: t, dir: t.TempDir(), port: port}
	s.args = append([]string{"--bind", "127.0.0.1", "--port", strconv.Itoa(port), "--save", "",
		"--appendonly", "yes", "--appendfsync", "always", "--dir", s.dir,
		"--logfile", filepath.Join(s.dir, "redis.log")}, extra...)
	s.start()
	t.Cleanup(s.kill)
	return s
}

func (s *redisServer) URL() string { return fmt.Sprintf("redis://127.0.0.1:%d/0", s.port) }

func (s *redisServer) start() {
	s.t.Helper()
	s.cmd = exec.Command("redis-server", s.args...)
	if err := s.cmd.Start(); err != nil {
		s.t.Fatalf("start redis-server: %v", err)
	}
	c := redis.NewClient(&redis.Options{Addr: fmt.Sprintf("127.0.0.1:%d", s.port), MaxRetries: -1})
	defer c.Close()
	deadline := time.Now().Add(10 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		err := c.Ping(ctx).Err()
		cancel()
		if err == nil || strings.HasPrefix(err.Error(), "NOAUTH") {
			return
		}
		if time.Now().After(deadline) {
			log, _ := os.ReadFile(filepath.Join(s.dir, "redis.log"))
			s.t.Fatalf("redis-server on port %d not up after 10s: %v\n%s", s.port, err, log)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// kill kills the server with SIGKILL, as a crash would, and waits for it.
func (s *redisServer) kill() {
	if s.cmd == nil || s.cmd.Process == nil {
		return
	}
	_ = s.cmd.Process.Signal(syscall.SIGKILL)
	_ = s.cmd.Wait()
	s.cmd = nil
}

// restart kills the server and starts it again from the same directory.
func (s *redisServer) restart() {
	s.t.Helper()
	s.kill()
	s.start()
}
