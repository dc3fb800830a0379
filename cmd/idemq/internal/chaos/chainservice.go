package chaos

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	natsjs "github.com/idemq/idemq/brokers/nats"
	"github.com/idemq/idemq/brokers/rabbitmq"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/dedup"
	"github.com/idemq/idemq/httpidem"
	"github.com/idemq/idemq/keys"
	"github.com/idemq/idemq/outbox"
	"github.com/idemq/idemq/processed"
)

// ChainServiceEnv is the environment variable holding a chain service's
// JSON configuration. WorkerMain runs the service when it is set.
const ChainServiceEnv = "IDEMQ_CHAOS_CHAIN"

// The chain's services, one OS process each (see Scenario.Chain). Each has
// its crash point, where an armed incarnation SIGKILLs itself.
const (
	// chainAPI is payments' HTTP API (httpidem): it writes the charge and
	// its outbox row in one transaction. Crash point: after the commit,
	// before the response is written.
	chainAPI = "api"
	// chainPayRelay publishes payments' outbox to RabbitMQ. Crash point:
	// after the broker confirmed a batch, before the rows are marked sent.
	chainPayRelay = "payments-relay"
	// chainLedger consumes the charges, writes a ledger entry and an
	// outbox row with a derived key. Crash point: after COMMIT, before
	// the ack.
	chainLedger = "ledger"
	// chainLedgerRelay publishes the ledger's outbox to NATS JetStream.
	// Crash point as chainPayRelay's.
	chainLedgerRelay = "ledger-relay"
	// chainNotify consumes the ledger's events and records a
	// notification. Crash point as chainLedger's.
	chainNotify = "notify"
)

// chainRoles are the services in slot order.
var chainRoles = []string{chainAPI, chainPayRelay, chainLedger, chainLedgerRelay, chainNotify}

// chainCrashPoint names each service's crash point, as Result.Injected
// counts it.
var chainCrashPoint = map[string]string{
	chainAPI:         "kill-api-after-commit-before-response",
	chainPayRelay:    "kill-payments-relay-after-publish-before-mark",
	chainLedger:      "kill-ledger-after-commit-before-ack",
	chainLedgerRelay: "kill-ledger-relay-after-publish-before-mark",
	chainNotify:      "kill-notify-after-commit-before-ack",
}

// SabotageNoDedup makes the chain's ledger service drop its dedup insert:
// every delivery runs the handler, so each redelivery after a crash between
// COMMIT and ack applies the charge again. The checker must report
// duplicates.
const SabotageNoDedup = "no-dedup"

// The chain's consumer names (the dedup scopes), its derived-key step and
// the lock timeout of its idempotency keys.
const (
	chainLedgerConsumer = "ledger"
	chainNotifyConsumer = "notify"
	chainLedgerStep     = "ledger-entry-recorded/v1"
	chainChargeStep     = "charge-created/v1"
	// chainLockTimeout is httpidem's LockTimeout: a claim left by an API
	// process killed mid-request is taken over by a retry after it.
	chainLockTimeout = 3 * time.Second
)

// chainService is one chain service process's configuration, passed as
// JSON in ChainServiceEnv.
type chainService struct {
	Role              string
	Slot, Incarnation int
	// DatabaseURL, AMQPURL and NATSURL lead through the harness's proxies.
	DatabaseURL string
	AMQPURL     string
	NATSURL     string
	// Prefix names the schemas: <Prefix>_payments, _ledger and _notify.
	Prefix          string
	Queue           string // payments to ledger, on RabbitMQ
	Stream, Subject string // ledger to notify, on JetStream
	Listen          string // the API's address
	// KillAfter, if positive, makes the process SIGKILL itself at its
	// crash point the KillAfter-th time it gets there.
	KillAfter int
	Sabotage  string
}

