//go:build unix

package chaos

import (
	"os"
	"syscall"
)

// killGroup sends SIGKILL to the process group led by pid.
func killGroup(pid int) { _ = syscall.Kill(-pid, syscall.SIGKILL) }

// killSelf sends this process SIGKILL: it dies at once, running nothing.
func killSelf() { _ = syscall.Kill(os.Getpid(), syscall.SIGKILL) }
