package consumer

import (
	"context"
	"fmt"
	"strings"
	"time"
)

// Durability is what an ack rests on: how many database servers hold a
// message's commit when its COMMIT returns, which is when the runtime acks.
// A Store with a Durability method (see Store) reads it; Run logs it when it
// starts, with a warning when a failover can lose acked messages, and
// `idemq status` prints it (its String).
type Durability struct {
	// Nodes is how many servers hold a commit when its COMMIT returns:
	// this one, plus the synchronous standbys a COMMIT waits for, which
	// SynchronousStandbyNames names (FIRST n or ANY n of them; one, for a
	// plain list). 0 on a standby.
	Nodes int
	// Quorum is true when SynchronousStandbyNames asks for ANY n: a COMMIT
	// waits for any n of the listed standbys, not for the first n.
	Quorum bool
	// SynchronousCommit is the synchronous_commit the claims' transactions
	// commit with: remote_write, on or remote_apply (the synchronous
	// standbys have written, flushed or applied the commit when it
	// returns; without them, all three wait for this server's flush).
	SynchronousCommit string
	// SynchronousStandbyNames is the server's synchronous_standby_names:
	// "" when no COMMIT waits for a standby.
	SynchronousStandbyNames string
	// Standby is true when the server is itself a standby (in recovery):
	// it takes no writes, so no claim commits there.
	Standby bool
	// Synchronous and Asynchronous name the physical standbys streaming
	// from the server (their application_name), by their sync_state in
	// pg_stat_replication: sync and quorum ones confirm commits; async and
	// potential ones do not, so a failover to one of them can lose acked
	// messages.
	Synchronous, Asynchronous []string
	// Unknown counts the standbys whose sync_state the Store's role may
	// not read (pg_stat_replication shows it to superusers and members of
	// pg_read_all_stats) while SynchronousStandbyNames is set; without it,
	// every standby is asynchronous.
	Unknown int
}

// durabilityReporter is a Store that reads the Durability of its commits
// (see Store).
type durabilityReporter interface {
	Durability(ctx context.Context) (Durability, error)
}

// durabilityTimeout bounds Run's read of the Durability.
const durabilityTimeout = 5 * time.Second

// String says in words what a commit rests on when the runtime acks, such
// as "a commit is on 2 nodes before the ack (this primary and synchronous
// standby s1; synchronous_commit=on)".
func (d Durability) String() string {
	if d.Standby {
		return "none: this server is a standby (in recovery), where no claim can commit; the database URL must reach the primary"
	}
	var b strings.Builder
	fmt.Fprintf(&b, "a commit is on %s before the ack (", countNoun(d.Nodes, "node", "nodes"))
	want := d.Nodes - 1
	switch {
	case want <= 0 && len(d.Synchronous)+len(d.Asynchronous)+d.Unknown == 0:
		b.WriteString("this server; no standby streams from it")
	case want <= 0:
		b.WriteString("this primary")
	case d.Quorum:
		fmt.Fprintf(&b, "this primary and any %d of the quorum standbys%s", want, standbyList(d.Synchronous, " "))
		if len(d.Synchronous) > want {
			b.WriteString(", so a failover must promote the most advanced")
		}
	default:
		fmt.Fprintf(&b, "this primary and %s%s", countNoun(want, "synchronous standby", "synchronous standbys"), standbyList(d.Synchronous, ", "))
	}
	if want > 0 {
		fmt.Fprintf(&b, "; synchronous_commit=%s", d.SynchronousCommit)
		switch d.SynchronousCommit {
		case "remote_write":
			b.WriteString(": they have written it, not flushed it")
		case "remote_apply":
			b.WriteString(": they have applied it")
		}
	}
	for _, w := range d.warnings() {
		b.WriteString("; " + w)
	}
	if d.Unknown > 0 {
		fmt.Fprintf(&b, "; %s whose sync_state this role cannot read (grant it pg_read_all_stats)",
			countNoun(d.Unknown, "standby streams", "standbys stream"))
	}
	b.WriteString(")")
	return b.String()
}

// warnings says what, in d, can lose acked messages or stall commits: Run
// logs each as a warning.
func (d Durability) warnings() []string {
	if d.Standby {
		return nil // String says it; the warning is Run's own
	}
	var w []string
	if n := len(d.Asynchronous); n > 0 {
		w = append(w, fmt.Sprintf("%s%s: a failover to %s can lose acked messages",
			countNoun(n, "standby streams asynchronously", "standbys stream asynchronously"), standbyList(d.Asynchronous, ", "), pluralNoun(n, "it", "one of them")))
	}
	if want := d.Nodes - 1; want > 0 && d.Unknown == 0 && len(d.Synchronous) < want {
		w = append(w, fmt.Sprintf("only %d of the %d synchronous standbys a COMMIT waits for %s connected: COMMITs wait until enough are",
			len(d.Synchronous), want, pluralNoun(len(d.Synchronous), "is", "are")))
	}
	return w
}

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
	w := d.warnings()
	for _, msg := range w {
		r.log.Warn("idemq: "+msg, append(attrs, "durability", d.String())...)
	}
	if len(w) == 0 {
		r.log.Info("idemq: durability: "+d.String(), attrs...)
	}
}

// countNoun renders "1 node", "2 nodes".
func countNoun(n int, one, many string) string {
	return fmt.Sprintf("%d %s", n, pluralNoun(n, one, many))
}

func pluralNoun(n int, one, many string) string {
	if n == 1 {
		return one
	}
	return many
}

// standbyList renders standby names after sep, or nothing without any.
func standbyList(ns []string, sep string) string {
	if len(ns) == 0 {
		return ""
	}
	return sep + strings.Join(ns, ", ")
}
