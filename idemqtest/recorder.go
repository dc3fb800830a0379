package idemqtest

import (
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
)

// Recorder is a fake of an out-of-process service: an HTTP server that
// answers every request with 200 OK and an empty JSON object, and records
// it. Every run's Env has a fresh one; a handler that calls a service (to
// send an email, charge a card) calls Env.Recorder.URL in the test instead.
// Its calls are part of the effect the kit compares, so a call that is
// repeated when a transaction is retried (a call out of process is not
// undone by a rollback: use an outbox) fails the cases that retry.
//
// A Recorder can also be used on its own, like httptest.Server.
type Recorder struct {
	// URL is the server's base URL, such as http://127.0.0.1:40123.
	URL string

	srv   *httptest.Server
	mu    sync.Mutex
	calls []Call
}

// Call is one request a Recorder received.
type Call struct {
	Method string `json:"method"`
	// Path is the request's path and query.
	Path string `json:"path"`
	Body string `json:"body,omitempty"`
}

// NewRecorder starts a Recorder. Close it when done.
func NewRecorder() *Recorder {
	r := &Recorder{}
	r.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		body, _ := io.ReadAll(req.Body)
		r.mu.Lock()
		r.calls = append(r.calls, Call{Method: req.Method, Path: req.URL.RequestURI(), Body: string(body)})
		r.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, "{}")
	}))
	r.URL = r.srv.URL
	return r
}

// Calls returns the requests received so far, in order.
func (r *Recorder) Calls() []Call {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]Call(nil), r.calls...)
}

// Close shuts the server down.
func (r *Recorder) Close() { r.srv.Close() }
