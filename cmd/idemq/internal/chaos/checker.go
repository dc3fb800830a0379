package chaos

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
)

// CheckInput is what the checker compares: sets of message ids taken from
// the producer and from the database after the run.
type CheckInput struct {
	// Confirmed are the ids with at least one publish the broker
	// confirmed.
	Confirmed map[string]bool
	// Attempted are the ids the producer tried to publish, confirmed or
	// not. An effect for an attempted but unconfirmed id is allowed (the
	// broker may have stored it without confirming); any other id is
	// unexpected.
	Attempted map[string]bool
	// Processed are the ids in processed_messages for the consumer.
	Processed map[string]bool
	// Effects counts the business-effect rows per id.
	Effects map[string]int
	// DeadLetters counts dead-letter rows per id. The workload has no
	// poison messages, so any is a finding.
	DeadLetters map[string]int
	// Aborted are the ids whose every publish was in a transaction the
	// broker definitely aborted: none of them may have an effect.
	Aborted map[string]bool
}

// Verdict is the checker's finding. Pass means zero lost, zero duplicate
// effects and zero unexpected effects (nor dead letters, nor a claim
// without its effect).
type Verdict struct {
	Confirmed int
	Processed int
	Effects   int // effect rows
	// Lost are confirmed ids without an effect.
	Lost []string
	// Duplicates are ids with more than one effect row.
	Duplicates []string
	// Unexpected are ids with an effect that the producer never tried
	// to publish.
	Unexpected []string
	// Inconsistent are ids whose dedup row and effect disagree: claimed
	// without an effect, or an effect without a claim.
	Inconsistent []string
	// DeadLettered are ids found in the dead-letter table.
	DeadLettered []string
	// Orphaned are outbox rows never published (chain scenarios).
	Orphaned []string `json:",omitempty"`
	// Aborted is the number of ids published only in aborted
	// transactions; AbortedApplied are those of them with an effect.
	Aborted        int
	AbortedApplied []string
}

// Pass reports whether the run kept the exactly-once promise.
func (v Verdict) Pass() bool {
	return len(v.Lost) == 0 && len(v.Duplicates) == 0 && len(v.Unexpected) == 0 &&
		len(v.Inconsistent) == 0 && len(v.DeadLettered) == 0 && len(v.AbortedApplied) == 0 && len(v.Orphaned) == 0
}

// Check compares the sets.
func Check(in CheckInput) Verdict {
	v := Verdict{Confirmed: len(in.Confirmed), Processed: len(in.Processed), Aborted: len(in.Aborted)}
	for id := range in.Confirmed {
		if in.Effects[id] == 0 {
			v.Lost = append(v.Lost, id)
		}
	}
	for id, n := range in.Effects {
		v.Effects += n
		if n > 1 {
			v.Duplicates = append(v.Duplicates, id)
		}
		if !in.Attempted[id] && !in.Confirmed[id] {
			v.Unexpected = append(v.Unexpected, id)
		}
		if n > 0 && !in.Processed[id] {
			v.Inconsistent = append(v.Inconsistent, id)
		}
		if n > 0 && in.Aborted[id] {
			v.AbortedApplied = append(v.AbortedApplied, id)
		}
	}
	for id := range in.Processed {
		if in.Effects[id] == 0 {
			v.Inconsistent = append(v.Inconsistent, id)
		}
	}
	for id, n := range in.DeadLetters {
		if n > 0 {
			v.DeadLettered = append(v.DeadLettered, id)
		}
	}
	for _, s := range [][]string{v.Lost, v.Duplicates, v.Unexpected, v.Inconsistent, v.DeadLettered, v.AbortedApplied} {
		slices.Sort(s)
	}
	return v
}

// receipt is one delivery a worker received.
type receipt struct {
	t    int64
	inc  incKey
	copy string
}

// incKey names one worker process: a slot and its incarnation.
type incKey struct{ slot, inc int }

// deliveryLog is what the workers' delivery logs say.
type deliveryLog struct {
	receipts  []receipt
	selfKills map[incKey]int64 // incarnation -> time of its K line
	exits     map[incKey]ExitReport
	slow      int              // slow handler calls started
	faults    map[string]int64 // faults the workers injected, by kind
}

