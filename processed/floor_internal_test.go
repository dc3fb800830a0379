package processed

import (
	"testing"
	"time"
)

// TestFloorFor: the floor is the end of the run of contiguous range
// partitions that holds now; with none holding now, the upper bound of the
// last one before it; with none before it either, none.
func TestFloorFor(t *testing.T) {
	at := func(h int) *time.Time {
		v := time.Date(2026, 12, 2, 0, 0, 0, 0, time.UTC).Add(time.Duration(h) * time.Hour)
		return &v
	}
	part := func(lo, hi int) partitionInfo { return partitionInfo{name: "p", lower: at(lo), upper: at(hi)} }
	legacy := partitionInfo{name: "legacy", upper: at(2)}
	def := partitionInfo{name: "default"}
	for _, c := range []struct {
		name    string
		now     int
		parts   []partitionInfo
		floor   *time.Time
		present bool
	}{
		{"a run ahead", 3, []partitionInfo{def, part(4, 5), part(2, 3), part(3, 4)}, at(5), true},
		{"a gap ahead ends the run", 3, []partitionInfo{part(2, 3), part(3, 4), part(5, 6), def}, at(4), true},
		{"from the legacy partition", 1, []partitionInfo{legacy, part(2, 3), def}, at(3), true},
		{"now in a gap", 4, []partitionInfo{part(2, 3), part(3, 4), part(5, 6), def}, at(4), false},
		{"now past every partition", 9, []partitionInfo{part(2, 3), def}, at(3), false},
		{"now before every partition", 1, []partitionInfo{part(2, 3), def}, nil, false},
		{"no range partition", 1, []partitionInfo{def}, nil, false},
	} {
		floor, present := floorFor(*at(c.now), c.parts)
		if present != c.present || (floor == nil) != (c.floor == nil) || floor != nil && !floor.Equal(*c.floor) {
			t.Errorf("%s: floorFor = %v, %v; want %v, %v", c.name, floor, present, c.floor, c.present)
		}
	}
}

// TestFloorDue: a floor is set when there is none, raised when the run
// grows, kept when unchanged, and lowered only when no range partition
// holds the present.
func TestFloorDue(t *testing.T) {
	at := func(h int) *time.Time {
		v := time.Date(2026, 12, 2, 0, 0, 0, 0, time.UTC).Add(time.Duration(h) * time.Hour)
		return &v
	}
	part := func(lo, hi int) partitionInfo { return partitionInfo{name: "p", lower: at(lo), upper: at(hi)} }
	run := []partitionInfo{part(2, 3), part(3, 4), part(4, 5)}
	for _, c := range []struct {
		name  string
		old   *time.Time
		now   int
		parts []partitionInfo
		due   bool
	}{
		{"none yet", nil, 3, run, true},
		{"unchanged", at(5), 3, run, false},
		{"the run grew", at(4), 3, run, true},
		{"not lowered while the present is held", at(7), 3, run, false},
		{"lowered once the present is in a gap", at(7), 6, run, true},
		{"none, and no partition before the present", nil, 1, run, false},
	} {
		if due := floorDue(c.old, *at(c.now), c.parts); due != c.due {
			t.Errorf("%s: floorDue = %v, want %v", c.name, due, c.due)
		}
	}
}
