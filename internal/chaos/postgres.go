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
		u, err := user.Lookup("postgres")
		if err != nil {
			_ = os.RemoveAll(dir)
			return nil, fmt.Errorf("chaos: running as root needs a postgres user: %w", err)
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		if err := os.Chown(dir, uid, gid); err != nil {
			_ = os.RemoveAll(dir)
			return nil, fmt.Errorf("chaos: %w", err)
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
