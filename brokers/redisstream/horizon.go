package redisstream

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/idemq/idemq/consumer"
)

// RedeliveryHorizon implements the RedeliveryHorizon of consumer.Source: it returns the time
// the oldest entry the group could still deliver was added, read from its
// id (the milliseconds part of an id XADD generated): the older of the
// group's oldest pending entry (XPENDING: read by any consumer, live, dead
// or released by Close, and not acked) and the first entry after the
// group's last-delivered id (XINFO GROUPS, then XRANGE), which no consumer
// has read yet. With neither the horizon is zero: nothing is
// redeliverable. Without the group (deleted, or lost by a server restarted
// without persistence) it is the first entry after Config.StartID, where
// the Source creates the group again ("$": none); without the stream, zero.
//
// It asks the server each time, so it covers every consumer of the group.
// A pending entry trimmed or deleted from the stream holds the horizon
// back until a claim drops it from the group, although it cannot be
// delivered again. An entry cannot be applied before it was added; the
// horizon assumes ids XADD generated ("*", as Publisher does), whose time
// is the server's clock, up to the skew consumer.Config.HorizonMargin
// covers (an id given by the producer may carry any time). If the server
// cannot be asked, it returns the error, and the janitor does not purge.
func (s *Source) RedeliveryHorizon(ctx context.Context) (time.Time, bool, error) {
	fail := func(what string, err error) (time.Time, bool, error) {
		return time.Time{}, false, fmt.Errorf("redisstream: horizon of group %q on stream %q: %s: %w", s.cfg.Group, s.cfg.Stream, what, err)
	}
	if s.closed() {
		return fail("closed", consumer.ErrSourceClosed)
	}
	// The group's last-delivered id first, its pending entries then: an
	// entry delivered in between is past that id, so the XRANGE sees it.
	groups, err := s.rdb.XInfoGroups(ctx, s.cfg.Stream).Result()
	switch {
	case err != nil && strings.Contains(err.Error(), "no such key"):
		return time.Time{}, true, nil // no stream: nothing to deliver
	case err != nil:
		return fail("XINFO GROUPS", err)
	}
	last, found := s.cfg.StartID, false
	for _, g := range groups {
		if g.Name == s.cfg.Group {
			last, found = g.LastDeliveredID, true
			break
		}
	}
	var horizon time.Time
	older := func(id string) error {
		at := entryTime(id)
		if at.IsZero() {
			return fmt.Errorf("entry id %q carries no time", id)
		}
		if horizon.IsZero() || at.Before(horizon) {
			horizon = at
		}
		return nil
	}
	if found {
		p, err := s.rdb.XPending(ctx, s.cfg.Stream, s.cfg.Group).Result()
		if err != nil {
			return fail("XPENDING", err)
		}
		if p.Count > 0 {
			if err := older(p.Lower); err != nil {
				return fail("oldest pending entry", err)
			}
		}
	}
	if last != "$" {
		next, err := s.rdb.XRangeN(ctx, s.cfg.Stream, "("+last, "+", 1).Result()
		if err != nil {
			return fail("XRANGE after the last-delivered id "+last, err)
		}
		if len(next) > 0 {
			if err := older(next[0].ID); err != nil {
				return fail("first entry not yet delivered", err)
			}
		}
	}
	return horizon, true, nil
}
