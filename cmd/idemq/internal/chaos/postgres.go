package chaos

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
)

// DefaultPGBin is where Debian and Ubuntu install PostgreSQL 15's server
// binaries.
const DefaultPGBin = "/usr/lib/postgresql/15/bin"

// PGCluster is a throwaway Postgres cluster the harness owns: initdb into a
// temporary directory, its own port on 127.0.0.1, stopped and removed by
// Close. Restart stops it with `pg_ctl -m immediate` (a crash: no
// checkpoint, in-flight transactions lost, WAL replayed at the next start).
type PGCluster struct {
	bin, dir, data, logFile string
	port                    int
	asPostgres              bool // run the binaries as user postgres (we are root)
}

// StartPGCluster creates and starts a cluster with the binaries in bin
// (DefaultPGBin if empty).
func StartPGCluster(ctx context.Context, bin string) (*PGCluster, error) {
	if bin == "" {
		bin = DefaultPGBin
	}
	if _, err := os.Stat(filepath.Join(bin, "initdb")); err != nil {
		return nil, fmt.Errorf("chaos: postgres binaries: %w", err)
	}
	dir, err := os.MkdirTemp("", "idemq-chaos-pg-")
	if err != nil {
		return nil, fmt.Errorf("chaos: %w", err)
	}
	c := &PGCluster{bin: bin, dir: dir, data: filepath.Join(dir, "data"), logFile: filepath.Join(dir, "postgres.log")}
	if os.Geteuid() == 0 {
		// initdb refuses to run as root: run as postgres.
		if err := giveToPostgres(dir); err != nil {
			_ = os.RemoveAll(dir)
			return nil, err
		}
		c.asPostgres = true
	}
	if c.port, err = freePort(); err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	if out, err := c.cmd(ctx, "initdb", "-D", c.data, "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync").CombinedOutput(); err != nil {
		_ = os.RemoveAll(dir)
		return nil, fmt.Errorf("chaos: initdb: %w: %s", err, out)
	}
	if err := c.Start(ctx); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// giveToPostgres makes user postgres own dir, for the server binaries that
// refuse to run as root.
func giveToPostgres(dir string) error {
	u, err := user.Lookup("postgres")
	if err != nil {
		return fmt.Errorf("chaos: running as root needs a postgres user: %w", err)
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	if err := os.Chown(dir, uid, gid); err != nil {
		return fmt.Errorf("chaos: %w", err)
	}
	return nil
}

func (c *PGCluster) cmd(ctx context.Context, name string, args ...string) *exec.Cmd {
	path := filepath.Join(c.bin, name)
	if c.asPostgres {
		return exec.CommandContext(ctx, "runuser", append([]string{"-u", "postgres", "--", path}, args...)...)
	}
	return exec.CommandContext(ctx, path, args...)
}

// URL is the cluster's connection URL (database postgres, trust auth).
func (c *PGCluster) URL() string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", c.port)
}

// Addr is the cluster's host:port.
func (c *PGCluster) Addr() string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(c.port)) }

