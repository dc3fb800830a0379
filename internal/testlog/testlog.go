// Package testlog captures slog output in tests, from any goroutine.
package testlog

import (
	"bytes"
	"log/slog"
	"sync"
)

// Buffer is an io.Writer that is safe for concurrent writes, and reads.
type Buffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

// Write appends p.
func (b *Buffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

// String returns everything written so far.
func (b *Buffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// New returns a text logger that logs level and above to a fresh Buffer.
func New(level slog.Level) (*slog.Logger, *Buffer) {
	b := &Buffer{}
	return slog.New(slog.NewTextHandler(b, &slog.HandlerOptions{Level: level})), b
}
