// Package console is the web console `idemq console` serves: an overview of
// the dedup table, the dead-letter queues, the outbox and the HTTP key table;
// dead letters grouped by failure fingerprint; a group's envelopes; the dry
// run, replay and requeue of a group or a selection; an audit log of every
// replay; and the lookup of a message id or an HTTP idempotency key.
//
// Everything it serves is embedded (templates, one stylesheet, one script):
// no CDN, no build step. Pages are rendered with html/template, so message
// bodies and headers are text, never markup. Every mutating request needs a
// session signed in with a token, a CSRF token bound to that session, a
// SameSite=Strict cookie and a same-origin Origin header; with ReadOnly, or
// without tokens, the server offers and accepts no mutation at all.
package console

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/processed"
)

// DLQ is one dead-letter queue or topic the console shows.
type DLQ struct {
	// Broker is "rabbitmq", "kafka", "nats" or "redis"; Name the queue,
	// topic, NATS JetStream subject or Redis stream key.
	Broker, Name string
	// Depth reads the queue's depth (RabbitMQ: ready messages; Kafka:
	// records retained; NATS: messages the stream holds on the subject;
	// Redis: the stream's length).
	Depth func(ctx context.Context) (int64, error)
	// Open opens a browser on the queue and, with publish, a way to
	// republish to a message's source. The console closes what it opens
	// with Conn.Close.
	Open func(ctx context.Context, publish bool) (*Conn, error)
}

// Conn is an open dead-letter queue.
type Conn struct {
	Browser dlq.Browser
	Publish func(ctx context.Context, destination string, msg *consumer.Message) error
	Close   func()
}

// ID names the queue in URLs: broker:name.
func (d DLQ) ID() string { return d.Broker + ":" + d.Name }

// ConsumerStatus is one consumer's part of the overview.
type ConsumerStatus struct {
	Consumer string
	Rows     int64
	Oldest   time.Time
	// PurgeEligible is nil without a retention.
	PurgeEligible *int64
	LastApplied   *processed.Row
	// Shards are, with Config.Shards, the consumer's status on each shard,
	// in order; the fields above are then their total (the last applied
	// and the oldest of all, the sum of the counts).
	Shards []ConsumerStatus
}

// Shard is one database of a dedup store sharded across several
// (processed.Sharded): its shard's store, and the database it uses.
type Shard struct {
	Store *processed.Store
	DB    processed.DB
}

// Token is one operator's token: Name is what the audit records.
type Token struct{ Name, Secret string }

// ParseToken reads "name:secret", or a bare secret (named "operator").
func ParseToken(s string) (Token, error) {
	s = strings.TrimSpace(s)
	name, secret, ok := strings.Cut(s, ":")
	if !ok {
		name, secret = "operator", s
	}
	if name == "" || secret == "" {
		return Token{}, errors.New("a token is \"name:secret\" or a secret, and neither may be empty")
	}
	if len(secret) < 8 {
		return Token{}, fmt.Errorf("token %q: the secret must be at least 8 bytes", name)
	}
	return Token{Name: name, Secret: secret}, nil
}

// Table names a table that may not exist.
type Table struct{ Schema, Name string }

