package consumer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/consumer/dedup"
	"github.com/jackc/pgx/v5"
)

type nopSource struct{}

func (nopSource) Receive(ctx context.Context) (Delivery, error) { <-ctx.Done(); return nil, ctx.Err() }
func (nopSource) Close() error                                  { return nil }

// nopStore is a Store with conns connections (0: unknown) and no database.
type nopStore struct{ conns int }

func (nopStore) BeginClaim(context.Context, []dedup.Claim) (pgx.Tx, []dedup.ClaimResult, error) {
	return nil, nil, errors.New("nop")
}
func (nopStore) Ping(context.Context) error                                  { return nil }
func (nopStore) Purge(context.Context, string, time.Duration) (int64, error) { return 0, nil }
func (s nopStore) MaxConns() int                                             { return s.conns }

type hookOnlyRetry struct{ HookDefaults }

func (hookOnlyRetry) OnRetry(context.Context, *Message, int, error, time.Duration) {}

func validConfig() Config {
	return Config{
		Name:         "payments",
		Source:       nopSource{},
		Store:        nopStore{},
		Handler:      func(context.Context, pgx.Tx, *Message) error { return nil },
		DeadLetterer: DeadLettererFunc(func(context.Context, *Message, Failure) error { return nil }),
	}
}

func TestConfigDefaults(t *testing.T) {
	t.Parallel()
	rt, err := New(validConfig())
	if err != nil {
		t.Fatal(err)
	}
	c := rt.cfg
	if c.Concurrency != defaultConcurrency || c.MaxBodyBytes != defaultMaxBodyBytes ||
		c.ShutdownTimeout != defaultShutdownTimeout || c.SlowCommit != defaultSlowCommit || c.Retry.MaxAttempts != defaultMaxAttempts ||
		c.Retry.InitialInterval != defaultInitialInterval || c.Retry.MaxInterval != defaultMaxInterval ||
		c.Retry.MaxElapsed != defaultMaxElapsed || c.Logger == nil || c.MessageID == nil {
		t.Fatalf("defaults not applied: %+v", c)
	}
}

func TestConfigValidation(t *testing.T) {
	t.Parallel()
	cases := []struct {
		field string
		mod   func(*Config)
	}{
		{"Name", func(c *Config) { c.Name = "" }},
		{"Name", func(c *Config) { c.Name = strings.Repeat("n", 201) }},
		{"Source", func(c *Config) { c.Source = nil }},
		{"Store", func(c *Config) { c.Store = nil }},
		{"Store", func(c *Config) { c.Store = nopStore{conns: 1} }},                                             // one connection, Concurrency 8
		{"Store", func(c *Config) { c.Store = nopStore{conns: 1}; c.Concurrency = 1; c.Retention = time.Hour }}, // and a janitor
		{"Handler", func(c *Config) { c.Handler = nil }},
		{"DeadLetterer", func(c *Config) { c.DeadLetterer = nil }},
		{"Concurrency", func(c *Config) { c.Concurrency = -1 }},
		{"MaxBodyBytes", func(c *Config) { c.MaxBodyBytes = -2 }},
		{"HandlerTimeout", func(c *Config) { c.HandlerTimeout = -time.Second }},
		{"ShutdownTimeout", func(c *Config) { c.ShutdownTimeout = -time.Second }},
		{"SlowCommit", func(c *Config) { c.SlowCommit = -2 }},
		{"Retention", func(c *Config) { c.Retention = -time.Hour }},
		{"Retry.MaxAttempts", func(c *Config) { c.Retry.MaxAttempts = -3 }},
		{"Retry.MaxInterval", func(c *Config) { c.Retry.InitialInterval = time.Minute; c.Retry.MaxInterval = time.Second }},
		{"Middleware[0]", func(c *Config) { c.Middleware = []Middleware{nil} }},
		{"Hooks[0]", func(c *Config) { c.Hooks = []Hook{HookDefaults{}} }}, // a hook of no event
	}
	for _, tc := range cases {
		cfg := validConfig()
		tc.mod(&cfg)
		_, err := New(cfg)
		var ce *ConfigError
		if !errors.As(err, &ce) || ce.Field != tc.field || !errors.Is(err, ErrInvalidConfig) {
			t.Errorf("%s: got %v, want a ConfigError for field %s", tc.field, err, tc.field)
		}
	}

	cfg := validConfig()
	cfg.Store = nopStore{conns: 1}
	cfg.Concurrency = 1
	cfg.Hooks = []Hook{hookOnlyRetry{}}
	if _, err := New(cfg); err != nil {
		t.Fatalf("one connection with Concurrency 1 and no Retention should do: %v", err)
	}
}

func TestPermanent(t *testing.T) {
	t.Parallel()
	base := errors.New("unknown account")
	err := Permanent(base)
	if !IsPermanent(err) || !errors.Is(err, base) || !errors.Is(err, &permanentError{}) {
		t.Fatalf("Permanent(%v) = %v: not recognised", base, err)
	}
	wrapped := errors.Join(errors.New("ctx"), err)
	if !IsPermanent(wrapped) {
		t.Fatal("wrapped permanent error not recognised")
	}
	if Permanent(nil) != nil || IsPermanent(base) {
		t.Fatal("Permanent(nil) must be nil and plain errors not permanent")
	}
}

