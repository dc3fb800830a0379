package chaos

import (
	"context"
	"fmt"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/processed"
)

// SabotageBlindReshard, on a scenario with ReshardFrom, reshards as an
// operator who skips the guide would: the shards' recorded maps are
// deleted, and the workers start with the new map alone, never checking a
// moved message's old shard. The messages delivered again after the
// reshard whose keys moved are applied a second time, on the new shard,
// and the checker must report them.
const SabotageBlindReshard = "blind-reshard"

// shardSet is a sharded scenario's shards: a private Postgres cluster
// each, and the map the workers start with.
type shardSet struct {
	clusters []*PGCluster
	pools    []*pgxpool.Pool
	// gate is held for reading while a worker is spawned, and for
	// writing while the map changes, so that no worker of the old map
	// starts while one of the new runs.
	gate      sync.RWMutex
	cur, prev int // the map's shard count, and the previous one's during a reshard (0: none)
}

// startShards starts the scenario's shard clusters, with the schema, the
// dedup table and the effects table on each.
func (r *run) startShards(ctx context.Context) error {
	ss := &shardSet{cur: r.s.Shards}
	if r.s.ReshardFrom > 0 {
		ss.cur = r.s.ReshardFrom
	}
	r.shards = ss
	for i := range r.s.Shards {
		c, err := StartPGCluster(ctx, r.h.cfg.PGBin)
		if err != nil {
			return fmt.Errorf("chaos: shard %d: %w", i, err)
		}
		ss.clusters = append(ss.clusters, c)
		pool, err := pgxpool.New(ctx, c.URL())
		if err != nil {
			return fmt.Errorf("chaos: shard %d: %w", i, err)
		}
		ss.pools = append(ss.pools, pool)
		q := pgx.Identifier{r.schema}.Sanitize()
		if _, err := pool.Exec(ctx, `CREATE SCHEMA `+q); err != nil {
			return fmt.Errorf("chaos: shard %d: create schema: %w", i, err)
		}
		store, err := processed.New(pool, processed.Config{Schema: r.schema})
		if err != nil {
			return err
		}
		if err := store.Migrate(ctx); err != nil {
			return fmt.Errorf("chaos: shard %d: migrate: %w", i, err)
		}
		if _, err := pool.Exec(ctx, `CREATE TABLE `+q+`.effects (msg_id text NOT NULL, copy text NOT NULL, slot int NOT NULL, incarnation int NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())`); err != nil {
			return fmt.Errorf("chaos: shard %d: create effects: %w", i, err)
		}
	}
	r.h.event("scenario %s: %d shard clusters up (%s); the map starts at %d shards", r.s.Name, r.s.Shards, r.shardAddrs(), ss.cur)
	return nil
}

func (r *run) shardAddrs() string {
	out := ""
	for i, c := range r.shards.clusters {
		if i > 0 {
			out += ", "
		}
		out += c.Addr()
	}
	return out
}

// closeShards stops and removes the shard clusters.
func (r *run) closeShards() {
	if r.shards == nil {
		return
	}
	for _, p := range r.shards.pools {
		p.Close()
	}
	for _, c := range r.shards.clusters {
		c.Close()
	}
}

// dataPools are the databases that hold the claims and the effects: the
// shards, or the scenario's one database.
func (r *run) dataPools() []*pgxpool.Pool {
	if r.shards != nil {
		return r.shards.pools
	}
	return []*pgxpool.Pool{r.db.pool}
}

// shardConfig fills in wc's shards: the URLs of the map's shards (both
// maps' during a reshard) and the counts. The caller holds the gate.
func (r *run) shardConfig(wc *WorkerConfig) {
	ss := r.shards
	n := max(ss.cur, ss.prev)
	for _, c := range ss.clusters[:n] {
		wc.ShardURLs = append(wc.ShardURLs, c.URL())
	}
	wc.ShardMap, wc.PreviousShards = ss.cur, ss.prev
}

// reshard changes the map from ReshardFrom shards to Shards as the guide
// says: no worker of the old map may run once one of the new map starts,
// so the spawns wait while every running worker is SIGKILLed; the next
// incarnations start with both maps.
func (r *run) reshard(ctx context.Context) {
	ss := r.shards
	ss.gate.Lock()
	defer ss.gate.Unlock()
	r.mu.Lock()
	var procs []*proc
	now := time.Now().UnixNano()
	for k, p := range r.procs {
		if _, sent := r.nemesisSent[k]; !sent {
			r.nemesisSent[k] = now
			_ = p.cmd.Process.Signal(syscall.SIGKILL)
		}
		procs = append(procs, p)
	}
	r.mu.Unlock()
	for _, p := range procs {
		select {
		case <-p.done:
		case <-ctx.Done():
			return
		}
	}
	ss.prev, ss.cur = ss.cur, r.s.Shards
	if r.s.Sabotage == SabotageBlindReshard {
		for i, pool := range ss.pools {
			if _, err := pool.Exec(ctx, `DELETE FROM `+pgx.Identifier{r.schema, "processed_messages_shard_map"}.Sanitize()); err != nil {
				r.problem(fmt.Sprintf("blind reshard: shard %d: %v", i, err))
			}
		}
		ss.prev = 0
	}
	r.inject("reshard", 1)
	r.h.event("scenario %s: resharding from %d to %d: %d workers killed; the next start with both maps", r.s.Name, ss.prev, ss.cur, len(procs))
}

// restartShard restarts a random shard's cluster, down for down.
func (r *run) restartShard(ctx context.Context, down time.Duration) error {
	i := r.intn(len(r.shards.clusters))
	r.h.event("scenario %s: shard %d (%s) restarted", r.s.Name, i, r.shards.clusters[i].Addr())
	return r.shards.clusters[i].Restart(ctx, down)
}

// shardFindings checks, on each shard, that every effect has its claim
// beside it: an effect on a shard without its message's claim there would
// have committed in a transaction the claim was not in. It also counts
// each shard's effects.
func (r *run) shardFindings(ctx context.Context) (found []string, effects []int, err error) {
	if r.shards == nil {
		return nil, nil, nil
	}
	q := pgx.Identifier{r.schema}.Sanitize()
	for i, pool := range r.shards.pools {
		var n, all int
		var sample *string
		err := pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE NOT EXISTS (SELECT 1 FROM `+q+`.processed_messages p WHERE p.consumer = $1 AND p.message_id = e.msg_id)),
	min(e.msg_id) FILTER (WHERE NOT EXISTS (SELECT 1 FROM `+q+`.processed_messages p WHERE p.consumer = $1 AND p.message_id = e.msg_id)),
	count(*)
FROM `+q+`.effects e`, r.consumer()).Scan(&n, &sample, &all)
		if err != nil {
			return nil, nil, fmt.Errorf("chaos: shard %d: %w", i, err)
		}
		if n > 0 {
			found = append(found, fmt.Sprintf("shard %d holds %d effects without their claim (e.g. %s)", i, n, *sample))
		}
		effects = append(effects, all)
	}
	return found, effects, nil
}
