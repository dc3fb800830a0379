package httpidem_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/httpidem"
)

// Example wraps a handler that writes through the request's transaction. A
// retry with the same key replays the first response; the handler runs once.
func Example() {
	ctx := context.Background()
	url := os.Getenv("DATABASE_URL")
	if url == "" {
		url = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()
	_, _ = pool.Exec(ctx, `DROP SCHEMA IF EXISTS idemq_httpidem_example CASCADE`)
	defer pool.Exec(ctx, `DROP SCHEMA IF EXISTS idemq_httpidem_example CASCADE`)

	mw, err := httpidem.New(pool, httpidem.Config{Schema: "idemq_httpidem_example"})
	if err != nil {
		fmt.Println(err)
		return
	}
	if err := mw.Migrate(ctx); err != nil {
		fmt.Println(err)
		return
	}
	_, _ = pool.Exec(ctx, `CREATE TABLE idemq_httpidem_example.orders (id serial, item text)`)

	h := mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, _ := httpidem.Tx(r.Context())
		var id int
		_ = tx.QueryRow(r.Context(), `INSERT INTO idemq_httpidem_example.orders (item) VALUES ('book') RETURNING id`).Scan(&id)
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "order %d", id)
	}))
	for range 2 {
		req := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader(`{"item":"book"}`))
		req.Header.Set("Idempotency-Key", "order-abc")
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		fmt.Printf("%d %s replayed=%q\n", rec.Code, rec.Body.String(), rec.Header().Get(httpidem.ReplayedHeader))
	}
	// Output:
	// 201 order 1 replayed=""
	// 201 order 1 replayed="true"
}