// Config configures the console.
type Config struct {
	// Store is the dedup store, for lookups and the dry run. Required,
	// unless Shards is given.
	Store *processed.Store
	// DB is the database the Store uses: the console creates its audit
	// table (idemq_console_audit, in the Store's schema) and reads the
	// outbox and HTTP key tables there. Required, unless Shards is given.
	DB processed.DB
	// Shards are the databases of a dedup store sharded across several
	// (processed.Sharded), shard 0 first, in its map's order. The
	// overview and each consumer's page then show every shard's rows and
	// their total, the applied charts sum the shards, and lookups, dry
	// runs and replays look an id up on each shard. Leave Store and DB
	// nil: shard 0's database holds the audit table and the janitor's
	// reports (a Sharded records them there), and the outbox and HTTP key
	// tables are read there. Defaults to none: one database, Store's.
	Shards []Shard
	// Status reads a consumer's overview row in one database (Store's, or
	// each shard's). Defaults to the row counts of Store.Stats alone.
	Status func(ctx context.Context, db Shard, consumer string) (ConsumerStatus, error)
	// Consumers are always shown, besides those found in the dedup table.
	Consumers []string
	// Retention is the dedup retention: the purge-eligible count and the
	// replay-horizon guard use it. Defaults to 0: no guard.
	Retention time.Duration
	// DLQs are the dead-letter queues shown.
	DLQs []DLQ
	// Tokens may run mutating actions. Defaults to none: read-only.
	Tokens []Token
	// ReadOnly hides and refuses every mutating action.
	ReadOnly bool
	// VerifyKeys check envelope signatures (current key first); replays
	// then take only verified envelopes.
	VerifyKeys [][]byte
	// Rate caps republished messages per second. Defaults to 50.
	Rate float64
	// Outbox and HTTPKeys are shown if they exist.
	Outbox, HTTPKeys Table
	// Reconciliation is the file `idemq reconcile --out` writes: the
	// overview shows the last reconciliation it holds, read at each
	// request. Defaults to "": no reconciliation shown.
	Reconciliation string
	// Info lists what the console is connected to, passwords redacted.
	Info [][2]string
	// Secrets are the raw URLs and DSNs whose passwords are masked in
	// every error the console shows.
	Secrets []string
	// PageSize is the number of envelopes per page. Defaults to 20.
	PageSize int
	// ScanLimit bounds how many dead letters one page reads. Defaults to
	// 10000.
	ScanLimit int
	// AllowedHosts are the Host headers served, against DNS rebinding (a
	// web page whose name resolves to 127.0.0.1 reading the console).
	// Defaults to loopback names (localhost, 127.0.0.1, [::1]) when the
	// console listens on loopback, and to any host otherwise.
	AllowedHosts []string
	// Logger defaults to discarding.
	Logger *slog.Logger
}

// Server is the console's http.Handler.
type Server struct {
	cfg      Config
	log      *slog.Logger
	mux      *http.ServeMux
	sessions *sessions
	jobs     *jobs
	audit    *audit
	// locks serialise browsing each queue: two RabbitMQ browsers on one
	// queue would each see only part of it. A channel of one, so a page
	// waiting on a running replay can give up.
	locks map[string]chan struct{}
	// anyHost accepts every Host header: set when listening beyond
	// loopback without AllowedHosts.
	anyHost bool
	dlqs    map[string]DLQ
	// ctx is the replays' context, cancelled by Close.
	ctx    context.Context
	cancel context.CancelFunc
	// counts keeps the counts of the applied charts' closed buckets;
	// clock reads now and the time before which buckets are closed
	// (dbClock); countHook, if set, sees each count query (tests).
	counts    *countCache
	clock     clock
	countHook func(countRange)
	// shards are the dedup store's databases: Config.Shards, or Store's
	// alone. lookup finds a dedup row in any of them.
	shards []Shard
	lookup interface {
		Lookup(ctx context.Context, consumerName, id string) (processed.Row, error)
	}
}

