package testdb

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemq/idemq/internal/testlog"
)

// PgBouncerOptions configure the PgBouncer that PgBouncer starts.
type PgBouncerOptions struct {
	// PoolMode is PgBouncer's pool_mode. Defaults to "transaction".
	PoolMode string
	// PoolSize is default_pool_size, the server connections PgBouncer
	// opens to the test database. Defaults to 2.
	PoolSize int
}

// pgbouncerLifetime bounds a PgBouncer the tests start, should the test
// binary fail to stop it.
const pgbouncerLifetime = 10 * time.Minute

// PgBouncer starts a PgBouncer of its own in front of the test database
// (URL's host, port, database and user), listening on a free port of
// 127.0.0.1, and returns the URL of the database through it. Its ini and
// user list live in t.TempDir(); it is stopped when the test ends, and
// killed after pgbouncerLifetime at the latest. It never touches a system
// PgBouncer's configuration.
//
// The binary is pgbouncer on PATH, else /usr/sbin/pgbouncer (Debian's
// package pgbouncer). If it is missing the test is skipped, unless
// IDEMQ_REQUIRE_PGBOUNCER is set (CI installs it): then it fails. As root
// it runs as nobody (PgBouncer refuses to run as root; it reads its
// files before it switches user).
//
// From PgBouncer 1.21 on, max_prepared_statements is set to 0, so that
// every version behaves as Debian's 1.18 does: protocol-level prepared
// statements are not tracked across server connections.
func PgBouncer(t testing.TB, opts PgBouncerOptions) string {
	t.Helper()
	bin := pgbouncerBinary()
	if bin == "" {
		if os.Getenv("IDEMQ_REQUIRE_PGBOUNCER") != "" {
			t.Fatal("testdb: pgbouncer is required (IDEMQ_REQUIRE_PGBOUNCER is set) but not installed")
		}
		t.Skip("pgbouncer is not installed: apt-get install pgbouncer to run this test (CI sets IDEMQ_REQUIRE_PGBOUNCER)")
	}
	if opts.PoolMode == "" {
		opts.PoolMode = "transaction"
	}
	if opts.PoolSize == 0 {
		opts.PoolSize = 2
	}
	up, err := pgconn.ParseConfig(URL())
	if err != nil {
		t.Fatalf("testdb: parse %s: %v", URL(), err)
	}
	major, minor, err := pgbouncerVersion(bin)
	if err != nil {
		t.Fatalf("testdb: %v", err)
	}
	dir := t.TempDir()
	userlist := filepath.Join(dir, "userlist.txt")
	if err := os.WriteFile(userlist, []byte(fmt.Sprintf("%s \"\"\n", iniQuote(up.User))), 0o600); err != nil {
		t.Fatal(err)
	}
	server := fmt.Sprintf("host=%s port=%d dbname=%s user=%s", up.Host, up.Port, up.Database, up.User)
	if up.Password != "" {
		server += " password=" + up.Password
	}
	var lastErr error
	for range 3 { // the free port may be taken before PgBouncer binds it
		port, err := freePort()
		if err != nil {
			t.Fatal(err)
		}
		ini := fmt.Sprintf(`[databases]
%s = %s

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %d
unix_socket_dir =
auth_type = trust
auth_file = %s
pool_mode = %s
default_pool_size = %d
min_pool_size = 0
reserve_pool_size = 0
max_client_conn = 200
server_login_retry = 1
`, up.Database, server, port, userlist, opts.PoolMode, opts.PoolSize)
		if major > 1 || minor >= 21 {
			ini += "max_prepared_statements = 0\n"
		}
		iniPath := filepath.Join(dir, "pgbouncer.ini")
		if err := os.WriteFile(iniPath, []byte(ini), 0o600); err != nil {
			t.Fatal(err)
		}
		if lastErr = startPgBouncer(t, bin, iniPath, port); lastErr == nil {
			u := url.URL{Scheme: "postgres", User: url.User(up.User), Host: net.JoinHostPort("127.0.0.1", strconv.Itoa(port)),
				Path: "/" + up.Database, RawQuery: "sslmode=disable"}
			return u.String()
		}
	}
	t.Fatalf("testdb: start pgbouncer: %v", lastErr)
	return ""
}

func pgbouncerBinary() string {
	if p, err := exec.LookPath("pgbouncer"); err == nil {
		return p
	}
	const debian = "/usr/sbin/pgbouncer"
	if fi, err := os.Stat(debian); err == nil && !fi.IsDir() {
		return debian
	}
	return ""
}

var versionRE = regexp.MustCompile(`PgBouncer (\d+)\.(\d+)`)

func pgbouncerVersion(bin string) (major, minor int, err error) {
	out, err := exec.Command(bin, "--version").CombinedOutput()
	if err != nil {
		return 0, 0, fmt.Errorf("%s --version: %v: %s", bin, err, out)
	}
	m := versionRE.FindSubmatch(out)
	if m == nil {
		return 0, 0, fmt.Errorf("%s --version: no version in %q", bin, out)
	}
	major, _ = strconv.Atoi(string(m[1]))
	minor, _ = strconv.Atoi(string(m[2]))
	return major, minor, nil
}

// startPgBouncer runs bin on iniPath until the test ends and waits until it
// accepts connections on port.
func startPgBouncer(t testing.TB, bin, iniPath string, port int) error {
	ctx, cancel := context.WithTimeout(context.Background(), pgbouncerLifetime)
	var args []string
	if os.Geteuid() == 0 {
		args = append(args, "-u", "nobody")
	}
	cmd := exec.CommandContext(ctx, bin, append(args, iniPath)...)
	cmd.WaitDelay = 5 * time.Second
	out := &testlog.Buffer{}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		cancel()
		return err
	}
	exited := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(exited)
	}()
	stop := func() {
		_ = cmd.Process.Signal(os.Interrupt) // SIGINT: PgBouncer's safe shutdown
		select {
		case <-exited:
		case <-time.After(5 * time.Second):
			cancel() // kills it
			<-exited
		}
		cancel()
	}
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	deadline := time.Now().Add(10 * time.Second)
	for {
		select {
		case <-exited:
			cancel()
			return fmt.Errorf("pgbouncer exited: %s", strings.TrimSpace(out.String()))
		default:
		}
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			c.Close()
			break
		}
		if time.Now().After(deadline) {
			stop()
			return fmt.Errorf("pgbouncer did not listen on %s within 10s: %s", addr, strings.TrimSpace(out.String()))
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Cleanup(func() {
		stop()
		if t.Failed() {
			t.Logf("pgbouncer's log:\n%s", out.String())
		}
	})
	return nil
}

// freePort returns a TCP port of 127.0.0.1 that was free a moment ago.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// iniQuote quotes a name for PgBouncer's auth_file.
func iniQuote(s string) string { return `"` + strings.ReplaceAll(s, `"`, `""`) + `"` }