// Start starts the cluster and waits until it accepts connections.
func (c *PGCluster) Start(ctx context.Context) error {
	opts := fmt.Sprintf("-p %d -c listen_addresses=127.0.0.1 -c unix_socket_directories=%s -c max_connections=300 -c shared_buffers=64MB",
		c.port, c.dir)
	if out, err := c.cmd(ctx, "pg_ctl", "-D", c.data, "-l", c.logFile, "-o", opts, "-w", "-t", "60", "start").CombinedOutput(); err != nil {
		return fmt.Errorf("chaos: pg_ctl start: %w: %s", err, out)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		conn, err := pgx.Connect(cctx, c.URL())
		cancel()
		if err == nil {
			_ = conn.Close(ctx)
			return nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return fmt.Errorf("chaos: postgres did not come up: %w", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// Crash stops the cluster with `pg_ctl -m immediate`.
func (c *PGCluster) Crash(ctx context.Context) error {
	if out, err := c.cmd(ctx, "pg_ctl", "-D", c.data, "-m", "immediate", "-w", "stop").CombinedOutput(); err != nil {
		return fmt.Errorf("chaos: pg_ctl stop: %w: %s", err, out)
	}
	return nil
}

// Restart crashes the cluster and starts it again after down.
func (c *PGCluster) Restart(ctx context.Context, down time.Duration) error {
	if err := c.Crash(ctx); err != nil {
		return err
	}
	sleepCtx(ctx, down)
	return c.Start(ctx)
}

// Close stops the cluster and removes its directory.
func (c *PGCluster) Close() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_ = c.cmd(ctx, "pg_ctl", "-D", c.data, "-m", "immediate", "-w", "stop").Run()
	_ = os.RemoveAll(c.dir)
}

// freePort returns a TCP port that was free on 127.0.0.1 a moment ago.
func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("chaos: find a free port: %w", err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

func sleepCtx(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// PGFailoverStallBound is the longest a PGFailover scenario may go without
// an apply (see Stall): the primary's crash, the standby's promotion (about
// a second here), and the pool's reconnect to it through the multi-host URL
// (connect_timeout 5s for the dead host). TestPostgresFailoverWithSyncStandby
// measured 0.3s.
const PGFailoverStallBound = 15 * time.Second

// pgStandbyName is the PGPair standby's application_name, which the
// primary's synchronous_standby_names names.
const pgStandbyName = "s1"

// PGPair is a private Postgres primary with a synchronous standby, made by
// pg_basebackup -R: a COMMIT on the primary returns once the standby has
// flushed it. Failover crashes the primary and promotes the standby, which
// then runs alone (it did not inherit synchronous_standby_names, set on the
// primary after the base backup, so its COMMITs do not wait for a standby
// that is gone).
type PGPair struct {
	Primary, Standby *PGCluster
	async            bool
}

// StartPGPair starts a primary and its synchronous standby with the
// binaries in bin (DefaultPGBin if empty); with async, the standby streams
// asynchronously and Failover loses the primary's last second of commits
// (see SabotageAsyncStandby). On an error nothing is left running.
func StartPGPair(ctx context.Context, bin string, async bool) (_ *PGPair, err error) {
	p := &PGPair{async: async}
	defer func() {
		if err != nil {
			p.Close()
		}
	}()
	if p.Primary, err = StartPGCluster(ctx, bin); err != nil {
		return nil, err
	}
	pr := p.Primary
	dir, err := os.MkdirTemp("", "idemq-chaos-pg-standby-")
	if err != nil {
		return nil, fmt.Errorf("chaos: %w", err)
	}
	s := &PGCluster{bin: pr.bin, dir: dir, data: filepath.Join(dir, "data"), logFile: filepath.Join(dir, "postgres.log"), asPostgres: pr.asPostgres}
	p.Standby = s
	if s.asPostgres {
		if err := giveToPostgres(dir); err != nil {
			return nil, err
		}
	}
	if s.port, err = freePort(); err != nil {
		return nil, err
	}
	conninfo := fmt.Sprintf("host=127.0.0.1 port=%d user=postgres application_name=%s", pr.port, pgStandbyName)
	if out, err := s.cmd(ctx, "pg_basebackup", "-D", s.data, "-R", "-X", "stream", "-c", "fast", "--no-sync", "-d", conninfo).CombinedOutput(); err != nil {
		return nil, fmt.Errorf("chaos: pg_basebackup: %w: %s", err, out)
	}
	if err := s.Start(ctx); err != nil {
		return nil, err
	}
	if async {
		return p, nil
	}
	conn, err := pgx.Connect(ctx, pr.URL())
	if err != nil {
		return nil, fmt.Errorf("chaos: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, `ALTER SYSTEM SET synchronous_standby_names = '`+pgStandbyName+`'`); err != nil {
		return nil, fmt.Errorf("chaos: %w", err)
	}
	if _, err := conn.Exec(ctx, `SELECT pg_reload_conf()`); err != nil {
		return nil, fmt.Errorf("chaos: %w", err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		var sync bool
		err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_replication WHERE application_name = $1 AND sync_state = 'sync')`,
			pgStandbyName).Scan(&sync)
		if err == nil && sync {
			return p, nil
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("chaos: the standby is not synchronous after 30s (%v)", err)
		}
		if !sleepCtx(ctx, 100*time.Millisecond) {
			return nil, ctx.Err()
		}
	}
}

// URL is the pair's multi-host URL: pgx connects to whichever of the two
// accepts writes.
func (p *PGPair) URL() string {
	return fmt.Sprintf("postgres://postgres@%s,%s/postgres?sslmode=disable&target_session_attrs=read-write&connect_timeout=5",
		p.Primary.Addr(), p.Standby.Addr())
}

// Failover crashes the primary (pg_ctl -m immediate) and promotes the
// standby, waiting until it accepts writes. An asynchronous pair's standby
// first stops receiving WAL for a second, as a standby that lags does, so
// the commits of that second are lost with the primary.
func (p *PGPair) Failover(ctx context.Context) error {
	if p.async {
		return p.failoverLagging(ctx)
	}
	if err := p.Primary.Crash(ctx); err != nil {
		return err
	}
	return p.promote(ctx)
}

func (p *PGPair) failoverLagging(ctx context.Context) error {
	// An empty primary_conninfo, reloaded, shuts the WAL receiver down
	// and keeps it down: what the primary commits from then on never
	// reaches the standby. (A stopped receiver would not do: the kernel
	// buffers what the primary sends meanwhile, and the receiver reads it
	// when it runs again.)
	conn, err := pgx.Connect(ctx, p.Standby.URL())
	if err != nil {
		return fmt.Errorf("chaos: %w", err)
	}
	_, err = conn.Exec(ctx, `ALTER SYSTEM SET primary_conninfo = ''`)
	if err == nil {
		_, err = conn.Exec(ctx, `SELECT pg_reload_conf()`)
	}
	_ = conn.Close(ctx)
	if err != nil {
		return fmt.Errorf("chaos: cut the standby off: %w", err)
	}
	sleepCtx(ctx, time.Second)
	if err := p.Primary.Crash(ctx); err != nil {
		return err
	}
	return p.promote(ctx)
}

func (p *PGPair) promote(ctx context.Context) error {
	if out, err := p.Standby.cmd(ctx, "pg_ctl", "-D", p.Standby.data, "-w", "-t", "60", "promote").CombinedOutput(); err != nil {
		return fmt.Errorf("chaos: pg_ctl promote: %w: %s", err, out)
	}
	return nil
}

// Close stops both servers and removes their directories.
func (p *PGPair) Close() {
	for _, c := range []*PGCluster{p.Primary, p.Standby} {
		if c != nil {
			c.Close()
		}
	}
}
