// Package kafkaoffsets is the offset bookkeeping that brokers/kafka's and
// brokers/franz's Sources share: per partition, the records fetched and
// not yet committable, in offset order, and the commit point, which is one
// past the highest offset below which every record is acked.
//
// Nothing here is safe for concurrent use: each Source guards its
// partitions with its own mutex.
package kafkaoffsets

// State is where an Entry is in its life.
type State uint8

// Entry states.
const (
	Queued    State = iota // fetched or requeued, not handed out
	Out                    // handed out, not yet settled
	Acked                  // acked: committable once every earlier entry is
	Abandoned              // its partition or generation ended before it was acked
)

// Entry is one fetched record of a partition. A Source embeds it in its own
// entries.
type Entry struct {
	Offset int64
	Epoch  int32 // the record's leader epoch, or -1 if unknown
	State  State
}

// Offset is a commit point: the next offset to read, with the leader epoch
// of the record before it (-1 if unknown).
type Offset struct {
	Offset int64
	Epoch  int32
}

// Partition tracks one partition's pending entries and commit point. Use
// New to make one.
type Partition struct {
	// pending holds the entries in offset order, from the first one that
	// is not yet acked.
	pending   []*Entry
	commitTo  Offset // one past the highest contiguous acked; Offset -1 if none
	committed int64  // last offset committed, or -1
}

// New returns a Partition with nothing pending or committed.
func New() Partition {
	return Partition{commitTo: Offset{Offset: -1, Epoch: -1}, committed: -1}
}

// Add appends a fetched entry, whose offset is above every pending one.
func (p *Partition) Add(e *Entry) { p.pending = append(p.pending, e) }

// Len returns the number of pending entries: fetched and not yet
// committable.
func (p *Partition) Len() int { return len(p.pending) }

// Control accounts for a transaction marker at offset, which is never
// handed out: it counts as acked, so the commit point moves past it once
// every earlier entry is acked. It returns true if the marker is now
// pending behind an unacked entry (and so counts in Len until then), false
// if the commit point moved past it at once.
func (p *Partition) Control(offset int64, epoch int32) (pending bool) {
	if len(p.pending) == 0 {
		if offset+1 > p.commitTo.Offset {
			p.commitTo = Offset{Offset: offset + 1, Epoch: epoch}
		}
		return false
	}
	p.pending = append(p.pending, &Entry{Offset: offset, Epoch: epoch, State: Acked})
	return true
}

// Ack marks e, one of the pending entries, acked, and moves the commit
// point past the acked entries at the head. It returns how many entries
// that made committable: the drop in Len.
func (p *Partition) Ack(e *Entry) (done int) {
	e.State = Acked
	n := 0
	for n < len(p.pending) && p.pending[n].State == Acked {
		p.commitTo = Offset{Offset: p.pending[n].Offset + 1, Epoch: p.pending[n].Epoch}
		p.pending[n] = nil
		n++
	}
	if n > 0 {
		p.pending = p.pending[n:]
	}
	return n
}

// Due returns the commit point and true if it is past the last offset
// committed.
func (p *Partition) Due() (Offset, bool) {
	return p.commitTo, p.commitTo.Offset > p.committed
}

// Committed notes that offset was committed.
func (p *Partition) Committed(offset int64) {
	if offset > p.committed {
		p.committed = offset
	}
}

// Release abandons the entries not handed out, forgets every pending
// entry, and returns how many there were: the partition is no longer this
// member's.
func (p *Partition) Release() int {
	n := len(p.pending)
	for _, e := range p.pending {
		if e.State == Queued {
			e.State = Abandoned
		}
	}
	p.pending = nil
	return n
}