// New validates cfg and returns the console.
func New(cfg Config) (*Server, error) {
	shards := cfg.Shards
	switch {
	case len(shards) > 0 && (cfg.Store != nil || cfg.DB != nil):
		return nil, errors.New("console: give Shards, or Store and DB, not both")
	case len(shards) > 0:
		for i, sh := range shards {
			if sh.Store == nil || sh.DB == nil {
				return nil, fmt.Errorf("console: shard %d needs its Store and DB", i)
			}
		}
		cfg.Store, cfg.DB = shards[0].Store, shards[0].DB
	case cfg.Store == nil || cfg.DB == nil:
		return nil, errors.New("console: Store and DB are required")
	default:
		shards = []Shard{{Store: cfg.Store, DB: cfg.DB}}
	}
	if cfg.Rate == 0 {
		cfg.Rate = 50
	}
	if cfg.Rate < 0 || cfg.Retention < 0 {
		return nil, errors.New("console: Rate and Retention must not be negative")
	}
	if cfg.PageSize <= 0 {
		cfg.PageSize = 20
	}
	if cfg.ScanLimit <= 0 {
		cfg.ScanLimit = 10000
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	names := map[string]bool{}
	for _, t := range cfg.Tokens {
		if t.Name == "" || t.Secret == "" {
			return nil, errors.New("console: a token needs a name and a secret")
		}
		names[t.Name] = true
	}
	s := &Server{cfg: cfg, log: cfg.Logger, sessions: newSessions(), jobs: newJobs(),
		audit: &audit{db: cfg.DB, schema: cfg.Store.Schema()}, locks: map[string]chan struct{}{}, dlqs: map[string]DLQ{},
		counts: &countCache{m: map[countKey]int64{}}, shards: shards, lookup: cfg.Store}
	s.clock = s.dbClock
	if len(cfg.Shards) > 0 {
		stores := make([]*processed.Store, len(shards))
		for i, sh := range shards {
			stores[i] = sh.Store
		}
		// The default map, of the shards' count: Lookup asks each shard,
		// and package dlq's LookupMessage (on shards keyed by shard key)
		// the message's key, Message.Key.
		sharded, err := processed.NewSharded(stores, processed.ShardedConfig{Map: processed.ShardMap{Shards: len(stores)}})
		if err != nil {
			return nil, fmt.Errorf("console: %w", err)
		}
		s.lookup = sharded
	}
	for _, d := range cfg.DLQs {
		if _, dup := s.dlqs[d.ID()]; dup {
			return nil, fmt.Errorf("console: dead-letter queue %s given twice", d.ID())
		}
		s.dlqs[d.ID()] = d
		s.locks[d.ID()] = make(chan struct{}, 1)
	}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	s.routes()
	return s, nil
}

// Mutable reports whether the console offers mutating actions at all.
func (s *Server) Mutable() bool { return !s.cfg.ReadOnly && len(s.cfg.Tokens) > 0 }

// ServeHTTP implements http.Handler, with the security headers on every
// response.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	h.Set("Content-Security-Policy", "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("X-Frame-Options", "DENY")
	// same-origin, not no-referrer: with no-referrer, browsers send
	// "Origin: null" on form posts, which the CSRF check refuses.
	h.Set("Referrer-Policy", "same-origin")
	h.Set("Cache-Control", "no-store")
	h.Set("Cross-Origin-Opener-Policy", "same-origin")
	if !s.hostAllowed(r.Host) {
		http.Error(w, "this console does not serve the host "+strconv.Quote(r.Host)+" (see --allowed-host)", http.StatusMisdirectedRequest)
		return
	}
	if !s.signedIn(w, r) {
		return
	}
	s.mux.ServeHTTP(w, r)
}

// hostAllowed checks a request's Host header.
func (s *Server) hostAllowed(hostport string) bool {
	host, _, err := net.SplitHostPort(hostport)
	if err != nil {
		host = hostport
	}
	host = strings.ToLower(strings.Trim(host, "[]"))
	if len(s.cfg.AllowedHosts) > 0 {
		for _, h := range s.cfg.AllowedHosts {
			if strings.EqualFold(strings.Trim(h, "[]"), host) {
				return true
			}
		}
		return false
	}
	return s.anyHost || IsLoopback(host)
}

// Close stops running replays (what they did not settle stays in the
// dead-letter queue) and waits for them to record their result.
func (s *Server) Close() {
	s.cancel()
	s.jobs.wg.Wait()
}

// CheckAddr refuses to listen on a non-loopback address without a token,
// even read-only: the dead letters' bodies are as sensitive as the actions.
func CheckAddr(addr string, haveToken bool) error {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("--addr %q: %w", addr, err)
	}
	if IsLoopback(host) || haveToken {
		return nil
	}
	return fmt.Errorf("--addr %s is not a loopback address: give a token (--token, $IDEMQ_CONSOLE_TOKEN or --token-file) to serve beyond this host", addr)
}

// IsLoopback reports whether host names only loopback interfaces.
func IsLoopback(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(strings.Trim(host, "[]"))
	return ip != nil && ip.IsLoopback()
}

// ListenAndServe serves the console on addr until ctx is done, then shuts
// down gracefully. ready, if set, is called with the bound address.
func ListenAndServe(ctx context.Context, addr string, s *Server, ready func(net.Addr)) error {
	if err := CheckAddr(addr, len(s.cfg.Tokens) > 0); err != nil {
		return err
	}
	if host, _, _ := net.SplitHostPort(addr); !IsLoopback(host) {
		s.anyHost = true
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: s, ReadHeaderTimeout: 10 * time.Second,
		BaseContext: func(net.Listener) context.Context { return ctx }}
	if ready != nil {
		ready(ln.Addr())
	}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err = srv.Shutdown(sctx)
	s.Close()
	if errors.Is(err, http.ErrServerClosed) {
		err = nil
	}
	return err
}
