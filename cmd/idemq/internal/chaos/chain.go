package chaos

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	amqp "github.com/rabbitmq/amqp091-go"

	natsjs "github.com/idemq/idemq/brokers/nats"
	"github.com/idemq/idemq/brokers/rabbitmq"
	"github.com/idemq/idemq/cmd/idemq/internal/reconcile"
	"github.com/idemq/idemq/httpidem"
	"github.com/idemq/idemq/outbox"
	"github.com/idemq/idemq/processed"
)

// BrokerChain is the chain scenario's "broker": RabbitMQ between payments
// and ledger, NATS JetStream between ledger and notify. A Scenario with it
// runs the whole chain of examples/chain as five OS processes (an HTTP API
// with idempotency keys, two outbox relays, two consumers; see the chain*
// roles), each started again after it dies, under a load client that
// retries as a real one would; Kills, SelfKills (each service's own crash
// point), PGRestarts, PGResetRate and ConnCuts apply. Its checker reports,
// per key, a request answered 2xx without its downstream effects (Lost),
// an effect applied twice (Duplicates), an effect for a key never
// answered 2xx (Unexpected), an outbox row never published (Orphaned) and
// any dead letter.
const BrokerChain = "chain"

// chainClients is the load client's concurrency.
const chainClients = 8

// chainState is a chain scenario's wiring.
type chainState struct {
	prefix                 string
	queue, stream, subject string
	listen                 string
	pgProxy, amqpProxy     *Proxy
	natsProxy              *Proxy
	load                   *chainLoad
}

// notifications is the notify service's table.
func (c *chainState) notifications() string {
	_, _, notify := chainSchemas(c.prefix)
	return pgx.Identifier{notify, "notifications"}.Sanitize()
}

// runChain runs a BrokerChain scenario.
func (h *harness) runChain(ctx context.Context, idx int, s Scenario) (Result, error) {
	ctx, cancel := context.WithTimeout(ctx, s.Timeout)
	defer cancel()
	tag := randomHex(4)
	r := &run{h: h, db: scenarioDB{url: h.dbURL, pool: h.pool}, s: s, idx: idx, dir: filepath.Join(h.dir, s.Name),
		rng: mrand.New(mrand.NewPCG(h.cfg.Seed, uint64(idx))), procs: map[incKey]*proc{}, logPaths: map[incKey]string{}, kills: map[incKey]int64{},
		nemesisSent: map[incKey]int64{}, armed: map[incKey]bool{}, nextInc: map[int]int{}, start: time.Now(),
		chain: &chainState{prefix: "chain_" + tag, queue: "idemq-chain-" + tag, stream: "IDEMQ_CHAIN_" + tag,
			subject: "idemq.chain." + tag}}
	c := r.chain
	r.phase.Store("setup")
	res := Result{Scenario: s.Name, Broker: s.Broker, Mode: s.Mode, Faults: s.Faults(), Messages: s.Messages}
	if err := os.MkdirAll(r.dir, 0o755); err != nil {
		return res, fmt.Errorf("chaos: %w", err)
	}
	h.event("scenario %s: the chain (API, relays, ledger, notify as %d processes), %d keys, faults: %s", s.Name, len(chainRoles), s.Messages, res.Faults)
	if err := r.setupChain(ctx); err != nil {
		return res, err
	}
	defer r.teardownChain()
	c.load = &chainLoad{endpoint: "http://" + c.listen + "/charges", accepted: map[string]chainCharge{}}

	progressDone := make(chan struct{})
	var progressWG sync.WaitGroup
	if h.cfg.Progress != nil {
		progressWG.Add(1)
		go func() {
			defer progressWG.Done()
			r.progressLoop(ctx, progressDone)
		}()
	}
	for slot := range chainRoles {
		r.startSlot(ctx, slot)
	}
	loadDone := make(chan struct{})
	go func() {
		defer close(loadDone)
		c.load.drive(ctx, r)
	}()
	nemesisDone := make(chan struct{})
	go func() {
		defer close(nemesisDone)
		r.nemesis(ctx)
	}()
	<-loadDone
	<-nemesisDone
	var failures []string
	r.phase.Store("draining")
	h.event("scenario %s: load and faults done; waiting for every accepted key to reach notify", s.Name)
	if err := r.waitChain(ctx); err != nil {
		failures = append(failures, err.Error())
	}
	r.phase.Store("stopping")
	r.stopAll()
	close(progressDone)
	progressWG.Wait()

	res.Duration = time.Since(r.start)
	v, more, err := r.checkChain(context.WithoutCancel(ctx))
	if err != nil {
		return res, err
	}
	res.Verdict = v
	l := c.load
	res.Publishes = int(l.requests.Load())
	res.ProducerDuplicates = int(l.timeouts.Load() + l.duplicates.Load() + l.changed.Load())
	res.KillsRandom, res.KillsAfterCommit = int(r.killsRandom.Load()), int(r.killsSelf.Load())
	res.Kills = res.KillsRandom + res.KillsAfterCommit
	res.Incarnations = r.incarnations
	res.Injected = map[string]int64{}
	r.injected.Range(func(k, v any) bool {
		res.Injected[k.(string)] = v.(*atomic.Int64).Load()
		return true
	})
	r.mu.Lock()
	for k := range r.kills {
		if _, random := r.nemesisSent[k]; random {
			res.Injected["kill-"+chainRoles[k.slot]+"-random"]++
		} else {
			res.Injected[chainCrashPoint[chainRoles[k.slot]]]++
		}
	}
	r.mu.Unlock()
	res.Injected["client-timeouts"] = l.timeouts.Load()
	res.Injected["client-resends"] = l.duplicates.Load()
	res.Injected["client-changed-bodies"] = l.changed.Load()
	for k, v := range res.Injected {
		if v == 0 {
			delete(res.Injected, k)
		}
	}
	if !v.Pass() {
		failures = append(failures, fmt.Sprintf("exactly-once broken: %d lost, %d duplicate effects, %d unexpected, %d orphaned, %d dead-lettered",
			len(v.Lost), len(v.Duplicates), len(v.Unexpected), len(v.Orphaned), len(v.DeadLettered)))
	}
	failures = append(failures, more...)
	r.finish(&res, failures)
	return res, nil
}

