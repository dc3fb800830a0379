//go:build unix && !linux

package chaos

import "syscall"

// childAttr puts a child process in its own process group if group is set.
// Outside Linux there is no parent-death signal: a child outlives a harness
// that is killed, until the harness's cleanup (or the operator) stops it.
func childAttr(group bool) *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: group}
}
