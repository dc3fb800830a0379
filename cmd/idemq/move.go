package main

import (
	"context"
	"errors"
	"fmt"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/redact"
	"github.com/idemq/idemq/processed"
)

var processedMoveCommand = &command{
	name:    "processed move",
	args:    "--shard-url <url>... --shards <n> --previous-shards <m> (--to <shard> | --finish)",
	summary: "during a reshard, move the dedup rows of the keys that changed shard, or finish it",
	help: `During a reshard of a sharded dedup store (processed.Sharded, see
docs/sharding.md), moves the dedup records of the shard keys the new map
places on shard --to, from every other shard (or only --from) to it: a page
of records at a time is inserted on --to (keeping each record's fingerprint
and time), read back and compared there, and only then deleted where it
was. The consumers keep running, with both maps. Records without a shard
key (claimed by a store of one database, or before migration 0007) stay
where they are, and are counted.

--finish instead ends the reshard, once no shard holds a record from before
it that the new map places on another shard, or that has no shard key (the
janitor's purges remove those once older than the retention); until then it
says what is left, and exits 1. Afterwards start the consumers without the
old map (ShardedConfig.Previous).

Give every shard's URL with --shard-url, in shard order (as many as the
larger map has), and the maps' shard counts. The command knows the default
maps only: keys placed by jump consistent hashing of their FNV-1a hash
(ShardMap without Place), named by --map-name and --previous-map-name
(default "key"). A map with a Place function of your own is moved with
Sharded.MoveRows and FinishReshard from Go.

It prints a line per source shard (records scanned, moved, already there,
unkeyed), with a progress line on a terminal. Exits 1 if a move or a check
fails, or --finish finds records left.

Examples:
  idemq processed move --shard-url postgres://db0/app --shard-url postgres://db1/app \
      --shard-url postgres://db2/app --shards 3 --previous-shards 2 --to 2
  idemq processed move --shard-url ... --shards 3 --previous-shards 2 --finish`,
	run: runProcessedMove,
}

func runProcessedMove(ctx context.Context, e *env, c *command, args []string) error {
	var (
		db             dbFlags
		urls           listOfFlag
		shards, prev   int
		name, prevName string
		to, from       int
		finish         bool
	)
	fs := c.flagSet()
	fs.StringVar(&db.schema, "schema", "", "schema of the dedup table on every shard (default: each connection's current schema)")
	fs.StringVar(&db.table, "table", "processed_messages", "name of the dedup table")
	fs.Var(&urls, "shard-url", "a shard's database URL, in shard order (repeat it for each)")
	fs.IntVar(&shards, "shards", 0, "the new map's shard count (required)")
	fs.IntVar(&prev, "previous-shards", 0, "the old map's shard count (required)")
	fs.StringVar(&name, "map-name", "key", "the new map's name")
	fs.StringVar(&prevName, "previous-map-name", "key", "the old map's name")
	fs.IntVar(&to, "to", -1, "move the records the new map places on this shard")
	fs.IntVar(&from, "from", -1, "move them from this shard only (default: every other shard)")
	fs.BoolVar(&finish, "finish", false, "end the reshard instead, if nothing is left to move or purge")
	if _, err := c.parse(e, fs, args, 0); err != nil {
		return err
	}
	switch {
	case shards < 1 || prev < 1:
		return usagef("--shards and --previous-shards are required, and positive")
	case len(urls) != max(shards, prev):
		return usagef("%d --shard-url for maps of %d and %d shards: give one per shard of the larger map", len(urls), shards, prev)
	case finish == (to >= 0):
		return usagef("give --to (a shard of the new map) or --finish")
	case !finish && to >= shards:
		return usagef("--to %d: the new map has shards 0 to %d", to, shards-1)
	case from >= len(urls) || from == to && from >= 0:
		return usagef("--from %d: another shard, below %d", from, len(urls))
	}
	s, err := processed.OpenSharded(ctx, urls, processed.Config{Schema: db.schema, Table: db.table}, processed.ShardedConfig{
		Map:      processed.ShardMap{Name: name, Shards: shards},
		Previous: &processed.ShardMap{Name: prevName, Shards: prev},
	})
	if err != nil {
		var ce *consumer.ConfigError
		if errors.As(err, &ce) {
			return usagef("%s", ce.Error())
		}
		return redactAll(err, urls)
	}
	defer s.Close()

	if finish {
		if err := s.FinishReshard(ctx); err != nil {
			return redactAll(err, urls)
		}
		fmt.Fprintf(e.stdout, "the reshard from %s/%d to %s/%d is finished: start the consumers without the old map\n", prevName, prev, name, shards)
		return nil
	}
	prog := newProgress(e.stderr)
	var total processed.MoveReport
	for i := range urls {
		if i == to || from >= 0 && i != from {
			continue
		}
		rep, err := s.MoveRows(ctx, i, to, func(r processed.MoveReport) {
			prog.update("shard %d → %d: %d scanned, %d moved", i, to, r.Scanned, r.Moved)
		})
		prog.done()
		if err != nil {
			return redactAll(fmt.Errorf("move from shard %d: %w", i, err), urls)
		}
		fmt.Fprintf(e.stdout, "shard %d → %d: %d records scanned, %d moved (%d were there already), %d without a shard key left\n",
			i, to, rep.Scanned, rep.Moved, rep.Present, rep.Unkeyed)
		total.Scanned, total.Moved, total.Present, total.Unkeyed = total.Scanned+rep.Scanned, total.Moved+rep.Moved, total.Present+rep.Present, total.Unkeyed+rep.Unkeyed
	}
	fmt.Fprintf(e.stdout, "moved %d records to shard %d, each checked there before its delete; %d without a shard key stay until purged\n", total.Moved, to, total.Unkeyed)
	return nil
}

// redactAll masks the passwords of urls in err.
func redactAll(err error, urls []string) error {
	for _, u := range urls {
		err = redact.Error(err, u)
	}
	return err
}
