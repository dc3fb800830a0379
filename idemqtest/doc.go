// Package idemqtest tests that your handler keeps idemq's exactly-once
// guarantee, in the style of net/http/httptest and river's rivertest.
//
// idemq applies a message once only if the handler does its part: every
// change goes through the transaction it is given, nothing is kept in memory
// from one attempt to the next, the effect does not depend on the clock, and
// nothing leaves the process. A handler that writes through the pool, counts
// in memory, stores now() or calls another service breaks the guarantee
// while idemq's own tests stay green. This package finds out, with one test:
//
//	func TestCreditIsIdempotent(t *testing.T) {
//		idemqtest.Run(t, idemqtest.Suite{
//			Setup:    func(ctx context.Context, env *idemqtest.Env) error { _, err := env.Pool.Exec(ctx, schemaSQL); return err },
//			Handler:  credit,
//			Messages: []*consumer.Message{{ID: "pay-1", Body: []byte(`{"account":"a","cents":100}`)}, ...},
//			Effect:   idemqtest.Rows(`SELECT id, balance_cents FROM accounts`),
//		})
//	}
//
// Run gives one subtest per case (see Suite for the list): duplicates
// delivered one after another and at once, a crash between COMMIT and ack,
// a COMMIT that fails after the handler ran, a transient error and its
// retry, the same id with another payload, a dead-letter replay after a fix,
// the BatchHandler against the Handler, determinism, and a probe that rolls
// the handler's transaction back. Each case runs the real consumer runtime
// over the in-memory broker (brokers/memory) with faults injected around
// it, in a fresh schema, and compares the end state, read by the Suite's
// Effect, with the state after applying each sample once; every sample must
// also end applied, with its dedup row, not dead-lettered (but where the
// case dead-letters on purpose). The probe runs the handler on each sample
// in a transaction it then rolls back, and fails if any table of the
// schema, or the Recorder, changed all the same: a write through the pool,
// even one a retry cannot double (ON CONFLICT DO NOTHING), is named there.
// A failure names the case, says what was done and what usually causes the
// difference, and shows a line diff of the effect as JSON.
//
// Given an HTTPSuite, Run does the same for an HTTP API behind httpidem:
// concurrent duplicate requests, a connection lost after the commit, a key
// reused with another body, a key after its retention, and consistent
// replays.
//
// # The database
//
// Every run gets an Env: a fresh schema in the test database (created and
// dropped by the kit), a pool whose search_path is that schema, so that
// unqualified table names in Setup, handlers and Effect resolve to it, and a
// fresh Recorder. The database is Suite.DatabaseURL, else
// $IDEMQ_TEST_DATABASE_URL, else $DATABASE_URL, else
// postgres://postgres@127.0.0.1:5432/test?sslmode=disable; the kit creates
// nothing outside its own idemqtest_* schemas.
//
// # Volatile values and services
//
// Leave columns such as created_at DEFAULT now() out of the Effect, or list
// them in Suite.Ignore; the determinism case reports any value that differs
// between two clean runs, and the other cases mask such values so that each
// reports only its own difference. A handler that calls another service
// should call Env.Recorder.URL in the test: the Recorder's calls are part of
// the compared effect, so a call repeated by a retry fails the retry cases.
// Build such a handler with Suite.NewHandler, which gets each run's Env;
// NewHandler also gives each run a fresh handler, as a restarted process
// would have.
//
// # Limits
//
// The kit runs the runtime on its defaults: a per-message Handler in groups
// (BatchSize 32, the deliveries waiting when a lane starts a transaction
// share it), and, given a BatchHandler, batch mode. The concurrent case
// clears the messages' ordering Key, as redeliveries to another process
// would not share this process's key lanes.
// Run needs a *testing.T; Check runs the same cases anywhere and returns
// the results.
package idemqtest