func TestChainOrder(t *testing.T) {
	t.Parallel()
	var trace []string
	mw := func(name string) Middleware {
		return func(next Handler) Handler {
			return func(ctx context.Context, tx pgx.Tx, m *Message) error {
				trace = append(trace, name)
				return next(ctx, tx, m)
			}
		}
	}
	h := chain(func(context.Context, pgx.Tx, *Message) error { trace = append(trace, "h"); return nil }, mw("a"), mw("b"))
	_ = h(context.Background(), nil, &Message{})
	if strings.Join(trace, ",") != "a,b,h" {
		t.Fatalf("order %v", trace)
	}
}

func TestIDFromHeader(t *testing.T) {
	t.Parallel()
	m := &Message{ID: "broker", Headers: map[string]string{"Idempotency-Key": "k1"}}
	if id, _ := IDFromHeader("Idempotency-Key")(m); id != "k1" {
		t.Fatalf("got %q", id)
	}
	if id, _ := idFromMessage(m); id != "broker" {
		t.Fatalf("got %q", id)
	}
	c := m.Clone()
	c.Headers["Idempotency-Key"] = "changed"
	if m.Header("Idempotency-Key") != "k1" {
		t.Fatal("Clone shares headers")
	}
}

func TestBatchConfigValidation(t *testing.T) {
	t.Parallel()
	bh := func(context.Context, pgx.Tx, []*Message) error { return nil }
	cfg := validConfig()
	cfg.Handler = nil
	cfg.BatchHandler = bh
	rt, err := New(cfg)
	if err != nil || rt.cfg.BatchSize != defaultBatchSize || rt.cfg.BatchWait != defaultBatchWait {
		t.Fatalf("BatchHandler defaults: %v %+v", err, rt)
	}
	for field, mod := range map[string]func(*Config){
		"BatchHandler": func(c *Config) { c.BatchHandler = bh },
		"Middleware": func(c *Config) {
			c.Handler = nil
			c.BatchHandler = bh
			c.Middleware = []Middleware{func(h Handler) Handler { return h }}
		},
		"BatchSize": func(c *Config) { c.BatchSize = 10_001 },
		"BatchWait": func(c *Config) { c.BatchWait = -2 },
	} {
		c := validConfig()
		mod(&c)
		var ce *ConfigError
		if _, err := New(c); !errors.As(err, &ce) || ce.Field != field {
			t.Errorf("%s: got %v", field, err)
		}
	}
}

func TestPoolSizeWarning(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name        string
		maxConns    int32
		concurrency int
		retention   time.Duration
		want        string // "needed" in the warning, or "" for none
	}{
		{"pgxpool default on 2 cores", 4, 0, 0, "8"},
		{"one per worker", 8, 0, 0, ""},
		{"janitor needs one more", 8, 0, time.Hour, "9"},
		{"room for the janitor", 9, 0, time.Hour, ""},
		{"batch lanes", 2, 3, 0, "3"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var logs strings.Builder
			cfg := validConfig()
			cfg.Store = nopStore{conns: int(tc.maxConns)}
			cfg.Concurrency = tc.concurrency
			cfg.Retention = tc.retention
			cfg.Logger = slog.New(slog.NewTextHandler(&logs, nil))
			if _, err := New(cfg); err != nil {
				t.Fatal(err)
			}
			got := logs.String()
			if tc.want == "" {
				if got != "" {
					t.Fatalf("unexpected log: %s", got)
				}
				return
			}
			if !strings.Contains(got, "level=WARN") || !strings.Contains(got, "needed="+tc.want) ||
				!strings.Contains(got, fmt.Sprintf("pool_max_conns=%d", tc.maxConns)) {
				t.Fatalf("want a warning with needed=%s, got %q", tc.want, got)
			}
		})
	}
}

// windowSource is a Source with a Configure method with a fixed window (0: it takes the
// runtime's); it records the settings it was given.
type windowSource struct {
	nopSource
	window int
	got    *SourceSettings
}

func (s windowSource) Configure(set SourceSettings) int {
	*s.got = set
	if s.window == 0 {
		return set.Window
	}
	return s.window
}

func TestWindowedBatchSize(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name                string
		window, conc, batch int
		wantSize            int
		wantWarning         bool
	}{
		{"takes the runtime's window", 0, 8, 100, 100, false},
		{"room for every lane", 800, 8, 100, 100, false},
		{"rabbitmq default before batch sizing", 16, 8, 100, 2, true},
		{"memory default", 64, 4, 50, 16, true},
		{"less than one per lane", 4, 8, 100, 1, true},
		{"per-message mode", 16, 8, 1, 1, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var logs strings.Builder
			cfg := validConfig()
			var got SourceSettings
			cfg.Source = windowSource{window: tc.window, got: &got}
			cfg.Concurrency, cfg.BatchSize = tc.conc, tc.batch
			cfg.Logger = slog.New(slog.NewTextHandler(&logs, nil))
			rt, err := New(cfg)
			if err != nil {
				t.Fatal(err)
			}
			if got.Window != tc.conc*tc.batch || got.Logger == nil {
				t.Fatalf("Configure got window %d and logger %v, want %d and the runtime's", got.Window, got.Logger, tc.conc*tc.batch)
			}
			if rt.batchSize != tc.wantSize {
				t.Fatalf("batch size %d, want %d", rt.batchSize, tc.wantSize)
			}
			if warned := strings.Contains(logs.String(), "window"); warned != tc.wantWarning {
				t.Fatalf("warning %v, want %v: %q", warned, tc.wantWarning, logs.String())
			}
		})
	}
}