// readLogs parses the delivery log of each incarnation.
func readLogs(paths map[incKey]string) (*deliveryLog, error) {
	dl := &deliveryLog{selfKills: map[incKey]int64{}, exits: map[incKey]ExitReport{}, faults: map[string]int64{}}
	for k, path := range paths {
		f, err := os.Open(path)
		if os.IsNotExist(err) {
			continue // killed before it opened its log
		}
		if err != nil {
			return nil, err
		}
		sc := bufio.NewScanner(f)
		sc.Buffer(make([]byte, 1<<20), 16<<20)
		for sc.Scan() {
			kind, rest, _ := strings.Cut(sc.Text(), " ")
			ts, rest, _ := strings.Cut(rest, " ")
			t, err := strconv.ParseInt(ts, 10, 64)
			if err != nil {
				continue // a line torn by SIGKILL
			}
			switch kind {
			case logReceived:
				fields := strings.Fields(rest)
				if len(fields) >= 2 {
					dl.receipts = append(dl.receipts, receipt{t: t, inc: k, copy: fields[0]})
				}
			case logSlow:
				dl.slow++
			case logFault:
				dl.faults[strings.TrimSpace(rest)]++
			case logSelfKill:
				dl.selfKills[k] = t
			case logExit:
				var r ExitReport
				if err := json.Unmarshal([]byte(rest), &r); err == nil {
					dl.exits[k] = r
				}
			}
		}
		err = sc.Err()
		f.Close()
		if err != nil {
			return nil, fmt.Errorf("chaos: read %s: %w", path, err)
		}
	}
	slices.SortFunc(dl.receipts, func(a, b receipt) int {
		switch {
		case a.t < b.t:
			return -1
		case a.t > b.t:
			return 1
		}
		return 0
	})
	return dl, nil
}

// Redeliveries summarises deliveries received more than once.
type Redeliveries struct {
	// Deliveries is the number of deliveries workers received.
	Deliveries int
	// Total is Deliveries minus the distinct publish copies received:
	// broker redeliveries (producer duplicates are separate copies).
	Total int
	// PerKill lists, for each killed process, how many of the copies it
	// had received were delivered again after it died.
	PerKill []int
	// Max and Mean summarise PerKill.
	Max  int
	Mean float64
}

// redeliveriesPerKill counts, for each killed incarnation, the copies it
// received whose next receipt, by another incarnation, came after the kill.
func redeliveriesPerKill(dl *deliveryLog, kills map[incKey]int64) Redeliveries {
	var r Redeliveries
	byCopy := map[string][]receipt{}
	for _, rc := range dl.receipts {
		byCopy[rc.copy] = append(byCopy[rc.copy], rc)
	}
	r.Deliveries = len(dl.receipts)
	r.Total = r.Deliveries - len(byCopy)
	perKill := map[incKey]int{}
	for k := range kills {
		perKill[k] = 0
	}
	for _, rs := range byCopy {
		// rs is in time order. For each killed incarnation that held
		// this copy, look for a receipt elsewhere after the kill.
		seen := map[incKey]bool{}
		for i, rc := range rs {
			tk, killed := kills[rc.inc]
			if !killed || seen[rc.inc] {
				continue
			}
			// Only the incarnation's last receipt of the copy counts.
			last := true
			for _, later := range rs[i+1:] {
				if later.inc == rc.inc {
					last = false
					break
				}
			}
			if !last {
				continue
			}
			for _, later := range rs[i+1:] {
				if later.inc != rc.inc && later.t >= tk {
					perKill[rc.inc]++
					seen[rc.inc] = true
					break
				}
			}
		}
	}
	sum := 0
	for _, n := range perKill {
		r.PerKill = append(r.PerKill, n)
		sum += n
		r.Max = max(r.Max, n)
	}
	slices.Sort(r.PerKill)
	if len(perKill) > 0 {
		r.Mean = float64(sum) / float64(len(perKill))
	}
	return r
}
