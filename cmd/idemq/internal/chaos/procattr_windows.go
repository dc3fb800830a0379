package chaos

import "syscall"

// childAttr has nothing to set on Windows; the chaos harness needs Unix
// signals and does not run there (its kills are approximations there).
func childAttr(bool) *syscall.SysProcAttr { return &syscall.SysProcAttr{} }
