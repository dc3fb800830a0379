// Command chain runs three services in one process and proves the whole
// chain exactly once: an HTTP payments API (httpidem) writes each charge
// and an outbox row in one transaction; a relay publishes it to RabbitMQ;
// a ledger consumer applies it and writes its own outbox row, with a key
// derived from the charge's; a second relay publishes that to NATS
// JetStream; a notify consumer records a notification. A load client sends
// requests as a real client would (timeouts, re-sends with the same key,
// a few re-sends with another body), and at the end the program checks,
// for every key, one charge, one ledger entry and one notification, a 422
// for every changed body, and no dead letter.
//
// Each service has a schema of its own in DATABASE_URL's database, as it
// would have a database of its own; they share nothing but the brokers.
//
//	go run ./examples/chain
//
// It needs Postgres (DATABASE_URL), RabbitMQ (AMQP_URL) and NATS with
// JetStream (NATS_URL), each defaulting to the local server. It exits 1 if
// any check fails.
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	amqp "github.com/rabbitmq/amqp091-go"

	natsjs "github.com/idemq/idemq/brokers/nats"
	"github.com/idemq/idemq/brokers/rabbitmq"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/httpidem"
	"github.com/idemq/idemq/keys"
	"github.com/idemq/idemq/outbox"
	"github.com/idemq/idemq/processed"
)

const defaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/test"

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return
		}
		fmt.Fprintln(os.Stderr, "chain:", err)
		os.Exit(1)
	}
}

type options struct {
	keys, workers      int
	prefix, queue      string
	stream, subject    string
	timeout, keepAfter time.Duration
}

