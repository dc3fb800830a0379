package chaos

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// CommitAction is what a Postgres-aware Proxy does with a COMMIT.
type CommitAction int

const (
	// CommitPass forwards the COMMIT normally.
	CommitPass CommitAction = iota
	// CommitResetAfter forwards the COMMIT to the server, then resets the
	// client's connection before the server's answer can reach it: the
	// transaction (most likely) committed, but the client cannot know.
	CommitResetAfter
	// CommitResetBefore resets the connection without forwarding the
	// COMMIT: the server rolls the transaction back.
	CommitResetBefore
)

// ProxyOptions configures a Proxy.
type ProxyOptions struct {
	// Postgres makes the proxy parse the frontend protocol so that
	// OnCommit can act on each simple-protocol COMMIT.
	Postgres bool
	// OnCommit, with Postgres, decides the fate of each COMMIT. Defaults
	// to always CommitPass.
	OnCommit func() CommitAction
}

// ProxyStats counts what a Proxy did.
type ProxyStats struct {
	Conns, Commits, ResetsAfter, ResetsBefore, Dropped int64
}

// Proxy is a TCP proxy listening on 127.0.0.1 that injects faults between a
// client and target: added latency on the client-to-server direction,
// connection resets at a Postgres COMMIT, and dropping every connection at
// once.
type Proxy struct {
	ln      net.Listener
	target  string
	opts    ProxyOptions
	latency atomic.Int64 // nanoseconds

	mu     sync.Mutex
	conns  map[*proxyPair]struct{}
	closed bool
	wg     sync.WaitGroup

	conns_, commits, resetsAfter, resetsBefore, dropped atomic.Int64
}

type proxyPair struct {
	client, server net.Conn
	once           sync.Once
}

// reset closes both ends, with an RST on the client side.
func (pp *proxyPair) reset() {
	pp.once.Do(func() {
		if tc, ok := pp.client.(*net.TCPConn); ok {
			_ = tc.SetLinger(0)
		}
		if tc, ok := pp.server.(*net.TCPConn); ok {
			_ = tc.SetLinger(0)
		}
		_ = pp.client.Close()
		_ = pp.server.Close()
	})
}

// NewProxy listens on an ephemeral 127.0.0.1 port and forwards every
// connection to target.
func NewProxy(target string, opts ProxyOptions) (*Proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("chaos: proxy listen: %w", err)
	}
	p := &Proxy{ln: ln, target: target, opts: opts, conns: map[*proxyPair]struct{}{}}
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// Addr is the proxy's host:port.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// SetLatency sets the delay added before each client-to-server write.
func (p *Proxy) SetLatency(d time.Duration) { p.latency.Store(int64(d)) }

// Stats returns the proxy's counters.
func (p *Proxy) Stats() ProxyStats {
	return ProxyStats{Conns: p.conns_.Load(), Commits: p.commits.Load(), ResetsAfter: p.resetsAfter.Load(),
		ResetsBefore: p.resetsBefore.Load(), Dropped: p.dropped.Load()}
}

// DropAll resets every open connection and returns how many it reset.
func (p *Proxy) DropAll() int {
	p.mu.Lock()
	pairs := make([]*proxyPair, 0, len(p.conns))
	for pp := range p.conns {
		pairs = append(pairs, pp)
	}
	p.mu.Unlock()
	for _, pp := range pairs {
		pp.reset()
	}
	p.dropped.Add(int64(len(pairs)))
	return len(pairs)
}

// Close stops listening, resets every connection and waits for the proxy's
// goroutines.
func (p *Proxy) Close() {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	_ = p.ln.Close()
	p.mu.Lock()
	for pp := range p.conns {
		pp.reset()
	}
	p.mu.Unlock()
	p.wg.Wait()
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		s, err := net.DialTimeout("tcp", p.target, 5*time.Second)
		if err != nil {
			_ = c.Close()
			continue
		}
		pp := &proxyPair{client: c, server: s}
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			pp.reset()
			return
		}
		p.conns[pp] = struct{}{}
		p.mu.Unlock()
		p.conns_.Add(1)
		p.wg.Add(2)
		go func() {
			defer p.wg.Done()
			var err error
			if p.opts.Postgres {
				err = p.pumpPostgres(pp)
			} else {
				err = p.pump(pp.server, pp.client, true)
			}
			_ = err
			pp.reset()
			p.forget(pp)
		}()
		go func() {
			defer p.wg.Done()
			_ = p.pump(pp.client, pp.server, false)
			pp.reset()
		}()
	}
}

