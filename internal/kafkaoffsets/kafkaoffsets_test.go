package kafkaoffsets

import "testing"

func entries(p *Partition, offsets ...int64) []*Entry {
	es := make([]*Entry, len(offsets))
	for i, off := range offsets {
		es[i] = &Entry{Offset: off, Epoch: int32(off % 3), State: Out}
		p.Add(es[i])
	}
	return es
}

func wantDue(t *testing.T, p *Partition, off int64, ok bool) {
	t.Helper()
	got, due := p.Due()
	if due != ok || (ok && got.Offset != off) {
		t.Fatalf("Due = %+v, %v; want offset %d, %v", got, due, off, ok)
	}
}

// TestContiguous: the commit point moves only past acked entries at the
// head, never past an unacked one, and carries the epoch of the entry
// before it.
func TestContiguous(t *testing.T) {
	p := New()
	wantDue(t, &p, 0, false)
	es := entries(&p, 10, 11, 12, 13)
	if n := p.Ack(es[2]); n != 0 {
		t.Fatalf("ack of 12 before 10: %d done", n)
	}
	wantDue(t, &p, 0, false)
	if n := p.Ack(es[1]); n != 0 {
		t.Fatalf("ack of 11 before 10: %d done", n)
	}
	if n := p.Ack(es[0]); n != 3 || p.Len() != 1 {
		t.Fatalf("ack of 10: %d done, %d pending; want 3, 1", n, p.Len())
	}
	got, _ := p.Due()
	if got != (Offset{Offset: 13, Epoch: 12 % 3}) {
		t.Fatalf("commit point %+v, want 13 with the epoch of 12", got)
	}
	p.Committed(13)
	wantDue(t, &p, 0, false)
	p.Committed(5) // an older commit answered late changes nothing
	wantDue(t, &p, 0, false)
	if n := p.Ack(es[3]); n != 1 || p.Len() != 0 {
		t.Fatalf("ack of 13: %d done, %d pending", n, p.Len())
	}
	wantDue(t, &p, 14, true)
}

// TestControl: a marker with nothing pending moves the commit point at
// once; behind an unacked entry it waits, and counts as pending.
func TestControl(t *testing.T) {
	p := New()
	if p.Control(4, 1) {
		t.Fatal("marker with nothing pending: pending")
	}
	wantDue(t, &p, 5, true)
	if p.Control(2, 1) { // an older marker does not move it back
		t.Fatal("older marker: pending")
	}
	wantDue(t, &p, 5, true)
	es := entries(&p, 5)
	if !p.Control(6, 1) || p.Len() != 2 {
		t.Fatalf("marker behind an unacked entry: %d pending, want 2", p.Len())
	}
	wantDue(t, &p, 5, true)
	if n := p.Ack(es[0]); n != 2 {
		t.Fatalf("ack of 5: %d done, want 2 (with the marker)", n)
	}
	wantDue(t, &p, 7, true)
}

// TestRelease: releasing abandons the queued entries only, and forgets
// them all.
func TestRelease(t *testing.T) {
	p := New()
	es := entries(&p, 1, 2, 3)
	es[0].State, es[2].State = Queued, Acked
	if n := p.Release(); n != 3 || p.Len() != 0 {
		t.Fatalf("Release = %d, %d pending; want 3, 0", n, p.Len())
	}
	if es[0].State != Abandoned || es[1].State != Out || es[2].State != Acked {
		t.Fatalf("states after Release: %v %v %v", es[0].State, es[1].State, es[2].State)
	}
	wantDue(t, &p, 0, false)
}
