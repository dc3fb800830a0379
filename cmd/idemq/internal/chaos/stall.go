package chaos

import (
	"fmt"
	"slices"
	"sort"
	"time"
)

// apply is one effect row: a message applied by a worker slot at t (unix
// nanoseconds, the database's clock_timestamp() when the effect was
// written, inside the message's transaction).
type apply struct {
	id   string
	slot int
	t    int64
}

// Stall is the longest time without progress while messages were
// outstanding: a message the broker confirmed is outstanding from the
// moment the workload's schedule had it published first until its first
// effect (or until the end, if it has none), so that a producer stuck on a
// dead node, publishing nothing, counts as much as a consumer; ids never
// confirmed are left out.
// Overall, progress is any apply.
//
// A worker slot stalls when it applies nothing while messages keep coming:
// its longest gap between applies within the publishing window, from the
// first message due to the last publish confirmed, during which a message
// arrives every fraction of a second and the broker spreads them over the
// consumers. That shows one consumer stuck on a dead node even while the
// others absorb its share, and the queue never waits.
type Stall struct {
	// Max is the longest gap overall, and MaxEnd when it ended (unix
	// nanoseconds).
	Max    time.Duration
	MaxEnd int64
	// SlotMax is the longest gap of any one slot: Slot's, ending at
	// SlotEnd.
	SlotMax time.Duration
	Slot    int
	SlotEnd int64
	// Gaps (slot -1) and SlotGaps are every gap of more than
	// longSlotGap, overall and per slot, which a bound that depends on
	// the time of the gap checks one by one.
	Gaps     []SlotGap `json:",omitempty"`
	SlotGaps []SlotGap `json:",omitempty"`
}

// SlotGap is a time [From, To] (unix nanoseconds) in which worker slot
// Slot applied nothing while messages were being published, or (Slot -1)
// no message was applied while one waited.
type SlotGap struct {
	Slot     int
	From, To int64
}

// longSlotGap is the shortest gap Stall.Gaps and Stall.SlotGaps list:
// below every StallBound, so that each gap over a bound is listed.
const longSlotGap = 5 * time.Second

// computeStall measures the stalls of a run whose confirmed ids were first
// due at waiting and applied as applies say, up to end, and those of worker
// slots 0..slots-1 within the publishing window [from, to] (unix
// nanoseconds).
func computeStall(waiting map[string]int64, applies []apply, slots int, from, to, end int64) Stall {
	first := map[string]int64{}
	for _, a := range applies {
		if t, ok := first[a.id]; !ok || a.t < t {
			first[a.id] = a.t
		}
	}
	// The periods during which some message was outstanding.
	type period struct{ from, to int64 }
	var ps []period
	for id, c := range waiting {
		a, ok := first[id]
		if !ok {
			a = end
		}
		if a > c {
			ps = append(ps, period{c, a})
		}
	}
	slices.SortFunc(ps, func(a, b period) int {
		switch {
		case a.from < b.from:
			return -1
		case a.from > b.from:
			return 1
		}
		return 0
	})
	var busy []period
	for _, p := range ps {
		if n := len(busy); n > 0 && p.from <= busy[n-1].to {
			busy[n-1].to = max(busy[n-1].to, p.to)
			continue
		}
		busy = append(busy, p)
	}

	// longest returns the longest gap, and its end, between the times
	// (sorted) and the bounds of the busy periods, and every gap longer
	// than longSlotGap (as slot -1).
	longest := func(times []int64) (time.Duration, int64, []SlotGap) {
		var best, bestEnd int64
		var long []SlotGap
		gap := func(from, to int64) {
			if g := to - from; g > best {
				best, bestEnd = g, to
			}
			if time.Duration(to-from) > longSlotGap {
				long = append(long, SlotGap{Slot: -1, From: from, To: to})
			}
		}
		for _, p := range busy {
			prev := p.from
			i := sort.Search(len(times), func(i int) bool { return times[i] > p.from })
			for ; i < len(times) && times[i] <= p.to; i++ {
				gap(prev, times[i])
				prev = times[i]
			}
			gap(prev, p.to)
		}
		return time.Duration(best), bestEnd, long
	}
	all := make([]int64, len(applies))
	bySlot := make([][]int64, slots)
	for i, a := range applies {
		all[i] = a.t
		if a.slot >= 0 && a.slot < slots {
			bySlot[a.slot] = append(bySlot[a.slot], a.t)
		}
	}
	slices.Sort(all)
	var st Stall
	st.Max, st.MaxEnd, st.Gaps = longest(all)
	for slot, ts := range bySlot {
		slices.Sort(ts)
		prev := from
		for _, t := range append(ts, to) {
			if t < from || t > to {
				continue
			}
			g := time.Duration(t - prev)
			if g > st.SlotMax {
				st.SlotMax, st.Slot, st.SlotEnd = g, slot, t
			}
			if g > longSlotGap {
				st.SlotGaps = append(st.SlotGaps, SlotGap{Slot: slot, From: prev, To: t})
			}
			prev = t
		}
	}
	return st
}

