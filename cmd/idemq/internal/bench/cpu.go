package bench

import (
	"os"
	"runtime/metrics"
	"strconv"
	"strings"
	"time"
)

// cpuSnapshot is CPU time used so far: by this process (user and system),
// and by the whole machine (every process and the kernel, from /proc/stat;
// zero where there is none); and this process's heap allocations and
// garbage collections so far.
type cpuSnapshot struct {
	process time.Duration
	machine time.Duration
	alloc   uint64 // bytes allocated on the heap
	gcs     uint64 // completed garbage collection cycles
}

// The runtime/metrics samples a cpuSnapshot reads.
const (
	metricAllocBytes = "/gc/heap/allocs:bytes"
	metricGCCycles   = "/gc/cycles/total:gc-cycles"
)

func cpuNow() cpuSnapshot {
	s := []metrics.Sample{{Name: metricAllocBytes}, {Name: metricGCCycles}}
	metrics.Read(s)
	return cpuSnapshot{process: processCPU(), machine: machineCPU(), alloc: metricUint(s[0]), gcs: metricUint(s[1])}
}

// metricUint is a sample's value, or 0 if this Go has no such metric.
func metricUint(s metrics.Sample) uint64 {
	if s.Value.Kind() != metrics.KindUint64 {
		return 0
	}
	return s.Value.Uint64()
}

// heapPerMessage returns the heap bytes allocated since s per message and
// the garbage collections completed since s.
func (s cpuSnapshot) heapPerMessage(n int) (bytes float64, gcs uint64) {
	now := cpuNow()
	if n > 0 && now.alloc > s.alloc {
		bytes = float64(now.alloc-s.alloc) / float64(n)
	}
	if now.gcs > s.gcs {
		gcs = now.gcs - s.gcs
	}
	return bytes, gcs
}

// perMessage returns the CPU used since s, in microseconds per message, for
// the process and the machine (0 if unknown).
func (s cpuSnapshot) perMessage(n int) (process, machine float64) {
	if n <= 0 {
		return 0, 0
	}
	now := cpuNow()
	us := func(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) / float64(n) }
	if s.process > 0 && now.process > s.process {
		process = us(now.process - s.process)
	}
	if s.machine > 0 && now.machine > s.machine {
		machine = us(now.machine - s.machine)
	}
	return process, machine
}

// machineCPU sums the busy time of every CPU in /proc/stat's first line:
// user, nice, system, irq, softirq and steal (not idle or iowait).
func machineCPU() time.Duration {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 9 || f[0] != "cpu" {
		return 0
	}
	var ticks int64
	for _, i := range []int{1, 2, 3, 6, 7, 8} { // user nice system irq softirq steal
		v, err := strconv.ParseInt(f[i], 10, 64)
		if err != nil {
			return 0
		}
		ticks += v
	}
	// USER_HZ is 100 on every Linux configuration Go supports.
	return time.Duration(ticks) * 10 * time.Millisecond
}