// run runs the chain once, printing its summary to out.
func run(ctx context.Context, args []string, out io.Writer) error {
	var o options
	fs := flag.NewFlagSet("chain", flag.ContinueOnError)
	fs.SetOutput(out)
	fs.IntVar(&o.keys, "keys", 300, "payment requests, each with its own Idempotency-Key")
	fs.IntVar(&o.workers, "clients", 8, "concurrent clients")
	fs.StringVar(&o.prefix, "schema-prefix", "chain", "the services' schemas are <prefix>_payments, _ledger and _notify (recreated)")
	fs.StringVar(&o.queue, "queue", "chain.charges", "the RabbitMQ queue between payments and ledger (recreated)")
	fs.StringVar(&o.stream, "stream", "CHAIN_LEDGER", "the JetStream stream between ledger and notify (recreated)")
	fs.StringVar(&o.subject, "subject", "chain.ledger", "the stream's subject")
	fs.DurationVar(&o.timeout, "timeout", 50*time.Second, "how long the chain may take to settle")
	if err := fs.Parse(args); err != nil {
		return err
	}
	dbURL, amqpURL, natsURL := env("DATABASE_URL", defaultDatabaseURL), env("AMQP_URL", rabbitmq.DefaultURL), env("NATS_URL", nats.DefaultURL)
	start := time.Now()
	if err := resetBrokers(amqpURL, natsURL, o); err != nil {
		return err
	}
	defer func() { _ = resetBrokers(amqpURL, natsURL, o) }()
	ch, err := newChain(ctx, dbURL, amqpURL, natsURL, o)
	if err != nil {
		return err
	}
	defer ch.close()
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errs := ch.start(sctx)

	addr, stopAPI, err := serve(ch.api)
	if err != nil {
		return err
	}
	defer stopAPI()
	load := drive(ctx, "http://"+addr+"/charges", o)
	fmt.Fprintf(out, "sent %d requests for %d keys: %d timed out and re-sent, %d duplicates re-sent, %d re-sent with another body\n",
		load.requests.Load(), o.keys, load.timeouts.Load(), load.duplicates.Load(), load.changed.Load())

	// Wait until every charge reached the end of the chain.
	deadline := time.Now().Add(o.timeout)
	for {
		n, err := ch.count(ctx, ch.notifications)
		if err != nil {
			return err
		}
		if n >= int64(len(load.accepted)) || time.Now().After(deadline) {
			break
		}
		select {
		case err := <-errs:
			return err
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
	cancel()
	for range len(ch.relays) + len(ch.consumers) {
		if err := <-errs; err != nil && !errors.Is(err, context.Canceled) {
			return err
		}
	}
	return ch.check(ctx, out, load, time.Since(start))
}

func env(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

// chain is the three services: their stores, outboxes, relays and
// consumers.
type chain struct {
	payments, ledger, notify *processed.Store // one per service, each in its schema
	charges, entries         string           // the payments and ledger tables
	notifications            string           // the notify table
	queue                    string           // where payments publishes its charges
	api                      http.Handler
	relays                   []*outbox.Relay
	consumers                []*consumer.Runtime
	rmqPub                   *rabbitmq.Publisher
	natsPub                  *natsjs.Publisher
}

// Charge is the body of POST /charges and of the event payments publishes.
type Charge struct {
	Account string `json:"account"`
	Cents   int64  `json:"cents"`
	Key     string `json:"key,omitempty"` // the request's Idempotency-Key, in the event
}

func newChain(ctx context.Context, dbURL, amqpURL, natsURL string, o options) (_ *chain, err error) {
	ch := &chain{queue: o.queue}
	defer func() {
		if err != nil {
			ch.close()
		}
	}()
	open := func(service string) (*processed.Store, error) {
		schema := o.prefix + "_" + service
		s, err := processed.Open(ctx, dbURL, processed.Config{Schema: schema})
		if err != nil {
			var pe *pgconn.ParseConfigError
			if errors.As(err, &pe) { // its text may quote the password
				return nil, errors.New("invalid DATABASE_URL: check its syntax and parameters")
			}
			return nil, fmt.Errorf("cannot reach Postgres (start it, or set DATABASE_URL): %w", err)
		}
		if _, err := s.Pool().Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE; CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize()); err != nil {
			s.Close()
			return nil, err
		}
		if err := s.Migrate(ctx); err != nil {
			s.Close()
			return nil, err
		}
		return s, nil
	}
	if ch.payments, err = open("payments"); err != nil {
		return nil, err
	}
	if ch.ledger, err = open("ledger"); err != nil {
		return nil, err
	}
	if ch.notify, err = open("notify"); err != nil {
		return nil, err
	}
	ch.charges = pgx.Identifier{ch.payments.Schema(), "charges"}.Sanitize()
	ch.entries = pgx.Identifier{ch.ledger.Schema(), "entries"}.Sanitize()
	ch.notifications = pgx.Identifier{ch.notify.Schema(), "notifications"}.Sanitize()
	for _, ddl := range []struct {
		s   *processed.Store
		sql string
	}{
		{ch.payments, `CREATE TABLE ` + ch.charges + ` (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, key text NOT NULL, account text NOT NULL, cents bigint NOT NULL)`},
		{ch.ledger, `CREATE TABLE ` + ch.entries + ` (key text NOT NULL, account text NOT NULL, cents bigint NOT NULL)`},
		{ch.notify, `CREATE TABLE ` + ch.notifications + ` (key text NOT NULL, text text NOT NULL)`},
	} {
		if _, err := ddl.s.Pool().Exec(ctx, ddl.sql); err != nil {
			return nil, err
		}
	}

	// payments: the API and its outbox, relayed to RabbitMQ.
	payOut, err := newOutbox(ctx, ch.payments)
	if err != nil {
		return nil, err
	}
	mw, err := httpidem.New(ch.payments.Pool(), httpidem.Config{Schema: ch.payments.Schema()})
	if err != nil {
		return nil, err
	}
	if err := mw.Migrate(ctx); err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /charges", func(w http.ResponseWriter, r *http.Request) { ch.charge(w, r, payOut) })
	ch.api = mw.Wrap(mux)
	if ch.rmqPub, err = rabbitmq.NewPublisher(ctx, rabbitmq.PublisherConfig{URL: amqpURL}); err != nil {
		return nil, fmt.Errorf("cannot reach RabbitMQ (start it, or set AMQP_URL): %w", err)
	}
	if err := ch.addRelay(payOut, func(ctx context.Context, dest string, msgs ...*consumer.Message) error {
		return ch.rmqPub.Publish(ctx, "", dest, msgs...)
	}); err != nil {
		return nil, err
	}

	// ledger: consumes the charges, writes an entry and an event.
	ledgerOut, err := newOutbox(ctx, ch.ledger)
	if err != nil {
		return nil, err
	}
	src, err := rabbitmq.NewSource(ctx, rabbitmq.Config{URL: amqpURL, Queue: o.queue, Topology: &rabbitmq.Topology{}})
	if err != nil {
		return nil, fmt.Errorf("cannot set up RabbitMQ (start it, or set AMQP_URL): %w", err)
	}
	if err := ch.addConsumer("ledger", src, ch.ledger, consumer.JSON(func(ctx context.Context, tx pgx.Tx, m *consumer.Message, c Charge) error {
		if _, err := tx.Exec(ctx, `INSERT INTO `+ch.entries+` (key, account, cents) VALUES ($1, $2, $3)`, c.Key, c.Account, c.Cents); err != nil {
			return err
		}
		body, _ := json.Marshal(c)
		// The event's id derives from the charge event's: a redelivered
		// charge that got this far before makes the same id.
		return ledgerOut.Enqueue(ctx, tx, outbox.Message{Destination: o.subject, ID: keys.ChildKey(m.ID, "ledger-entry-recorded/v1"), Body: body})
	})); err != nil {
		return nil, err
	}
	if ch.natsPub, err = natsjs.NewPublisher(ctx, natsjs.PublisherConfig{URL: natsURL}); err != nil {
		return nil, fmt.Errorf("cannot reach NATS (start nats-server -js, or set NATS_URL): %w", err)
	}
	if err := ch.addRelay(ledgerOut, ch.natsPub.Publish); err != nil {
		return nil, err
	}

	// notify: consumes the ledger's events, records a notification.
	nsrc, err := natsjs.NewSource(ctx, natsjs.Config{URL: natsURL, Stream: o.stream, Subject: o.subject, Durable: "notify", Topology: &natsjs.Topology{}})
	if err != nil {
		return nil, fmt.Errorf("cannot set up JetStream (start nats-server -js, or set NATS_URL): %w", err)
	}
	if err := ch.addConsumer("notify", nsrc, ch.notify, consumer.JSON(func(ctx context.Context, tx pgx.Tx, m *consumer.Message, c Charge) error {
		_, err := tx.Exec(ctx, `INSERT INTO `+ch.notifications+` (key, text) VALUES ($1, $2)`, c.Key, fmt.Sprintf("%s was charged %d cents", c.Account, c.Cents))
		return err
	})); err != nil {
		return nil, err
	}
	return ch, nil
}

func newOutbox(ctx context.Context, s *processed.Store) (*outbox.Outbox, error) {
	ob, err := outbox.New(s.Pool(), outbox.Config{Schema: s.Schema()})
	if err != nil {
		return nil, err
	}
	return ob, ob.Migrate(ctx)
}

func (ch *chain) addRelay(ob *outbox.Outbox, publish outbox.PublishFunc) error {
	r, err := outbox.NewRelay(ob, outbox.RelayConfig{Publish: publish, PollInterval: 20 * time.Millisecond})
	if err != nil {
		return err
	}
	ch.relays = append(ch.relays, r)
	return nil
}

func (ch *chain) addConsumer(name string, src consumer.Source, s *processed.Store, h consumer.Handler) error {
	rt, err := consumer.New(consumer.Config{Name: name, Source: src, Store: s, Handler: h})
	if err != nil {
		_ = src.Close()
		return err
	}
	ch.consumers = append(ch.consumers, rt)
	return nil
}

// charge is POST /charges: the charge and its event commit together, in
// the transaction httpidem began for the request's key.
func (ch *chain) charge(w http.ResponseWriter, r *http.Request, ob *outbox.Outbox) {
	tx, _ := httpidem.Tx(r.Context())
	var c Charge
	if err := json.NewDecoder(r.Body).Decode(&c); err != nil || c.Account == "" || c.Cents <= 0 {
		http.Error(w, `want {"account": non-empty, "cents": positive}`, http.StatusBadRequest)
		return
	}
	c.Key = r.Header.Get("Idempotency-Key")
	var id int64
	err := tx.QueryRow(r.Context(), `INSERT INTO `+ch.charges+` (key, account, cents) VALUES ($1, $2, $3) RETURNING id`, c.Key, c.Account, c.Cents).Scan(&id)
	if err == nil {
		body, _ := json.Marshal(c)
		err = ob.Enqueue(r.Context(), tx, outbox.Message{Destination: ch.queue, ID: keys.ChildKey(c.Key, "charge-created/v1"), Body: body})
	}
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError) // rolls back, frees the key
		return
	}
	w.WriteHeader(http.StatusCreated)
	_, _ = fmt.Fprintf(w, `{"charge_id": %d}`, id)
}

