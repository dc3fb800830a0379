package consumer

import (
	"context"
	"time"

	"github.com/idemq/idemq/consumer/dedup"
)

// durabilityReporter is a Store that reads the Durability of its commits
// (see dedup.Store).
type durabilityReporter interface {
	Durability(ctx context.Context) (dedup.Durability, error)
}

// durabilityTimeout bounds Run's read of the Durability.
const durabilityTimeout = 5 * time.Second

// checkDurability reads the Store's Durability, if it reports one, and
// logs it: a warning for each way a failover can lose acked messages, or
// commits stall.
func (r *Runtime) checkDurability(ctx context.Context) {
	ds, ok := r.cfg.Store.(durabilityReporter)
	if !ok || ctx.Err() != nil {
		return
	}
	dctx, cancel := context.WithTimeout(ctx, durabilityTimeout)
	defer cancel()
	d, err := ds.Durability(dctx)
	if err != nil {
		r.log.Warn("idemq: cannot read the database's replication state, so cannot tell how many nodes hold a commit before its ack", "error", err)
		return
	}
	attrs := []any{"nodes", d.Nodes, "synchronous_commit", d.SynchronousCommit, "synchronous_standby_names", d.SynchronousStandbyNames}
	if d.Standby {
		r.log.Warn("idemq: the store's database is a standby (in recovery): no claim can commit there until it is promoted",
			append(attrs, "hint", "point the database URL at the primary; a multi-host URL with target_session_attrs=read-write finds it")...)
		return
	}
	w := d.Warnings()
	for _, msg := range w {
		r.log.Warn("idemq: "+msg, append(attrs, "durability", d.String())...)
	}
	if len(w) == 0 {
		r.log.Info("idemq: durability: "+d.String(), attrs...)
	}
}
