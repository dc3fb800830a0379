package testdb

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// Cluster is a Postgres server of a test's own, made with Debian's
// postgresql-common (pg_createcluster), on a free port of 127.0.0.1, with
// trust authentication for local and replication connections. It never
// touches the shared test server.
type Cluster struct {
	// Version is the major version, such as "15"; Name the cluster's
	// name; Port its port.
	Version, Name string
	Port          int
	dataDir, log  string
}

// clusterPrefix starts the names of the clusters tests make, so that a
// later run can drop those a killed test binary left behind.
const clusterPrefix = "idemqtest"

// clusterLifetime is how long a cluster may outlive its test before a
// later NewCluster drops it (a test binary killed before its cleanup).
// The tests that make clusters take seconds.
const clusterLifetime = 30 * time.Minute

// clusterMarkers holds a file per cluster the tests made, which says
// until when it may live; postgresql-common's directories hold nothing of
// the tests' own, so that pg_dropcluster removes them whole.
var clusterMarkers = filepath.Join(os.TempDir(), "idemq-test-clusters")

// clusterCmdTimeout bounds each postgresql-common command.
const clusterCmdTimeout = 60 * time.Second

// NewCluster creates and starts a cluster for the test (wal_level replica,
// room for walsenders, fsync off: a test server, not a durable one) and
// drops it, stopping it, when the test ends. The major version is the
// newest installed.
//
// It skips the test if postgresql-common is missing or the test does not
// run as root (pg_createcluster needs root, or the postgres user), unless
// IDEMQ_REQUIRE_CLUSTERS is set: then it fails.
func NewCluster(t testing.TB) *Cluster {
	t.Helper()
	version := clusterSupport(t)
	dropExpiredClusters(t, version)
	var lastErr error
	for range 3 { // the free port may be taken before the server binds it
		port, err := freePort()
		if err != nil {
			t.Fatal(err)
		}
		c := &Cluster{Version: version, Name: newClusterName(), Port: port}
		if lastErr = c.create(t, "--start"); lastErr == nil {
			if lastErr = c.waitReady(t); lastErr == nil {
				return c
			}
		}
	}
	t.Fatalf("testdb: create a cluster: %v", lastErr)
	return nil
}