func (p *Proxy) forget(pp *proxyPair) {
	p.mu.Lock()
	delete(p.conns, pp)
	p.mu.Unlock()
}

func (p *Proxy) delay() {
	if d := time.Duration(p.latency.Load()); d > 0 {
		time.Sleep(d)
	}
}

// pump copies src to dst, delaying each chunk if upstream.
func (p *Proxy) pump(dst, src net.Conn, upstream bool) error {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if upstream {
				p.delay()
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return werr
			}
		}
		if err != nil {
			return err
		}
	}
}

// Postgres frontend protocol codes of untyped first messages.
const (
	pgSSLRequest    = 80877103
	pgGSSENCRequest = 80877104
	pgCancelRequest = 80877102
)

// pumpPostgres forwards the frontend (client-to-server) half of a Postgres
// connection message by message, applying OnCommit to each COMMIT.
func (p *Proxy) pumpPostgres(pp *proxyPair) error {
	r := bufio.NewReaderSize(pp.client, 32<<10)
	w := pp.server
	// Untyped messages first: SSL/GSSENC requests, then the startup (or
	// cancel) message.
	for {
		var hdr [8]byte
		if _, err := io.ReadFull(r, hdr[:]); err != nil {
			return err
		}
		n := int(binary.BigEndian.Uint32(hdr[:4]))
		if n < 8 || n > 1<<20 {
			return errors.New("chaos: proxy: bad startup length")
		}
		msg := make([]byte, n)
		copy(msg, hdr[:])
		if _, err := io.ReadFull(r, msg[8:]); err != nil {
			return err
		}
		if _, err := w.Write(msg); err != nil {
			return err
		}
		code := binary.BigEndian.Uint32(hdr[4:])
		if code == pgSSLRequest || code == pgGSSENCRequest {
			continue
		}
		if code == pgCancelRequest {
			return p.pump(w, pp.client, true)
		}
		break
	}
	for {
		var hdr [5]byte
		if _, err := io.ReadFull(r, hdr[:]); err != nil {
			return err
		}
		n := int(binary.BigEndian.Uint32(hdr[1:]))
		if n < 4 || n > 1<<30 {
			return errors.New("chaos: proxy: bad message length")
		}
		msg := make([]byte, 1+n)
		copy(msg, hdr[:])
		if _, err := io.ReadFull(r, msg[5:]); err != nil {
			return err
		}
		action := CommitPass
		if hdr[0] == 'Q' && isCommit(msg[5:]) {
			p.commits.Add(1)
			if p.opts.OnCommit != nil {
				action = p.opts.OnCommit()
			}
		}
		if action == CommitResetBefore {
			p.resetsBefore.Add(1)
			pp.reset()
			return nil
		}
		p.delay()
		if _, err := w.Write(msg); err != nil {
			return err
		}
		if action == CommitResetAfter {
			p.resetsAfter.Add(1)
			// Reset the client at once, so that the server's answer
			// never reaches it, but let the server read the COMMIT
			// before its side goes away.
			if tc, ok := pp.client.(*net.TCPConn); ok {
				_ = tc.SetLinger(0)
			}
			_ = pp.client.Close()
			time.Sleep(50 * time.Millisecond)
			pp.reset()
			return nil
		}
	}
}

// isCommit reports whether a simple-protocol query ends with COMMIT (or
// END): alone, or after the statements that check the transaction before
// it, as processed's commit does ("/* idemq-commit <token> */ CLOSE
// idemq_claim; COMMIT"; "SELECT ...; COMMIT" before migration 0009).
func isCommit(body []byte) bool {
	q := strings.TrimSpace(strings.TrimRight(string(body), "\x00"))
	q = strings.TrimSpace(strings.TrimSuffix(q, ";"))
	if i := strings.LastIndexByte(q, ';'); i >= 0 {
		q = strings.TrimSpace(q[i+1:])
	}
	return strings.EqualFold(q, "commit") || strings.EqualFold(q, "end")
}
