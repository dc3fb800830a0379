package chaos

import (
	"slices"
	"strings"
	"testing"
	"time"
)

// TestComputeStall: overall, the longest gap without an apply counts only
// while a confirmed message waits (from when its first publish was due to
// its first effect), and a message never applied waits until the end; a
// worker slot's longest gap counts within the publishing window.
func TestComputeStall(t *testing.T) {
	s := int64(time.Second)
	waiting := map[string]int64{"a": 0, "b": 1 * s, "c": 2 * s, "d": 20 * s}
	applies := []apply{
		{"a", 0, 1 * s}, {"b", 1, 2 * s},
		// Nothing applied from 2s to 9s but b again at 5s (a duplicate
		// is still progress), while c waits.
		{"b", 1, 5 * s}, {"c", 0, 9 * s},
		// Nothing waits from 9s to 20s: no overall stall there.
		{"d", 1, 21 * s},
	}
	// Publishing from 0s to 22s.
	st := computeStall(waiting, applies, 3, 0, 22*s, 30*s)
	if st.Max != 4*time.Second || st.MaxEnd != 9*s {
		t.Errorf("overall: %s ending at %d, want 4s ending at 9s", st.Max, st.MaxEnd/s)
	}
	// Slot 2 never applied: the whole window.
	if st.SlotMax != 22*time.Second || st.Slot != 2 || st.SlotEnd != 22*s {
		t.Errorf("per slot: slot %d %s ending at %d, want slot 2 22s ending at 22s", st.Slot, st.SlotMax, st.SlotEnd/s)
	}
	// Two slots: slot 0 is idle from 9s to the end of the window, 13s;
	// slot 1 from 5s to 21s, 16s.
	st = computeStall(waiting, applies, 2, 0, 22*s, 30*s)
	if st.SlotMax != 16*time.Second || st.Slot != 1 || st.SlotEnd != 21*s {
		t.Errorf("per slot: slot %d %s ending at %d, want slot 1 16s ending at 21s", st.Slot, st.SlotMax, st.SlotEnd/s)
	}

	// An id never applied waits until the end.
	waiting["e"] = 22 * s
	st = computeStall(waiting, applies, 2, 0, 22*s, 30*s)
	if st.Max != 8*time.Second || st.MaxEnd != 30*s {
		t.Errorf("with a lost id: %s ending at %d, want 8s ending at 30s", st.Max, st.MaxEnd/s)
	}
	// An apply before the id was due (a publisher ahead of its schedule,
	// or a clock step) makes no period.
	st = computeStall(map[string]int64{"x": 5 * s}, []apply{{"x", 0, 4 * s}}, 1, 4*s, 4*s, 30*s)
	if st.Max != 0 || st.SlotMax != 0 {
		t.Errorf("apply before it was due: %+v", st)
	}
	if g := longestGap([]int64{5, 1, 2, 9}); g != 4 {
		t.Errorf("longestGap = %d, want 4", g)
	}
}

func TestStallBound(t *testing.T) {
	nats := Scenario{Broker: BrokerNATS, Cluster: true, StallBound: NATSClusterStallBound}
	rabbit := Scenario{Broker: BrokerRabbitMQ, Cluster: true, StallBound: ClusterStallBound}
	for _, c := range []struct {
		s      Scenario
		outage time.Duration
		want   time.Duration
	}{
		{nats, 5 * time.Second, NATSClusterStallBound},
		// The CI run whose cluster confirmed no publish for 20.4s while a
		// slot went 33.7s without an apply.
		{nats, 20400 * time.Millisecond, 40400 * time.Millisecond},
		{rabbit, 40 * time.Second, ClusterStallBound},
		// A producer or cluster stuck longer than any election excuses no
		// more than NATSElection.
		{nats, 90 * time.Second, NATSElection + NATSClientFailover},
	} {
		if got := stallBound(c.s, c.outage); got != c.want {
			t.Errorf("%s cluster, outage %s: slot bound %s, want %s", c.s.Broker, c.outage, got, c.want)
		}
	}
}

// TestOutageDuring: only the time without a confirmed publish that lies
// within a slot's gap lifts its bound: an election early in a run does
// not excuse a worker stuck later.
func TestOutageDuring(t *testing.T) {
	const s = int64(time.Second)
	// Publishes confirmed every second, except none from 10s to 36s.
	var confirms []int64
	for i := int64(0); i <= 60; i++ {
		if i <= 10 || i >= 36 {
			confirms = append(confirms, i*s)
		}
	}
	slices.Reverse(confirms) // in any order
	for _, c := range []struct {
		from, to int64
		want     time.Duration
	}{
		{5 * s, 40 * s, 26 * time.Second},  // the whole outage within the gap
		{20 * s, 50 * s, 16 * time.Second}, // its end
		{38 * s, 60 * s, time.Second},      // after it: a publish a second
		{12 * s, 14 * s, 2 * time.Second},  // within it
	} {
		if got := outageDuring(confirms, c.from, c.to); got != c.want {
			t.Errorf("outage during [%ds, %ds] = %s, want %s", c.from/s, c.to/s, got, c.want)
		}
	}
	// A slot stuck 35s after the outage fails; one whose gap held it passes.
	nats := Scenario{Broker: BrokerNATS, Cluster: true, StallBound: NATSClusterStallBound}
	if late := outageDuring(confirms, 37*s, 72*s); 35*time.Second <= stallBound(nats, late) {
		t.Errorf("a 35s gap after the outage passes its bound %s", stallBound(nats, late))
	}
	if held := outageDuring(confirms, 5*s, 40*s); 35*time.Second > stallBound(nats, held) {
		t.Errorf("a 35s gap holding the 26s outage fails its bound %s", stallBound(nats, held))
	}
}