// start runs the relays and consumers until ctx ends; each sends its end
// on the returned channel (nil for a clean stop).
func (ch *chain) start(ctx context.Context) <-chan error {
	errs := make(chan error, len(ch.relays)+len(ch.consumers))
	for _, r := range ch.relays {
		go func() { errs <- r.Run(ctx) }()
	}
	for _, rt := range ch.consumers {
		go func() { errs <- rt.Run(ctx) }()
	}
	return errs
}

func (ch *chain) count(ctx context.Context, table string) (int64, error) {
	var n int64
	err := ch.notify.Pool().QueryRow(ctx, `SELECT count(*) FROM `+table).Scan(&n)
	return n, err
}

func (ch *chain) close() {
	for _, s := range []*processed.Store{ch.payments, ch.ledger, ch.notify} {
		if s != nil {
			s.Close()
		}
	}
	if ch.rmqPub != nil {
		_ = ch.rmqPub.Close()
	}
	if ch.natsPub != nil {
		_ = ch.natsPub.Close()
	}
}

// serve serves h on a free loopback port.
func serve(h http.Handler) (addr string, stop func(), err error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", nil, err
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(l) }()
	return l.Addr().String(), func() { _ = srv.Close() }, nil
}

// load is what the client sent and what it was told.
type load struct {
	requests, timeouts, duplicates, changed, rejected atomic.Int64
	mu                                                sync.Mutex
	accepted                                          map[string]Charge // key -> the charge the API accepted
}