// setupChain creates the services' schemas and tables, the queue and the
// streams, and the proxies the services reach Postgres and the brokers
// through.
func (r *run) setupChain(ctx context.Context) error {
	c := r.chain
	payments, ledger, notify := chainSchemas(c.prefix)
	for _, schema := range []string{payments, ledger, notify} {
		if _, err := r.db.pool.Exec(ctx, `CREATE SCHEMA `+pgx.Identifier{schema}.Sanitize()); err != nil {
			return fmt.Errorf("chaos: create schema: %w", err)
		}
	}
	mw, err := httpidem.New(r.db.pool, httpidem.Config{Schema: payments})
	if err != nil {
		return err
	}
	if err := mw.Migrate(ctx); err != nil {
		return fmt.Errorf("chaos: migrate httpidem: %w", err)
	}
	for _, schema := range []string{payments, ledger} {
		ob, err := outbox.New(r.db.pool, outbox.Config{Schema: schema})
		if err != nil {
			return err
		}
		if err := ob.Migrate(ctx); err != nil {
			return fmt.Errorf("chaos: migrate outbox: %w", err)
		}
	}
	for _, schema := range []string{ledger, notify} {
		store, err := processed.New(r.db.pool, processed.Config{Schema: schema})
		if err != nil {
			return err
		}
		if err := store.Migrate(ctx); err != nil {
			return fmt.Errorf("chaos: migrate the dedup store: %w", err)
		}
	}
	// No unique constraint on effects: a duplicate shows as a second row.
	_, err = r.db.pool.Exec(ctx, `
		CREATE TABLE `+pgx.Identifier{payments, "charges"}.Sanitize()+` (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, key text NOT NULL, account text NOT NULL, cents bigint NOT NULL);
		CREATE TABLE `+pgx.Identifier{ledger, "entries"}.Sanitize()+` (key text NOT NULL, account text NOT NULL, cents bigint NOT NULL);
		CREATE TABLE `+pgx.Identifier{notify, "notifications"}.Sanitize()+` (key text NOT NULL, text text NOT NULL);`)
	if err != nil {
		return fmt.Errorf("chaos: create the services' tables: %w", err)
	}

	// The queue and the streams exist before the relays publish, declared
	// as the consumers declare them.
	if err := r.h.withRetry(ctx, func() error {
		src, err := rabbitmq.NewSource(ctx, rabbitmq.Config{URL: r.h.amqpURL, Queue: c.queue, Topology: &rabbitmq.Topology{}})
		if err != nil {
			return err
		}
		return src.Close()
	}); err != nil {
		return fmt.Errorf("chaos: declare the queue: %w", err)
	}
	if err := r.h.withRetry(ctx, func() error {
		src, err := natsjs.NewSource(ctx, natsjs.Config{URL: r.h.natsSrv.URL(), Stream: c.stream, Subject: c.subject,
			Durable: chainNotifyConsumer, AckWait: NATSAckWait, Topology: &natsjs.Topology{}})
		if err != nil {
			return err
		}
		return src.Close()
	}); err != nil {
		return fmt.Errorf("chaos: declare the streams: %w", err)
	}

	pgTarget, err := hostPort(r.db.url)
	if err != nil {
		return err
	}
	if c.pgProxy, err = NewProxy(pgTarget, ProxyOptions{Postgres: true, OnCommit: r.onChainCommit}); err != nil {
		return err
	}
	amqpTarget, err := amqpHostPort(r.h.amqpURL)
	if err != nil {
		return err
	}
	if c.amqpProxy, err = NewProxy(amqpTarget, ProxyOptions{}); err != nil {
		return err
	}
	if c.natsProxy, err = NewProxy(r.h.natsSrv.Addr(), ProxyOptions{}); err != nil {
		return err
	}
	c.listen, err = chainListen()
	return err
}

