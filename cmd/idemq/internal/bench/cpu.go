package bench

import (
	"os"
	"strconv"
	"strings"
	"time"
)

// cpuSnapshot is CPU time used so far: by this process (user and system),
// and by the whole machine (every process and the kernel, from /proc/stat;
// zero where there is none).
type cpuSnapshot struct {
	process time.Duration
	machine time.Duration
}

func cpuNow() cpuSnapshot {
	return cpuSnapshot{process: processCPU(), machine: machineCPU()}
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