// drive sends o.keys charges from o.workers clients, as a real client
// would: a quarter of first attempts time out (the answer is lost, not the
// request) and are sent again with the same key and body; a fifth are
// sent again after their answer (a retry of a lost response); and one in
// twenty is sent again with another amount, which must be refused (422).
func drive(ctx context.Context, endpoint string, o options) *load {
	l := &load{accepted: map[string]Charge{}}
	keysCh := make(chan int)
	var wg sync.WaitGroup
	for range o.workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range keysCh {
				l.one(ctx, endpoint, i)
			}
		}()
	}
	for i := range o.keys {
		keysCh <- i
	}
	close(keysCh)
	wg.Wait()
	return l
}

func (l *load) one(ctx context.Context, endpoint string, i int) {
	key := fmt.Sprintf("charge-%05d", i)
	c := Charge{Account: fmt.Sprintf("acct-%d", i%17), Cents: int64(100 + i)}
	if rand.IntN(4) == 0 {
		l.timeouts.Add(1)
		_, _ = l.post(ctx, endpoint, key, c, time.Millisecond) // gives up at once; the server may still commit
	}
	for {
		status, err := l.post(ctx, endpoint, key, c, 10*time.Second)
		if err == nil && status == http.StatusCreated {
			break
		}
		if ctx.Err() != nil {
			return
		}
		time.Sleep(200 * time.Millisecond) // 409 (the first still running), a 5xx, a lost connection: same key, again
	}
	l.mu.Lock()
	l.accepted[key] = c
	l.mu.Unlock()
	if rand.IntN(5) == 0 {
		l.duplicates.Add(1)
		_, _ = l.post(ctx, endpoint, key, c, 10*time.Second)
	}
	if i%20 == 0 {
		l.changed.Add(1)
		if status, err := l.post(ctx, endpoint, key, Charge{Account: c.Account, Cents: c.Cents + 1}, 10*time.Second); err == nil && status == http.StatusUnprocessableEntity {
			l.rejected.Add(1)
		}
	}
}

func (l *load) post(ctx context.Context, endpoint, key string, c Charge, timeout time.Duration) (int, error) {
	l.requests.Add(1)
	body, _ := json.Marshal(c)
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, endpoint, bytes.NewReader(body))
	if err != nil {
		return 0, err
	}
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode, nil
}

