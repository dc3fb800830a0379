package processed_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/consumer/dedup"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

// TestClaimKeepsStrongerSynchronousCommit: a claim's transaction raises a
// synchronous_commit weaker than on (off, local) to on, and keeps the
// stronger ones the session has (remote_write, on, remote_apply), here set
// on the role with ALTER ROLE ... SET, the inherited setting an operator
// makes for synchronous replication. Every path of the claim is checked: a
// new claim, a batch of new claims, a duplicate (whose INSERT inserts
// nothing, so the read of the existing row sets it), and a batch with both.
func TestClaimKeepsStrongerSynchronousCommit(t *testing.T) {
	t.Parallel()
	for _, partitioned := range []bool{false, true} {
		name := "plain"
		if partitioned {
			name = "partitioned"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			admin := testdb.Pool(t)
			// The grants are made on the plain table; the conversion to
			// the partitioned layout carries them to the generations.
			adminStore, _ := setup(t, processed.Config{})
			schema := adminStore.Schema()
			if _, err := admin.Exec(ctx, "CREATE TABLE "+pgx.Identifier{schema, "ledger"}.Sanitize()+" (id text)"); err != nil {
				t.Fatal(err)
			}
			role, _ := limitedRole(t, admin, adminStore, "ledger")
			if partitioned {
				setup(t, processed.Config{Schema: schema, Partitioned: true})
			}
			for _, c := range []struct{ role, want string }{
				{"off", "on"},
				{"local", "on"},
				{"on", "on"},
				{"remote_write", "remote_write"},
				{"remote_apply", "remote_apply"},
			} {
				// A role's settings apply to the sessions it opens next:
				// a pool of its own for each.
				if _, err := admin.Exec(ctx, "ALTER ROLE "+pgx.Identifier{role}.Sanitize()+" SET synchronous_commit = "+c.role); err != nil {
					t.Fatal(err)
				}
				cfg, err := pgxpool.ParseConfig(testdb.URL())
				if err != nil {
					t.Fatal(err)
				}
				cfg.ConnConfig.User = role
				pool, err := pgxpool.NewWithConfig(ctx, cfg)
				if err != nil {
					t.Fatal(err)
				}
				s, err := processed.New(pool, processed.Config{Schema: schema, Partitioned: partitioned})
				if err != nil {
					t.Fatal(err)
				}
				var session string
				if err := pool.QueryRow(ctx, "SELECT current_setting('synchronous_commit')").Scan(&session); err != nil || session != c.role {
					t.Fatalf("the role's session has synchronous_commit %q (%v), want %q", session, err, c.role)
				}
				prefix := c.role + "-"
				for _, p := range []struct {
					path string
					ids  []string
				}{
					{"new", []string{prefix + "a"}},
					{"new batch", []string{prefix + "b", prefix + "c"}},
					{"duplicate", []string{prefix + "a"}},
					{"duplicate and new", []string{prefix + "b", prefix + "d"}},
				} {
					var claims []dedup.Claim
					for _, id := range p.ids {
						claims = append(claims, claimOf("sync", id, "x"))
					}
					tx, _, err := s.BeginClaim(ctx, claims)
					if err != nil {
						t.Fatalf("%s: BeginClaim: %v", p.path, err)
					}
					var got string
					if err := tx.QueryRow(ctx, "SELECT current_setting('synchronous_commit')").Scan(&got); err != nil {
						t.Fatal(err)
					}
					if err := tx.Commit(ctx); err != nil {
						t.Fatalf("%s: commit: %v", p.path, err)
					}
					if got != c.want {
						t.Errorf("role's synchronous_commit %s, claim (%s): the transaction commits with %q, want %q", c.role, p.path, got, c.want)
					}
				}
				pool.Close()
			}
		})
	}
}

// TestCommitRaisesHandlersSynchronousCommit: a handler's SET LOCAL
// synchronous_commit = off, after the claim, does not make the commit
// asynchronous: the COMMIT raises it again (a deferred trigger records the
// value the commit runs with). A stronger value the handler sets is kept.
func TestCommitRaisesHandlersSynchronousCommit(t *testing.T) {
	t.Parallel()
	s, pool := setup(t, processed.Config{})
	ctx := context.Background()
	seen := pgx.Identifier{s.Schema(), "seen"}.Sanitize()
	fn := pgx.Identifier{s.Schema(), "record_sync_commit"}.Sanitize()
	if _, err := pool.Exec(ctx, `CREATE TABLE `+seen+` (id text, setting text);
CREATE FUNCTION `+fn+`() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	UPDATE `+seen+` SET setting = current_setting('synchronous_commit') WHERE id = NEW.id;
	RETURN NULL;
END$$;
CREATE CONSTRAINT TRIGGER record AFTER INSERT ON `+seen+` DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION `+fn+`()`); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ handler, want string }{
		{"off", "on"},
		{"local", "on"},
		{"remote_apply", "remote_apply"},
	} {
		tx, _, err := s.BeginClaim(ctx, []dedup.Claim{claimOf("sync", "h-"+c.handler, "x")})
		if err != nil {
			t.Fatal(err)
		}
		// What a handler may do in the runtime's transaction.
		if _, err := tx.Exec(ctx, "SET LOCAL synchronous_commit = "+c.handler); err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, "INSERT INTO "+seen+" (id) VALUES ($1)", c.handler); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatalf("commit: %v", err)
		}
		var got string
		if err := pool.QueryRow(ctx, "SELECT setting FROM "+seen+" WHERE id = $1", c.handler).Scan(&got); err != nil {
			t.Fatal(err)
		}
		if got != c.want {
			t.Errorf("handler's SET LOCAL synchronous_commit = %s: the COMMIT ran with %q, want %q", c.handler, got, c.want)
		}
	}
}
