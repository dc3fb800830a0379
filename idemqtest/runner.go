package idemqtest

import (
	"fmt"
	"runtime"
	"strings"
	"sync"
	"testing"
)

// tb is what the cases need from a test: the part of *testing.T they use,
// with Run taking a tb, so that Check (and the kit's own tests) can run a
// suite under a collector instead of the real test.
type tb interface {
	Helper()
	Errorf(format string, args ...any)
	Fatalf(format string, args ...any)
	Logf(format string, args ...any)
	Skipf(format string, args ...any)
	Failed() bool
	Run(name string, f func(tb)) bool
}

// stdT adapts *testing.T.
type stdT struct{ *testing.T }

func (t stdT) Run(name string, f func(tb)) bool {
	return t.T.Run(name, func(t *testing.T) { f(stdT{t}) })
}

// Result is the outcome of one case, as Check reports it.
type Result struct {
	// Case is the case's name, the name of its subtest under Run.
	Case string
	// Failed and Skipped say how the case ended; neither means it passed.
	Failed, Skipped bool
	// Messages are the case's failure messages, or its skip reason.
	Messages []string
}

// String is "name: ok", "name: SKIP: reason" or "name: FAIL:" followed by
// the messages.
func (r Result) String() string {
	switch {
	case r.Failed:
		return r.Case + ": FAIL:\n" + strings.Join(r.Messages, "\n")
	case r.Skipped:
		return r.Case + ": SKIP: " + strings.Join(r.Messages, "; ")
	}
	return r.Case + ": ok"
}

// collector is a tb that records what happens instead of failing a test.
type collector struct {
	name    string
	mu      sync.Mutex
	res     Result
	results *[]Result // the root's list; children append to it
	logs    []string
}

func newCollector(name string) *collector {
	return &collector{name: name, res: Result{Case: name}, results: new([]Result)}
}

func (c *collector) Helper() {}

func (c *collector) Errorf(format string, args ...any) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.res.Failed = true
	c.res.Messages = append(c.res.Messages, fmt.Sprintf(format, args...))
}

func (c *collector) Fatalf(format string, args ...any) {
	c.Errorf(format, args...)
	runtime.Goexit()
}

func (c *collector) Logf(format string, args ...any) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.logs = append(c.logs, fmt.Sprintf(format, args...))
}

func (c *collector) Skipf(format string, args ...any) {
	c.mu.Lock()
	c.res.Skipped = true
	c.res.Messages = append(c.res.Messages, fmt.Sprintf(format, args...))
	c.mu.Unlock()
	runtime.Goexit()
}

func (c *collector) Failed() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.res.Failed
}

// Run runs f as a child case, in its own goroutine so that Fatalf and
// Skipf can end it, and records its result.
func (c *collector) Run(name string, f func(tb)) bool {
	child := &collector{name: name, res: Result{Case: name}, results: c.results}
	c.do(child, f)
	*c.results = append(*c.results, child.res)
	if child.res.Failed {
		c.mu.Lock()
		c.res.Failed = true
		c.mu.Unlock()
	}
	return !child.res.Failed
}

// do runs f on c's child in a goroutine and waits for it.
func (c *collector) do(child *collector, f func(tb)) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer func() {
			if v := recover(); v != nil {
				child.Errorf("panic: %v", v)
			}
		}()
		f(child)
	}()
	<-done
}