// check compares each service's effects with what the client was told,
// key by key, and prints the summary.
func (ch *chain) check(ctx context.Context, out io.Writer, l *load, took time.Duration) error {
	perKey := func(s *processed.Store, table string) (map[string]row, error) {
		rows, err := s.Pool().Query(ctx, `SELECT key, count(*), sum(cents) FROM `+table+` GROUP BY key`)
		if err != nil {
			return nil, err
		}
		m := map[string]row{}
		for rows.Next() {
			var k string
			var r row
			if err := rows.Scan(&k, &r.n, &r.cents); err != nil {
				return nil, err
			}
			m[k] = r
		}
		return m, rows.Err()
	}
	charges, err := perKey(ch.payments, ch.charges)
	if err != nil {
		return err
	}
	entries, err := perKey(ch.ledger, ch.entries)
	if err != nil {
		return err
	}
	notes := map[string]int64{}
	rows, err := ch.notify.Pool().Query(ctx, `SELECT key, count(*) FROM `+ch.notifications+` GROUP BY key`)
	if err != nil {
		return err
	}
	for rows.Next() {
		var k string
		var n int64
		if err := rows.Scan(&k, &n); err != nil {
			return err
		}
		notes[k] = n
	}
	if err := rows.Err(); err != nil {
		return err
	}
	var bad []string
	for key, c := range l.accepted {
		if charges[key] != (row{1, c.Cents}) || entries[key] != (row{1, c.Cents}) || notes[key] != 1 {
			bad = append(bad, fmt.Sprintf("%s: %d charges, %d ledger entries, %d notifications", key, charges[key].n, entries[key].n, notes[key]))
		}
	}
	for key := range charges {
		if _, ok := l.accepted[key]; !ok {
			bad = append(bad, key+": charged, but the client was never told so")
		}
	}
	if l.rejected.Load() != l.changed.Load() {
		bad = append(bad, fmt.Sprintf("%d of %d re-sends with another body refused with 422", l.rejected.Load(), l.changed.Load()))
	}
	var dead int64
	for _, rt := range ch.consumers {
		dead += rt.Stats().DeadLettered
	}
	if dead != 0 {
		bad = append(bad, fmt.Sprintf("%d dead letters", dead))
	}
	fmt.Fprintf(out, "\nchain summary (%s)\n", took.Round(time.Millisecond))
	fmt.Fprintf(out, "  keys accepted (2xx)     %5d\n", len(l.accepted))
	fmt.Fprintf(out, "  charges (payments)      %5d\n", sum(charges))
	fmt.Fprintf(out, "  ledger entries          %5d\n", sum(entries))
	fmt.Fprintf(out, "  notifications           %5d\n", len(notes))
	fmt.Fprintf(out, "  changed bodies refused  %5d of %d (422)\n", l.rejected.Load(), l.changed.Load())
	fmt.Fprintf(out, "  dead letters            %5d\n", dead)
	if len(bad) > 0 {
		for i, b := range bad {
			if i == 10 {
				fmt.Fprintf(out, "  ... and %d more\n", len(bad)-10)
				break
			}
			fmt.Fprintln(out, "  WRONG:", b)
		}
		return fmt.Errorf("%d keys or checks wrong", len(bad))
	}
	fmt.Fprintln(out, "\nOK: every key charged once, entered once, notified once.")
	return nil
}

// row is one key's effects in a table: how many, and their amount.
type row struct{ n, cents int64 }

func sum(m map[string]row) int64 {
	var n int64
	for _, r := range m {
		n += r.n
	}
	return n
}

// resetBrokers deletes the queue and the stream (and their dead-letter
// queue and stream) that the chain declares, so that each run starts
// empty.
func resetBrokers(amqpURL, natsURL string, o options) error {
	u, err := url.Parse(amqpURL)
	if err != nil { // its text quotes the URL, password and all
		return errors.New("invalid AMQP_URL: percent-encode reserved characters in the user name and password")
	}
	conn, err := amqp.Dial(amqpURL)
	if err != nil {
		return fmt.Errorf("cannot reach RabbitMQ at %s (start it, or set AMQP_URL): %w", u.Redacted(), err)
	}
	defer conn.Close()
	ach, err := conn.Channel()
	if err != nil {
		return err
	}
	for _, q := range []string{o.queue, rabbitmq.DLQName(o.queue)} {
		if _, err := ach.QueueDelete(q, false, false, false); err != nil {
			return fmt.Errorf("delete queue %s: %w", q, err)
		}
	}
	nc, err := nats.Connect(natsURL, nats.Timeout(5*time.Second))
	if err != nil {
		return fmt.Errorf("cannot reach NATS (start nats-server -js, or set NATS_URL): %w", err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, s := range []string{o.stream, o.stream + natsjs.DLQStreamSuffix} {
		if err := js.DeleteStream(ctx, s); err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
			return fmt.Errorf("delete stream %s: %w", s, err)
		}
	}
	return nil
}
