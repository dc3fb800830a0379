package chaos

import "os"

// killGroup kills the process pid (Windows has no process groups to signal).
func killGroup(pid int) {
	if p, err := os.FindProcess(pid); err == nil {
		_ = p.Kill()
	}
}

// killSelf ends this process at once, running no deferred calls.
func killSelf() { os.Exit(137) }
