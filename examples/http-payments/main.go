// Command http-payments is a small payments API whose POST /payments is made
// idempotent by httpidem: a client that retries with the same
// Idempotency-Key gets the original response, and the account is credited
// once.
//
//	go run ./examples/http-payments          # -addr 127.0.0.1:8080
//
// Postgres comes from DATABASE_URL (default the local server). The program
// works in the schema idemq_example_http, created if missing. Its errors
// never show the database password. See README.md for a curl walk-through.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/httpidem"
)

const (
	defaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	defaultSchema      = "idemq_example_http"
	// retention is how long idempotency keys are remembered.
	retention = 24 * time.Hour
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	switch {
	case errors.Is(err, flag.ErrHelp): // -h: the usage is printed
	case errors.As(err, new(usageError)):
		fmt.Fprintln(os.Stderr, "http-payments:", err)
		os.Exit(2)
	case err != nil:
		fmt.Fprintln(os.Stderr, "http-payments:", err)
		os.Exit(1)
	}
}

// usageError is a mistake on the command line.
type usageError struct{ err error }

func (e usageError) Error() string { return e.err.Error() + " (run with -h for the flags)" }
func (e usageError) Unwrap() error { return e.err }

// run serves the API until ctx is done, logging to logOut. On -h or --help
// it prints the usage to stdout and returns flag.ErrHelp. No error it
// returns contains the database password.
func run(ctx context.Context, args []string, stdout, logOut io.Writer) error {
	dbURL := os.Getenv("DATABASE_URL")
	if dbURL == "" {
		dbURL = defaultDatabaseURL
	}
	fs := flag.NewFlagSet("http-payments", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), "Usage: go run ./examples/http-payments [flags]\n\nServes a payments API whose POST /payments is idempotent per\nIdempotency-Key, on Postgres ($DATABASE_URL). See README.md for a curl\nwalk-through.\n\nFlags:\n")
		fs.PrintDefaults()
	}
	addr := fs.String("addr", "127.0.0.1:8080", "listen address")
	schema := fs.String("schema", defaultSchema, "Postgres schema for the example's tables")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			fs.SetOutput(stdout)
			fs.Usage()
			return err
		}
		return usageError{err}
	}
	if fs.NArg() > 0 {
		return usageError{fmt.Errorf("unexpected argument %q", fs.Arg(0))}
	}
	log := slog.New(slog.NewTextHandler(logOut, nil))
	pool, err := connect(ctx, dbURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	handler, mw, err := newApp(ctx, pool, *schema, log)
	if err != nil {
		return err
	}

	// Retention: forget keys after a day.
	go func() {
		t := time.NewTicker(time.Hour)
		defer t.Stop()
		for {
			if n, err := mw.Purge(ctx, retention); err != nil && ctx.Err() == nil {
				log.Warn("purge", "error", err)
			} else if n > 0 {
				log.Info("purged idempotency keys", "rows", n)
			}
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
		}
	}()

	srv := &http.Server{Addr: *addr, Handler: handler, ReadHeaderTimeout: 10 * time.Second}
	errc := make(chan error, 1)
	go func() { errc <- srv.ListenAndServe() }()
	log.Info("listening", "addr", *addr)
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	shutdown, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return srv.Shutdown(shutdown)
}

// connect opens a pool on url and checks it answers. Its errors name the
// server without credentials; a parse error, whose text may quote the
// password, is not shown.
func connect(ctx context.Context, url string) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, errors.New("invalid DATABASE_URL: check its syntax and parameters")
	}
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(cctx, cfg)
	if err == nil {
		err = pool.Ping(cctx)
	}
	if err != nil {
		if pool != nil {
			pool.Close()
		}
		c := cfg.ConnConfig
		return nil, fmt.Errorf("cannot reach Postgres at %s:%d/%s (start it, or set DATABASE_URL): %w", c.Host, c.Port, c.Database, err)
	}
	return pool, nil
}

// newApp creates the tables and returns the API.
func newApp(ctx context.Context, pool *pgxpool.Pool, schema string, log *slog.Logger) (http.Handler, *httpidem.Middleware, error) {
	mw, err := httpidem.New(pool, httpidem.Config{
		Schema: schema,
		// Keys are per API client. A real service takes the client from
		// its authentication, not from a header anyone can set.
		Scope: func(r *http.Request) string { return r.Header.Get("X-Client-Id") },
		// The client's clock changes on every retry; it is not part of
		// the request's identity.
		IgnoreFields: []string{"client_time"},
		Logger:       log,
	})
	if err != nil {
		return nil, nil, err
	}
	if err := mw.Migrate(ctx); err != nil {
		return nil, nil, err
	}
	s := &api{
		accounts: pgx.Identifier{schema, "accounts"}.Sanitize(),
		payments: pgx.Identifier{schema, "payments"}.Sanitize(),
		pool:     pool,
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+s.accounts+` (
	id            text   PRIMARY KEY,
	balance_cents bigint NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS `+s.payments+` (
	id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
	account      text        NOT NULL,
	amount_cents bigint      NOT NULL,
	created_at   timestamptz NOT NULL DEFAULT now()
)`); err != nil {
		return nil, nil, err
	}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /payments", s.createPayment)
	mux.HandleFunc("GET /payments/{id}", s.getPayment)
	mux.HandleFunc("GET /accounts/{id}", s.getAccount)
	return mw.Wrap(mux), mw, nil
}