// Standby creates a standby of c streaming from it (pg_basebackup -R) with
// the application_name name, as which synchronous_standby_names can name
// it, starts it, waits until c reports it streaming, and drops it when the
// test ends. It streams asynchronously until c's synchronous_standby_names
// names it.
func (c *Cluster) Standby(t testing.TB, name string) *Cluster {
	t.Helper()
	var lastErr error
	for range 3 {
		port, err := freePort()
		if err != nil {
			t.Fatal(err)
		}
		s := &Cluster{Version: c.Version, Name: newClusterName(), Port: port}
		if lastErr = s.create(t); lastErr != nil {
			continue
		}
		// Its own configuration (port, paths) stays; its data become
		// the primary's.
		if err := os.RemoveAll(s.dataDir); err != nil {
			t.Fatal(err)
		}
		if _, err := run(t, "install", "-d", "-o", "postgres", "-g", "postgres", "-m", "700", s.dataDir); err != nil {
			t.Fatal(err)
		}
		conn := fmt.Sprintf("host=127.0.0.1 port=%d user=postgres application_name=%s", c.Port, name)
		if _, err := run(t, "runuser", "-u", "postgres", "--", "pg_basebackup", "-D", s.dataDir, "-R", "-X", "stream", "-c", "fast", "-d", conn); err != nil {
			t.Fatalf("testdb: pg_basebackup: %v", err)
		}
		if _, lastErr = run(t, "pg_ctlcluster", s.Version, s.Name, "start"); lastErr != nil {
			continue
		}
		if lastErr = s.waitReady(t); lastErr != nil {
			continue
		}
		deadline := time.Now().Add(30 * time.Second)
		for {
			var streaming bool
			err := c.QueryRow(t, `SELECT EXISTS (SELECT 1 FROM pg_stat_replication WHERE application_name = $1 AND state = 'streaming')`, name).Scan(&streaming)
			if err == nil && streaming {
				return s
			}
			if time.Now().After(deadline) {
				t.Fatalf("testdb: standby %s does not stream from %s within 30s (%v):\n%s", name, c.Name, err, s.logTail())
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	t.Fatalf("testdb: create a standby: %v", lastErr)
	return nil
}

// URL returns the URL of the cluster's postgres database as the postgres
// user.
func (c *Cluster) URL() string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", c.Port)
}

// QueryRow runs sql on a connection of its own.
func (c *Cluster) QueryRow(t testing.TB, sql string, args ...any) pgx.Row {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	conn, err := pgx.Connect(ctx, c.URL())
	if err != nil {
		cancel()
		return errRow{err}
	}
	return closingRow{conn.QueryRow(ctx, sql, args...), conn, cancel}
}

// Exec runs sql, failing the test if it fails.
func (c *Cluster) Exec(t testing.TB, sql string, args ...any) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, c.URL())
	if err != nil {
		t.Fatalf("testdb: connect to cluster %s: %v", c.Name, err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(ctx, sql, args...); err != nil {
		t.Fatalf("testdb: %s on cluster %s: %v", sql, c.Name, err)
	}
}

// Set sets the server parameter name to value with ALTER SYSTEM and
// reloads the configuration; the server applies it a moment later.
func (c *Cluster) Set(t testing.TB, name, value string) {
	t.Helper()
	c.Exec(t, "ALTER SYSTEM SET "+pgx.Identifier{name}.Sanitize()+" = '"+strings.ReplaceAll(value, "'", "''")+"'")
	c.Exec(t, "SELECT pg_reload_conf()")
}

// create runs pg_createcluster (with extra options, such as --start),
// and registers the cluster's drop.
func (c *Cluster) create(t testing.TB, extra ...string) error {
	t.Helper()
	args := append([]string{c.Version, c.Name, "-p", strconv.Itoa(c.Port)}, extra...)
	args = append(args, "-o", "fsync=off", "-o", "shared_buffers=16MB", "-o", "max_connections=40",
		"-o", "wal_level=replica", "-o", "max_wal_senders=10",
		"--", "--auth-local=trust", "--auth-host=trust", "--no-sync")
	c.dataDir = filepath.Join("/var/lib/postgresql", c.Version, c.Name)
	c.log = filepath.Join("/var/log/postgresql", "postgresql-"+c.Version+"-"+c.Name+".log")
	// The marker first, so that a later run drops the cluster should this
	// binary be killed before its cleanup.
	if err := os.MkdirAll(clusterMarkers, 0o755); err != nil {
		return err
	}
	expires := strconv.FormatInt(time.Now().Add(clusterLifetime).Unix(), 10)
	if err := os.WriteFile(c.marker(), []byte(expires), 0o644); err != nil {
		return err
	}
	out, err := run(t, "pg_createcluster", args...)
	// Registered whatever happened: a half-made cluster is dropped too.
	t.Cleanup(func() { c.drop(t) })
	if err != nil {
		return err
	}
	for _, line := range strings.Split(out, "\n") {
		// Ver Cluster Port Status Owner Data-directory Log-file
		if f := strings.Fields(line); len(f) >= 7 && f[0] == c.Version && f[1] == c.Name {
			c.dataDir, c.log = f[5], f[6]
		}
	}
	return nil
}

// waitReady waits until the cluster answers a query.
func (c *Cluster) waitReady(t testing.TB) error {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		var one int
		err := c.QueryRow(t, "SELECT 1").Scan(&one)
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("cluster %s does not answer on port %d within 30s: %v\n%s", c.Name, c.Port, err, c.logTail())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// drop stops and drops the cluster, and removes its marker.
func (c *Cluster) drop(t testing.TB) {
	if t.Failed() {
		t.Logf("testdb: log of cluster %s:\n%s", c.Name, c.logTail())
	}
	if err := dropCluster(t, c.Version, c.Name); err != nil {
		t.Errorf("testdb: drop cluster %s: %v", c.Name, err)
	}
}

// marker is the file that says until when the cluster may live.
func (c *Cluster) marker() string { return filepath.Join(clusterMarkers, c.Version+"-"+c.Name) }

// dropCluster drops the cluster version/name, if pg_createcluster made it,
// and removes its marker.
func dropCluster(t testing.TB, version, name string) error {
	if _, err := os.Stat(filepath.Join("/etc/postgresql", version, name)); err == nil {
		if _, err := run(t, "pg_dropcluster", "--stop", version, name); err != nil {
			return err
		}
	} else if !errors.Is(err, os.ErrNotExist) {
		return err
	}
	if err := os.Remove(filepath.Join(clusterMarkers, version+"-"+name)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// logTail returns the end of the cluster's log.
func (c *Cluster) logTail() string {
	b, err := os.ReadFile(c.log)
	if err != nil {
		return err.Error()
	}
	if len(b) > 4000 {
		b = b[len(b)-4000:]
	}
	return string(b)
}

// clusterSupport returns the newest installed major version, or skips (or
// fails, with IDEMQ_REQUIRE_CLUSTERS) the test if clusters cannot be made.
func clusterSupport(t testing.TB) string {
	t.Helper()
	why := ""
	switch {
	case os.Geteuid() != 0:
		why = "the tests do not run as root, which pg_createcluster needs"
	default:
		for _, tool := range []string{"pg_createcluster", "pg_ctlcluster", "pg_dropcluster", "pg_basebackup", "runuser", "install"} {
			if _, err := exec.LookPath(tool); err != nil {
				why = tool + " is not installed (Debian's postgresql-common and postgresql-client)"
				break
			}
		}
	}
	var versions []int
	if why == "" {
		dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin/postgres")
		for _, d := range dirs {
			if v, err := strconv.Atoi(filepath.Base(filepath.Dir(filepath.Dir(d)))); err == nil {
				versions = append(versions, v)
			}
		}
		if len(versions) == 0 {
			why = "no Postgres server is installed under /usr/lib/postgresql"
		}
	}
	if why != "" {
		if os.Getenv("IDEMQ_REQUIRE_CLUSTERS") != "" {
			t.Fatalf("testdb: a cluster of the test's own is required (IDEMQ_REQUIRE_CLUSTERS is set), but %s", why)
		}
		t.Skipf("cannot make a Postgres cluster of the test's own: %s (IDEMQ_REQUIRE_CLUSTERS makes this a failure)", why)
	}
	sort.Ints(versions)
	return strconv.Itoa(versions[len(versions)-1])
}

// dropExpiredClusters drops the clusters of earlier test runs that
// outlived clusterLifetime: their test binary was killed before its
// cleanup.
func dropExpiredClusters(t testing.TB, version string) {
	markers, _ := filepath.Glob(filepath.Join(clusterMarkers, version+"-"+clusterPrefix+"*"))
	for _, f := range markers {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		if exp, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64); err != nil || time.Now().Unix() < exp {
			continue
		}
		name := strings.TrimPrefix(filepath.Base(f), version+"-")
		if err := dropCluster(t, version, name); err != nil {
			t.Logf("testdb: drop expired cluster %s: %v", name, err)
		}
	}
}

func newClusterName() string {
	var b [5]byte
	_, _ = rand.Read(b[:])
	return clusterPrefix + hex.EncodeToString(b[:])
}

// run runs a command, bounded by clusterCmdTimeout, and returns its
// output; the error carries the output.
func run(t testing.TB, name string, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), clusterCmdTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.WaitDelay = 5 * time.Second
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	if err != nil {
		return out.String(), fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, lastLines(out.String(), 20))
	}
	return out.String(), nil
}

func lastLines(s string, n int) string {
	var lines []string
	sc := bufio.NewScanner(strings.NewReader(s))
	for sc.Scan() {
		lines = append(lines, sc.Text())
	}
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// errRow is a pgx.Row whose Scan returns err.
type errRow struct{ err error }

func (r errRow) Scan(...any) error { return r.err }

// closingRow closes its connection once scanned.
type closingRow struct {
	row    pgx.Row
	conn   *pgx.Conn
	cancel context.CancelFunc
}

func (r closingRow) Scan(dest ...any) error {
	err := r.row.Scan(dest...)
	cerr := r.conn.Close(context.Background())
	r.cancel()
	return errors.Join(err, cerr)
}
