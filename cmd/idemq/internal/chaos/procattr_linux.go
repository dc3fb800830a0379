package chaos

import "syscall"

// childAttr makes a child process die with the harness (Linux's
// parent-death signal), in its own process group if group is set.
func childAttr(group bool) *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: group, Pdeathsig: syscall.SIGKILL}
}
