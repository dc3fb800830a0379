package processed

import (
	"context"
	"strconv"
	"strings"

	"github.com/idemq/idemq/consumer/dedup"
)

// Durability is the optional Store method of that name (see
// dedup.Store): it reads how many
// servers hold a claim's commit when its COMMIT returns, which is when the
// runtime acks. It reads whether the server is a standby
// (pg_is_in_recovery), the synchronous_commit the claims commit with (the
// session's, from the server, database, role or URL, raised to on as
// BeginClaim raises it), synchronous_standby_names, and the physical
// standbys streaming from the server with their sync_state
// (pg_stat_replication; logical replication and base backups are left
// out). It needs no privilege; pg_stat_replication shows sync_state to
// superusers and members of pg_read_all_stats only, and the standbys it
// hides count as Unknown while synchronous_standby_names is set.
//
// It is the view from the server the store's connections reach, now: a
// failover, or a change of synchronous_standby_names, changes it.
func (s *Store) Durability(ctx context.Context) (dedup.Durability, error) {
	var d dedup.Durability
	if err := s.db.QueryRow(ctx, `SELECT pg_is_in_recovery(), current_setting('synchronous_commit'), current_setting('synchronous_standby_names')`).
		Scan(&d.Standby, &d.SynchronousCommit, &d.SynchronousStandbyNames); err != nil {
		return d, s.wrap("read the replication state", err)
	}
	d.SynchronousCommit = raisedSyncCommit(d.SynchronousCommit)
	if d.Standby {
		return d, nil
	}
	want, quorum := syncStandbys(d.SynchronousStandbyNames)
	d.Nodes, d.Quorum = 1+want, quorum
	// A physical walsender is connected to no database; a logical one
	// (a subscription, a change-data-capture client) is, and is no
	// standby to fail over to.
	rows, err := s.db.Query(ctx, `SELECT coalesce(r.application_name, ''), r.sync_state
FROM pg_stat_replication r
WHERE r.state IS DISTINCT FROM 'backup'
	AND NOT EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.pid = r.pid AND a.datid IS NOT NULL)
ORDER BY 1, r.pid`)
	if err != nil {
		return d, s.wrap("read pg_stat_replication", err)
	}
	defer rows.Close()
	for rows.Next() {
		var (
			name  string
			state *string
		)
		if err := rows.Scan(&name, &state); err != nil {
			return d, s.wrap("read pg_stat_replication", err)
		}
		switch {
		case state != nil && (*state == "sync" || *state == "quorum"):
			d.Synchronous = append(d.Synchronous, name)
		case state != nil || want == 0:
			// async, potential; or hidden, while no standby can be
			// synchronous.
			d.Asynchronous = append(d.Asynchronous, name)
		default:
			d.Unknown++
		}
	}
	if err := rows.Err(); err != nil {
		return d, s.wrap("read pg_stat_replication", err)
	}
	return d, nil
}

// raisedSyncCommit is the synchronous_commit a claim's transaction commits
// with when the session has v: raiseSyncCommit's choice.
func raisedSyncCommit(v string) string {
	if v == "off" || v == "local" {
		return "on"
	}
	return v
}

// syncStandbys reads synchronous_standby_names: how many synchronous
// standbys a COMMIT waits for, and whether any of them will do (ANY n, a
// quorum) rather than the first n connected by priority (FIRST n, a bare
// n, or a plain list, whose first connected name is the one). Postgres has
// checked the syntax; what does not parse counts as a plain list.
func syncStandbys(names string) (n int, quorum bool) {
	s := strings.TrimSpace(names)
	if s == "" {
		return 0, false
	}
	word := s[:len(s)-len(strings.TrimLeftFunc(s, isIdentChar))]
	switch strings.ToLower(word) {
	case "any":
		quorum, s = true, strings.TrimSpace(s[len(word):])
	case "first":
		s = strings.TrimSpace(s[len(word):])
	}
	digits := s[:len(s)-len(strings.TrimLeft(s, "0123456789"))]
	if digits != "" && strings.HasPrefix(strings.TrimSpace(s[len(digits):]), "(") {
		if n, err := strconv.Atoi(digits); err == nil && n > 0 {
			return n, quorum
		}
	}
	return 1, false
}

// isIdentChar reports whether c may be part of an unquoted standby name
// (synchronous_standby_names' scanner also takes bytes above 127).
func isIdentChar(c rune) bool {
	return c == '_' || c == '$' || c >= 0x80 || '0' <= c && c <= '9' || 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z'
}