// chainCharge is the body of POST /charges and of the events.
type chainCharge struct {
	Account string `json:"account"`
	Cents   int64  `json:"cents"`
	Key     string `json:"key,omitempty"` // the request's Idempotency-Key, in the events
}

// chainSchemas returns the services' schemas for prefix.
func chainSchemas(prefix string) (payments, ledger, notify string) {
	return prefix + "_payments", prefix + "_ledger", prefix + "_notify"
}

// chainServiceMain runs the service in ChainServiceEnv and returns the exit
// code.
func chainServiceMain() int {
	var c chainService
	if err := json.Unmarshal([]byte(os.Getenv(ChainServiceEnv)), &c); err != nil {
		fmt.Fprintf(os.Stderr, "chain service: bad %s: %v\n", ChainServiceEnv, err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	if err := runChainService(ctx, c); err != nil && !errors.Is(err, context.Canceled) {
		fmt.Fprintf(os.Stderr, "chain %s %d.%d: %v\n", c.Role, c.Slot, c.Incarnation, err)
		return 1
	}
	return 0
}

// crashPoint counts the times a service reaches its crash point and
// SIGKILLs the process at the armed one.
type crashPoint struct {
	n, after int64
}

// reached counts one arrival; it is safe for concurrent use.
func (p *crashPoint) reached() {
	if n := atomic.AddInt64(&p.n, 1); p.after > 0 && n == p.after {
		killSelf()
		select {}
	}
}

func runChainService(ctx context.Context, c chainService) error {
	point := &crashPoint{after: int64(c.KillAfter)}
	payments, ledger, notify := chainSchemas(c.Prefix)
	switch c.Role {
	case chainAPI:
		return runChainAPI(ctx, c, payments, point)
	case chainPayRelay:
		pub, err := starting(ctx, func() (*rabbitmq.Publisher, error) {
			return rabbitmq.NewPublisher(ctx, rabbitmq.PublisherConfig{URL: c.AMQPURL, ConnectionName: "chain-" + c.Role})
		})
		if err != nil {
			return err
		}
		defer pub.Close()
		return runChainRelay(ctx, c, payments, point, func(ctx context.Context, dest string, msgs ...*consumer.Message) error {
			return pub.Publish(ctx, "", dest, msgs...)
		})
	case chainLedgerRelay:
		pub, err := starting(ctx, func() (*natsjs.Publisher, error) {
			return natsjs.NewPublisher(ctx, natsjs.PublisherConfig{URL: c.NATSURL})
		})
		if err != nil {
			return err
		}
		defer pub.Close()
		return runChainRelay(ctx, c, ledger, point, pub.Publish)
	case chainLedger:
		src, err := starting(ctx, func() (consumer.Source, error) {
			return rabbitmq.NewSource(ctx, rabbitmq.Config{URL: c.AMQPURL, Queue: c.Queue, ConnectionName: "chain-" + c.Role, Topology: &rabbitmq.Topology{}})
		})
		if err != nil {
			return err
		}
		entries := pgx.Identifier{ledger, "entries"}.Sanitize()
		return runChainConsumer(ctx, c, ledger, chainLedgerConsumer, src, point, func(ob *outbox.Outbox) consumer.Handler {
			return consumer.JSON(func(ctx context.Context, tx pgx.Tx, m *consumer.Message, ch chainCharge) error {
				if _, err := tx.Exec(ctx, `INSERT INTO `+entries+` (key, account, cents) VALUES ($1, $2, $3)`, ch.Key, ch.Account, ch.Cents); err != nil {
					return err
				}
				body, _ := json.Marshal(ch)
				return ob.Enqueue(ctx, tx, outbox.Message{Destination: c.Subject, ID: keys.ChildKey(m.ID, chainLedgerStep), Body: body})
			})
		})
	case chainNotify:
		src, err := starting(ctx, func() (consumer.Source, error) {
			return natsjs.NewSource(ctx, natsjs.Config{URL: c.NATSURL, Stream: c.Stream, Subject: c.Subject, Durable: chainNotifyConsumer,
				AckWait: NATSAckWait, Topology: &natsjs.Topology{}})
		})
		if err != nil {
			return err
		}
		notes := pgx.Identifier{notify, "notifications"}.Sanitize()
		return runChainConsumer(ctx, c, notify, chainNotifyConsumer, src, point, func(*outbox.Outbox) consumer.Handler {
			return consumer.JSON(func(ctx context.Context, tx pgx.Tx, _ *consumer.Message, ch chainCharge) error {
				_, err := tx.Exec(ctx, `INSERT INTO `+notes+` (key, text) VALUES ($1, $2)`, ch.Key,
					fmt.Sprintf("%s was charged %d cents", ch.Account, ch.Cents))
				return err
			})
		})
	}
	return fmt.Errorf("unknown role %q", c.Role)
}

// starting calls open until it succeeds, for up to startTimeout: a service
// starting during a Postgres restart or a connection cut waits for it, as
// its supervisor would start it again.
func starting[T any](ctx context.Context, open func() (T, error)) (T, error) {
	deadline := time.Now().Add(startTimeout)
	for {
		v, err := open()
		if err == nil || ctx.Err() != nil || time.Now().After(deadline) {
			return v, err
		}
		if !sleepCtx(ctx, 200*time.Millisecond) {
			return v, err
		}
	}
}

// startTimeout bounds a chain service's start.
const startTimeout = 30 * time.Second

// runChainAPI serves POST /charges until ctx ends.
func runChainAPI(ctx context.Context, c chainService, schema string, point *crashPoint) error {
	pool, err := pgxpool.New(ctx, c.DatabaseURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	mw, err := httpidem.New(pool, httpidem.Config{Schema: schema, LockTimeout: chainLockTimeout})
	if err != nil {
		return err
	}
	ob, err := outbox.New(pool, outbox.Config{Schema: schema})
	if err != nil {
		return err
	}
	charges := pgx.Identifier{schema, "charges"}.Sanitize()
	mux := http.NewServeMux()
	mux.HandleFunc("POST /charges", func(w http.ResponseWriter, r *http.Request) {
		tx, _ := httpidem.Tx(r.Context())
		var ch chainCharge
		if err := json.NewDecoder(r.Body).Decode(&ch); err != nil || ch.Account == "" || ch.Cents <= 0 {
			http.Error(w, `want {"account": non-empty, "cents": positive}`, http.StatusBadRequest)
			return
		}
		ch.Key = r.Header.Get("Idempotency-Key")
		var id int64
		err := tx.QueryRow(r.Context(), `INSERT INTO `+charges+` (key, account, cents) VALUES ($1, $2, $3) RETURNING id`, ch.Key, ch.Account, ch.Cents).Scan(&id)
		if err == nil {
			body, _ := json.Marshal(ch)
			err = ob.Enqueue(r.Context(), tx, outbox.Message{Destination: c.Queue, ID: keys.ChildKey(ch.Key, chainChargeStep), Body: body})
		}
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError) // rolls back, frees the key
			return
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = fmt.Fprintf(w, `{"charge_id": %d}`, id)
	})
	api := mw.Wrap(mux)
	// httpidem commits, then writes the response: a fresh 201 reaching
	// this writer is the point between the two.
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		api.ServeHTTP(&crashWriter{ResponseWriter: w, point: point}, r)
	})
	var ln net.Listener
	for try := 0; ; try++ { // the last incarnation's port may linger a moment
		if ln, err = net.Listen("tcp", c.Listen); err == nil || try == 50 {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: handler, ReadHeaderTimeout: 5 * time.Second}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	select {
	case err := <-served:
		return err
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return srv.Shutdown(sctx)
}

// crashWriter passes the crash point when a fresh (not replayed) 201 is
// about to be written.
type crashWriter struct {
	http.ResponseWriter
	point *crashPoint
}

func (w *crashWriter) WriteHeader(code int) {
	if code == http.StatusCreated && w.Header().Get("Idempotent-Replayed") == "" {
		w.point.reached()
	}
	w.ResponseWriter.WriteHeader(code)
}

// runChainRelay relays schema's outbox with publish until ctx ends,
// passing the crash point after each confirmed publish, before the rows
// are marked sent.
func runChainRelay(ctx context.Context, c chainService, schema string, point *crashPoint, publish outbox.PublishFunc) error {
	pool, err := pgxpool.New(ctx, c.DatabaseURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	ob, err := outbox.New(pool, outbox.Config{Schema: schema})
	if err != nil {
		return err
	}
	r, err := outbox.NewRelay(ob, outbox.RelayConfig{
		Publish: func(ctx context.Context, dest string, msgs ...*consumer.Message) error {
			if err := publish(ctx, dest, msgs...); err != nil {
				return err
			}
			point.reached()
			return nil
		},
		PollInterval:   20 * time.Millisecond,
		PublishTimeout: 2 * time.Second,
		Lease:          5 * time.Second, // a killed relay's rows are due again after it
		Backoff:        outbox.BackoffConfig{InitialInterval: 50 * time.Millisecond, MaxInterval: time.Second},
	})
	if err != nil {
		return err
	}
	return r.Run(ctx)
}

// runChainConsumer runs a consumer named name on src until ctx ends; its
// handler comes from handler, given the service's outbox.
func runChainConsumer(ctx context.Context, c chainService, schema, name string, src consumer.Source, point *crashPoint, handler func(*outbox.Outbox) consumer.Handler) error {
	store, err := starting(ctx, func() (*processed.Store, error) {
		return processed.Open(ctx, c.DatabaseURL, processed.Config{Schema: schema})
	})
	if err != nil {
		_ = src.Close()
		return err
	}
	defer store.Close()
	ob, err := outbox.New(store.Pool(), outbox.Config{Schema: schema})
	if err != nil {
		_ = src.Close()
		return err
	}
	var st dedup.Store = store
	if c.Sabotage == SabotageNoDedup && c.Role == chainLedger {
		st = noDedup{store}
	}
	rt, err := consumer.New(consumer.Config{Name: name, Source: src, Store: st, Handler: handler(ob),
		Hooks: []consumer.Hook{&crashHook{point: point}}})
	if err != nil {
		_ = src.Close()
		return err
	}
	return rt.Run(ctx)
}

// crashHook passes the crash point after each COMMIT, before the ack.
type crashHook struct {
	consumer.HookDefaults
	point *crashPoint
}

func (h *crashHook) OnApplied(context.Context, *consumer.Message, time.Duration, time.Duration) {
	h.point.reached()
}

// noDedup is SabotageNoDedup's store: it claims as processed does, then
// deletes the claims in the same transaction and calls every message new,
// so that nothing is ever deduplicated.
type noDedup struct{ *processed.Store }

func (s noDedup) BeginClaim(ctx context.Context, claims []dedup.Claim) (pgx.Tx, []dedup.ClaimResult, error) {
	tx, res, err := s.Store.BeginClaim(ctx, claims)
	if err != nil {
		return tx, res, err
	}
	ids := make([]string, len(claims))
	for i, c := range claims {
		ids[i] = c.MessageID
		res[i] = dedup.ClaimResult{Outcome: dedup.ClaimNew}
	}
	table := pgx.Identifier{s.Schema(), s.Table()}.Sanitize()
	if _, err := tx.Exec(ctx, `DELETE FROM `+table+` WHERE consumer = $1 AND message_id = ANY($2)`, claims[0].Consumer, ids); err != nil {
		return tx, nil, err
	}
	return tx, res, nil
}

// chainListen returns a free loopback address for the API.
func chainListen() (string, error) {
	p, err := freePort()
	if err != nil {
		return "", err
	}
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(p)), nil
}