// TestSlotGapsListed: every gap longer than longSlotGap, overall and per
// slot, is listed, not only the longest.
func TestSlotGapsListed(t *testing.T) {
	const s = int64(time.Second)
	applies := []apply{{"a", 0, 1 * s}, {"b", 0, 9 * s}, {"c", 1, 2 * s}, {"d", 1, 30 * s}, {"e", 0, 10 * s}}
	st := computeStall(map[string]int64{}, applies, 2, 0, 30*s, 30*s)
	want := []SlotGap{{0, 1 * s, 9 * s}, {0, 10 * s, 30 * s}, {1, 2 * s, 30 * s}}
	if !slices.Equal(st.SlotGaps, want) {
		t.Errorf("slot gaps %v, want %v", st.SlotGaps, want)
	}
	// Overall: x waits from 0s to its apply at 30s; applies at 1, 2, 9, 10.
	st = computeStall(map[string]int64{"x": 0}, append(applies, apply{"x", 0, 30 * s}), 2, 0, 30*s, 40*s)
	if want := []SlotGap{{-1, 2 * s, 9 * s}, {-1, 10 * s, 30 * s}}; !slices.Equal(st.Gaps, want) {
		t.Errorf("overall gaps %v, want %v", st.Gaps, want)
	}
}

// TestHoldStalls: the bound each long gap is held to, and the bounds the
// summary prints, are the ones that gap was checked against: for a NATS
// cluster, raised by the outage within the gap; not the scenario's 30s.
func TestHoldStalls(t *testing.T) {
	const s = int64(time.Second)
	// Publishes confirmed every second, except none from 10s to 30s.
	var confirms []int64
	for i := int64(0); i <= 80; i++ {
		if i <= 10 || i >= 30 {
			confirms = append(confirms, i*s)
		}
	}
	nats := Scenario{Broker: BrokerNATS, Cluster: true, StallBound: NATSClusterStallBound}
	// Overall, 34s without an apply holding the whole outage (bound 40s);
	// a slot's longest, 35.5s holding 14.5s of it (bound 34.5s), over it;
	// slot 3, 33s well after the outage (30s), is over it too and listed first.
	st := Stall{Max: 34 * time.Second, MaxEnd: 40 * s, SlotMax: 35500 * time.Millisecond, Slot: 1, SlotEnd: 51 * s,
		Gaps:     []SlotGap{{-1, 6 * s, 40 * s}},
		SlotGaps: []SlotGap{{3, 45 * s, 78 * s}, {1, 15500 * time.Millisecond.Nanoseconds(), 51 * s}}}
	maxBound, slotBound, failures := holdStalls(nats, st, confirms, 0)
	if maxBound != 40*time.Second || slotBound != 34500*time.Millisecond {
		t.Errorf("bounds %s overall, %s per slot; want 40s, 34.5s", maxBound, slotBound)
	}
	if len(failures) != 1 || !strings.Contains(failures[0], "worker slot 3 applied nothing for 33s (ending at +1m18s)") {
		t.Errorf("failures %q, want worker slot 3's alone (the first over its bound)", failures)
	}
	r := Result{StallBound: nats.StallBound, MaxStallBound: maxBound, SlotStallBound: slotBound, Stall: st}
	raised := "(bound 40s: the time in the gap without a confirmed publish, up to 26s, plus 20s)"
	if got := stallString(r); !strings.Contains(got, "34s overall while messages waited "+raised) ||
		!strings.Contains(got, "35.5s in worker slot 1 while messages were published (bound 34.5s:") {
		t.Errorf("summary %q names other bounds", got)
	}
	var md strings.Builder
	WriteMarkdown(&md, []Result{r})
	if !strings.Contains(md.String(), "34.0s / 35.5s (40s / 34.5s)") {
		t.Errorf("markdown row without both bounds:\n%s", md.String())
	}
	// Shown to a tenth of a second.
	r.SlotStallBound = 34512345678
	if got := stallString(r); !strings.Contains(got, "(bound 34.5s:") {
		t.Errorf("summary %q: a bound unrounded", got)
	}
	// A scenario without a raised bound prints its one bound, as before.
	rabbit := Scenario{Broker: BrokerRabbitMQ, Cluster: true, StallBound: ClusterStallBound}
	st = Stall{Max: 4 * time.Second, MaxEnd: 40 * s, SlotMax: 6 * time.Second, SlotEnd: 60 * s, SlotGaps: []SlotGap{{0, 54 * s, 60 * s}}}
	maxBound, slotBound, failures = holdStalls(rabbit, st, confirms, 0)
	r = Result{StallBound: rabbit.StallBound, MaxStallBound: maxBound, SlotStallBound: slotBound, Stall: st}
	if len(failures) != 0 || !strings.Contains(stallString(r), "4s overall while messages waited (bound 10s)") {
		t.Errorf("rabbit: failures %q, summary %q", failures, stallString(r))
	}
}