// longestGap returns the longest gap between consecutive times (sorted or
// not).
func longestGap(times []int64) time.Duration {
	ts := slices.Clone(times)
	slices.Sort(ts)
	var best int64
	for i := 1; i < len(ts); i++ {
		best = max(best, ts[i]-ts[i-1])
	}
	return time.Duration(best)
}

// outageDuring returns the longest part of [from, to] that lies between
// two consecutive confirmed publishes (confirms, unix nanoseconds, in any
// order): how long the cluster took no publish during that time, as the
// publisher saw it.
func outageDuring(confirms []int64, from, to int64) time.Duration {
	ts := slices.Clone(confirms)
	slices.Sort(ts)
	var best int64
	for i := 1; i < len(ts); i++ {
		best = max(best, min(ts[i], to)-max(ts[i-1], from))
	}
	return time.Duration(best)
}

// holdStalls checks every long gap of st against its bound: stallBound of
// s and of the time within the gap without a confirmed publish (confirms,
// unix nanoseconds; start is the run's, for the messages). It returns the
// bounds the longest gap overall and the longest of a worker slot were
// held to, and a failure for the first gap over its bound of each kind.
func holdStalls(s Scenario, st Stall, confirms []int64, start int64) (maxBound, slotBound time.Duration, failures []string) {
	bound := func(from, to int64) (time.Duration, time.Duration) {
		outage := outageDuring(confirms, from, to)
		return stallBound(s, outage), outage
	}
	at := func(end int64) time.Duration { return time.Duration(end - start).Round(100 * time.Millisecond) }
	for _, g := range st.Gaps {
		d := time.Duration(g.To - g.From)
		if b, outage := bound(g.From, g.To); d > b {
			failures = append(failures, fmt.Sprintf("no message applied for %s (ending at +%s) while messages waited, more than the bound %s (no publish was confirmed for %s of that time)",
				d.Round(time.Millisecond), at(g.To), b.Round(100*time.Millisecond), outage.Round(time.Millisecond)))
			break
		}
	}
	for _, g := range st.SlotGaps {
		d := time.Duration(g.To - g.From)
		if b, outage := bound(g.From, g.To); d > b {
			failures = append(failures, fmt.Sprintf("worker slot %d applied nothing for %s (ending at +%s) while messages were being published, more than the bound %s (no publish was confirmed for %s of that time)",
				g.Slot, d.Round(time.Millisecond), at(g.To), b.Round(100*time.Millisecond), outage.Round(time.Millisecond)))
			break
		}
	}
	maxBound, _ = bound(st.MaxEnd-int64(st.Max), st.MaxEnd)
	slotBound, _ = bound(st.SlotEnd-int64(st.SlotMax), st.SlotEnd)
	return maxBound, slotBound, failures
}