type api struct {
	pool               *pgxpool.Pool
	accounts, payments string
}

// Payment is the body of POST /payments.
type Payment struct {
	Account     string `json:"account"`
	AmountCents int64  `json:"amount_cents"`
	ClientTime  string `json:"client_time,omitempty"`
}

// Receipt is the response to POST /payments.
type Receipt struct {
	PaymentID    int64  `json:"payment_id"`
	Account      string `json:"account"`
	AmountCents  int64  `json:"amount_cents"`
	BalanceCents int64  `json:"balance_cents"`
}

func (s *api) createPayment(w http.ResponseWriter, r *http.Request) {
	tx, ok := httpidem.Tx(r.Context())
	if !ok {
		writeJSON(w, http.StatusInternalServerError, map[string]string{"error": "no transaction"})
		return
	}
	var p Payment
	if err := json.NewDecoder(r.Body).Decode(&p); err != nil || p.Account == "" || p.AmountCents <= 0 {
		// A 4xx is stored and replayed like any answer.
		writeJSON(w, http.StatusBadRequest, map[string]string{"error": "want {\"account\": non-empty, \"amount_cents\": positive}"})
		return
	}
	var rc Receipt
	err := tx.QueryRow(r.Context(), `INSERT INTO `+s.payments+` (account, amount_cents) VALUES ($1, $2) RETURNING id`,
		p.Account, p.AmountCents).Scan(&rc.PaymentID)
	if err == nil {
		err = tx.QueryRow(r.Context(), `INSERT INTO `+s.accounts+` (id, balance_cents) VALUES ($1, $2)
ON CONFLICT (id) DO UPDATE SET balance_cents = `+s.accounts+`.balance_cents + EXCLUDED.balance_cents
RETURNING balance_cents`, p.Account, p.AmountCents).Scan(&rc.BalanceCents)
	}
	if err != nil {
		// A 5xx rolls the transaction back and frees the key for a retry.
		writeJSON(w, http.StatusInternalServerError, map[string]string{"error": err.Error()})
		return
	}
	rc.Account, rc.AmountCents = p.Account, p.AmountCents
	w.Header().Set("Location", fmt.Sprintf("/payments/%d", rc.PaymentID))
	writeJSON(w, http.StatusCreated, rc)
}

// PaymentRecord is the response to GET /payments/{id}, the resource a
// created payment's Location names.
type PaymentRecord struct {
	PaymentID   int64     `json:"payment_id"`
	Account     string    `json:"account"`
	AmountCents int64     `json:"amount_cents"`
	CreatedAt   time.Time `json:"created_at"`
}

func (s *api) getPayment(w http.ResponseWriter, r *http.Request) {
	var p PaymentRecord
	id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	if err == nil {
		err = s.pool.QueryRow(r.Context(), `SELECT id, account, amount_cents, created_at FROM `+s.payments+` WHERE id = $1`, id).
			Scan(&p.PaymentID, &p.Account, &p.AmountCents, &p.CreatedAt)
	}
	switch {
	case errors.Is(err, strconv.ErrSyntax), errors.Is(err, strconv.ErrRange), errors.Is(err, pgx.ErrNoRows):
		writeJSON(w, http.StatusNotFound, map[string]string{"error": "no such payment"})
	case err != nil:
		writeJSON(w, http.StatusInternalServerError, map[string]string{"error": err.Error()})
	default:
		writeJSON(w, http.StatusOK, p)
	}
}

func (s *api) getAccount(w http.ResponseWriter, r *http.Request) {
	var balance int64
	err := s.pool.QueryRow(r.Context(), `SELECT balance_cents FROM `+s.accounts+` WHERE id = $1`, r.PathValue("id")).Scan(&balance)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		writeJSON(w, http.StatusNotFound, map[string]string{"error": "no such account"})
	case err != nil:
		writeJSON(w, http.StatusInternalServerError, map[string]string{"error": err.Error()})
	default:
		writeJSON(w, http.StatusOK, map[string]any{"account": r.PathValue("id"), "balance_cents": balance})
	}
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}