// onChainCommit decides the fate of a COMMIT through the Postgres proxy:
// at PGResetRate, the connection is reset, half the time after forwarding
// the COMMIT (an ambiguous commit), half before.
func (r *run) onChainCommit() CommitAction {
	if r.s.PGResetRate <= 0 || r.float() >= r.s.PGResetRate {
		return CommitPass
	}
	if r.float() < 0.5 {
		r.inject("pg-reset-after-commit", 1)
		return CommitResetAfter
	}
	r.inject("pg-reset-before-commit", 1)
	return CommitResetBefore
}

// teardownChain closes the proxies and drops what setupChain created.
func (r *run) teardownChain() {
	c := r.chain
	for _, p := range []*Proxy{c.pgProxy, c.amqpProxy, c.natsProxy} {
		if p != nil {
			p.Close()
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	payments, ledger, notify := chainSchemas(c.prefix)
	for _, schema := range []string{payments, ledger, notify} {
		_, _ = r.db.pool.Exec(ctx, `DROP SCHEMA IF EXISTS `+pgx.Identifier{schema}.Sanitize()+` CASCADE`)
	}
	_ = r.h.withRetry(ctx, func() error {
		conn, err := amqp.Dial(r.h.amqpURL)
		if err != nil {
			return err
		}
		defer conn.Close()
		ch, err := conn.Channel()
		if err != nil {
			return err
		}
		for _, q := range []string{c.queue, rabbitmq.DLQName(c.queue)} {
			if _, err := ch.QueueDelete(q, false, false, false); err != nil {
				return err
			}
		}
		return ch.ExchangeDelete(c.queue+".dlx", false, false)
	})
	if nc, err := nats.Connect(r.h.natsSrv.URL(), nats.Timeout(5*time.Second)); err == nil {
		if js, err := jetstream.New(nc); err == nil {
			for _, s := range []string{c.stream, c.stream + natsjs.DLQStreamSuffix} {
				_ = js.DeleteStream(ctx, s)
			}
		}
		nc.Close()
	}
}

// chainCommand returns the command of a new incarnation inc of a chain
// service in slot, armed to kill itself after killAfter crash points.
func (r *run) chainCommand(slot, inc, killAfter int) (*exec.Cmd, error) {
	c := r.chain
	dbURL, err := proxiedURL(r.db.url, c.pgProxy.Addr())
	if err != nil {
		return nil, err
	}
	amqpURL, err := proxiedURL(r.h.amqpURL, c.amqpProxy.Addr())
	if err != nil {
		return nil, err
	}
	b, err := json.Marshal(chainService{
		Role: chainRoles[slot], Slot: slot, Incarnation: inc,
		DatabaseURL: dbURL, AMQPURL: amqpURL, NATSURL: "nats://" + c.natsProxy.Addr(),
		Prefix: c.prefix, Queue: c.queue, Stream: c.stream, Subject: c.subject, Listen: c.listen,
		KillAfter: killAfter, Sabotage: r.s.Sabotage,
	})
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(r.h.cfg.WorkerCommand[0], r.h.cfg.WorkerCommand[1:]...)
	cmd.Env = append(os.Environ(), ChainServiceEnv+"="+string(b))
	return cmd, nil
}

// waitChain waits until every accepted key has its notification and both
// outboxes are empty of unsent rows.
func (r *run) waitChain(ctx context.Context) error {
	c := r.chain
	want := int64(c.load.acceptedN())
	payments, ledger, _ := chainSchemas(c.prefix)
	var notified, unsent int64
	for {
		qctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		err := r.db.pool.QueryRow(qctx, `SELECT (SELECT count(DISTINCT key) FROM `+c.notifications()+`),
			(SELECT count(*) FROM `+pgx.Identifier{payments, "outbox"}.Sanitize()+` WHERE sent_at IS NULL) +
			(SELECT count(*) FROM `+pgx.Identifier{ledger, "outbox"}.Sanitize()+` WHERE sent_at IS NULL)`).Scan(&notified, &unsent)
		cancel()
		if err == nil {
			if notified >= want && unsent == 0 {
				// Let redeliveries in flight settle, as they would
				// after any crash.
				sleepCtx(ctx, 2*time.Second)
				return nil
			}
		}
		if !sleepCtx(ctx, 250*time.Millisecond) {
			return fmt.Errorf("timed out with %d of %d accepted keys notified and %d outbox rows unsent", notified, want, unsent)
		}
	}
}

// checkChain compares, key by key, what the client was told with each
// service's effects, and looks for unsent outbox rows and dead letters.
// It returns the verdict and the failures that are not a key's.
func (r *run) checkChain(ctx context.Context) (Verdict, []string, error) {
	c := r.chain
	payments, ledger, _ := chainSchemas(c.prefix)
	type row struct{ n, cents int64 }
	var v Verdict
	load := func(table string, cents bool) (map[string]row, error) {
		sum := "0::bigint"
		if cents {
			sum = "sum(cents)::bigint"
		}
		rows, err := r.db.pool.Query(ctx, `SELECT key, count(*), `+sum+` FROM `+table+` GROUP BY key`)
		if err != nil {
			return nil, fmt.Errorf("chaos: read %s: %w", table, err)
		}
		defer rows.Close()
		m := map[string]row{}
		for rows.Next() {
			var k string
			var x row
			if err := rows.Scan(&k, &x.n, &x.cents); err != nil {
				return nil, err
			}
			m[k] = x
		}
		return m, rows.Err()
	}
	charges, err := load(pgx.Identifier{payments, "charges"}.Sanitize(), true)
	if err != nil {
		return v, nil, err
	}
	entries, err := load(pgx.Identifier{ledger, "entries"}.Sanitize(), true)
	if err != nil {
		return v, nil, err
	}
	notes, err := load(c.notifications(), false)
	if err != nil {
		return v, nil, err
	}
	l := c.load
	l.mu.Lock()
	defer l.mu.Unlock()
	v.Confirmed = len(l.accepted)
	v.Processed = len(notes)
	var failures []string
	for key, ch := range l.accepted {
		if charges[key].n == 0 || entries[key].n == 0 || notes[key].n == 0 {
			v.Lost = append(v.Lost, fmt.Sprintf("%s (%d charges, %d ledger entries, %d notifications)", key, charges[key].n, entries[key].n, notes[key].n))
			continue
		}
		if charges[key].n == 1 && entries[key].n == 1 && (charges[key].cents != ch.Cents || entries[key].cents != ch.Cents) {
			failures = append(failures, fmt.Sprintf("%s: accepted %d cents, charged %d, entered %d", key, ch.Cents, charges[key].cents, entries[key].cents))
		}
	}
	for _, m := range []map[string]row{charges, entries, notes} {
		for key, x := range m {
			v.Effects += int(x.n)
			if x.n > 1 {
				v.Duplicates = append(v.Duplicates, key)
			}
			if _, ok := l.accepted[key]; !ok {
				v.Unexpected = append(v.Unexpected, key)
			}
		}
	}
	for _, schema := range []string{payments, ledger} {
		rows, err := r.db.pool.Query(ctx, `SELECT destination || ' ' || message_id FROM `+pgx.Identifier{schema, "outbox"}.Sanitize()+` WHERE sent_at IS NULL`)
		if err != nil {
			return v, nil, fmt.Errorf("chaos: read the outbox: %w", err)
		}
		ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return v, nil, err
		}
		v.Orphaned = append(v.Orphaned, ids...)
	}
	dead, err := r.chainDeadLetters(ctx)
	if err != nil {
		return v, nil, err
	}
	v.DeadLettered = dead
	if got, want := l.rejected.Load(), l.changed.Load(); got != want {
		failures = append(failures, fmt.Sprintf("%d of %d re-sends with another body refused with 422", got, want))
	}
	if n := l.changedAccepted.Load(); n > 0 {
		failures = append(failures, fmt.Sprintf("%d re-sends with another body were accepted", n))
	}
	if n := l.refused.Load(); n > 0 {
		failures = append(failures, fmt.Sprintf("%d requests were refused (not 201) though sent with their own key and body", n))
	}
	if n := l.unfinished.Load(); n > 0 {
		failures = append(failures, fmt.Sprintf("%d keys were never answered 2xx before the scenario ended", n))
	}
	// idemq reconcile, over the same databases, must find them clean.
	rep, err := reconcile.Run(ctx, r.chainReconcileConfig())
	if err != nil {
		return v, nil, fmt.Errorf("chaos: reconcile: %w", err)
	}
	if !rep.Clean {
		var kinds []string
		for _, k := range rep.Kinds() {
			if k.Failing && k.Kind.Count > 0 {
				kinds = append(kinds, fmt.Sprintf("%d %s", k.Kind.Count, k.Title))
			}
		}
		failures = append(failures, "idemq reconcile found discrepancies: "+strings.Join(kinds, ", "))
	}
	for _, s := range [][]string{v.Lost, v.Duplicates, v.Unexpected, v.Orphaned, v.DeadLettered} {
		slices.Sort(s)
	}
	v.Duplicates = slices.Compact(v.Duplicates)
	v.Unexpected = slices.Compact(v.Unexpected)
	return v, failures, nil
}

// chainReconcileConfig is what `idemq reconcile` is told of the chain:
// payments' outbox feeds ledger, which forwards each charge under its
// derived key into its own outbox, which feeds notify.
func (r *run) chainReconcileConfig() reconcile.Config {
	payments, ledger, notify := chainSchemas(r.chain.prefix)
	db := func(name, schema string) reconcile.Database {
		return reconcile.Database{Name: name, DB: r.db.pool,
			Outbox: reconcile.Table{Schema: schema, Name: "outbox"}, Dedup: reconcile.Table{Schema: schema, Name: "processed_messages"}}
	}
	return reconcile.Config{
		Databases: []reconcile.Database{db("payments", payments), db("ledger", ledger), db("notify", notify)},
		Flows: []reconcile.Flow{
			{Producer: "payments", Destination: r.chain.queue, Consumer: chainLedgerConsumer, ConsumerDatabases: []string{"ledger"}},
			{Producer: "ledger", Destination: r.chain.subject, Consumer: chainNotifyConsumer, ConsumerDatabases: []string{"notify"}},
		},
		Forwards: []reconcile.Forward{{Consumer: chainLedgerConsumer, ConsumerDatabases: []string{"ledger"},
			OutboxDatabases: []string{"ledger"}, Destination: r.chain.subject, Step: chainLedgerStep}},
		Since: r.start.Add(-time.Minute),
		Grace: time.Second, // waitChain saw everything settled, and waited longer
	}
}

// chainDeadLetters counts the messages in the queue's and the stream's
// dead-letter queue and stream; the workload has no poison message.
func (r *run) chainDeadLetters(ctx context.Context) ([]string, error) {
	c := r.chain
	var out []string
	conn, err := amqp.Dial(r.h.amqpURL)
	if err != nil {
		return nil, fmt.Errorf("chaos: %w", err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return nil, fmt.Errorf("chaos: %w", err)
	}
	q, err := ch.QueueDeclarePassive(rabbitmq.DLQName(c.queue), true, false, false, false, nil)
	if err != nil {
		return nil, fmt.Errorf("chaos: the dead-letter queue: %w", err)
	}
	for i := range q.Messages {
		out = append(out, fmt.Sprintf("%s #%d", q.Name, i+1))
	}
	nc, err := nats.Connect(r.h.natsSrv.URL(), nats.Timeout(5*time.Second))
	if err != nil {
		return nil, fmt.Errorf("chaos: %w", err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, err
	}
	st, err := js.Stream(ctx, c.stream+natsjs.DLQStreamSuffix)
	if err != nil {
		return nil, fmt.Errorf("chaos: the dead-letter stream: %w", err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		return nil, err
	}
	for i := range info.State.Msgs {
		out = append(out, fmt.Sprintf("%s #%d", info.Config.Name, i+1))
	}
	return out, nil
}

// chainLoad is the load client: what it sent and what it was told.
type chainLoad struct {
	endpoint                                string
	requests, timeouts, duplicates, changed atomic.Int64
	rejected, changedAccepted, unfinished   atomic.Int64
	refused                                 atomic.Int64 // the same request refused (not 201)
	mu                                      sync.Mutex
	accepted                                map[string]chainCharge
}

func (l *chainLoad) acceptedN() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.accepted)
}

// drive sends one charge per key, spread over PublishOver, from
// chainClients clients, as a real client would: a quarter of first
// attempts time out at once (the answer is lost, not the request) and are
// sent again with the same key and body; DupRate of keys are sent again
// after their answer; one in twenty is sent again with another amount,
// which must be refused with 422. Every request is retried with its key
// until it gets an answer that settles it.
func (l *chainLoad) drive(ctx context.Context, r *run) {
	keys := make(chan int)
	var wg sync.WaitGroup
	for range chainClients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range keys {
				l.one(ctx, r, i)
			}
		}()
	}
	every := r.s.PublishOver / time.Duration(r.s.Messages)
	for i := range r.s.Messages {
		if !sleepCtx(ctx, time.Until(r.start.Add(time.Duration(i)*every))) {
			break
		}
		select {
		case keys <- i:
		case <-ctx.Done():
		}
	}
	close(keys)
	wg.Wait()
}

func (l *chainLoad) one(ctx context.Context, r *run, i int) {
	key := fmt.Sprintf("%s-%06d", r.s.Name, i)
	ch := chainCharge{Account: fmt.Sprintf("acct-%d", i%17), Cents: int64(100 + i)}
	if r.intn(4) == 0 {
		l.timeouts.Add(1)
		_, _ = l.post(ctx, key, ch, time.Millisecond) // gives up at once; the server may still commit
	}
	status, ok := l.until(ctx, key, ch)
	if !ok {
		l.unfinished.Add(1)
		return
	}
	if status != http.StatusCreated {
		l.refused.Add(1)
		return
	}
	l.mu.Lock()
	l.accepted[key] = ch
	l.mu.Unlock()
	if r.float() < r.s.DupRate {
		l.duplicates.Add(1)
		if status, ok := l.until(ctx, key, ch); ok && status != http.StatusCreated {
			l.refused.Add(1)
		}
	}
	if i%20 == 0 {
		l.changed.Add(1)
		switch status, ok := l.until(ctx, key, chainCharge{Account: ch.Account, Cents: ch.Cents + 1}); {
		case !ok:
		case status == http.StatusUnprocessableEntity:
			l.rejected.Add(1)
		default:
			l.changedAccepted.Add(1)
		}
	}
}

// until sends the request again until it settles, as a client does on a
// lost connection, a 409 (the first still running) or a 5xx, and returns
// the status that settled it; false if ctx ended first.
func (l *chainLoad) until(ctx context.Context, key string, ch chainCharge) (int, bool) {
	for {
		status, err := l.post(ctx, key, ch, 10*time.Second)
		if err == nil && status != http.StatusConflict && status < 500 {
			return status, true
		}
		if !sleepCtx(ctx, 100*time.Millisecond) {
			return 0, false
		}
	}
}

func (l *chainLoad) post(ctx context.Context, key string, ch chainCharge, timeout time.Duration) (int, error) {
	l.requests.Add(1)
	body, _ := json.Marshal(ch)
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, l.endpoint, bytes.NewReader(body))
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

// proxiedURL is rawURL with its host and port replaced by addr.
func proxiedURL(rawURL, addr string) (string, error) {
	u, err := url.Parse(rawURL)
	if err != nil || u.Host == "" {
		return "", errors.New("chaos: want a URL with a host (scheme://user@host:port/...)")
	}
	u.Host = addr
	return u.String(), nil
}
